"""The per-step top-up's kernels on one GPU: checks against float64, then the price per layer.

Run on the device machine from the repo root (torch and Triton only, no SGLang):
    source bench/layout.sh; sfi_site /tmp/sfi-site; PYTHONPATH=/tmp/sfi-site python3 -P bench/topup_h200.py --out $OUT

Qwen3-4B's attention shape (32 query heads, 8 KV heads, head dim 128, bf16). A request holds
sinks 4, a selection of 1536 positions in [4, window start) (the top-up's engines' budget:
bench/speed_h200.py's -topup) and a window of 256; the top-up reads 32 pages of 16.
  1. checks: kernels.page_scores, pick_pages (against torch.topk) and drop_held (one layer,
     and three in one launch) against their references (4K context, 3 rows, memory rows),
     and fast_decode with the chosen pages against float64 attention over the same
     positions, on the packed and the in-place (triton-pool) paths;
  2. timing at 32K and 128K, batch 1 and 8, CUDA events, median of the replays of a CUDA
     graph of 8 layer calls (repeated to ~3 ms: kernels_h200.bench_graph), each layer its own K/V cache (so no layer finds another's
     keys in L2): fast_decode over 2048 held (what `sfi` reads), the top-up's choice
     (page_scores + pick_pages; page_scores alone; pick_pages alone; page_scores + torch.topk, the
     choice before pick_pages), drop_held per layer and for a group's 7 other layers in one launch,
     fast_decode over 1536 held + the 32 pages; page_scores over tiles of 4, 8 and 16 pages
     per program with 2 to 8 warps;
  3. the pool pages' key summaries (kernels.summarize_pages; SGLang's --page-size 16: the
     same caches through a req_to_token of whole pool pages, the top-up's pages from 16, the
     first page boundary past the sinks): checked against the reference and the keys, then
     the scores and the choice from them (tiles of 8 to 64 pages), the keys' scores on that
     layout, and one decode step's summary writes (B slots per layer).
Writes topup_h200.json.
"""

import argparse
import json
import math
import os
import pathlib
import sys

import torch

if not torch.cuda.is_available():  # a smoke run here: the kernels under Triton's interpreter
    os.environ["TRITON_INTERPRET"] = "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float32  # the interpreter's bf16 dot is not the GPU's
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))  # after a laid-out site (bench/layout.sh)
from sfi_sglang import kernels as K  # noqa: E402
from sfi_sglang.method.config import SFIConfig  # noqa: E402

HQ, HKV, D, S, W, PAGE, PAGES = 32, 8, 128, 4, 256, 16, 32
LO = SFIConfig(sinks=S, page_size=PAGE).topup_lo  # the top-up's pages on the pool's page boundaries (summaries)


def state(B, n, held_k, layers=1, dev=DEV, seed=0):
    """A pool of B requests of n tokens (slots shuffled), `layers` K/V caches, a sorted
    random selection of held_k positions per (row, head) in [S, n - W)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    torch.manual_seed(seed)
    tokens = B * n
    perm = torch.randperm(tokens, generator=g).int()
    r2t = perm.view(B, n).to(dev)
    pages = torch.randperm(tokens // PAGE, generator=g)  # the same slots in whole pool pages (--page-size)
    r2t_paged = (pages.view(B, n // PAGE, 1) * PAGE + torch.arange(PAGE)).view(B, n).int().to(dev)
    caches = [(torch.randn(tokens, HKV, D, device=dev, dtype=DTYPE),
               torch.randn(tokens, HKV, D, device=dev, dtype=DTYPE)) for _ in range(layers)]
    ws = torch.full((B,), n - W, dtype=torch.int64, device=dev)
    held = torch.stack([torch.stack([(torch.randperm(n - W - S, generator=g)[:held_k] + S).sort().values
                                     for _ in range(HKV)]) for _ in range(B)]).int().to(dev)
    q = torch.randn(B, HQ, D, device=dev, dtype=DTYPE)
    return dict(r2t=r2t, r2t_paged=r2t_paged, caches=caches, ws=ws, held=held, q=q,
                rpi=torch.arange(B, device=dev),
                seq_lens=torch.full((B,), n, dtype=torch.int32, device=dev),
                packed_len=torch.full((B,), S + held_k, dtype=torch.int32, device=dev),
                n_sinks=torch.full((B,), S, dtype=torch.int32, device=dev))


def checks() -> dict:
    st = state(3, 4096, 300, seed=1)
    kc, vc = st["caches"][0]
    row_of = torch.tensor([2, 0, 1], dtype=torch.int32, device=DEV)
    held_rows = torch.empty_like(st["held"])
    held_rows[row_of.long()] = st["held"]
    args = (st["q"], kc, st["r2t"], st["rpi"], st["seq_lens"], st["ws"], held_rows, S, PAGE, 4096 // PAGE)
    got = K.page_scores(*args, row_of=row_of)
    ref = K.ref_page_scores(*args, row_of=row_of)
    fin = ~ref.isinf()
    res = {"scores_inf_equal": bool(torch.equal(got.isinf(), ref.isinf())),
           "scores_max_rel_err": float(((got.double() - ref)[fin].abs().max() / ref[fin].abs().max()).item())}
    chosen = K.pick_pages(got, PAGES, st["seq_lens"], st["ws"], S, PAGE)
    ref_top = K.choose_pages(ref, PAGES)
    # the chosen pages' float64 scores are the best PAGES up to float32 rounding
    kth = ref.topk(PAGES, -1).values[..., -1:]
    picked = ref.gather(-1, chosen.long().clamp_min(0))
    res["chosen_are_top"] = bool((picked >= kth - 1e-4 * kth.abs()).all())
    res["chosen_equal_reference"] = bool(torch.equal(chosen.sort(-1).values, ref_top.sort(-1).values))
    other = torch.randint(S, 4096 - W, held_rows.shape, device=DEV).int()
    res["drop_held_equal"] = bool(torch.equal(K.drop_held(chosen, st["rpi"], other, S, PAGE, row_of=row_of),
                                              K.ref_drop_held(chosen, st["rpi"], other, S, PAGE, row_of=row_of)))
    group = torch.stack([other, other.flip(0), held_rows])  # three layers' selections, one launch
    res["drop_held_group_equal"] = all(
        torch.equal(d, K.ref_drop_held(chosen, st["rpi"], h, S, PAGE, row_of=row_of))
        for d, h in zip(K.drop_held(chosen, st["rpi"], group, S, PAGE, row_of=row_of), group))
    sel = st["held"]
    top = dict(extra_pages=chosen, extra_base=S, extra_page=PAGE)
    packed_k = torch.zeros(3, HKV, S + sel.shape[-1], D, dtype=DTYPE, device=DEV)
    packed_v = torch.zeros_like(packed_k)
    pos = torch.cat([torch.arange(S, device=DEV).int().expand(3, HKV, S), sel], -1)
    K.pack(kc, vc, st["r2t"], st["rpi"], pos, packed_k, packed_v)
    base = (st["q"], kc, vc, st["r2t"], st["rpi"], st["seq_lens"], st["ws"])
    for name, mem, kw in (("packed", (packed_k, packed_v), {}),
                          ("in_place", (None, None), dict(sel_pos=sel, n_sinks=st["n_sinks"]))):
        want = K.ref_fast_decode(*base, *mem, st["packed_len"], D ** -0.5, **kw, **top)
        out = K.fast_decode(*base, *mem, st["packed_len"], D ** -0.5, **kw, **top)
        res[f"fast_{name}_rel_err"] = float((torch.linalg.vector_norm(out.double() - want)
                                             / torch.linalg.vector_norm(want)).item())
        without = K.ref_fast_decode(*base, *mem, st["packed_len"], D ** -0.5, **kw)
        res[f"fast_{name}_topup_changes_output"] = float((torch.linalg.vector_norm(without - want)
                                                          / torch.linalg.vector_norm(want)).item())
    summ = torch.full((st["r2t"].numel() // PAGE, HKV, 2, D), float("nan"), dtype=DTYPE, device=DEV)
    locs = st["r2t_paged"][:, :4000].reshape(-1).contiguous()  # every row's extend, the last page partial
    K.summarize_pages(kc, summ, locs, PAGE)
    want = K.ref_summarize_pages(kc, torch.full_like(summ, float("nan")), locs, PAGE)
    res["summ_equal_reference"] = bool(torch.equal(summ.isnan(), want.isnan())
                                       and torch.equal(summ.nan_to_num(), want.nan_to_num()))
    K.summarize_pages(kc, summ, st["r2t_paged"][:, 4000:].reshape(-1).contiguous(), PAGE)
    pargs = (st["q"], kc, st["r2t_paged"], st["rpi"], st["seq_lens"], st["ws"], held_rows, LO, PAGE, 4096 // PAGE)
    keyed = K.page_scores(*pargs, row_of=row_of)
    from_summ = K.page_scores(*pargs, row_of=row_of, summ=summ)
    res["summ_scores_equal_keys"] = bool(torch.equal(keyed, from_summ))
    res["ok"] = (res["summ_equal_reference"] and res["summ_scores_equal_keys"]
                 and res["scores_inf_equal"] and res["scores_max_rel_err"] < 1e-5 and res["chosen_are_top"]
                 and res["chosen_equal_reference"] and res["drop_held_equal"] and res["drop_held_group_equal"]
                 and res["fast_packed_rel_err"] < 2e-2 and res["fast_in_place_rel_err"] < 2e-2)
    return res


def graph_time(fn) -> float:
    """Median microseconds of one call of fn (8 layers' calls), from kernels_h200's CUDA-graph timer."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from kernels_h200 import bench_graph

    return bench_graph([fn], est_ms=0.5)[0] * 1000


def timing(n: int, B: int, layers: int = 8) -> dict:
    full, held_k = 2048, 2048 - PAGES * PAGE
    st = state(B, n, full, layers=layers)
    sel_full = st["held"]
    sel = sel_full[..., :held_k].contiguous()
    nsk = st["n_sinks"]
    plen_full = torch.full((B,), S + full, dtype=torch.int32, device=DEV)
    plen = torch.full((B,), S + held_k, dtype=torch.int32, device=DEV)
    maxp = n // PAGE
    out = torch.empty_like(st["q"])
    chosen = [None] * layers

    def fast(sel_pos, plen, extra=None):
        def f():
            for i, (kc, vc) in enumerate(st["caches"]):
                kw = {} if extra is None else dict(extra_pages=extra[i] if isinstance(extra, list) else extra,
                                                   extra_base=S, extra_page=PAGE)
                K.fast_decode(st["q"], kc, vc, st["r2t"], st["rpi"], st["seq_lens"], st["ws"], None, None, plen,
                              D ** -0.5, out=out, sel_pos=sel_pos, n_sinks=nsk, max_window=W, **kw)
        return f

    def choose():
        for i, (kc, _) in enumerate(st["caches"]):
            chosen[i] = K.choose_topup(st["q"], kc, st["r2t"], st["rpi"], st["seq_lens"], st["ws"], sel, S, PAGE,
                                       PAGES, maxp)

    def scores():
        for kc, _ in st["caches"]:
            K.page_scores(st["q"], kc, st["r2t"], st["rpi"], st["seq_lens"], st["ws"], sel, S, PAGE, maxp)

    def scores_with(block_p, warps):  # the tile of pages per program and the warps, swept
        def f():
            for kc, _ in st["caches"]:
                K.page_scores(st["q"], kc, st["r2t"], st["rpi"], st["seq_lens"], st["ws"], sel, S, PAGE, maxp,
                              block_p=block_p, num_warps=warps)
        return f

    def choose_torch():  # page_scores + torch.topk + where, the choice before pick_pages
        for kc, _ in st["caches"]:
            K.choose_pages(K.page_scores(st["q"], kc, st["r2t"], st["rpi"], st["seq_lens"], st["ws"], sel, S, PAGE,
                                         maxp), PAGES)

    sc = K.page_scores(st["q"], st["caches"][0][0], st["r2t"], st["rpi"], st["seq_lens"], st["ws"], sel, S, PAGE,
                       maxp)

    def pick():
        for _ in range(layers):
            K.pick_pages(sc, PAGES, st["seq_lens"], st["ws"], S, PAGE)

    choose()
    fixed = [c.clone() for c in chosen]

    def drop():
        for i in range(layers):
            K.drop_held(fixed[i], st["rpi"], sel, S, PAGE)

    later = sel.expand(7, *sel.shape).contiguous()  # a group of 8 layers: the other 7's selections

    def drop_group():
        K.drop_held(fixed[0], st["rpi"], later, S, PAGE)

    summs = []
    for kc, _ in st["caches"]:
        summs.append(torch.empty((B * n // PAGE, HKV, 2, D), dtype=DTYPE, device=DEV))
        K.summarize_pages(kc, summs[-1], st["r2t_paged"].reshape(-1).contiguous(), PAGE)
    r2p = st["r2t_paged"]

    def scores_paged(summ_on, block_p=None, warps=4):  # the paged layout, from the keys or the summaries
        def f():
            for (kc, _), sm in zip(st["caches"], summs):
                K.page_scores(st["q"], kc, r2p, st["rpi"], st["seq_lens"], st["ws"], sel, LO, PAGE, maxp,
                              summ=sm if summ_on else None, block_p=block_p, num_warps=warps)
        return f

    def choose_summ():
        for (kc, _), sm in zip(st["caches"], summs):
            K.choose_topup(st["q"], kc, r2p, st["rpi"], st["seq_lens"], st["ws"], sel, LO, PAGE, PAGES, maxp,
                           summ=sm)

    step_locs = r2p[:, n - 1].contiguous()  # one decode step's writes (each ends its page: 16 keys read)

    def summarize_step():
        for (kc, _), sm in zip(st["caches"], summs):
            K.summarize_pages(kc, sm, step_locs, PAGE)

    res = {"context": n, "batch": B, "layers_per_graph": layers,
           "fast_2048_us": graph_time(fast(sel_full, plen_full)) / layers,
           "choose_us": graph_time(choose) / layers,
           "scores_us": graph_time(scores) / layers,
           "pick_us": graph_time(pick) / layers,
           "choose_torch_topk_us": graph_time(choose_torch) / layers,
           "drop_held_us": graph_time(drop) / layers,
           "drop_held_group_of_8_us": graph_time(drop_group),
           "fast_1536_plus_pages_us": graph_time(fast(sel, plen, fixed)) / layers}
    # bytes: K of [S, n - W) per (row, KV head) for the choice; (S + 2048 + W) K/V rows for the fast step
    res["scores_us_by_tile_and_warps"] = {f"{bp}x{w}": graph_time(scores_with(bp, w)) / layers
                                          for bp, w in ((4, 2), (4, 4), (8, 4), (8, 8), (16, 8))}
    res["scores_paged_keys_us"] = graph_time(scores_paged(False)) / layers
    res["summ_scores_us_by_tile_and_warps"] = {f"{bp}x{w}": graph_time(scores_paged(True, bp, w)) / layers
                                               for bp, w in ((8, 4), (16, 4), (32, 4), (32, 8), (64, 8))}
    res["choose_summ_us"] = graph_time(choose_summ) / layers
    res["summarize_step_us"] = graph_time(summarize_step) / layers
    res["summ_bytes"] = B * HKV * ((n - W - LO) // PAGE) * 2 * D * 2
    res["choose_bytes"] = B * HKV * (n - W - S) * D * 2
    res["choose_tb_s"] = res["choose_bytes"] / res["choose_us"] / 1e6
    res["scores_tb_s"] = res["choose_bytes"] / res["scores_us"] / 1e6
    res["fast_bytes"] = B * HKV * (S + full + W) * D * 2 * 2
    res["topup_over_fast"] = (res["choose_us"] + res["fast_1536_plus_pages_us"]) / res["fast_2048_us"] - 1
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    p.add_argument("--configs", default="32768x1,32768x8,131072x1,131072x8")
    args = p.parse_args(argv)
    res = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)", "checks": checks(),
           "timing": []}
    print(json.dumps(res["checks"]), flush=True)
    path = pathlib.Path(args.out) / "topup_h200.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    for c in filter(None, args.configs.split(",")):
        n, B = (int(x) for x in c.split("x"))
        row = timing(n, B)
        print(json.dumps(row), flush=True)
        res["timing"].append(row)
        path.write_text(json.dumps(res, indent=1))
        torch.cuda.empty_cache()
    path.write_text(json.dumps(res, indent=1))
    return 0 if res["checks"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
