"""The fast step's kernel at small batches: its launch shape against the bytes it reads.

Run on the device machine from the repo root (no sglang needed):
    source bench/layout.sh; sfi_site /tmp/sfi-site; python3 -P bench/fast_b1_h200.py --out $OUT

A decode step at batch 1 runs the fast kernel once per sparse layer (34 for Qwen3-4B), on
the `triton-pool` path: the sinks and the selected positions read in place through
req_to_token (three dependent loads per tile: position, slot, K/V), then the window. Each
layer has its own K/V pool, as in SGLang, so no layer reads another's bytes from L2. The
34 launches are captured in one CUDA graph and replayed; the figure is the median replay
over 34, so launch gaps count as they do in SGLang's decode graphs.

Per (context, batch, splits, BLOCK_N, warps, stages, split-K merge): us per layer, GB/s over the bytes
read (K/V of S + K + W positions per KV head, plus positions and slots), and that as a
share of the device's copy bandwidth. The first configuration is the shipped choice;
every other one's output is checked against it. Also the floor of 34 captured launches of
a kernel that reads nothing, the shipped shape at batch 1 over the sinks and the window
alone (no selected positions: what the kernel costs beyond its bytes), and the slow
pass's key-norm work on rows that keep no logits (score row -1) priced against the same
pass without norms.
Writes fast_b1_h200.json to --out.
"""

import argparse
import importlib
import itertools
import json
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # beside kernels_h200, also under -P
from kernels_h200 import bench_graph, hbm_copy  # noqa: E402
from sfi_sglang import kernels as K  # noqa: E402
FD = importlib.import_module("sfi_sglang.kernels.fast_decode")

H_Q, H_KV, D, LAYERS = 32, 8, 128, 34  # Qwen3-4B
SINKS, WINDOW, BUDGET = 4, 256, 2048
ONCE = float("inf")  # bench_graph's est_ms that captures each call once (no repeats)


def layers_for(n, batch, dev, gen):
    """Per layer: K/V pools of batch x n tokens, sel_pos [batch, H_kv, BUDGET] (sorted random
    positions in [SINKS, n - WINDOW)); shared: req_to_token and the per-row state."""
    slots = batch * n
    rt = torch.arange(slots, dtype=torch.int32, device=dev).view(batch, n)
    state = dict(req_to_token=rt, req_pool_indices=torch.arange(batch, dtype=torch.int32, device=dev),
                 seq_lens=torch.full((batch,), n, dtype=torch.int32, device=dev),
                 win_start=torch.full((batch,), n - WINDOW, dtype=torch.int32, device=dev),
                 packed_len=torch.full((batch,), SINKS + BUDGET, dtype=torch.int32, device=dev),
                 n_sinks=torch.full((batch,), SINKS, dtype=torch.int32, device=dev))
    layers = []
    for _ in range(LAYERS):
        kc = torch.randn(slots, H_KV, D, device=dev, dtype=torch.bfloat16, generator=gen)
        vc = torch.randn(slots, H_KV, D, device=dev, dtype=torch.bfloat16, generator=gen)
        span = n - WINDOW - SINKS
        sel = torch.rand(batch, H_KV, span, device=dev, generator=gen).topk(BUDGET, -1).indices
        sel = (sel.sort(-1).values + SINKS).to(torch.int32).contiguous()
        q = torch.randn(batch, H_Q, D, device=dev, dtype=torch.bfloat16, generator=gen)
        layers.append(dict(q=q, k=kc, v=vc, sel=sel, out=torch.empty_like(q)))
    return state, layers


REDUCES = {"loop": True, "vector": "vector", "separate": False}  # fast_decode's fused_reduce


def fast_calls(state, layers, splits, block_n, warps, stages, reduce="loop"):
    def call(ly):
        return lambda: FD.fast_decode(
            ly["q"], ly["k"], ly["v"], state["req_to_token"], state["req_pool_indices"], state["seq_lens"],
            state["win_start"], None, None, state["packed_len"], D ** -0.5, out=ly["out"], num_splits=splits,
            max_window=WINDOW, block_n=block_n, num_warps=warps, num_stages=stages,
            fused_reduce=REDUCES[reduce], sel_pos=ly["sel"], n_sinks=state["n_sinks"])
    return [call(ly) for ly in layers]


def time_row(row, state, layers, reps):
    """Times the 34 launches of `row`'s shape (splits, block_n, warps, stages, reduce) in one
    graph: row["us_per_layer"], the median replay over LAYERS, returned unrounded; None and
    row["error"] where Triton cannot compile the shape."""
    try:
        calls = fast_calls(state, layers, row["splits"], row["block_n"], row["warps"], row["stages"], row["reduce"])
        us = bench_graph(calls, ONCE, replays=reps)[0] * 1e3
    except Exception as e:  # a shape Triton cannot compile: say so, go on
        row["error"] = repr(e)[:300]
        return None
    row["us_per_layer"] = round(us, 2)
    return us


def slow_norms(n, batch, dev, gen, reps):
    """The slow pass over batch x n positions with every score row -1, with and without norms."""
    slots = batch * n
    kc = torch.randn(slots, H_KV, D, device=dev, dtype=torch.bfloat16, generator=gen)
    vc = torch.randn(slots, H_KV, D, device=dev, dtype=torch.bfloat16, generator=gen)
    q = torch.randn(batch, H_Q, D, device=dev, dtype=torch.bfloat16, generator=gen)
    rt = torch.arange(slots, dtype=torch.int32, device=dev).view(batch, n)
    rpi = torch.arange(batch, dtype=torch.int32, device=dev)
    sl = torch.full((batch,), n, dtype=torch.int32, device=dev)
    scores = torch.empty(1, H_Q, n, dtype=torch.float32, device=dev)
    norms = torch.empty(1, H_KV, n, dtype=torch.bfloat16, device=dev)
    none = torch.full((batch,), -1, dtype=torch.int32, device=dev)
    row = dict(context=n, batch=batch, part="slow pass, score rows -1")
    for name, kw in (("no_norms", {}), ("norms", dict(norms_out=norms))):
        def fn(kw=kw):
            K.dense_decode_with_scores(q, kc, vc, rt, rpi, sl, D ** -0.5, scores_out=scores, score_rows=none,
                                       max_len=n, **kw)
        row[name + "_us"] = round(bench_graph([fn], ONCE, replays=reps)[0] * 1e3, 2)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    p.add_argument("--shapes", default="16384x1,131072x1,16384x8", help="CONTEXTxBATCH,... (34 layers' pools each)")
    p.add_argument("--splits", default="8,16,24,32,48,64")
    p.add_argument("--block-n", default="16,32,64")
    p.add_argument("--warps", default="2,4")
    p.add_argument("--stages", default="2,3")
    p.add_argument("--reduce", default="loop,vector,separate", help="the split-K merge: " + ", ".join(REDUCES))
    p.add_argument("--reps", type=int, default=25)
    args = p.parse_args()
    dev = torch.device("cuda")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    res = dict(device=torch.cuda.get_device_name(), sms=torch.cuda.get_device_properties(dev).multi_processor_count,
               shape=dict(h_q=H_Q, h_kv=H_KV, d=D, layers=LAYERS, sinks=SINKS, window=WINDOW, budget=BUDGET),
               copy_gbs=round(hbm_copy(), 1), rows=[])
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}), flush=True)
    t0 = time.perf_counter()

    # the floor: LAYERS captured launches of a kernel that writes 4 bytes
    z = torch.zeros(1, dtype=torch.int32, device=dev)
    floor_ms, _ = bench_graph([lambda: z.add_(1)] * LAYERS, ONCE, replays=args.reps)
    res["launch_floor_us"] = round(floor_ms * 1e3, 2)
    print(f"floor: {res['launch_floor_us']} us per captured launch", flush=True)

    gen = torch.Generator(device=dev)
    gen.manual_seed(0)
    for n, batch in (tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")):
        state, layers = layers_for(n, batch, dev, gen)
        positions = SINKS + BUDGET + WINDOW
        nbytes = batch * H_KV * positions * D * 2 * 2 + batch * H_KV * (BUDGET + positions) * 4
        shipped = FD.choose_num_splits(FD.split_programs(batch, H_KV), BUDGET + WINDOW, FD.BLOCK_N_DEFAULT, dev,
                                       min_blocks_per_split=2, max_splits=FD.MAX_SPLITS_DEFAULT,
                                       programs_per_sm=2, one_wave=True)
        configs = [(shipped, FD.BLOCK_N_DEFAULT, FD.NUM_WARPS_DEFAULT, FD.NUM_STAGES_DEFAULT, "loop")]
        configs += [c for c in itertools.product(ints(args.splits), ints(args.block_n), ints(args.warps),
                                                 ints(args.stages), args.reduce.split(",")) if c != configs[0]]
        ref = None
        for i, (splits, bn, w, st, red) in enumerate(configs):
            row = dict(context=n, batch=batch, splits=splits, block_n=bn, warps=w, stages=st, reduce=red,
                       shipped=i == 0)
            us = time_row(row, state, layers, args.reps)
            if us is not None:
                outs = torch.stack([ly["out"].float() for ly in layers])
                if ref is None:
                    ref = outs.clone()
                row["max_abs_diff"] = float((outs - ref).abs().max())
                row["gbs"] = round(nbytes / us / 1e3, 1)
                row["of_copy"] = round(row["gbs"] / res["copy_gbs"], 3)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        if batch == 1:  # the fixed cost: the shipped shape over the sinks and the window only
            state["packed_len"].fill_(SINKS)
            for red in args.reduce.split(","):
                row = dict(context=n, batch=batch, splits=shipped, block_n=FD.BLOCK_N_DEFAULT,
                           warps=FD.NUM_WARPS_DEFAULT, stages=FD.NUM_STAGES_DEFAULT, reduce=red,
                           memory="sinks and window only")
                time_row(row, state, layers, args.reps)
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
        del state, layers
        torch.cuda.empty_cache()

    # the slow pass's norms on rows with no score row: what computing them costs there
    for n, batch in ((32768, 8), (131072, 1)):
        row = slow_norms(n, batch, dev, gen, args.reps)
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    (out / "fast_b1_h200.json").write_text(json.dumps(res, indent=1) + "\n")
    best = {}
    for r in res["rows"]:
        if "us_per_layer" in r and "memory" not in r:
            key = (r["context"], r["batch"])
            if key not in best or r["us_per_layer"] < best[key]["us_per_layer"]:
                best[key] = r
    for r in res["rows"]:
        if r.get("shipped"):
            b = best.get((r["context"], r["batch"]))
            if b is None or "us_per_layer" not in r:
                continue
            print(f"{r['context']}x{r['batch']}: shipped {r['us_per_layer']} us ({r['of_copy']:.0%} of copy), "
                  f"best {b['us_per_layer']} us ({b['of_copy']:.0%}) at splits {b['splits']} block_n {b['block_n']} "
                  f"warps {b['warps']} stages {b['stages']} reduce {b.get('reduce', 'loop')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
