"""SparseMemory (sfi_sglang/method/memory.py): the torch reference path against float64 dense
attention when every candidate is selected, and the kernel path (packed buffers +
kernels.fast_decode / dense_decode_with_scores, run under TRITON_INTERPRET=1 on CPU
tensors) against the reference path on the same inputs. Also the fused Triton Selector
(kernels/selector.py) against sfi_sglang.method.selector's torch pipeline.

Small shapes, fresh random inputs, ragged lengths, GQA groups 1/3/4.
"""

import dataclasses
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

_TRITON_PREIMPORTED = "triton" in sys.modules
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from sfi_sglang.method.config import SFIConfig  # noqa: E402
from sfi_sglang.kernels import reference as REF  # noqa: E402
from sfi_sglang.method.memory import SparseMemory  # noqa: E402

_REPO = pathlib.Path(__file__).resolve().parents[1]
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _interpreter_usable():
    """As in test_kernels.py: TRITON_INTERPRET only applies if set before triton's import."""
    if torch.cuda.is_available() or not _TRITON_PREIMPORTED:
        return True
    import triton.language.standard as std
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(std.cdiv, InterpretedFunction)


_IN_PROCESS = _interpreter_usable()
if not _IN_PROCESS and os.environ.get("SFI_MEMORY_SUBPROCESS") == "1":
    raise RuntimeError("triton imported before TRITON_INTERPRET could be set")

kernel_test = pytest.mark.skipif(not _IN_PROCESS, reason="covered by test_kernel_path_in_fresh_process")

if not _IN_PROCESS:
    def test_kernel_path_in_fresh_process():
        env = dict(os.environ, TRITON_INTERPRET="1", SFI_MEMORY_SUBPROCESS="1")
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "-k", "kernel", str(pathlib.Path(__file__).resolve())],
                           cwd=str(_REPO), env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return (torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref)).item()


def make_pool(seq_lens, Hkv, G, D, max_slots=8, dtype=torch.float32, seed=None):
    """Random KV pool with shuffled slots; requests in random pool slots."""
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    num = sum(seq_lens) + 9
    k_cache = torch.randn(num, Hkv, D, generator=gen).to(dtype)
    v_cache = torch.randn(num, Hkv, D, generator=gen).to(dtype)
    perm = torch.randperm(num, generator=gen)
    rpi = torch.randperm(max_slots, generator=gen)[:len(seq_lens)].long()
    rtt = torch.full((max_slots, max(seq_lens) + 4), num + 10**6, dtype=torch.int32)  # junk
    off = 0
    for b, n in enumerate(seq_lens):
        rtt[rpi[b], :n] = perm[off:off + n].int()
        off += n
    q = torch.randn(len(seq_lens), Hkv * G, D, generator=gen).to(dtype)
    st = dict(k=k_cache, v=v_cache, rtt=rtt, rpi=rpi, q=q,
              seq_lens=torch.tensor(seq_lens, dtype=torch.int32))
    return {k_: v_.to(DEV) for k_, v_ in st.items()}, gen


def selection(cfg, n_sel, Hkv, gen, k=None):
    """Per row: positions [b, H_kv, K] (sorted, -1 padded), sel_count, win_start for a
    selection at context lengths n_sel; k=None selects every candidate of [S, hi)."""
    S, W = cfg.sinks, cfg.window
    B = len(n_sel)
    pos = torch.full((B, Hkv, cfg.budget), -1, dtype=torch.int64)
    cnt = torch.zeros(B, dtype=torch.int32)
    ws = torch.zeros(B, dtype=torch.int64)
    for b, n in enumerate(n_sel):
        hi = max(S, n - W)
        ws[b] = hi
        c = min(cfg.budget, hi - S) if k is None else min(k, cfg.budget, hi - S)
        cnt[b] = c
        for h in range(Hkv):
            if k is None:
                p = torch.arange(S, hi)
            else:
                p = (torch.randperm(hi - S, generator=gen)[:c] + S).sort().values
            pos[b, h, :c] = p
    return pos.to(DEV), cnt.to(DEV), ws.to(DEV)


def dense64(st, sm_scale):
    out, _ = REF.ref_dense_decode_with_scores(st["q"], st["k"], st["v"], st["rtt"], st["rpi"],
                                              st["seq_lens"], sm_scale)
    return out


CFG = SFIConfig(sinks=4, window=8, budget=48, dense_layers=(), fast_path="triton")  # packed: the copy path


def fast_positions(mem, layer_id: int, slot: int, t: int) -> torch.Tensor:
    """Positions [H_kv, L] of a fast step of `slot` at context length t, read off the memory's
    tensors (sinks, selected, window; ascending, disjoint): what every path must attend to."""
    li, S = mem.layer_index[layer_id], mem.sinks
    count, ws = int(mem.sel_count[slot]), int(mem.win_start[slot])
    sel = mem.sel_pos[li, slot, :, :count].long()
    sinks = torch.arange(min(S, t), device=mem.device).expand(mem.num_kv_heads, -1)
    window = torch.arange(min(max(ws, S), t), t, device=mem.device).expand(mem.num_kv_heads, -1)
    return torch.cat([sinks, sel, window], dim=1)


# ------------------------------------------------------------------ reference path
@pytest.mark.parametrize("G", [1, 3, 4])
def test_reference_all_selected_equals_dense(G):
    """Selection at n_sel (every candidate fits in K), fast step at t >= n_sel (the window
    grew): sinks + selected + window is the whole history -> equals dense."""
    Hkv, D = 2, 16
    n_sel = [40, 60, 13, 2, 5]             # 2 < S: bootstrap of a context shorter than the sinks
    t = [43, 60, 20, 7, 9]
    st, gen = make_pool(t, Hkv, G, D)
    mem = SparseMemory(4, [1, 3], 8, Hkv, D, CFG, DEV, torch.float32, packed=False)
    pos, cnt, ws = selection(CFG, n_sel, Hkv, gen)
    for lid in (1, 3):
        mem.store(lid, st["rpi"], pos, cnt, ws, st["k"], st["v"], st["rtt"],
                  seq_lens=torch.tensor(n_sel, device=DEV))
    ref = dense64(st, D ** -0.5)
    for lid in (1, 3):
        out = mem.attend_fast(lid, st["q"], st["k"], st["v"], st["rtt"], st["rpi"], st["seq_lens"],
                              D ** -0.5)
        assert out.dtype == torch.float32 and out.shape == st["q"].shape
        assert rel_err(out, ref) < 1e-5
    # positions: ascending, disjoint, the whole history
    for b, slot in enumerate(st["rpi"].tolist()):
        p = fast_positions(mem, 1, slot, t[b])
        assert p.shape == (Hkv, t[b]) and (p == torch.arange(t[b], device=DEV)).all()


def test_reference_partial_selection_matches_positions():
    """Partial selection: attend_fast == float64 attention over exactly the positions
    sinks + selected + window (the fast-step semantics of memory.py), batched rows of equal
    and different lengths."""
    Hkv, G, D = 2, 4, 16
    cfg = SFIConfig(sinks=4, window=8, budget=12, dense_layers=())
    n_sel = [80, 80, 50, 70]
    t = [83, 83, 50, 74]
    st, gen = make_pool(t, Hkv, G, D)
    mem = SparseMemory(2, [0, 1], 8, Hkv, D, cfg, DEV, torch.float32, packed=False)
    pos, cnt, ws = selection(cfg, n_sel, Hkv, gen, k=10)
    mem.store(1, st["rpi"], pos[..., :10], cnt, ws, st["k"], st["v"], st["rtt"])
    lse = torch.empty(len(t), Hkv * G)  # the adaptive trigger's input
    out = mem.attend_fast(1, st["q"], st["k"], st["v"], st["rtt"], st["rpi"], st["seq_lens"], 0.25,
                          lse_out=lse)
    # the KV pool's slots that no row attends may hold any bits (SGLang's padding slot 0, a
    # slot not written yet, a freed one): NaN there changes nothing
    seen = torch.zeros(st["k"].shape[:2], dtype=torch.bool, device=DEV)
    for b, slot in enumerate(st["rpi"].tolist()):
        p = fast_positions(mem, 1, slot, t[b])
        seen[st["rtt"][slot][p].long(), torch.arange(Hkv, device=DEV)[:, None]] = True
    k_nan, v_nan = (x.masked_fill(~seen[..., None], float("nan")) for x in (st["k"], st["v"]))
    out_nan = mem.attend_fast(1, st["q"], k_nan, v_nan, st["rtt"], st["rpi"], st["seq_lens"], 0.25)
    assert torch.equal(out_nan, out)
    # a row of length 0 reads nothing (the backend's host-path rows): 0, lse -inf, others alike
    skip = st["seq_lens"].clone()
    skip[1] = 0
    lse_skip = torch.empty_like(lse)
    out_skip = mem.attend_fast(1, st["q"], st["k"], st["v"], st["rtt"], st["rpi"], skip, 0.25,
                               lse_out=lse_skip, max_len=max(t))
    assert (out_skip[1] == 0).all() and (lse_skip[1] == float("-inf")).all()
    keep = [0, 2, 3]
    assert rel_err(out_skip[keep], out[keep]) < 1e-6 and torch.allclose(lse_skip[keep], lse[keep])
    for b, slot in enumerate(st["rpi"].tolist()):
        p = fast_positions(mem, 1, slot, t[b])                   # [H, L]
        hi = int(ws[b])
        assert p.shape[1] == 4 + 10 + (t[b] - hi)
        assert torch.equal(p[:, 4:14], pos[b, :, :10])
        slots = st["rtt"][slot][p].long()                       # [H, L]
        keys = st["k"][slots, torch.arange(Hkv)[:, None]].double()
        vals = st["v"][slots, torch.arange(Hkv)[:, None]].double()
        qg = st["q"][b].double().view(Hkv, G, D)
        logits = torch.einsum("hgd,hld->hgl", qg, keys) * 0.25
        w = torch.softmax(logits, -1)
        o = torch.einsum("hgl,hld->hgd", w, vals).reshape(Hkv * G, D)
        assert rel_err(out[b], o) < 1e-5
        assert (lse[b].double() - torch.logsumexp(logits, -1).reshape(-1)).abs().max() < 1e-5


def test_topup_pages_are_the_best_pages_not_held():
    """The top-up (kernels.choose_topup's torch path): per KV head, the `pages` pages of
    [sinks, window start) with the highest Quest bound (an upper bound of every q.k on the
    page) among those holding no held position, brute-forced on random inputs."""
    from sfi_sglang.kernels import choose_topup, page_bounds

    gen = torch.Generator().manual_seed(3)
    H, G, D, n, lo, hi, page, pages = 2, 3, 8, 120, 4, 100, 8, 3
    q, keys = torch.randn(H, G, D, generator=gen), torch.randn(n, H, D, generator=gen)
    bound = page_bounds(q, keys, lo, (hi - lo) // page, page)           # [H, 12]
    qk = torch.einsum("hgd,nhd->hgn", q, keys)[:, :, lo:lo + 12 * page]
    assert (bound + 1e-5 >= qk.amax(1).reshape(H, 12, page).amax(-1)).all()
    best = bound.argsort(dim=-1, descending=True)
    # head 0 holds its best page whole and its second best in part; head 1 holds nothing
    held = torch.full((1, H, 12), -1, dtype=torch.int32)
    held[0, 0, :page] = lo + best[0, 0] * page + torch.arange(page)
    held[0, 0, page:page + 2] = lo + best[0, 1] * page + torch.arange(2)
    rtt, rpi = torch.arange(n, dtype=torch.int32)[None], torch.zeros(1, dtype=torch.long)

    def top(win_start, held):
        return choose_topup(q.view(1, H * G, D), keys, rtt, rpi, torch.tensor([n]), torch.tensor([win_start]),
                            held, lo, page, pages, n // page)[0]
    got = top(hi, held)
    assert got.shape == (H, pages) and got.dtype == torch.int32
    for h, want in ((0, best[0, 2:5]), (1, best[1, :3])):
        assert set(got[h].tolist()) == set(want.tolist())
    assert (top(lo + page - 1, held) == -1).all()  # no whole page
    every = (lo + torch.arange(12 * page, dtype=torch.int32)).expand(1, H, -1).contiguous()
    assert (top(hi, every) == -1).all()  # every page held: none left


def test_topup_every_n_layers_reuses_the_groups_pages():
    """--sfi-topup-every 2 over sparse layers 1..5 (layer 0 dense): pages chosen at 1, 3 and
    5 with the layer's own query; at 2 and 4 the group's, less a page the layer holds; a new
    step chooses again; the device step's StepTopUp reads what the host path reads."""
    from sfi_sglang.method.baselines import HostPath
    from sfi_sglang.method.topup import StepTopUp, layer_pages

    Hkv, G, D = 2, 2, 16
    cfg = SFIConfig(sinks=4, window=8, budget=16, dense_layers=(0,), topup_pages=2, page_size=8,
                    topup_every=2)
    st, gen = make_pool([120], Hkv, G, D, seed=7)
    mem = SparseMemory(6, range(6), 8, Hkv, D, cfg, DEV, torch.float32, packed=False)
    pos, cnt, ws = selection(cfg, [120], Hkv, gen, k=16)
    for lid in range(1, 6):
        mem.store(lid, st["rpi"], pos, cnt, ws, st["k"], st["v"], st["rtt"])
    host = HostPath(mem, None, None, None, None)
    qs = torch.randn(6, 1, Hkv * G, D, generator=gen)
    args = (st["k"], st["rtt"], st["rpi"], st["seq_lens"])
    first = host.topup(1, int(st["rpi"][0]), 5, qs[1], *args, cfg)
    # layer 2 holds the group's first page of head 0: it reads the group's pages less that one
    page0 = int(first[0, 0, 0])
    pos2 = pos.clone()
    pos2[0, 0, 0] = cfg.topup_lo + page0 * 8
    pos2[0, 0] = pos2[0, 0].sort().values
    mem.store(2, st["rpi"], pos2, cnt, ws, st["k"], st["v"], st["rtt"])
    got = {lid: host.topup(lid, int(st["rpi"][0]), 5, qs[lid], *args, cfg) for lid in range(2, 6)}
    for lid in (3, 5):
        assert torch.equal(got[lid], layer_pages(mem, lid, cfg, qs[lid], *args))
    assert torch.equal(got[4], layer_pages(mem, 4, cfg, qs[4], *args, group=got[3]))
    assert int(got[2][0, 0, 0]) == -1 and torch.equal(got[2][0, :, 1:], first[0, :, 1:])
    assert torch.equal(got[2][0, 1], first[0, 1])
    again = host.topup(2, int(st["rpi"][0]), 6, qs[2], *args, cfg)  # a new step: layer 2 chooses
    assert torch.equal(again, layer_pages(mem, 2, cfg, qs[2], *args))
    # the device step's (the server's config, every row of the batch) reads the same pages
    step = StepTopUp(mem, cfg)
    for lid, want in {1: first, **got}.items():
        assert torch.equal(step.pages(lid, qs[lid], *args), want)
    # the pool in pages of 8 slots (SGLang's --page-size 8) holding the same keys: the choice
    # from PageSummaries kept as the keys were written (in two forwards, the first ending
    # mid-page) gives the same pages at every layer
    from sfi_sglang.method.topup import PageSummaries

    slot, n = int(st["rpi"][0]), 120
    order = torch.randperm(n // 8 + 2, generator=gen)
    rtt_p = st["rtt"].clone()
    rtt_p[slot, :n] = (order[torch.arange(n) // 8] * 8 + torch.arange(n) % 8).int().to(DEV)
    k_p = torch.zeros((n // 8 + 2) * 8, Hkv, D, device=DEV)
    k_p[rtt_p[slot, :n].long()] = st["k"][st["rtt"][slot, :n].long()]
    assert cfg.topup_layers(6) == [1, 3, 5] and PageSummaries.wanted(cfg, 8) and not PageSummaries.wanted(cfg, 1)
    summ = PageSummaries(cfg.topup_layers(6), k_p.shape[0], Hkv, D, 8, k_p.dtype, DEV)
    for lid in (1, 3, 5):
        summ.store(lid, k_p, rtt_p[slot, :61])
        summ.store(lid, k_p, rtt_p[slot, 61:n])
    assert summ.bytes() == 3 * (n // 8 + 2) * Hkv * 2 * D * 4
    keyed, paged = StepTopUp(mem, cfg), StepTopUp(mem, cfg, summ)
    for lid in range(1, 6):
        want = keyed.pages(lid, qs[lid], *args)
        assert torch.equal(paged.pages(lid, qs[lid], k_p, rtt_p, st["rpi"], st["seq_lens"]), want)
    # a dense layer inside a group (3 here, one group of 8): its memory row sits between the
    # group's others and is skipped; each later layer drops what it holds, as the host path does
    mid = dataclasses.replace(cfg, dense_layers=(3,), topup_every=8)
    start = layer_pages(mem, 0, mid, qs[0], *args)
    h, j = (int(i) for i in (layer_pages(mem, 5, mid, qs[5], *args, group=start)[0] >= 0).nonzero()[0])
    pos4 = pos.clone()  # layer 4 holds a page of the group's that 3 and 5 keep
    pos4[0, h, 0] = mid.topup_lo + int(start[0, h, j]) * 8
    pos4[0, h] = pos4[0, h].sort().values
    mem.store(4, st["rpi"], pos4, cnt, ws, st["k"], st["v"], st["rtt"])
    step = StepTopUp(mem, mid)
    assert torch.equal(step.pages(0, qs[0], *args), start)
    for lid in (1, 2, 4, 5):
        assert torch.equal(step.pages(lid, qs[lid], *args), layer_pages(mem, lid, mid, qs[lid], *args, group=start))
    assert int(step.pages(4, qs[4], *args)[0, h, j]) == -1 and int(step.pages(5, qs[5], *args)[0, h, j]) >= 0


@pytest.mark.parametrize("fast_path", ["reference", "triton", "triton-pool"])
def test_fast_step_with_topup_pages(fast_path):
    """attend_fast(extra=pages) == float64 attention over the memory's positions and the
    pages' (disjoint from them; -1 reads nothing) on every fast path's memory; with holes
    in the selection (a request's own whole pages on a server without them), holes=True
    reads the memory's positions alone (the packed path's kernel skips the stale rows)."""
    Hkv, G, D = 2, 2, 16
    packed = fast_path != "reference"
    cfg = SFIConfig(sinks=4, window=8, budget=12, dense_layers=(), page_size=4,
                    fast_path="triton" if not packed else fast_path)
    n_sel, t = [80, 60], [83, 61]
    st, gen = make_pool(t, Hkv, G, D, seed=5)
    mem = SparseMemory(2, [0, 1], 8, Hkv, D, cfg, DEV, torch.float32, packed=packed)
    pos = torch.full((2, Hkv, 10), -1, dtype=torch.int64)
    pos[:, :, :10] = 30 + torch.arange(10)  # the selection holds [30, 40)
    cnt, ws = torch.tensor([10, 10]), torch.tensor([n - 8 for n in n_sel])
    mem.store(0, st["rpi"], pos.to(DEV), cnt, ws, st["k"], st["v"], st["rtt"])
    holes = pos.clone()
    holes[:, :, 2:4] = -1                   # holes inside the count, as a page selection leaves
    mem.store(1, st["rpi"], holes.to(DEV), cnt, ws, st["k"], st["v"], st["rtt"])
    extra = torch.tensor([[[0, 2, -1], [1, -1, 3]], [[2, 3, 1], [-1, -1, -1]]], dtype=torch.int32)
    for lid, kw in ((0, {"extra": extra.to(DEV)}), (1, {"extra": extra.to(DEV), "holes": True}),
                    (1, {"holes": True})):
        out = mem.attend_fast(lid, st["q"], st["k"], st["v"], st["rtt"], st["rpi"], st["seq_lens"], 0.25, **kw)
        for b, slot in enumerate(st["rpi"].tolist()):
            base = fast_positions(mem, lid, slot, t[b])
            for h in range(Hkv):
                pages = [x for x in extra[b, h].tolist() if x >= 0] if "extra" in kw else []
                p = sorted({x for x in base[h].tolist() if x >= 0} | {4 + 4 * g + i for g in pages for i in range(4)})
                slots = st["rtt"][slot][p].long()
                keys, vals = st["k"][slots, h].double(), st["v"][slots, h].double()
                qh = st["q"][b].double().view(Hkv, G, D)[h]
                o = torch.softmax(qh @ keys.T * 0.25, -1) @ vals
                assert rel_err(out[b].view(Hkv, G, D)[h], o) < 1e-5


def test_reset_store_and_bytes():
    Hkv, D = 2, 8
    mem = SparseMemory(3, [1, 2], 5, Hkv, D, CFG, DEV, torch.float16, packed=False)
    L, M, K = 2, 5, CFG.budget
    assert mem.bytes() == L * M * Hkv * K * 4 + M * 4 + M * 4 + M * 8 + M * 4 + M * 8 + M * 4 * 8
    st, gen = make_pool([70, 30], Hkv, 1, D, max_slots=5)
    pos, cnt, ws = selection(CFG, [70, 30], Hkv, gen, k=5)
    mem.store(2, st["rpi"], pos, cnt, ws, st["k"], st["v"], st["rtt"])
    slot = int(st["rpi"][0])
    assert int(mem.sel_count[slot]) == 5 and int(mem.win_start[slot]) == 62
    assert (mem.sel_pos[mem.layer_index[2], slot, :, 5:] == -1).all()
    mem.reset(st["rpi"][:1])
    assert int(mem.sel_count[slot]) == 0 and (mem.sel_pos[:, slot] == -1).all()
    assert int(mem.sel_count[int(st["rpi"][1])]) == 5
    pk = SparseMemory(3, [1, 2], 5, Hkv, D, CFG, DEV, torch.float16, packed=True)
    assert pk.bytes() == mem.bytes() + 2 * L * M * Hkv * (CFG.sinks + K) * D * 2 + M * 4
    # "triton-pool" reads the pool in place: per slot only the lists (and packed_len)
    pool_cfg = CFG.replace(fast_path="triton-pool")
    pool = SparseMemory(3, [1, 2], 5, Hkv, D, pool_cfg, DEV, torch.float16, packed=True)
    assert pool.bytes() == mem.bytes() + M * 4 and not pool.packed_k
    # footprint (what SGLang's budget sets aside, sfi_sglang.integration.hooks) is the allocation
    for m, cfg, packed in ((mem, CFG, False), (pk, CFG, True), (pool, pool_cfg, True)):
        assert m.bytes() == SparseMemory.footprint(L, Hkv, D, cfg, torch.float16, packed, M)
    # memory rows: the selections and packed K/V of rows + 1 rows, whatever the slots
    many = SparseMemory(3, [1, 2], 50, Hkv, D, CFG, DEV, torch.float16, packed=True, rows=4)
    row = L * Hkv * K * 4 + 2 * L * Hkv * (CFG.sinks + K) * D * 2
    assert many.bytes() == 5 * row + 50 * (4 + 4 + 8 + 4 + 8 + 4 * 8 + 4) and many.row_bytes() == row
    assert many.bytes() == SparseMemory.footprint(L, Hkv, D, CFG, torch.float16, True, 50, rows=4)


def test_kv_budget_sets_aside_the_sparse_memory_and_nothing_per_token():
    from sfi_sglang.method.config import SFIConfigError
    from sfi_sglang.method.memory import kv_budget

    L, H, D, slots = 4, 2, 16, 3
    per_slot = SparseMemory.footprint(L, H, D, CFG, torch.bfloat16, True, 1)
    kv_cell = 2 * L * H * D * 2
    avail = (slots + 1) * per_slot + 1000 * kv_cell + kv_cell - 1
    left = kv_budget(avail, L, H, D, CFG, torch.bfloat16, True, slots)
    # every byte past the memory is SGLang's: no key norms beside the pool (the slow pass
    # computes them from the keys it reads)
    assert left == 1001 * kv_cell - 1
    with pytest.raises(SFIConfigError, match="lower --sfi-memory-rows"):
        kv_budget((slots + 1) * per_slot, L, H, D, CFG, torch.bfloat16, True, slots)
    # --sfi-memory-rows auto: the rows set aside are no fewer than the backend makes of the
    # pool it gets (cfg.rows_for of SGLang's token count, at most the budget's)
    auto = CFG.replace(memory_rows="auto")
    for tokens in (0, 250, 5000):
        avail = 30 * per_slot + tokens * kv_cell
        left = kv_budget(avail, L, H, D, auto, torch.bfloat16, False, 40, rows="auto")  # as hooks passes it
        pool = left // kv_cell
        made = auto.rows_for(pool, 41)
        assert avail - left >= SparseMemory.footprint(L, H, D, auto, torch.bfloat16, False, 41, rows=made)
        assert left <= kv_budget(avail, L, H, D, CFG.replace(memory_rows=1), torch.bfloat16, False, 40, rows=1)
    assert made == 41  # 5000 tokens hold more than the 41 slots' worth of S + W + K = 60
    # a number of rows past the slots sets aside one per slot (the backend makes no more)
    assert (kv_budget(avail, L, H, D, CFG, torch.bfloat16, False, 40, rows=500)
            == kv_budget(avail, L, H, D, CFG, torch.bfloat16, False, 40, rows=41))


def test_score_buffers_are_made_once_and_set_aside_from_the_kv_budget(monkeypatch):
    """The slow pass's score and key-norm buffers (step.ScoreBuffers) are allocated at the
    backend's start, one row per score row of a step (step.score_rows), and SGLang's KV
    budget shrinks by exactly their bytes (hooks._reserve_sfi_memory passes reserve_bytes to
    kv_budget)."""
    from sfi_sglang.method import step
    from sfi_sglang.method.memory import kv_budget
    from sfi_sglang.method.step import ScoreBuffers

    rows, sparse, hq, hkv, width = 5, 3, 4, 2, 100
    sb = ScoreBuffers("cpu", True, rows, sparse, hq, hkv, width, batched=True)
    wn = 104  # the norms' width: 100 rounded up to 16 bytes of bf16
    cell = 4 * hq * width + 2 * hkv * wn  # a row's float32 logits and bf16 key norms
    one, per_row = rows * cell, sparse * cell
    assert sb.bytes() == one + rows * per_row == ScoreBuffers.reserve_bytes(rows, sparse, hq, hkv, width, True)
    s1, n1 = sb.layer(rows, None)
    s2, n2 = sb.layer(2, None)
    assert (s1.data_ptr(), n1.data_ptr()) == (s2.data_ptr(), n2.data_ptr())  # never replaced
    assert n1.shape == (rows, hkv, wn) and n1.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="score rows"):
        sb.layer(rows + 1, None)
    sc, nm = sb.step(rows)
    assert sc.shape == (sparse, rows, hq, width) and nm.shape == (sparse, rows, hkv, wn)
    # every layer's and row's norms start 16-byte aligned (one Triton variant for all)
    assert all(nm[i, r].data_ptr() % 16 == 0 for i in range(sparse) for r in range(rows))
    assert sb.step(rows + 1) is None
    # the batched Selector's buffers hold as many rows as SELECT_BATCH_BYTES allows
    monkeypatch.setattr(step, "SELECT_BATCH_BYTES", 2 * per_row)
    assert ScoreBuffers.reserve_bytes(rows, sparse, hq, hkv, width, True) == one + 2 * per_row
    assert ScoreBuffers.reserve_bytes(rows, sparse, hq, hkv, width, False) == one
    assert ScoreBuffers("cpu", False, rows, sparse, hq, hkv, width, True).bytes() == 0  # the torch reference
    monkeypatch.undo()
    # Qwen3-4B at a 128K context: 64 slots without a limit on slow rows ~1.1 GiB (the
    # batched buffer does not fit 256 MiB); with the default limit of 8, 8 rows whatever
    # the slots
    big = ScoreBuffers.reserve_bytes(step.score_rows(65, 0), 34, 32, 8, 131072 + 4, True)
    assert big == 65 * (32 * 4 * (131072 + 4) + 8 * 2 * (131072 + 8))
    assert step.score_rows(65, SFIConfig().max_slow_rows) == 8 and step.score_rows(3, 8) == 3
    assert step.score_rows(65, 0, 5) == 5 and step.score_rows(65, 8, 5) == 5 and step.score_rows(3, 0, 5) == 3
    L, H, D, slots = 4, 2, 16, 3
    kv_cell = 2 * L * H * D * 2
    mem = SparseMemory.footprint(L, H, D, CFG, torch.bfloat16, True, slots + 1)
    scores = sb.bytes()
    avail = mem + scores + 1000 * kv_cell
    assert kv_budget(avail, L, H, D, CFG, torch.bfloat16, True, slots, scores) == 1000 * kv_cell
    assert kv_budget(avail, L, H, D, CFG, torch.bfloat16, True, slots) == avail - mem


def test_step_plan_limits_slow_rows_and_maps_them_to_score_rows():
    """StepPlan.begin: at most max_slow rows are slow (the first in batch order; SFI-off
    rows and the padding slot never), each with its score row; the score rows carry the
    slow rows' slots and lengths, and the rest select nothing (padding slot, length 0).
    A row put off is slow at its next step; put off before its first selection, it runs
    dense meanwhile (its memory holds nothing of its own)."""
    from sfi_sglang.method.boundary import TriggerPolicy
    from sfi_sglang.method.step import StepPlan

    cfg = SFIConfig(max_slow_rows=2)
    L, slots_n = 3, 8
    pol = TriggerPolicy(torch.zeros(4, dtype=torch.bool), torch.ones(4, dtype=torch.bool), slots_n, cfg)
    plan = StepPlan(pol, slots_n, L, "cpu", max_slow=cfg.max_slow_rows)
    slots = torch.tensor([3, 0, 5, 6, 2])  # batch row 1: SGLang's padding slot
    for s, off in ((3, False), (5, True), (6, False), (2, False)):
        plan.start(s, sfi=not off, dense_layers=(0,) if s == 6 else ())
        pol.reset(torch.tensor([s]), cfg)
    lens = torch.tensor([40, 1, 50, 60, 70])
    ids = torch.zeros(5, dtype=torch.int64)
    rows = plan.begin(ids, slots, lens)  # no selection yet: every SFI row wants a slow step
    assert rows.slow.tolist() == [True, False, False, True, False]
    assert rows.deferred.tolist() == [False, False, False, False, True]  # row 4 put off
    # and, with no selection to read yet, dense at every layer this step (no scores)
    assert rows.bare.tolist() == [False, False, False, False, True]
    assert rows.dense[4].all() and rows.need_l[:, 4].all() and not rows.dense[3, 1:].any()
    assert rows.score_row.tolist() == [0, -1, -1, 1, -1]
    assert rows.sel_slots.tolist() == [3, 6] and rows.sel_lens.tolist() == [40, 60]
    assert rows.sel_l.tolist() == [[True, False], [True, True], [True, True]]  # slot 6: layer 0 dense
    assert rows.need_l[:, 2].all()  # the SFI-off row runs every layer's dense pass, without scores
    rows = plan.begin(ids, slots, lens + 1)  # the put-off row now; the others hold selections
    assert rows.slow.tolist() == [False, False, False, False, True] and not rows.deferred.any()
    assert not rows.bare.any() and not rows.dense[0].any()
    assert rows.score_row.tolist() == [-1, -1, -1, -1, 0]
    assert rows.sel_slots.tolist() == [2, 0] and rows.sel_lens.tolist() == [71, 0]
    assert not rows.sel_l[:, 1].any()
    # a step the whole batch ran dense: every SFI row refreshes at its next step; the one past
    # the limit reads the selection it holds meanwhile (behind by a token, not bare)
    plan.skip(slots)
    rows = plan.begin(ids, slots, lens + 3)
    assert rows.slow.tolist() == [True, False, False, True, False]
    assert rows.deferred.tolist() == [False, False, False, False, True]
    assert not rows.bare.any() and not rows.dense[4].any()
    assert plan.begin(ids, slots, lens + 4).slow.tolist() == [False, False, False, False, True]
    unlimited = StepPlan(pol, slots_n, L, "cpu").begin(ids, slots, lens)
    assert unlimited.sel_slots.shape == (5,)  # one score row per batch row


# ------------------------------------------------------------------ kernel path == reference
@kernel_test
@pytest.mark.parametrize("G,full", [(1, True), (3, False), (4, False), (4, True)])
def test_kernel_path_matches_reference(G, full):
    Hkv, D = 2, 32
    cfg = SFIConfig(sinks=4, window=8, budget=40 if full else 12, dense_layers=(), fast_path="triton")
    n_sel = [30, 52, 3, 17] if full else [60, 52, 3, 17]
    t = [34, 52, 6, 20] if full else [66, 52, 6, 20]
    st, gen = make_pool(t, Hkv, G, D, seed=None)
    mems = [SparseMemory(2, [1], 8, Hkv, D, cfg, DEV, torch.float32, packed=p) for p in (False, True)]
    # the fast path that reads the pool in place: nothing packed, the same result
    mems.append(SparseMemory(2, [1], 8, Hkv, D, cfg.replace(fast_path="triton-pool"), DEV, torch.float32,
                             packed=True))
    assert mems[1].packed and not mems[0].packed and not mems[2].packed_k
    pos, cnt, ws = selection(cfg, n_sel, Hkv, gen, k=None if full else 10)
    for m in mems:
        m.reset(st["rpi"])
        m.store(1, st["rpi"], pos, cnt, ws, st["k"], st["v"], st["rtt"],
                seq_lens=torch.tensor(n_sel, device=DEV))
    args = (st["q"], st["k"], st["v"], st["rtt"], st["rpi"], st["seq_lens"], D ** -0.5)
    ref = mems[0].attend_fast(1, *args)
    for m in mems[1:]:
        out = torch.full_like(st["q"], float("nan"))
        m.attend_fast(1, *args, out=out)
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) < 1e-5, m.fast_path
        if full:
            assert rel_err(out, dense64(st, D ** -0.5)) < 1e-5
    # slow step: dense + scores + key norms, kernel vs reference
    o_ref, s_ref, n_ref = mems[0].attend_slow(1, *args, max_len=max(t) + 3)
    o_k, s_k, n_k = mems[1].attend_slow(1, *args, max_len=max(t) + 3)
    assert rel_err(o_k, o_ref) < 1e-5 and rel_err(o_ref, dense64(st, D ** -0.5)) < 1e-5
    fin = torch.isfinite(s_ref)
    assert torch.equal(fin, torch.isfinite(s_k)) and rel_err(s_k[fin], s_ref[fin]) < 1e-5
    live = fin[:, ::s_ref.shape[1] // n_ref.shape[1]]  # [b, H_kv, N]: positions < seq_len
    assert n_k.dtype == n_ref.dtype == torch.bfloat16
    assert rel_err(n_k[live].double(), n_ref[live].double()) < 2 ** -7  # one bf16 step


@kernel_test
def test_kernel_store_is_the_reference_store_in_one_launch():
    """kernels.store_selection (the Triton path's store) keeps the same bookkeeping as the
    torch path, packs sinks + selection, and leaves rows outside `rows` untouched:
    short selections (K' < K), a context shorter than the sinks, a masked-out row."""
    Hkv, D = 2, 16
    cfg = SFIConfig(sinks=4, window=8, budget=12, dense_layers=(), fast_path="triton")
    n_sel = [60, 3, 40, 52]
    st, gen = make_pool([64, 6, 44, 56], Hkv, 2, D, seed=3)
    mems = [SparseMemory(2, [1], 8, Hkv, D, cfg, DEV, torch.float32, packed=p) for p in (False, True)]
    mems.append(SparseMemory(2, [1], 8, Hkv, D, cfg.replace(fast_path="triton-pool"), DEV, torch.float32,
                             packed=True))  # the same launch, bookkeeping only
    first = selection(cfg, n_sel, Hkv, gen, k=9)
    pos, cnt, ws = selection(cfg, n_sel, Hkv, gen, k=7)
    rows = torch.tensor([True, True, False, True], device=DEV)
    lens = torch.tensor(n_sel, device=DEV)
    for m in mems:
        m.store(1, st["rpi"], *first, st["k"], st["v"], st["rtt"], seq_lens=lens)
        m.store(1, st["rpi"], pos[..., :9], cnt, ws, st["k"], st["v"], st["rtt"], seq_lens=lens, only=rows)
    ref, ker, pool = mems
    for name in ("sel_pos", "sel_count", "win_start", "n_sinks", "fast_ws"):
        assert torch.equal(getattr(ker, name), getattr(ref, name)), name
        assert torch.equal(getattr(pool, name), getattr(ref, name)), name
    assert torch.equal(pool.packed_len, ker.packed_len)
    assert int(ker.n_sinks[int(st["rpi"][1])]) == 3 and int(ker.sel_count[int(st["rpi"][2])]) == 9
    for b, slot in enumerate(st["rpi"].tolist()):
        ns, c = int(ref.n_sinks[slot]), int(ref.sel_count[slot])
        assert int(ker.packed_len[slot]) == ns + c
        for h in range(Hkv):
            p = torch.cat([torch.arange(ns, device=DEV), ref.sel_pos[0, slot, h, :c].long()])
            tok = st["rtt"][slot, p].long()
            assert torch.equal(ker.packed_k[0][slot, h, :ns + c], st["k"][tok, h])
            assert torch.equal(ker.packed_v[0][slot, h, :ns + c], st["v"][tok, h])


@kernel_test
@pytest.mark.parametrize("fast_path,packed,page", [("triton", False, 1), ("triton", True, 1),
                                                   ("triton-pool", True, 1), ("triton", True, 4)])
def test_memory_rows_hold_what_the_slots_held(fast_path, packed, page):
    """With memory rows (`rows`: fewer than the slots, given by the host in any order),
    each path stores, attends and exports a slot's memory as a memory of one row per slot
    does, bit for bit; a slot gets no row when none is free, and a row taken back and given
    to another slot comes back empty."""
    Hkv, G, D = 2, 3, 16
    cfg = SFIConfig(sinks=4, window=8, budget=12, dense_layers=(), fast_path=fast_path, selection_page=page)
    n_sel, t = [60, 52, 40, 17], [66, 52, 44, 20]
    st, gen = make_pool(t, Hkv, G, D)
    slots = st["rpi"].tolist()
    flat = SparseMemory(2, [1], 8, Hkv, D, cfg, DEV, torch.float32, packed=packed)
    rowed = SparseMemory(2, [1], 8, Hkv, D, cfg, DEV, torch.float32, packed=packed, rows=len(slots))
    assert rowed.sel_pos.shape[1] == len(slots) + 1 and flat.sel_pos.shape[1] == 8
    for slot in reversed(slots):  # rows in another order than the slots
        assert not rowed.rows.has(slot) and rowed.give_row(slot) and rowed.rows.has(slot)
    spare = next(s for s in range(1, 8) if s not in slots)
    assert not rowed.give_row(spare) and rowed.rows.free == 0  # all rows held
    pos, cnt, ws = selection(cfg, n_sel, Hkv, gen, k=9)
    lens = torch.tensor(n_sel, device=DEV)
    for m in (flat, rowed):
        m.reset(st["rpi"])
        m.store(1, st["rpi"], pos, cnt, ws, st["k"], st["v"], st["rtt"], seq_lens=lens)
    args = (st["q"], st["k"], st["v"], st["rtt"], st["rpi"], st["seq_lens"], D ** -0.5)
    out = [m.attend_fast(1, *args, out=torch.full_like(st["q"], float("nan"))) for m in (flat, rowed)]
    assert torch.isfinite(out[0]).all() and torch.equal(out[0], out[1])
    for slot in slots:
        a, b = flat.export(slot), rowed.export(slot)
        assert torch.equal(a[0], b[0]) and a[1:] == b[1:]
    # a row taken back and given to another slot: that slot's memory starts empty
    rowed.rows.take(slots[0])
    assert rowed.rows.free == 1 and not rowed.rows.has(slots[0]) and rowed.give_row(spare)
    assert int(rowed.sel_count[spare]) == 0 and (rowed.export(spare)[0] == -1).all()
    assert int(rowed.rows.row_of[slots[0]]) == 0


@kernel_test
def test_kernel_path_half_precision_and_restore():
    """Half-precision pool (bf16 on CUDA; fp16 on CPU: the Triton 3.8 interpreter's tl.dot
    on bf16 returns garbage, see test_kernels.py); a second selection overwrites the first."""
    Hkv, G, D = 2, 4, 32
    dt = torch.bfloat16 if DEV == "cuda" else torch.float16
    cfg = SFIConfig(sinks=4, window=8, budget=16, dense_layers=(), fast_path="triton")
    t = [70, 45]
    st, gen = make_pool(t, Hkv, G, D, dtype=dt)
    mems = [SparseMemory(1, [0], 8, Hkv, D, cfg, DEV, dt, packed=p) for p in (False, True)]
    args = (st["q"], st["k"], st["v"], st["rtt"], st["rpi"], st["seq_lens"], D ** -0.5)
    for k in (16, 5):
        pos, cnt, ws = selection(cfg, [66, 45], Hkv, gen, k=k)
        for m in mems:
            m.store(0, st["rpi"], pos, cnt, ws, st["k"], st["v"], st["rtt"])
        ref = mems[0].attend_fast(0, *args)
        out = mems[1].attend_fast(0, *args)
        assert rel_err(out, ref) < 2e-2


# ------------------------------------------------------------------ fused Selector (Triton)
@kernel_test
@pytest.mark.parametrize("overrides", [{}, {"fusion": "geometric"}, {"alpha": 0.0},
                                       {"use_prior": False, "nms_radius": 3, "selection_page": 4}])
def test_kernel_fused_selector_matches_torch(overrides):
    """The fused Selector's ranking key equals the torch pipeline's score, and the two choose
    the same positions (whole pages in the last case)."""
    from sfi_sglang.method import selector as S

    cfg = SFIConfig(dense_layers=()).replace(**overrides)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    B, H, R, N = 3, 4, 4, 300
    logits = torch.randn(B, H, R, N, generator=gen) * 3
    logits[2, :, :, ::3] = -math.inf
    logits[1, :, 1] = -math.inf                          # a fully masked row
    norms = torch.rand(B, H, N, generator=gen) * 4 + 0.2
    lo, hi = torch.tensor([4, 4, 0]), torch.tensor([290, 100, 4])
    logits, norms, lo, hi = (x.to(DEV) for x in (logits, norms, lo, hi))
    n_rows = torch.tensor([1, 2, 1], device=DEV)
    score = S.select_scores(logits, norms, lo, hi, n_rows, cfg)
    key = S.select_key_fused(logits, norms, lo, hi, n_rows, cfg)
    cand = S.candidate_mask(lo, hi, N)[:, None, :].expand(B, H, N)
    fin = torch.isfinite(score)
    lowest = torch.finfo(torch.float32).min
    assert torch.equal(torch.isfinite(key) & (key > lowest), fin)
    assert (key[cand & ~fin] == lowest).all()
    assert torch.isneginf(key[~cand]).all()
    err = ((key[fin] - score[fin]).abs() / score[fin].abs().clamp_min(1)).max()
    assert err < 1e-4
    a = S.select(logits, norms, lo, hi, 32, n_rows, cfg, fused=False)
    b = S.select(logits, norms, lo, hi, 32, n_rows, cfg, fused=True)
    assert (a == b).float().mean() > 0.98


def test_export_import_and_step_counters():
    """A selection copied out of one slot and into another (sfi_sglang.integration.radix's sharing)
    gives the same fast-step positions there; step counters reset with the slot."""
    Hkv, D = 2, 8
    mem = SparseMemory(3, [1, 2], 6, Hkv, D, CFG, DEV, torch.float32, packed=False)
    st, gen = make_pool([70, 70], Hkv, 1, D, max_slots=6)
    pos, cnt, ws = selection(CFG, [70, 70], Hkv, gen, k=5)
    src, dst = st["rpi"].tolist()
    for lid in (1, 2):
        mem.store(lid, st["rpi"][:1], pos[:1], cnt[:1], ws[:1], st["k"], st["v"], st["rtt"])
    positions, count, hi = mem.export(src)
    mem.reset([dst])
    mem.import_(dst, positions, count, hi, lambda lid: (st["k"], st["v"]), st["rtt"], [1, 2])
    for lid in (1, 2):
        assert torch.equal(fast_positions(mem, lid, dst, 75), fast_positions(mem, lid, src, 75))
    slots = torch.tensor([src, dst])
    mem.count_steps(slots, torch.tensor([True, True]), torch.tensor([False, True]))
    mem.count_steps(slots, torch.tensor([True, False]), torch.tensor([False, False]))
    assert mem.counts[src].tolist() == [2, 0, 0, 0] and mem.counts[dst].tolist() == [1, 1, 0, 0]
    mem.reset([src])
    assert mem.counts[src].tolist() == [0, 0, 0, 0] and int(mem.sel_count[src]) == 0


@kernel_test
def test_kernel_fused_selector_reads_norms_on_the_candidates_only():
    """The slow pass writes key norms for positions < seq_len only (its buffers' tails keep
    whatever they held): NaN norms off the candidates [lo, hi) change neither the fused
    key nor the torch path's choice."""
    from sfi_sglang.method import selector as S

    cfg = SFIConfig(dense_layers=())
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    B, H, R, N = 2, 4, 1, 200
    logits = (torch.randn(B, H, R, N, generator=gen) * 3).to(DEV)
    norms = (torch.rand(B, H, N, generator=gen) * 4 + 0.2).to(DEV)
    lo, hi = torch.tensor([4, 4], device=DEV), torch.tensor([150, 190], device=DEV)
    off = ~S.candidate_mask(lo, hi, N)[:, None, :].expand(B, H, N)
    poisoned = norms.masked_fill(off, float("nan"))
    assert torch.equal(S.select_key_fused(logits, norms, lo, hi, 1, cfg),
                       S.select_key_fused(logits, poisoned, lo, hi, 1, cfg))
    assert torch.equal(S.select(logits, norms, lo, hi, 32, 1, cfg, fused=False),
                       S.select(logits, poisoned, lo, hi, 32, 1, cfg, fused=False))


@kernel_test
@pytest.mark.parametrize("G,whole_pages", [(1, False), (4, False), (4, True)])
def test_flashinfer_lists_and_merge_are_the_fast_step(G, whole_pages):
    """The FlashInfer fast path around FlashInfer's decode (kernels.flashinfer_fast): each
    (request, KV head) list (page = KV slot * H_kv + head) holds exactly the fast step's
    positions, cut into C rows that together cover it; FlashInfer's decode over those rows
    (its float64 stand-in, ref_paged_decode) merged by merge_rows equals the reference fast
    step, log-sum-exp included. Rows: lists longer than ROW (several rows each), one shorter
    than C (empty rows, LSE -inf), the padding slot's (no entry: output 0), and one whose
    lists outgrow the planned bound (flagged `over`, capped). With whole pages
    (--sfi-selection-page) some heads hold fewer positions than the count (trailing -1
    entries, as the Selector's pages leave): their lists leave them out, and one more row per
    list, unread by the merge, covers the rest of the region. The Triton kernels equal their
    references, and nothing is packed."""
    from sfi_sglang.kernels import flashinfer_fast as fif
    from sfi_sglang.method.memory import NO_WINDOW

    Hkv, D = 3, 16
    cfg = CFG.replace(fast_path="flashinfer", max_interval=300,  # cap 360: C = 3 rows of 120
                      selection_page=3 if whole_pages else 1)
    n_sel, t = [60, 52, 2, 40, 60], [296, 57, 2, 40, 420]
    st, gen = make_pool(t, Hkv, G, D, seed=None)
    ref_mem = SparseMemory(2, [1], 8, Hkv, D, cfg.replace(fast_path="triton"), DEV, torch.float32, packed=False)
    mem = SparseMemory(2, [1], 8, Hkv, D, cfg, DEV, torch.float32, packed=True, group=G)
    assert mem.fast_path == "flashinfer" and not mem.packed_k
    assert mem.bytes() < SparseMemory(2, [1], 8, Hkv, D, CFG, DEV, torch.float32, packed=True).bytes()
    pos, cnt, ws = selection(cfg, n_sel, Hkv, gen, k=9)
    if whole_pages:  # heads holding 9 - 3 and 9 - 5 of the 9 (trailing -1, still sorted)
        pos[0, 0, 6:9] = -1
        pos[4, Hkv - 1, 4:9] = -1
    rpi, seq_lens = st["rpi"].clone(), st["seq_lens"].clone()
    for m in (ref_mem, mem):
        m.reset(rpi)
        m.store(1, rpi, pos, cnt, ws, st["k"], st["v"], st["rtt"], seq_lens=torch.tensor(n_sel, device=DEV))
    mem.fast_ws[rpi[3]] = NO_WINDOW  # as the padding slot: nothing selected, no window
    mem.sel_count[rpi[3]] = 0
    mem.n_sinks[rpi[3]] = 0
    mem.packed_len[rpi[3]] = 0
    fi, cap = mem._fi, mem.fast_cap
    assert cap == 360 and fi.C == 3 and fif.ROW * fi.C >= cap and fi.R == 3 + whole_pages
    fl = mem.fast_lists(rpi, seq_lens)
    want_len = [4 + 9 + 296 - 52, 4 + 9 + 57 - 44, 2, 0, 4 + 9 + 420 - 52]
    assert fl.over.tolist() == [False, False, False, False, True]
    assert fl.lengths.tolist() == [min(n, cap) for n in want_len]
    sm = D ** -0.5
    B, n = len(t), len(t) * Hkv * fi.R
    bufs = [(torch.full_like(fi.indptr, -7), torch.full_like(fi.pages, -7), torch.zeros_like(fi.qrows))
            for _ in range(2)]
    for build, (indptr, pages, qrows) in zip((fif.build_lists, REF.ref_build_lists), bufs):
        args = (st["q"], st["rtt"], rpi, fl.lengths, fl.start, seq_lens, fl.win_start, mem.n_sinks,
                mem.sel_pos[0], mem.sel_count, indptr, pages, qrows, fi.C)
        build(*args, cap, whole_pages) if build is fif.build_lists else build(*args, whole_pages)
    (indptr, pages, qrows), (rindptr, rpages, rqrows) = bufs
    assert torch.equal(indptr[:n + 1], rindptr[:n + 1])
    assert torch.equal(pages[:int(indptr[n])], rpages[:int(indptr[n])])
    assert torch.equal(qrows[:n], rqrows[:n])
    # memory rows (--sfi-memory-rows): the lists read sel_pos by row_of[slot], rows in
    # another order than the slots
    row_of = torch.zeros(8, dtype=torch.int32, device=DEV)
    row_of[rpi] = torch.arange(B, 0, -1, dtype=torch.int32, device=DEV)
    by_row = torch.full((B + 1,) + tuple(mem.sel_pos.shape[2:]), -1, dtype=torch.int32, device=DEV)
    by_row[row_of[rpi].long()] = mem.sel_pos[0][rpi]
    rbufs = (torch.full_like(fi.indptr, -7), torch.full_like(fi.pages, -7), torch.zeros_like(fi.qrows))
    fif.build_lists(st["q"], st["rtt"], rpi, fl.lengths, fl.start, seq_lens, fl.win_start, mem.n_sinks, by_row,
                    mem.sel_count, *rbufs, fi.C, cap, whole_pages, row_of=row_of)
    assert torch.equal(rbufs[0][:n + 1], indptr[:n + 1])
    assert torch.equal(rbufs[1][:int(indptr[n])], pages[:int(indptr[n])])
    rows_len = (indptr[1:n + 1] - indptr[:n]).view(B, Hkv, fi.R)
    real = rows_len[:, :, :fi.C]  # the merged rows; with whole pages the last row holds the rest
    assert int(real.max()) <= fi.row_len <= fif.ROW and int(rows_len.min()) >= 0
    assert real[2].min() == 0 and rows_len[3].sum() == 0  # empty rows: a short list, none
    for b, slot in enumerate(rpi.tolist()):
        if b in (3, 4):
            continue
        want = fast_positions(ref_mem, 1, slot, t[b])
        for h in range(Hkv):
            w = want[h][want[h] >= 0]
            assert int(real[b, h].sum()) == w.numel()
            assert int(rows_len[b, h].sum()) == int(fl.lengths[b])
            lo = int(indptr[(b * Hkv + h) * fi.R])
            row = pages[lo: lo + w.numel()].long()
            assert torch.equal(row % Hkv, torch.full_like(row, h))
            assert torch.equal(row // Hkv, st["rtt"][slot, w].long())
    o_rows, lse_rows = REF.ref_paged_decode(qrows[:n], st["k"].reshape(-1, D), st["v"].reshape(-1, D),
                                            indptr, pages, sm)
    assert torch.isinf(lse_rows[(2 * Hkv) * fi.R:(4 * Hkv) * fi.R]).any()
    ref_lse = torch.empty(B, Hkv * G)
    ref = ref_mem.attend_fast(1, st["q"], st["k"], st["v"], st["rtt"], rpi, seq_lens, sm, lse_out=ref_lse)
    for merge in (fif.merge_rows, REF.ref_merge_rows):
        out, lse = torch.full_like(st["q"], float("nan")), torch.full((B, Hkv * G), float("nan"))
        merge(o_rows.float(), lse_rows.float(), out, fi.C, lse_out=lse, R=fi.R)
        keep = [0, 1, 2]
        assert rel_err(out[keep], ref[keep]) < 1e-5
        assert torch.allclose(lse[keep], ref_lse[keep], atol=1e-4)
        assert torch.equal(out[3], torch.zeros_like(out[3])) and torch.isinf(lse[3]).all()


class _DecodeStandIn:
    """FlashInfer's planned decode wrapper as the path runs it (`run(qrows, kv, out, lse,
    return_lse)`), computed by its float64 stand-in over the path's own indptr and pages:
    FlashInfer does not run on the CPU."""

    def __init__(self, fi, sm):
        self.fi, self.sm = fi, sm

    def run(self, qrows, kv, out, lse, return_lse):
        D = qrows.shape[-1]
        o, l2 = REF.ref_paged_decode(qrows, kv[0].reshape(-1, D), kv[1].reshape(-1, D), self.fi.indptr,
                                     self.fi.pages, self.sm)
        out.copy_(o)
        lse.copy_(l2)


@kernel_test
def test_flashinfer_path_runs_a_large_step_by_chunks():
    """The FlashInfer path's buffers hold `rows` batch rows (min(slots, CHUNK)), not one per
    slot: a step of more rows runs chunk by chunk, each chunk's lists from the start of the
    buffers (`lengths(chunk=...)` restarts its offsets), and gives what one pass over the
    whole batch gives, bit for bit, log-sum-exp included: the reference fast step."""
    from sfi_sglang.kernels import flashinfer_fast as fif
    from sfi_sglang.method.step import FastLists

    Hkv, G, D = 2, 2, 16
    cfg = CFG.replace(fast_path="flashinfer", max_interval=300)
    n_sel, t = [60, 52, 2, 40, 60], [296, 57, 2, 40, 200]
    st, gen = make_pool(t, Hkv, G, D, seed=3)
    ref_mem = SparseMemory(2, [1], 8, Hkv, D, cfg.replace(fast_path="triton"), DEV, torch.float32, packed=False)
    mem = SparseMemory(2, [1], 8, Hkv, D, cfg, DEV, torch.float32, packed=True, group=G)
    pos, cnt, ws = selection(cfg, n_sel, Hkv, gen, k=9)
    rpi, seq_lens = st["rpi"], st["seq_lens"]
    for m in (ref_mem, mem):
        m.reset(rpi)
        m.store(1, rpi, pos, cnt, ws, st["k"], st["v"], st["rtt"], seq_lens=torch.tensor(n_sel, device=DEV))
    sm = D ** -0.5
    whole, chunked = mem._fi, fif.FlashInferFastDecode(Hkv, G, D, mem.fast_cap, 2, DEV, torch.float32)
    assert whole.rows == 8 and chunked.rows == 2
    assert chunked.buffers()[2].numel() * 4 == whole.buffers()[2].numel()  # pages: 2 rows of 8
    assert chunked.chunks(5) == [(0, 2), (2, 4), (4, 5)] and whole.chunks(5) == [(0, 5)]
    fl = mem.fast_lists(rpi, seq_lens)
    fl2 = FastLists(*fif.lengths(rpi, seq_lens, mem.fast_ws, mem.packed_len, mem.fast_cap, Hkv, chunk=2))
    assert torch.equal(fl2.lengths, fl.lengths) and not fl.over.any()
    L = fl.lengths.long() * Hkv
    assert fl.start.tolist() == [0, *torch.cumsum(L, 0)[:4].tolist()]
    assert fl2.start.tolist() == [0, int(L[0]), 0, int(L[2]), 0]
    outs = []
    for fi, f in ((whole, fl), (chunked, fl2)):
        fi.wrappers = {n: _DecodeStandIn(fi, sm) for n in (1, 2, 5)}
        out, lse = torch.full_like(st["q"], float("nan")), torch.full((5, Hkv * G), float("nan"))
        fi.run(st["q"], st["k"], st["v"], st["rtt"], rpi, f.lengths, f.start, seq_lens, f.win_start, mem.n_sinks,
               mem.sel_pos[0], mem.sel_count, out=out, lse_out=lse)
        outs.append((out, lse))
    (out, lse), (out2, lse2) = outs
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    ref_lse = torch.empty(5, Hkv * G)
    ref = ref_mem.attend_fast(1, st["q"], st["k"], st["v"], st["rtt"], rpi, seq_lens, sm, lse_out=ref_lse)
    assert rel_err(out, ref) < 1e-5 and torch.allclose(lse, ref_lse, atol=1e-4)
