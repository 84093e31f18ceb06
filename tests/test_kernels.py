"""Correctness tests for the SFI Triton kernels (sfi_sglang.kernels).

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set here
before the kernels are imported) at small shapes, in fp32, against float64 references.
"""

import contextlib
import importlib.util
import math
import os
import pathlib
import sys

import subprocess

import pytest
import torch

_TRITON_PREIMPORTED = "triton" in sys.modules
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

_REPO = pathlib.Path(__file__).resolve().parents[1]


def _interpreter_usable():
    """TRITON_INTERPRET only takes effect for @triton.jit functions decorated after it is set,
    including triton.language's own (tl.cdiv, tl.max...). If another test module imported
    triton first (e.g. through sglang), this process cannot interpret our kernels."""
    if torch.cuda.is_available() or not _TRITON_PREIMPORTED:
        return True
    import triton.language.standard as std
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(std.cdiv, InterpretedFunction)


_IN_PROCESS = _interpreter_usable()
if not _IN_PROCESS and os.environ.get("SFI_KERNELS_SUBPROCESS") == "1":
    raise RuntimeError("triton imported before TRITON_INTERPRET could be set (check conftest/plugins)")



@pytest.fixture(autouse=True)
def _needs_usable_interpreter(request):
    if not _IN_PROCESS and request.node.name != "test_kernels_in_fresh_process":
        pytest.skip("covered by test_kernels_in_fresh_process (triton was imported first)")


if not _IN_PROCESS:
    def test_kernels_in_fresh_process():
        env = dict(os.environ, TRITON_INTERPRET="1", SFI_KERNELS_SUBPROCESS="1")
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            str(pathlib.Path(__file__).resolve())],
                           cwd=str(_REPO), env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


from sfi_sglang import kernels as K  # noqa: E402
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def rel_err(out, ref):
    out = out.double()
    ref = ref.double()
    return (torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref)).item()


def make_state(B, Hkv, G, D, P, seq_lens, dtype=torch.float32, max_reqs=None, extra_slots=7,
               seed=None):
    """Random KV pool with a shuffled req_to_token mapping and random pool slots."""
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    max_ctx = max(seq_lens) + 5
    max_reqs = max_reqs or B + 3
    num_slots = sum(seq_lens) + extra_slots
    k_cache = torch.randn(num_slots, Hkv, D, generator=gen).to(dtype)
    v_cache = torch.randn(num_slots, Hkv, D, generator=gen).to(dtype)
    perm = torch.randperm(num_slots, generator=gen)
    req_pool_indices = torch.randperm(max_reqs, generator=gen)[:B].long()
    req_to_token = torch.full((max_reqs, max_ctx), num_slots + 10**6, dtype=torch.int32)  # junk
    off = 0
    for b, n in enumerate(seq_lens):
        req_to_token[req_pool_indices[b], :n] = perm[off:off + n].int()
        off += n
    q = torch.randn(B, Hkv * G, D, generator=gen).to(dtype)
    packed_k = torch.randn(max_reqs, Hkv, P, D, generator=gen).to(dtype)
    packed_v = torch.randn(max_reqs, Hkv, P, D, generator=gen).to(dtype)
    st = dict(q=q, k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token,
              req_pool_indices=req_pool_indices, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
              packed_k=packed_k, packed_v=packed_v, gen=gen)
    return {k: (v.to(DEV) if torch.is_tensor(v) else v) for k, v in st.items()}


def sfi_layout(st, S, W, Kc, seq_lens, P):
    """Selection per (request, head): sinks [0,S) + Kc random positions in [S, hi) with
    hi = seq_len - W (window [hi, seq_len)). Returns positions [B,H_kv,P], win_start, packed_len."""
    gen = st["gen"]
    B = len(seq_lens)
    Hkv = st["k_cache"].shape[1]
    positions = torch.full((B, Hkv, P), -1, dtype=torch.int32)
    win_start = torch.zeros(B, dtype=torch.int32)
    max_reqs = st["packed_k"].shape[0]
    packed_len = torch.randint(0, P + 1, (max_reqs,), generator=gen).int()  # junk elsewhere
    for b, n in enumerate(seq_lens):
        hi = max(min(S, n), n - W)
        win_start[b] = hi
        s = min(S, hi)
        k = max(0, min(Kc, hi - s))
        for h in range(Hkv):
            sel = torch.randperm(max(hi - s, 0), generator=gen)[:k].sort().values + s
            row = torch.cat([torch.arange(s), sel]).int()
            positions[b, h, :len(row)] = row
        packed_len[st["req_pool_indices"][b].item()] = s + k
    return positions.to(DEV), win_start.to(DEV), packed_len.to(DEV)


# ---------------------------------------------------------------------------- fast_decode

FAST_CASES = [
    # (G, D, splits, block_n, seq_lens, S, W, Kc, P)
    (1, 32, 1, 16, [70, 200, 9], 4, 40, 24, 32),
    (3, 32, None, 16, [300, 41, 130], 4, 50, 20, 28),
    (4, 64, 3, 16, [257, 120, 64], 4, 37, 40, 48),
    (8, 32, 4, None, [400, 150], 2, 90, 30, 40),
    (4, 32, 7, 16, [513, 90, 33, 5], 4, 64, 16, 24),
]


@pytest.mark.parametrize("fused", [False, True, "vector"])
@pytest.mark.parametrize("G,D,splits,block_n,seq_lens,S,W,Kc,P", FAST_CASES)
def test_fast_decode_matches_reference(G, D, splits, block_n, seq_lens, S, W, Kc, P, fused):
    Hkv = 2
    st = make_state(len(seq_lens), Hkv, G, D, P, seq_lens)
    positions, win_start, packed_len = sfi_layout(st, S, W, Kc, seq_lens, P)
    # the packed buffers hold whatever; fast_decode must read exactly packed_len entries
    B, Hq = len(seq_lens), Hkv * G
    lse_ref = torch.empty(B, Hq, dtype=torch.float64, device=DEV)
    ref = K.ref_fast_decode(st["q"], st["k_cache"], st["v_cache"], st["req_to_token"],
                            st["req_pool_indices"], st["seq_lens"], win_start, st["packed_k"],
                            st["packed_v"], packed_len, 1.0 / math.sqrt(D), lse_out=lse_ref)
    out = torch.full_like(st["q"], float("nan"))
    lse = torch.full((B, Hq), float("nan"), device=DEV)  # the adaptive trigger's input
    K.fast_decode(st["q"], st["k_cache"], st["v_cache"], st["req_to_token"],
                  st["req_pool_indices"], st["seq_lens"], win_start, st["packed_k"],
                  st["packed_v"], packed_len, 1.0 / math.sqrt(D), out=out,
                  num_splits=splits, block_n=block_n, fused_reduce=fused, lse_out=lse)
    assert torch.isfinite(out).all(), "unwritten or non-finite output"
    assert rel_err(out, ref) < TOL[torch.float32]
    assert (lse.double() - lse_ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("G,D,splits,block_n,seq_lens,S,W,Kc,P", FAST_CASES[1:4])
def test_fast_decode_reads_the_selection_in_place(G, D, splits, block_n, seq_lens, S, W, Kc, P, fused):
    """The "triton-pool" fast path (sel_pos and n_sinks instead of packed K/V): the sinks and
    each head's selected positions read through req_to_token equal the float64 reference
    (a -1 entry reads nothing), and, without holes, the packed path's result; with a hole,
    the packed path told of it (`holes`) skips the packed row behind it."""
    Hkv = 2
    st = make_state(len(seq_lens), Hkv, G, D, P, seq_lens)
    positions, win_start, packed_len = sfi_layout(st, S, W, Kc, seq_lens, P)
    max_reqs = st["packed_k"].shape[0]
    sel_pos = torch.randint(-1, 5, (max_reqs, Hkv, P - S), dtype=torch.int32, generator=st["gen"])  # junk
    n_sinks = torch.randint(0, S + 1, (max_reqs,), dtype=torch.int32, generator=st["gen"])
    for b, n in enumerate(seq_lens):
        pool = int(st["req_pool_indices"][b])
        ns = min(S, max(min(S, n), n - W))
        n_sinks[pool] = ns
        sel_pos[pool] = -1
        sel_pos[pool, :, :int(packed_len[pool]) - ns] = positions[b, :, ns:int(packed_len[pool])].cpu()
    sel_pos, n_sinks = sel_pos.to(DEV), n_sinks.to(DEV)
    args = (st["q"], st["k_cache"], st["v_cache"], st["req_to_token"], st["req_pool_indices"],
            st["seq_lens"], win_start, None, None, packed_len, D ** -0.5)
    K.pack(st["k_cache"], st["v_cache"], st["req_to_token"], st["req_pool_indices"], positions,
           st["packed_k"], st["packed_v"])
    packed = K.fast_decode(*args[:7], st["packed_k"], st["packed_v"], *args[9:], num_splits=splits,
                           block_n=block_n, fused_reduce=fused)
    kw = dict(num_splits=splits, block_n=block_n, fused_reduce=fused, sel_pos=sel_pos, n_sinks=n_sinks)
    assert rel_err(K.fast_decode(*args, **kw), packed) < TOL[torch.float32]
    pool0 = int(st["req_pool_indices"][0])
    sel_pos[pool0, 0, 0] = -1  # a hole: head 0 of row 0 reads one position fewer
    B, Hq = len(seq_lens), Hkv * G
    lse_ref = torch.empty(B, Hq, dtype=torch.float64, device=DEV)
    ref = K.ref_fast_decode(*args, lse_out=lse_ref, sel_pos=sel_pos, n_sinks=n_sinks)
    lse = torch.full((B, Hq), float("nan"), device=DEV)
    out = K.fast_decode(*args, **kw, lse_out=lse)
    assert torch.isfinite(out).all() and rel_err(out, ref) < TOL[torch.float32]
    assert (lse.double() - lse_ref).abs().max().item() < 1e-4
    assert rel_err(out[0, :G], packed[0, :G]) > 1e-3  # the hole changed head 0's result
    # the packed path with `holes` (whole-page selections): the packed row behind the hole
    # is still there, and is skipped
    pk = (st["packed_k"], st["packed_v"])
    held = K.fast_decode(*args[:7], *pk, *args[9:], **{**kw, "sel_pos": None, "n_sinks": None},
                         holes=sel_pos, hole_base=S)
    assert rel_err(held, ref) < TOL[torch.float32]
    assert rel_err(K.ref_fast_decode(*args[:7], *pk, *args[9:], holes=sel_pos, hole_base=S), ref) < 1e-12
    # head 0 of row 0 all holes: a split whose first tiles hold only holes starts from an
    # empty softmax (no NaN from -inf - -inf), on both paths
    sel_pos[pool0, 0] = -1
    ref = K.ref_fast_decode(*args, sel_pos=sel_pos, n_sinks=n_sinks)
    for got in (K.fast_decode(*args, **kw),
                K.fast_decode(*args[:7], *pk, *args[9:], **{**kw, "sel_pos": None, "n_sinks": None},
                              holes=sel_pos, hole_base=S)):
        assert torch.isfinite(got).all() and rel_err(got, ref) < TOL[torch.float32]


def _topup_state(seq_lens, S, W, Kc, P, page, G=3, D=32, Hkv=2, rows=False, seed=0):
    """A random state with a selection per slot (held [slots or rows, H_kv, Kc], -1
    padded, without the sinks) and its row_of (memory rows in another order) if rows."""
    st = make_state(len(seq_lens), Hkv, G, D, P, seq_lens, seed=seed)
    positions, win_start, packed_len = sfi_layout(st, S, W, Kc, seq_lens, P)
    max_reqs = st["packed_k"].shape[0]
    held = torch.full((max_reqs, Hkv, Kc), -1, dtype=torch.int32)
    for b in range(len(seq_lens)):
        pool = int(st["req_pool_indices"][b])
        n = int(packed_len[pool]) - S
        held[pool, :, :n] = positions[b, :, S:S + n].cpu()
    row_of = None
    if rows:
        row_of = torch.randperm(max_reqs, generator=st["gen"]).int()
        by_row = torch.full_like(held, -1)
        by_row[row_of.long()] = held
        held = by_row
    st.update(positions=positions, win_start=win_start, packed_len=packed_len, held=held.to(DEV),
              row_of=None if row_of is None else row_of.to(DEV),
              max_pages=st["req_to_token"].shape[1] // page)
    return st


@pytest.mark.parametrize("rows", [False, True])
def test_topup_page_scores_and_choice(rows):
    """kernels.topup against float64: Quest's bound of each whole page of [S, window start),
    -inf on pages holding a held position and past a row's pages; the top pages chosen
    are the reference's, hold no held position; drop_held takes out another layer's."""
    S, W, Kc, page, take = 4, 40, 20, 8, 3
    seq_lens = [300, 41, 200]
    st = _topup_state(seq_lens, S, W, Kc, 48, page, rows=rows)
    args = (st["q"], st["k_cache"], st["req_to_token"], st["req_pool_indices"], st["seq_lens"],
            st["win_start"], st["held"], S, page, st["max_pages"])
    got = K.page_scores(*args, row_of=st["row_of"])
    ref = K.ref_page_scores(*args, row_of=st["row_of"])
    assert torch.equal(got.isinf().cpu(), ref.isinf().cpu())
    fin = ~ref.isinf()
    assert fin.sum() > 30 and (got[fin].double() - ref[fin]).abs().max() < 1e-4 * ref[fin].abs().max()
    for b, n in enumerate(seq_lens):  # the pages that count: whole ones before the window, none held
        hi = int(st["win_start"][b])
        pool = int(st["req_pool_indices"][b])
        held = st["held"][int(st["row_of"][pool]) if rows else pool].cpu()
        for h in range(2):
            hp = {(int(x) - S) // page for x in held[h] if x >= 0}
            want = [p for p in range(max(hi - S, 0) // page) if p not in hp]
            assert fin[b, h].nonzero()[:, 0].tolist() == want
    chosen = K.pick_pages(got, take, st["seq_lens"], st["win_start"], S, page)
    assert torch.equal(chosen.cpu(), _topk_ref(ref, take).int())
    assert chosen.dtype == torch.int32 and (chosen[1] == -1).all()  # row 1: no whole page outside its memory
    other = torch.randint(-1, st["max_pages"] * page, (3, *st["held"].shape), generator=st["gen"]).int().to(DEV)
    dropped = K.drop_held(chosen, st["req_pool_indices"], other[1], S, page, row_of=st["row_of"])
    assert torch.equal(dropped.cpu(), K.ref_drop_held(chosen, st["req_pool_indices"], other[1], S, page,
                                                      row_of=st["row_of"]).cpu())
    assert ((dropped == -1) & (chosen >= 0)).any() and ((dropped == chosen) & (chosen >= 0)).any()
    # three layers' selections in one launch: each layer's drop_held
    group = K.drop_held(chosen, st["req_pool_indices"], other, S, page, row_of=st["row_of"])
    assert group.shape == (3, *chosen.shape)
    for i in range(3):
        assert torch.equal(group[i], K.drop_held(chosen, st["req_pool_indices"], other[i], S, page,
                                                 row_of=st["row_of"]))


def test_page_summaries_kept_as_the_kv_grows_score_as_the_keys_do():
    """summarize_pages over a pool allocated in pages (SGLang's --page-size): written by
    chunked extends (one ending mid-page, the next going on from it) then decode steps,
    each pool page's summary is its written keys' exact per-channel min/max; page_scores
    from the summaries equals page_scores from the keys (pages aligned to the pool's)."""
    S, W, Kc, page = 8, 40, 20, 8
    seq_lens = [300, 41, 203]
    st = _topup_state(seq_lens, S, W, Kc, 48, page, rows=True, seed=3)
    gen, Hkv, D = st["gen"], st["k_cache"].shape[1], st["k_cache"].shape[2]
    grow = 9  # decode steps after the extends
    need = [-(-(n + grow) // page) for n in seq_lens]
    pool_pages = sum(need) + 5
    order = torch.randperm(pool_pages, generator=gen)
    r2t = torch.zeros_like(st["req_to_token"].cpu())
    first = 0
    for b, n in enumerate(seq_lens):
        pos = torch.arange(r2t.shape[1])
        pg = order[first:first + need[b]]
        r2t[int(st["req_pool_indices"][b])] = (pg[(pos // page).clamp_max(need[b] - 1)] * page + pos % page).int()
        first += need[b]
    r2t = r2t.to(DEV)
    k_cache = torch.randn(pool_pages * page, Hkv, D, generator=gen).to(DEV)
    summ = torch.full((pool_pages, Hkv, 2, D), float("nan"), device=DEV)
    rpi = st["req_pool_indices"]

    def locs(spans):  # out_cache_loc of one forward: each row's positions [a, b), in row order
        return torch.cat([r2t[int(rpi[b]), a:e] for b, (a, e) in enumerate(spans)]).contiguous()

    split = [37, 20, 128]  # 37 and 20 end mid-page
    K.summarize_pages(k_cache, summ, locs([(0, a) for a in split]), page)
    K.summarize_pages(k_cache, summ, locs([(a, n) for a, n in zip(split, seq_lens)]), page)
    for t in range(grow):
        K.summarize_pages(k_cache, summ, locs([(n + t, n + t + 1) for n in seq_lens]), page)
    want = torch.full_like(summ, float("nan"))
    K.ref_summarize_pages(k_cache, want, locs([(0, n + grow) for n in seq_lens]), page)
    for b, n in enumerate(seq_lens):
        for p in range(need[b]):
            slots = r2t[int(rpi[b]), p * page:min((p + 1) * page, n + grow)].long()
            keys = k_cache[slots]
            sp = int(slots[0]) // page
            assert torch.equal(summ[sp, :, 0], keys.amin(0)) and torch.equal(summ[sp, :, 1], keys.amax(0))
            assert torch.equal(want[sp], summ[sp])
    lens = st["seq_lens"] + grow
    win = st["win_start"] + grow
    args = (st["q"], k_cache, r2t, rpi, lens, win, st["held"], S, page, st["max_pages"])
    keyed = K.page_scores(*args, row_of=st["row_of"])
    got = K.page_scores(*args, row_of=st["row_of"], summ=summ)
    ref = K.ref_page_scores(*args, row_of=st["row_of"], summ=summ)
    assert (~keyed.isinf()).sum() > 30 and torch.equal(got.isinf(), keyed.isinf())
    fin = ~keyed.isinf()
    assert (got[fin] - keyed[fin]).abs().max() < 1e-5 * keyed[fin].abs().max()
    assert (got[fin].double() - ref[fin]).abs().max() < 1e-4 * ref[fin].abs().max()
    with pytest.raises(AssertionError, match="aligned"):
        K.page_scores(*args[:7], S - 1, *args[8:], summ=summ)


@pytest.mark.parametrize("ties,block_max", [(False, 8192), (True, 8192), (True, 1024)])
def test_pick_pages_is_an_exact_top_k_of_each_rows_pages(ties, block_max, monkeypatch):
    """kernels.pick_pages: per (row, KV head), the `take` largest scores among the row's own
    (min(win_start, seq_len) - lo) // page pages (later columns ignored, whatever they
    hold), ascending, -inf never taken, -1 padded; ties at the last taken score to the
    lowest pages; with the scores in registers and (block_max 1024) over several blocks,
    and rows with fewer pages than `take`. The CPU path (choose_pages, torch.topk) gives
    the same set."""
    monkeypatch.setattr(importlib.import_module(K.__name__ + ".topup"), "PICK_BLOCK_MAX", block_max)
    S, page, take, N = 4, 4, 37, 2600
    seq_lens = torch.tensor([S + N * page, S + 3000, 40, S + 30 * page + 3], dtype=torch.int32)
    win_start = torch.tensor([S + N * page, S + 3000 + 7, 6, S + 36 * page], dtype=torch.int64)
    g = torch.Generator().manual_seed(11)
    scores = torch.randn(4, 3, N, generator=g) * 5
    if ties:  # a coarse grid: many keys equal to the last one taken
        scores = torch.round(scores) + 0.25
    scores[0, 0, :5] = -math.inf
    scores[0, 1] = -math.inf  # fewer finite pages than take
    scores[0, 1, 100:110] = torch.randn(10, generator=g)
    scores[1, 2, 700:] = 1e9  # past row 1's 750 pages: ignored
    n = ((torch.minimum(win_start, seq_lens.long()) - S).clamp_min(0) // page).tolist()
    own = scores.clone()
    for b, nb in enumerate(n):
        own[b, :, nb:] = -math.inf
    ref = _topk_ref(own, take).int()
    got = K.pick_pages(scores.to(DEV), take, seq_lens.to(DEV), win_start.to(DEV), S, page)
    assert got.dtype == torch.int32 and torch.equal(got.cpu(), ref)
    assert (got[2] == -1).all() and (got[3, :, 30:] == -1).all() and (got[0, 1, 10:] == -1).all()
    if not ties:
        def as_set(t):
            return torch.where(t < 0, N, t.long()).sort(-1).values
        assert torch.equal(as_set(K.choose_pages(own, take)), as_set(ref))


@pytest.mark.parametrize("listed", [False, True])
def test_fast_decode_reads_the_topup_pages(listed):
    """fast_decode with extra_pages (the top-up) equals float64 attention over sinks,
    selection, the pages' positions and the window, on the packed and in-place paths; and
    the reference's pages equal the same positions listed in the selection."""
    S, W, Kc, P, page, G, D = 4, 40, 20, 24, 8, 3, 32
    seq_lens = [300, 41, 200]
    st = _topup_state(seq_lens, S, W, Kc, P, page, G=G, D=D)
    K.pack(st["k_cache"], st["v_cache"], st["req_to_token"], st["req_pool_indices"], st["positions"],
           st["packed_k"], st["packed_v"])
    scores = K.page_scores(st["q"], st["k_cache"], st["req_to_token"], st["req_pool_indices"], st["seq_lens"],
                           st["win_start"], st["held"], S, page, st["max_pages"])
    extra = K.choose_pages(scores, 3)
    n_sinks = torch.full((st["packed_k"].shape[0],), S, dtype=torch.int32, device=DEV)
    args = (st["q"], st["k_cache"], st["v_cache"], st["req_to_token"], st["req_pool_indices"],
            st["seq_lens"], st["win_start"])
    mem = (None, None) if listed else (st["packed_k"], st["packed_v"])
    kw = dict(sel_pos=st["held"], n_sinks=n_sinks) if listed else {}
    top = dict(extra_pages=extra, extra_base=S, extra_page=page)
    ref = K.ref_fast_decode(*args, *mem, st["packed_len"], D ** -0.5, **kw, **top)
    out = K.fast_decode(*args, *mem, st["packed_len"], D ** -0.5, num_splits=3, block_n=16, **kw, **top)
    assert torch.isfinite(out).all() and rel_err(out, ref) < TOL[torch.float32]
    # the same positions listed after the selection, read with no top-up
    pos = K.extra_positions(extra, S, page).cpu()
    sel = torch.full((st["packed_k"].shape[0], 2, Kc + pos.shape[-1]), -1, dtype=torch.int32)
    plen = st["packed_len"].clone()
    for b in range(len(seq_lens)):
        pool = int(st["req_pool_indices"][b])
        for h in range(2):
            row = torch.cat([st["held"][pool, h].cpu(), pos[b, h]])
            row = row[row >= 0]
            sel[pool, h, :row.numel()] = row.int()
        plen[pool] = S + Kc + pos.shape[-1]
    listed_ref = K.ref_fast_decode(*args, None, None, plen, D ** -0.5, sel_pos=sel.to(DEV), n_sinks=n_sinks)
    assert rel_err(ref, listed_ref) < 1e-12
    assert rel_err(ref, K.ref_fast_decode(*args, *mem, st["packed_len"], D ** -0.5, **kw)) > 1e-3


def test_fast_decode_after_pack_equals_dense_when_memory_covers_history():
    """Below S+K+W tokens the sparse memory is the whole history: SFI == dense."""
    G, D, Hkv, P = 4, 32, 2, 64
    seq_lens = [60, 33, 90]
    S, W = 4, 30
    st = make_state(len(seq_lens), Hkv, G, D, P, seq_lens)
    positions, win_start, packed_len = sfi_layout(st, S, W, 10**6, seq_lens, P)
    pk = torch.full_like(st["packed_k"], float("nan"))
    pv = torch.full_like(st["packed_v"], float("nan"))
    K.pack(st["k_cache"], st["v_cache"], st["req_to_token"], st["req_pool_indices"], positions,
           pk, pv)
    out = torch.full_like(st["q"], float("nan"))
    K.fast_decode(st["q"], st["k_cache"], st["v_cache"], st["req_to_token"],
                  st["req_pool_indices"], st["seq_lens"], win_start, pk, pv, packed_len,
                  D ** -0.5, out=out, num_splits=2, block_n=16)
    dense, _ = K.ref_dense_decode_with_scores(st["q"], st["k_cache"], st["v_cache"],
                                              st["req_to_token"], st["req_pool_indices"],
                                              st["seq_lens"], D ** -0.5)
    assert torch.isfinite(out).all()
    assert rel_err(out, dense) < TOL[torch.float32]


def test_fast_decode_edge_lengths():
    """packed_len = 0 for one request, empty window for another, both empty for a third."""
    G, D, Hkv, P = 4, 32, 2, 20
    seq_lens = [50, 40, 30]
    st = make_state(3, Hkv, G, D, P, seq_lens)
    rpi = st["req_pool_indices"].cpu()
    packed_len = torch.zeros(st["packed_k"].shape[0], dtype=torch.int32)
    packed_len[rpi[0]] = 0
    packed_len[rpi[1]] = 13
    packed_len[rpi[2]] = 0
    win_start = torch.tensor([10, 40, 30], dtype=torch.int32)
    packed_len, win_start = packed_len.to(DEV), win_start.to(DEV)
    args = (st["q"], st["k_cache"], st["v_cache"], st["req_to_token"], st["req_pool_indices"],
            st["seq_lens"], win_start, st["packed_k"], st["packed_v"], packed_len, D ** -0.5)
    lse_ref = torch.empty(3, Hkv * G, dtype=torch.float64, device=DEV)
    ref = K.ref_fast_decode(*args, lse_out=lse_ref)
    assert torch.isneginf(lse_ref[2]).all()
    for splits, fused in ((1, False), (3, False), (3, True), (3, "vector")):
        out = torch.full_like(st["q"], float("nan"))
        lse = torch.full((3, Hkv * G), float("nan"), device=DEV)
        K.fast_decode(*args, out=out, num_splits=splits, block_n=16, fused_reduce=fused, lse_out=lse)
        assert torch.isfinite(out).all()
        assert torch.equal(out[2].cpu(), torch.zeros_like(out[2]).cpu())  # nothing to attend
        assert rel_err(out[:2], ref[:2]) < TOL[torch.float32]
        assert torch.isneginf(lse[2]).all()  # an empty memory: -inf, not NaN
        assert (lse[:2].double() - lse_ref[:2]).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", [
    torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="Triton 3.8 interpreter: tl.dot on bf16 operands returns garbage (seen here)")),
])
def test_fast_decode_half_precision(dtype):
    G, D, Hkv, P = 4, 32, 2, 24
    seq_lens = [150, 70]
    st = make_state(2, Hkv, G, D, P, seq_lens, dtype=dtype)
    _, win_start, packed_len = sfi_layout(st, 4, 40, 20, seq_lens, P)
    args = (st["q"], st["k_cache"], st["v_cache"], st["req_to_token"], st["req_pool_indices"],
            st["seq_lens"], win_start, st["packed_k"], st["packed_v"], packed_len, D ** -0.5)
    ref = K.ref_fast_decode(*args)
    out = torch.full_like(st["q"], float("nan"))
    K.fast_decode(*args, out=out, num_splits=2, block_n=16)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kv_cache_is_read_as_its_values(kv_dtype):
    """An fp8 KV cache (SGLang's --kv-cache-dtype fp8_*, unit scales): the fast kernel
    (over packed fp8 copies and the window read in place), the dense pass with scores and
    the pack read each K/V entry as the value it holds, in the query's dtype."""
    G, D, Hkv, P = 4, 32, 2, 24
    seq_lens = [150, 70]
    st = make_state(2, Hkv, G, D, P, seq_lens)
    for name in ("k_cache", "v_cache", "packed_k", "packed_v"):
        st[name] = st[name].to(kv_dtype)
    positions, win_start, packed_len = sfi_layout(st, 4, 40, 20, seq_lens, P)
    args = (st["q"], st["k_cache"], st["v_cache"], st["req_to_token"], st["req_pool_indices"],
            st["seq_lens"], win_start, st["packed_k"], st["packed_v"], packed_len, D ** -0.5)
    out = torch.full_like(st["q"], float("nan"))
    K.fast_decode(*args, out=out, num_splits=2, block_n=16)
    assert rel_err(out, K.ref_fast_decode(*args)) < TOL[torch.float32]
    dense = args[:6] + (D ** -0.5,)
    ref_out, ref_sc = K.ref_dense_decode_with_scores(*dense, n_max=160)
    o, sc = K.dense_decode_with_scores(*dense, max_len=160, num_splits=3, block_n=16)
    fin = torch.isfinite(ref_sc)
    assert rel_err(o, ref_out) < TOL[torch.float32] and rel_err(sc[fin], ref_sc[fin]) < TOL[torch.float32]
    pk, rk = torch.zeros_like(st["packed_k"]), torch.zeros_like(st["packed_k"])
    pv, rv = torch.zeros_like(st["packed_v"]), torch.zeros_like(st["packed_v"])
    K.pack(st["k_cache"], st["v_cache"], st["req_to_token"], st["req_pool_indices"], positions, pk, pv)
    K.ref_pack(st["k_cache"], st["v_cache"], st["req_to_token"], st["req_pool_indices"], positions, rk, rv)
    assert torch.equal(pk.view(torch.uint8), rk.view(torch.uint8))  # byte for byte
    assert torch.equal(pv.view(torch.uint8), rv.view(torch.uint8))


# ------------------------------------------------------------------ dense + scores (slow)

@pytest.mark.parametrize("G,D,splits,block_n,seq_lens,extra", [
    (1, 32, 1, 16, [100, 37], 0),
    (3, 32, None, 16, [250, 31, 129], 19),
    (4, 64, 4, 32, [300, 90], 45),
    (8, 32, 5, 16, [160, 7, 64], 3),
])
def test_dense_decode_with_scores(G, D, splits, block_n, seq_lens, extra):
    Hkv = 2
    st = make_state(len(seq_lens), Hkv, G, D, 8, seq_lens)
    n_max = max(seq_lens) + extra
    scale = 1.0 / math.sqrt(D)
    args = (st["q"], st["k_cache"], st["v_cache"], st["req_to_token"], st["req_pool_indices"],
            st["seq_lens"], scale)
    scores = torch.full((len(seq_lens), Hkv * G, n_max), float("nan"), device=DEV)
    norms = torch.full((len(seq_lens), Hkv, n_max), float("nan"), device=DEV)  # float32: the math
    out = torch.full_like(st["q"], float("nan"))
    ref_out, ref_sc = K.ref_dense_decode_with_scores(*args, n_max=n_max)
    o, sc = K.dense_decode_with_scores(*args, scores_out=scores, out=out, num_splits=splits,
                                       block_n=block_n, norms_out=norms)
    assert o.data_ptr() == out.data_ptr() and sc.data_ptr() == scores.data_ptr()
    # the key norms of every row's positions < seq_len against float64; the tail unwritten
    for b, n in enumerate(seq_lens):
        keys = st["k_cache"][st["req_to_token"][st["req_pool_indices"][b], :n].long()].double()
        assert rel_err(norms[b, :, :n].double(), torch.linalg.vector_norm(keys, dim=-1).T) < 1e-6
        assert torch.isnan(norms[b, :, n:]).all()
    assert torch.isfinite(out).all()
    assert rel_err(out, ref_out) < TOL[torch.float32]
    assert not torch.isnan(sc).any(), "score element left unwritten"
    fin = torch.isfinite(ref_sc)
    assert torch.equal(torch.isfinite(sc).cpu(), fin.cpu())  # -inf exactly past seq_len
    assert (sc[~fin] == float("-inf")).all()
    assert rel_err(sc[fin], ref_sc[fin]) < TOL[torch.float32]


def test_dense_decode_with_scores_into_score_rows():
    """A decode step's dense pass writes only its slow rows' logits, each to its score row
    (StepPlan's score_row): rows at -1 attend but write no logits, and score rows no batch
    row maps to are left as they were."""
    G, D, Hkv = 2, 32, 2
    seq_lens = [120, 40, 200, 75]
    st = make_state(len(seq_lens), Hkv, G, D, 8, seq_lens)
    args = (st["q"], st["k_cache"], st["v_cache"], st["req_to_token"], st["req_pool_indices"],
            st["seq_lens"], D ** -0.5)
    n_max = max(seq_lens) + 9
    rows = torch.tensor([-1, 1, -1, 0], dtype=torch.int32, device=DEV)  # 2 slow rows of 4
    ref_out, ref_sc = K.ref_dense_decode_with_scores(*args, n_max=n_max)
    bf16 = dict(dtype=torch.bfloat16, device=DEV)  # the norms' dtype in the backend (NORM_DTYPE)
    ref_norms = torch.full((3, Hkv, n_max), float("nan"), **bf16)
    ro, rsc = K.ref_dense_decode_with_scores(*args, scores_out=torch.zeros(2, Hkv * G, n_max, device=DEV),
                                             score_rows=rows, norms_out=ref_norms)
    assert torch.equal(rsc[0], ref_sc[3].float()) and torch.equal(rsc[1], ref_sc[1].float())
    for split in (1, 3):
        scores = torch.full((3, Hkv * G, n_max), float("nan"), device=DEV)  # row 2: no batch row
        norms = torch.full((3, Hkv, n_max), float("nan"), **bf16)
        out = torch.empty_like(st["q"])
        o, sc = K.dense_decode_with_scores(*args, scores_out=scores, out=out, num_splits=split,
                                           block_n=16, score_rows=rows, norms_out=norms)
        assert sc.data_ptr() == scores.data_ptr()
        assert rel_err(o, ref_out) < TOL[torch.float32]  # every row attends
        for b, r in ((3, 0), (1, 1)):
            fin = torch.isfinite(ref_sc[b])
            assert torch.equal(torch.isfinite(sc[r]).cpu(), fin.cpu())
            assert rel_err(sc[r][fin], ref_sc[b][fin]) < TOL[torch.float32]
            # bf16: at most one step apart (2^-7 relative; the interpreter's cast and torch's
            # may round a norm to neighbouring steps)
            n = seq_lens[b]
            assert rel_err(norms[r, :, :n].double(), ref_norms[r, :, :n].double()) < 2 ** -7
            assert torch.isnan(norms[r, :, n:]).all() and torch.isnan(ref_norms[r, :, n:]).all()
        assert torch.isnan(sc[2]).all(), "a score row no batch row maps to was written"
        assert torch.isnan(norms[2]).all(), "a norm row no batch row maps to was written"


def test_dense_decode_with_scores_allocates():
    G, D, Hkv = 4, 32, 2
    seq_lens = [90, 45]
    st = make_state(2, Hkv, G, D, 8, seq_lens)
    args = (st["q"], st["k_cache"], st["v_cache"], st["req_to_token"], st["req_pool_indices"],
            st["seq_lens"], D ** -0.5)
    o, sc = K.dense_decode_with_scores(*args)
    ro, rsc = K.ref_dense_decode_with_scores(*args)
    assert sc.shape == (2, Hkv * G, 90) and sc.dtype == torch.float32
    assert rel_err(o, ro) < TOL[torch.float32]
    fin = torch.isfinite(rsc)
    assert torch.equal(torch.isfinite(sc).cpu(), fin.cpu())
    assert rel_err(sc[fin], rsc[fin]) < TOL[torch.float32]


# ------------------------------------------------------------------------------ pack

@pytest.mark.parametrize("D,P,block_p", [(32, 40, 16), (64, 150, None), (48, 33, 16)])
def test_pack(D, P, block_p):
    Hkv, B = 3, 3
    seq_lens = [300, 120, 64]
    st = make_state(B, Hkv, 1, D, P, seq_lens)
    positions, _, _ = sfi_layout(st, 4, 20, P - 4 - 3, seq_lens, P)
    pk = torch.full_like(st["packed_k"], float("nan"))
    pv = torch.full_like(st["packed_v"], float("nan"))
    rk, rv = pk.clone(), pv.clone()
    K.pack(st["k_cache"], st["v_cache"], st["req_to_token"], st["req_pool_indices"], positions,
           pk, pv, block_p=block_p)
    K.ref_pack(st["k_cache"], st["v_cache"], st["req_to_token"], st["req_pool_indices"],
               positions, rk, rv)
    # valid entries written bit-exactly; -1 entries and other pool slots untouched (NaN)
    assert torch.equal(torch.isnan(pk), torch.isnan(rk))
    assert torch.equal(torch.nan_to_num(pk), torch.nan_to_num(rk))
    assert torch.equal(torch.nan_to_num(pv), torch.nan_to_num(rv))
    n_valid = int((positions >= 0).sum())
    assert int((~torch.isnan(pk[..., 0])).sum()) == n_valid
    # explicit check of one entry against the cache
    b, h = 1, 2
    pool = int(st["req_pool_indices"][b])
    pos = int(positions[b, h, 5])
    slot = int(st["req_to_token"][pool, pos])
    assert torch.equal(pk[pool, h, 5], st["k_cache"][slot, h])


# ------------------------------------------------------------------- CPU fallback path

@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU fallback only")
def test_cpu_fallback_uses_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    G, D, Hkv, P = 4, 32, 2, 24
    seq_lens = [150, 70]
    st = make_state(2, Hkv, G, D, P, seq_lens)
    _, win_start, packed_len = sfi_layout(st, 4, 40, 20, seq_lens, P)
    args = (st["q"], st["k_cache"], st["v_cache"], st["req_to_token"], st["req_pool_indices"],
            st["seq_lens"], win_start, st["packed_k"], st["packed_v"], packed_len, D ** -0.5)
    out = K.fast_decode(*args)
    assert out.dtype == torch.float32
    assert rel_err(out, K.ref_fast_decode(*args)) < 1e-6


def test_fused_reduce_counters_reset():
    """The split-K tickets must be back at zero after every launch (graph replays rely on it)."""
    G, D, Hkv, P = 4, 32, 2, 24
    seq_lens = [150, 70, 99]
    st = make_state(3, Hkv, G, D, P, seq_lens)
    _, win_start, packed_len = sfi_layout(st, 4, 40, 20, seq_lens, P)
    args = (st["q"], st["k_cache"], st["v_cache"], st["req_to_token"], st["req_pool_indices"],
            st["seq_lens"], win_start, st["packed_k"], st["packed_v"], packed_len, D ** -0.5)
    counters = torch.zeros(16, dtype=torch.int32, device=DEV)
    ref = K.ref_fast_decode(*args)
    for _ in range(2):
        out = K.fast_decode(*args, num_splits=4, block_n=16, fused_reduce=True, counters=counters)
        assert int(counters.abs().sum()) == 0
        assert rel_err(out, ref) < TOL[torch.float32]


# ------------------------------------------------------------------ radix top-k (kernels/topk.py)
def _topk_ref(key, k):
    """k largest per row, ties to the lowest positions, -inf dropped, ascending, -1 padded
    (float64 keys, Python sort: the documented rule of kernels/topk.py)."""
    B, H, N = key.shape
    out = torch.full((B, H, k), -1, dtype=torch.int64)
    kd = key.double().cpu()
    for b in range(B):
        for h in range(H):
            v = kd[b, h].tolist()
            top = sorted(range(N), key=lambda j: (-v[j], j))[:k]
            sel = sorted(j for j in top if v[j] != -math.inf)
            out[b, h, :len(sel)] = torch.tensor(sel, dtype=torch.int64)
    return out


@pytest.mark.parametrize("B,H,N,k,ties,block", [
    (2, 3, 300, 17, False, 64), (1, 2, 2500, 64, True, 128), (2, 2, 40, 40, False, 64),
    (1, 1, 30, 64, True, 64), (2, 1, 700, 100, True, 64),
])
def test_topk_positions_exact(B, H, N, k, ties, block):
    g = torch.Generator().manual_seed(N + k)
    key = torch.randn(B, H, N, generator=g) * 5 - 3
    if ties:                                    # coarse grid: many equal keys (never +-0.0)
        key = torch.round(key) + 0.25
    key[..., :3] = -math.inf
    key[0, 0, 10:25] = torch.finfo(torch.float32).min   # candidates whose score is -inf
    if B > 1 and N > 100:                       # fewer finite keys than k
        key[1, 0] = -math.inf
        key[1, 0, 5:9] = torch.randn(4, generator=g)
        key[1, 0, 60:70] = torch.finfo(torch.float32).min
    key = key.to(DEV)
    ref = _topk_ref(key, k)
    out = K.topk_positions(key, k, block=block)
    assert out.dtype == torch.int64 and out.shape == (B, H, k)
    assert torch.equal(out.cpu(), ref)
    if not ties:                                # the Selector's torch path: same positions
        from sfi_sglang.method.selector import _top_k_from_key_torch
        assert torch.equal(_top_k_from_key_torch(key, k).cpu(), ref)


def test_topk_positions_onehot_fallback_and_signed_zero():
    key = torch.tensor([[[1.0, -0.0, 0.0, -math.inf, 2.0, 0.0, -1.0]]]).to(DEV)
    for uh in (True, False):
        # -0.0 ranks below +0.0 (torch's radix order); equal keys: lowest positions first
        assert K.topk_positions(key, 3, block=64, use_hist=uh).cpu().tolist() == [[[0, 2, 4]]]
        assert K.topk_positions(key, 4, block=64, use_hist=uh).cpu().tolist() == [[[0, 2, 4, 5]]]
        assert K.topk_positions(key, 9, block=64, use_hist=uh).cpu().tolist() == [[[0, 1, 2, 4, 5, 6, -1, -1, -1]]]


# ---------------------------------------------------------------------------- compiled variants

def _variant_key(fn, args, kwargs):
    """Triton's cache key for one launch, less the device: each positional argument as
    Triton specializes it (native_specialize_impl: ints on == 1 and divisibility by 16,
    pointers on 16-byte alignment; none for do_not_specialize), plus the constexprs and
    launch options passed by keyword."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    dns = getattr(fn, "kwargs", {}).get("do_not_specialize") or getattr(fn, "do_not_specialize", ()) or ()
    dns = {fn.arg_names[d] if isinstance(d, int) else d for d in dns}
    spec = tuple(native_specialize_impl(BaseBackend, a, False, n not in dns, n not in dns)
                 for n, a in zip(fn.arg_names, args))
    return spec, tuple(sorted(kwargs.items()))


@contextlib.contextmanager
def recorded_variants():
    """{kernel name: {(module, Triton cache key)}} of every launch inside the block, the
    kernels interpreted or compiled (bench/compile_variants.py compiles what it holds)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    keys, origs = {}, {cls: cls.run for cls in (InterpretedFunction, JITFunction)}

    def recording(orig):
        def run(self, *args, grid, warmup, **kwargs):
            keys.setdefault(self.fn.__name__, set()).add(
                (self.fn.__module__.rsplit(".", 1)[-1], _variant_key(self, args, kwargs)))
            return orig(self, *args, grid=grid, warmup=warmup, **kwargs)
        return run

    for cls, orig in origs.items():
        cls.run = recording(orig)
    try:
        yield keys
    finally:
        for cls, orig in origs.items():
            cls.run = orig


def launch_decode_step_kernels():
    """Every kernel a decode step launches (fast step; slow step: dense attention with
    scores and key norms, the fused Selector, top-k, the store and pack; dense layers), driven as the
    backend drives it, over batch sizes 1 and 8 and contexts 300 and 1500."""
    from sfi_sglang.method.config import SFIConfig

    cfg = SFIConfig()
    Hkv, G, D, S, W, Kc, bucket = 2, 4, 32, 4, 32, 64, 512
    P = S + Kc
    for B in (1, 8):
        for n in (300, 1500):
            seq_lens = [n - 7 * i for i in range(B)]
            st = make_state(B, Hkv, G, D, P, seq_lens, seed=B * n)
            positions, win_start, packed_len = sfi_layout(st, S, W, Kc, seq_lens, P)
            common = (st["q"], st["k_cache"], st["v_cache"], st["req_to_token"],
                      st["req_pool_indices"], st["seq_lens"])
            K.fast_decode(*common, win_start, st["packed_k"], st["packed_v"], packed_len, D ** -0.5)
            n_max = -(-max(seq_lens) // bucket) * bucket  # the backend's score buffer (SCORE_BUCKET)
            norms = torch.empty((B, Hkv, n_max), dtype=torch.bfloat16, device=DEV)
            _, scores = K.dense_decode_with_scores(*common, D ** -0.5, max_len=n_max, norms_out=norms)
            K.dense_decode(*common, D ** -0.5, max_len=max(seq_lens))
            hi = (st["seq_lens"].long() - W).clamp_min(S)
            lam_max = torch.full((B,), cfg.lambda_max_single, device=DEV)
            key = K.fused_topk_key(scores.view(B, Hkv, G, n_max), norms, torch.full_like(hi, S), hi,
                                   lam_max, cfg)
            sel = K.topk_positions(key, Kc)
            M = st["packed_k"].shape[0]
            i32 = dict(dtype=torch.int32, device=DEV)
            K.store_selection(st["k_cache"], st["v_cache"], st["req_to_token"],
                              st["req_pool_indices"], sel, (hi - S).clamp_max(Kc), hi, st["seq_lens"],
                              torch.ones(B, dtype=torch.bool, device=DEV), S,
                              torch.full((M, Hkv, Kc), -1, **i32), torch.zeros(M, **i32),
                              torch.zeros(M, dtype=torch.int64, device=DEV), torch.zeros(M, **i32),
                              torch.zeros(M, dtype=torch.int64, device=DEV), torch.zeros(M, **i32),
                              st["packed_k"], st["packed_v"])


def test_batch_and_context_build_no_new_kernel_variant():
    """Every kernel of a decode step (launch_decode_step_kernels) compiles to ONE variant
    over batches 1 and 8 and contexts 300 and 1500: its constexprs and Triton's specializations
    do not follow the batch or the context. (As constexprs, the split counts built a new
    variant at the first step of each new batch x context, a compile inside the decode
    loop: bench/NOTES.md, section 6.)"""
    with recorded_variants() as keys:
        launch_decode_step_kernels()
    launched = {"_fast_decode_kernel", "_dense_scores_kernel", "_row_stats_kernel",
                "_evid_prior_kernel", "_fuse_kernel", "_nms_excl_kernel", "_hist_kernel",
                "_count_kernel", "_write_kernel", "_pool_kernel", "_store_kernel"}
    assert launched <= set(keys), sorted(set(keys))
    # one variant per kernel; the dense kernel has two (with and without scores) and the
    # top-k histogram one per radix pass, whatever the batch and context
    topk = importlib.import_module(K.__name__ + ".topk")
    expected = {"_dense_scores_kernel": 2, "_hist_kernel": topk.NPASS}
    counts = {name: len(v) for name, v in keys.items()}
    assert counts == {name: expected.get(name, 1) for name in keys}
