"""On the GPU: the `sfi` backend's decode step under CUDA graphs (the GPU
harness of bench/harness.py: the product's backend over SGLang-layout pools).

Checks, each printed as one JSON line and collected in OUT/graph_check_h200.json:
  1. tokens equal with graphs on and off: the same requests decoded eagerly and through
     one CUDA graph of the whole step (StepPlan in the graph, the slow pass in a
     conditional node), over a batch mixing fast, slow, dense-layer and SFI-off rows,
     with more rows due a slow step at once than --max-slow-rows lets run slow;
  2. no host sync inside a replayed step: torch.cuda.set_sync_debug_mode("error") around
     the host part (init_forward_metadata_out_graph) and the replay of 16 steps;
  3. the conditional node exists in this torch (CUDAGraph.begin_capture_to_if_node).
Run from the repo root with sfi_sglang importable (bench/throughput_h200.sh lays it out):
  python bench/graph_check_h200.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def _has(mod: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(mod) is not None
    except ModuleNotFoundError:
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-4b")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--slow-every", type=int, default=8)
    p.add_argument("--refresh", choices=("interval", "adaptive"), default="interval",
                   help="adaptive: also the adaptive trigger (random weights: it fires often at a "
                        "low threshold), checked the same way; writes graph_check_h200_adaptive.json")
    p.add_argument("--adaptive-threshold", type=float, default=0.05)
    p.add_argument("--selection-page", type=int, default=1,
                   help="> 1: the Selector keeps whole pages (--sfi-selection-page), checked the same "
                        "way; writes graph_check_h200_pages.json")
    p.add_argument("--fast-path", choices=("triton", "triton-pool", "flashinfer"), default="triton",
                   help="the fast path checked (--sfi-fast-path); not triton: writes "
                        "graph_check_h200_<path>.json and also reports its tokens against triton's")
    p.add_argument("--max-slow-rows", type=int, default=2,
                   help="--sfi-max-slow-rows: below the batch's SFI rows (the requests run in lockstep), "
                        "so some slow steps are put off a step, graphs on and off")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8_e4m3"), default="auto",
                   help="fp8_e4m3: the pool in fp8 (unit scales), checked the same way; writes "
                        "graph_check_h200[...]_fp8.json")
    p.add_argument("--memory-rows", type=int, default=0,
                   help="--sfi-memory-rows: fewer than the batch's SFI rows, so some run dense (no row), "
                        "the rest through the kernels' row_of, graphs on and off; writes "
                        "graph_check_h200[...]_rows.json")
    p.add_argument("--topup-pages", type=int, default=0,
                   help="the per-step top-up (--sfi-topup-pages) in the graph, checked the same way; writes "
                        "graph_check_h200[...]_topup.json")
    p.add_argument("--topup-every", type=int, default=1)
    p.add_argument("--fused-reduce", choices=("loop", "vector", "separate"), default=None,
                   help="the fast kernel's split-K merge (kernels.fast_decode's fused_reduce: True, "
                        "\"vector\", False; default the shipped one) in every launch; writes "
                        "graph_check_h200[...]_<merge>.json")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import harness as bench
    if args.fused_reduce is not None:  # this process's default, read at every launch
        from fast_b1_h200 import FD, REDUCES

        FD.FUSED_REDUCE_DEFAULT = REDUCES[args.fused_reduce]
    from sfi_sglang.integration import state
    from sfi_sglang.method.config import SFIConfig
    from sfi_sglang.integration.graph_if import HAS_IF_NODE, run_if
    from sfi_sglang.integration.slots import Request

    dev, dtype = "cuda", torch.bfloat16
    from sfi_sglang.integration import graph_if

    res_if = {"graph_if_available": graph_if.available(), "graph_if_error": graph_if.error()}
    if res_if["graph_if_available"]:  # a toy IF node: the body runs only where pred holds
        x = torch.zeros(4, device=dev)
        pred = torch.zeros((), dtype=torch.bool, device=dev)
        y = torch.ones(4, device=dev)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            x.add_(y)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            x.add_(1.0)
            run_if(pred, lambda: x.add_(y * 10))
        x.zero_()
        got = []
        for p_ in (False, True, False):
            pred.fill_(p_)
            g.replay()
            torch.cuda.synchronize()
            got.append(float(x[0]))
        res_if["toy_if_node"] = got  # expect [1, 12, 13]
    print(json.dumps(res_if), flush=True)
    res = {**res_if, "torch": torch.__version__, "if_node": HAS_IF_NODE, "fused_reduce": args.fused_reduce,
           "raw_cuda_graph": hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph"),
           "cuda_bindings": _has("cuda.bindings.runtime"), "cupy": _has("cupy")}
    print(json.dumps(res), flush=True)
    cfg = SFIConfig(budget=512, window=128, refresh=args.refresh, max_interval=args.slow_every,
                    min_gap=min(16, args.slow_every), adaptive_threshold=args.adaptive_threshold,
                    selection_page=args.selection_page, fast_path=args.fast_path,
                    max_slow_rows=args.max_slow_rows, memory_rows=args.memory_rows,
                    topup_pages=args.topup_pages, topup_every=args.topup_every)
    model = bench.DummyModel(bench.SHAPES[args.shape], dtype, dev)
    B = args.batch
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8_e4m3" else None
    st = bench.Setup(model, cfg, args.context, B, args.steps, dev, dtype, all_slow=False, kv_dtype=kv_dtype)
    be = st.sfi
    first = torch.randint(100, 1000, (B,), device=dev)
    slots = st.fb.req_pool_indices.tolist()

    reset = st.reset

    def mixed_reset(ids):
        """Row 1: SFI off (a dense row); row 2: layer 5 dense too (its own dense layers)."""
        reset(ids)
        if B > 1:
            be.slots.start(slots[1], Request(cfg, False, rid=st.fb.rids[1]))
        if B > 2:
            be.step.dense[slots[2], 5] = True

    st.reset = mixed_reset

    def run(graphs: bool):
        runner = bench.Runner(st, graphs)
        ids, secs, slow = runner.run_sfi(first, args.steps)
        return ids, secs, slow, runner

    fired = lambda: (be.policy.fired[st.fb.req_pool_indices].tolist()  # noqa: E731
                     if be.policy.fired is not None else None)
    eager_ids, _, eager_slow, _ = run(False)
    eager_fired = fired()
    eager_counts = be.memory.counts[st.fb.req_pool_indices].tolist()
    graph_ids, secs, graph_slow, runner = run(True)
    res.update(refresh=args.refresh, selection_page=args.selection_page, kv_cache_dtype=args.kv_cache_dtype,
               max_slow_rows=args.max_slow_rows, memory_rows=args.memory_rows, adaptive_fired_eager=eager_fired,
               adaptive_fired_graph=fired())
    counts = be.memory.counts[st.fb.req_pool_indices].tolist()
    same = torch.equal(eager_ids, graph_ids)
    first_diff = None
    if not same:
        d = (eager_ids != graph_ids).nonzero()
        first_diff = d[0].tolist()
    res.update(tokens_equal=same, first_diff=first_diff, steps=args.steps, batch=B,
               slow_steps_eager=eager_slow, slow_steps_graph=graph_slow, counts=counts, eager_counts=eager_counts,
               graph_ms_per_step=round(1e3 * secs / args.steps, 3))
    print(json.dumps(res), flush=True)

    # 2. no host sync in the host part + replay of a step
    graph, out_ids = runner._sfi_graph
    st.reset(first)  # back at the prompt's end: 16 more steps fit the pools
    torch.cuda.synchronize()
    sync_ok, err = True, None
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(16):
            be.init_forward_metadata_out_graph(st.fb)
            graph.replay()
            st.advance(out_ids)
    except RuntimeError as e:  # a synchronizing call raises in "error" mode
        sync_ok, err = False, str(e)[:500]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    res.update(no_sync_in_replayed_steps=sync_ok, sync_error=err)
    print(json.dumps(res), flush=True)
    state.BACKENDS.clear()
    if args.fast_path != "triton":  # the same requests on the shipped path, graphs on
        del runner, graph
        st = bench.Setup(model, cfg.replace(fast_path="triton"), args.context, B, args.steps, dev, dtype,
                         all_slow=False, kv_dtype=kv_dtype)
        be, reset, slots = st.sfi, st.reset, st.fb.req_pool_indices.tolist()  # mixed_reset's, now
        st.reset = mixed_reset
        tri = bench.Runner(st, True)
        ids, _, _ = tri.run_sfi(first, args.steps)
        agree = (ids == graph_ids).float()
        diff = (ids != graph_ids).nonzero()
        # free runs part at the first pick bf16 sums in another order turn (random weights
        # have near ties); fed this path's tokens, triton's picks at every step of one history
        forced, _, _ = tri.run_sfi(first, args.steps, forced=graph_ids)
        # the same forced run eager, with each step's logit gap between triton's pick and
        # this path's, in bf16 rounding steps: near ties (a few steps) are what summation
        # order turns; a gap of many steps would be a fault
        eager = bench.Runner(st, False)
        forced_eager, _, _ = eager.run_sfi(first, args.steps, forced=graph_ids, gaps=True)
        g = eager.gaps[(forced_eager != graph_ids).cpu()]
        # the control: triton against itself in another summation order (one split per row
        # and head instead of its several, the same arithmetic otherwise), fed its own free
        # run's tokens: the share of picks that order alone turns on these weights
        fast_decode = sys.modules["sfi_sglang.kernels.fast_decode"]  # the module (the package exports its function)
        keep = fast_decode.MAX_SPLITS_DEFAULT
        fast_decode.MAX_SPLITS_DEFAULT = 1
        try:
            one_split, _, _ = bench.Runner(st, True).run_sfi(first, args.steps, forced=ids)
        finally:
            fast_decode.MAX_SPLITS_DEFAULT = keep
        res.update(order_control_forced_agreement=round(float((one_split == ids).float().mean()), 4))
        res.update(triton_tokens_equal=bool(torch.equal(ids, graph_ids)),
                   triton_agreement=round(float(agree.mean()), 4),
                   triton_first_diff=diff[0].tolist() if diff.numel() else None,
                   triton_forced_agreement=round(float((forced == graph_ids).float().mean()), 4),
                   triton_forced_eager_equal=bool(torch.equal(forced_eager, forced)),
                   forced_gap_steps=sorted(round(float(x), 1) for x in g),
                   top2_margin_steps_quartiles=[round(float(x), 1) for x in
                                                torch.quantile(eager.margins.flatten(), torch.tensor([.25, .5, .75]))])
        print(json.dumps(res), flush=True)
        state.BACKENDS.clear()
    os.makedirs(args.out, exist_ok=True)
    name = ("graph_check_h200" + ("_adaptive" if args.refresh == "adaptive" else "")
            + ("_pages" if args.selection_page > 1 else "")
            + (f"_{args.fast_path.replace('-', '_')}" if args.fast_path != "triton" else "")
            + ("_fp8" if kv_dtype is not None else "")
            + ("_rows" if args.memory_rows else "") + ("_topup" if args.topup_pages else "")
            + (f"_{args.fused_reduce}" if args.fused_reduce else ""))
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0 if same and sync_ok and (HAS_IF_NODE or res_if["graph_if_available"]) else 1


if __name__ == "__main__":
    sys.exit(main())
