"""Real SGLang 0.5.23, dense vs SFI, decode step time at long context.

Engines (`--engines`, comma-separated, run one after the other for each configuration in
one Python process), all through `sfi_sglang.Engine` (the product's entry point):
  dense-graph  SGLang's default dense server: triton attention, decode CUDA graphs and the
               overlap scheduler on (disable_sfi=True)
  sfi          the `sfi` backend, with whatever CUDA-graph / overlap settings sfi_sglang.Engine
               leaves on (this script sets neither); slow steps forced every --slow-every
               tokens (refresh="interval": random weights make boundaries meaningless)
  dense        triton attention, eager (no CUDA graphs, no overlap scheduler)
On CUDA every engine captures decode graphs only for batch 1 and the configuration's batch
(cuda_graph_bs_decode) and no prefill graphs (disable_prefill_cuda_graph: their capture ran
out of memory at mem-fraction 0.85). On a CPU (SGLang's CPU engine) no CUDA flag is set.
Model: a Qwen3-4B config with SGLang's dummy (random) weights, bf16; the tokenizer only
serves SFI's boundary table (skip_tokenizer_init: prompts and outputs are token ids).

One engine per CONTEXTxBATCH and engine, with context_length = CONTEXT + the decoded tokens
+ 64, rounded up to a multiple of 256 (per-context buffers, e.g. SFI's slow-step score
buffer, are sized by it); shut down (and its GPU memory freed) before the next one.
Decode time per step: the batch's prompts are prefilled once (max_new_tokens=1, filling the
radix cache); a warm-up decode runs past one slow step (no first-call compile is timed);
then t1 = the same request again (prefix cached: one token of extend + the first token)
and tM = with max_new_tokens=M; a decode step is (tM - t1) / (M - 1). Batch 1 reuses the
batch's first prompt (cached).

Output (--out): sglang_h200.json, rewritten after every measurement (a killed run keeps its
rows): per (context, batch) row step_ms per engine and ratio[dense engine] = dense_ms /
sfi_ms (> 1: SFI is faster). --profile CONTEXTxBATCH: at that configuration, after the
timing, a torch.profiler trace of --profile-steps decode steps of each --profile-engines
engine through SGLang's own profiler (Engine.start_profile / stop_profile), written to
OUT/profile/*.trace.json.gz, and OUT/profile_ENGINE_CONTEXTxBATCH.json: the top kernels by
total GPU time (kernels replayed inside a CUDA graph appear only if CUPTI reports them).
A failing engine launch, measurement or profile is logged and recorded, and the run goes on.
bench/speed_h200.py builds its engine rows on this driver.

On the H200 (bench/sglang_h200.sh unpacks SGLang and its Python dependencies, lays out
sfi_sglang and the sgl_kernel stand-in, and runs this once with every engine; $OUT gets the
JSON, the log and the profile):
  run(command="bash bench/sglang_h200.sh -- --configs 8192x16,32768x4,131072x1 "
              "--engines dense-graph,sfi --steps 48 --profile 32768x4", carry=[".sgl"])
On a CPU (smoke test of this script):
  python bench/sglang_h200.py --shape tiny --configs 256x2 --steps 8 --engines dense,sfi
"""

from __future__ import annotations

import argparse
import gc
import glob
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback

SHAPES = {
    # Qwen3-4B (config.json of Qwen/Qwen3-4B; longer positions for 128K contexts)
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=49152, tie_word_embeddings=True),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
ENGINES = ("dense", "dense-graph", "sfi")
DENSE_ENGINES = ("dense-graph", "dense")  # the reference of `ratio`, in this order
MARGIN = 64  # tokens of context_length beyond the prompt and the decoded tokens


def model_dir(shape: str, tokenizer_dir: str, max_pos: int) -> str:
    path = f"/tmp/sfi-dummy-{shape}"
    os.makedirs(path, exist_ok=True)
    cfg = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu",
               max_position_embeddings=max_pos, rms_norm_eps=1e-6, rope_theta=1000000.0,
               rope_scaling=None, attention_bias=False, attention_dropout=0.0, torch_dtype="bfloat16",
               bos_token_id=0, eos_token_id=0, use_cache=True, **SHAPES[shape])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(tokenizer_dir, name), path)
    return path


def add_launch_args(p, deadline_s: float) -> None:
    """The options of the bench scripts that launch engines one after another
    (bench/speed_h200.py, bench/launch_h200.py)."""
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-4b")
    p.add_argument("--slow-every", type=int, default=24)
    p.add_argument("--mem-fraction", type=float, default=0.8)
    p.add_argument("--dense-below", type=int, default=16384, help="the sfi-below engine's --sfi-dense-below")
    p.add_argument("--deadline-s", type=float, default=deadline_s, help="launch no engine after this")
    p.add_argument("--tokenizer", default=os.environ.get("SFI_TOKENIZER_DIR", ""))
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))


def tokenizer_or_default(path: str) -> str:
    """--tokenizer, else the embedded model's folder (its tokenizer files)."""
    if path:
        return path
    from sfi_sglang.model import default_model_path

    return default_model_path()


def context_length(args, n: int) -> int:
    """The engine's context_length for prompts of n tokens: room for the longest request
    (warm-up or timed), rounded up to a multiple of 256."""
    need = n + max(args.steps + 1, args.slow_every + 2) + MARGIN
    return -(-need // 256) * 256


def engine_kwargs(args, engine: str, path: str, ctx: int, batch: int) -> dict:
    kw = dict(model_path=path, load_format="dummy", skip_tokenizer_init=True,
              sampling_backend="pytorch", context_length=ctx, max_running_requests=batch,
              log_level="warning")
    import torch

    if torch.cuda.is_available():
        kw.update(dtype="bfloat16", mem_fraction_static=args.mem_fraction)
        if engine == "dense":
            kw.update(disable_cuda_graph=True, disable_overlap_schedule=True)
        else:
            # SGLang 0.5.23: the decode graphs of these batch sizes only (startup time);
            # no prefill graphs (their capture ran out of memory at mem-fraction 0.85)
            kw.update(cuda_graph_bs_decode=sorted({1, batch}), disable_prefill_cuda_graph=True)
    if engine == "sfi":
        from sfi_sglang.method.config import SFIConfig

        kw.update(sfi_refresh="interval", sfi_max_interval=args.slow_every,
                  sfi_min_gap=min(args.slow_every, SFIConfig().min_gap))
        if getattr(args, "memory_rows", None) is not None:
            kw["sfi_memory_rows"] = args.memory_rows
    else:
        kw.update(disable_sfi=True)
    return kw


def gpu_used_mib() -> list[int]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        return [int(x) for x in out.split()]
    except Exception:
        return []


def free_engine(engine) -> None:
    """Shut an engine down and give its memory back before the next one is launched."""
    try:
        engine.shutdown()
    finally:
        import torch

        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        if torch.cuda.is_available():  # the scheduler process's memory, seen from outside
            for _ in range(60):
                used = gpu_used_mib()
                if not used or max(used) < 4096:
                    break
                time.sleep(1)


def runner(engine, stream: bool = False):
    """run(prompts, new) -> (seconds, outputs): one greedy generate of `new` tokens each.
    stream: the requests streamed, as a chat client gets them (an output per token, each
    with its meta_info), each request's last chunk its output."""
    def run(ps, new):
        sp = dict(max_new_tokens=new, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        if stream:
            last, chunks = {}, {}
            for chunk in engine.generate(input_ids=ps, sampling_params=sp, stream=True):
                i = chunk.get("index", 0)
                last[i], chunks[i] = chunk, chunks.get(i, 0) + 1
            outs = [dict(last[i], chunks=chunks[i]) for i in range(len(ps))]
        else:
            outs = engine.generate(input_ids=ps, sampling_params=sp)
        dt = time.perf_counter() - t
        for o in outs:
            assert len(o["output_ids"]) == new, (len(o["output_ids"]), new)
        return dt, outs
    return run


def time_decode(run, ps, steps: int, slow_every: int):
    """ms per decode step of the batch `ps` (prefilled before: its prefixes are cached):
    a warm-up decode past one slow step, so that no first-call compile of a kernel is timed
    (run S4-5 timed some, section 6 of bench/NOTES.md), then (t(steps + 1) - t(1)) / steps."""
    run(ps, slow_every + 2)
    t1, _ = run(ps, 1)
    tm, outs = run(ps, steps + 1)
    step_ms = 1e3 * (tm - t1) / steps
    sfi = [o["meta_info"].get("sfi") or {} for o in outs]
    detail = dict(step_ms=round(step_ms, 3), tokens_per_s=round(len(ps) * 1e3 / step_ms, 1),
                  t1_s=round(t1, 3), tm_s=round(tm, 3),
                  slow_steps=sum(s.get("slow_steps", 0) for s in sfi),
                  fast_steps=sum(s.get("fast_steps", 0) for s in sfi))
    if "chunks" in outs[0]:  # streamed: the outputs each request got
        detail["chunks"] = sum(o["chunks"] for o in outs)
    return detail, outs


def graph_replays(events: list, top: int = 25) -> dict | None:
    """The decode steps of a trace: each CUDA-graph replay's kernels (those with the
    correlation id of a cudaGraphLaunch), so a prefill in the same trace stays out. Per
    replay: `span_us` from its first kernel's start to its last one's end, `busy_us` the
    union of its kernels' intervals (the GPU working), `gap_us` from the previous replay's
    end to its start (the GPU waiting for the host between steps). A step is span + gap;
    span - busy is the GPU idle inside a replay (e.g. conditional nodes), the gap host time
    the overlap scheduler did not hide. Medians over the replays; `kernels` the per-replay
    time of each kernel name (total over replays / replays), largest first. None without
    graph replays."""
    launches = {}
    for e in events:
        if e.get("ph") == "X" and str(e.get("cat", "")) == "cuda_runtime" \
                and str(e.get("name", "")).startswith("cudaGraphLaunch"):
            launches[(e.get("args") or {}).get("correlation")] = float(e["ts"])
    by_launch: dict = {}
    for e in events:
        if e.get("ph") == "X" and str(e.get("cat", "")) == "kernel":
            corr = (e.get("args") or {}).get("correlation")
            if corr in launches:
                by_launch.setdefault(corr, []).append((float(e["ts"]), float(e.get("dur", 0.0)), str(e["name"])))
    if not by_launch:
        return None
    replays, names, prev_end = [], {}, None
    for corr in sorted(by_launch, key=lambda c: min(k[0] for k in by_launch[c])):
        ks = sorted(by_launch[corr])
        start = cur_s = cur_e = ks[0][0]
        busy = 0.0
        for ts, d, name in ks:  # the union of the intervals, sorted by start
            names[name] = names.get(name, 0.0) + d
            if ts > cur_e:
                busy += cur_e - cur_s
                cur_s = ts
            cur_e = max(cur_e, ts + d)
        busy += cur_e - cur_s
        replays.append(dict(span_us=cur_e - start, busy_us=busy, kernels=len(ks),
                            gap_us=None if prev_end is None else start - prev_end))
        prev_end = cur_e
    n = len(replays)
    gaps = [r["gap_us"] for r in replays if r["gap_us"] is not None]
    return dict(replays=n, span_us=round(statistics.median([r["span_us"] for r in replays]), 1),
                busy_us=round(statistics.median([r["busy_us"] for r in replays]), 1),
                gap_us=round(statistics.median(gaps), 1) if gaps else None,
                kernels_per_replay=round(statistics.median([r["kernels"] for r in replays]), 1),
                kernels=[dict(name=k, us=round(v / n, 2)) for k, v in
                         sorted(names.items(), key=lambda kv: -kv[1])[:top]])


def summarize_trace(path: str, top: int = 30) -> dict:
    """Top kernels by total GPU time in a chrome trace of torch.profiler (kineto); without
    GPU kernels (a CPU run) the top CPU ops instead. With decode graphs, also each replay's
    time on the GPU against the step (graph_replays)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    cats: dict[str, int] = {}
    by_cat: dict[str, dict[str, list]] = {}
    graph_launches = 0
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = str(e.get("cat", ""))
        cats[cat] = cats.get(cat, 0) + 1
        name = str(e.get("name", ""))
        if cat == "cuda_runtime" and name.startswith("cudaGraphLaunch"):
            graph_launches += 1
        acc = by_cat.setdefault(cat, {}).setdefault(name, [0, 0.0])
        acc[0] += 1
        acc[1] += float(e.get("dur", 0.0))
    kind = "kernel" if by_cat.get("kernel") else "cpu_op"
    table = by_cat.get(kind, {})
    total = sum(v[1] for v in table.values())
    rows = sorted(table.items(), key=lambda kv: -kv[1][1])[:top]
    return dict(trace=os.path.basename(path), kind=kind, total_us=round(total, 1),
                graph_launches=graph_launches, event_counts=cats,
                gpu_us={c: round(sum(v[1] for v in by_cat.get(c, {}).values()), 1)
                        for c in ("kernel", "gpu_memcpy", "gpu_memset")},
                top=[dict(name=k, count=v[0], total_us=round(v[1], 1),
                          share=round(v[1] / total, 4) if total else 0.0) for k, v in rows],
                graph_replays=graph_replays(events))


def profile_decode(args, engine, run, name: str, n: int, b: int, prompts) -> dict:
    """A torch.profiler trace of a few decode steps inside SGLang (its profiler API), and
    its kernel summary."""
    prof_dir = os.path.abspath(os.path.join(args.out, "profile"))
    os.makedirs(prof_dir, exist_ok=True)
    prefix = f"{name}-{n}x{b}"
    before = set(glob.glob(os.path.join(prof_dir, "*")))
    engine.start_profile(output_dir=prof_dir, activities=["CPU", "GPU"], with_stack=False,
                         record_shapes=False, profile_prefix=prefix)
    try:
        dt, _ = run(prompts, args.profile_steps + 1)
    finally:
        engine.stop_profile()
    traces = [p for p in glob.glob(os.path.join(prof_dir, "*.json*")) if p not in before]
    for _ in range(30):  # written by the scheduler process
        if traces:
            break
        time.sleep(1)
        traces = [p for p in glob.glob(os.path.join(prof_dir, "*.json*")) if p not in before]
    if not traces:
        raise RuntimeError(f"no trace written to {prof_dir}")
    trace = max(traces, key=os.path.getmtime)
    summary = dict(engine=name, context=n, batch=b, decode_steps=args.profile_steps,
                   wall_s=round(dt, 3), **summarize_trace(trace))
    with open(os.path.join(args.out, f"profile_{name}_{n}x{b}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", default="dense-graph,sfi",
                   help=f"comma-separated, run in this order for each configuration: {', '.join(ENGINES)}")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-4b")
    p.add_argument("--configs", default="8192x16,32768x4,131072x1",
                   help="CONTEXTxBATCH, comma-separated; batch 1 at each context is measured too")
    p.add_argument("--steps", type=int, default=48, help="timed decode steps (M - 1)")
    p.add_argument("--slow-every", type=int, default=24)
    p.add_argument("--mem-fraction", type=float, default=0.8)
    p.add_argument("--memory-rows", default=None, type=lambda v: v if v == "auto" else int(v),
                   help="the sfi engine's --sfi-memory-rows (default: SFI's)")
    p.add_argument("--profile", default="", metavar="CONTEXTxBATCH",
                   help="profile decode steps at this configuration (one of --configs)")
    p.add_argument("--profile-engines", default="sfi", help="comma-separated engines to profile")
    p.add_argument("--profile-steps", type=int, default=8)
    p.add_argument("--stream", action="store_true", help="timed requests streamed (an output per token)")
    p.add_argument("--tokenizer", default=os.environ.get("SFI_TOKENIZER_DIR", ""),
                   help="folder with tokenizer.json (default: the embedded SmolLM2's)")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    engines = [e for e in args.engines.split(",") if e]
    bad = [e for e in engines if e not in ENGINES]
    if bad or not engines:
        p.error(f"--engines: unknown {bad}; choose from {ENGINES}")
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    profile_at = tuple(int(x) for x in args.profile.split("x")) if args.profile else None
    if profile_at and profile_at not in configs:
        p.error(f"--profile {args.profile} is not one of --configs")
    profile_engines = set(args.profile_engines.split(","))

    import numpy as np

    import sfi_sglang

    args.tokenizer = tokenizer_or_default(args.tokenizer)
    max_ctx = max(context_length(args, n) for n, _ in configs)
    path = model_dir(args.shape, args.tokenizer, max(max_ctx, 40960))
    vocab = SHAPES[args.shape]["vocab_size"]
    os.makedirs(args.out, exist_ok=True)
    out_json = os.path.join(args.out, "sglang_h200.json")
    result = dict(shape=args.shape, engines=engines, configs=args.configs, steps=args.steps,
                  slow_every=args.slow_every, mem_fraction=args.mem_fraction, argv=sys.argv[1:],
                  rows=[], runs=[], profiles=[])
    row_of: dict[tuple[int, int], dict] = {}

    def save():
        tmp = out_json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, out_json)

    def log(name, msg):
        print(f"[{name}] {msg}", flush=True)

    save()
    for n, b in configs:
        ctx = context_length(args, n)
        # the same prompts for every engine of this configuration
        prompts = [np.random.default_rng([n, b, i]).integers(100, vocab, n).tolist() for i in range(b)]
        for name in engines:
            kw = engine_kwargs(args, name, path, ctx, b)
            info = dict(engine=name, context=n, batch=b, context_length=ctx,
                        launch={k: v for k, v in kw.items() if k != "model_path"})
            result["runs"].append(info)
            log(name, f"{n}x{b}: launching (context_length {ctx}): {info['launch']}")
            engine = None
            try:
                t0 = time.perf_counter()
                engine = sfi_sglang.Engine(**kw)
                info["startup_s"] = round(time.perf_counter() - t0, 1)
                log(name, f"{n}x{b}: engine up in {info['startup_s']:.0f} s")

                run = runner(engine, stream=args.stream)
                warm, _ = run(prompts, 1)
                info["prefill_s"] = round(warm, 2)
                log(name, f"{n}x{b}: prefill {warm:.1f} s")
                save()
                for batch in sorted({1, b}):
                    detail, outs = time_decode(run, prompts[:batch], args.steps, args.slow_every)
                    row = row_of.get((n, batch))
                    if row is None:
                        row = row_of[(n, batch)] = dict(context=n, batch=batch, step_ms={}, ratio={}, detail={})
                        result["rows"].append(row)
                    row["step_ms"][name] = detail["step_ms"]
                    row["detail"][name] = detail
                    if "sfi" in row["step_ms"]:
                        row["ratio"] = {d: round(row["step_ms"][d] / row["step_ms"]["sfi"], 3)
                                        for d in DENSE_ENGINES if d in row["step_ms"]}
                    save()
                    log(name, f"{n}x{batch}: {json.dumps(detail)}")
                    if name == engines[-1]:  # the row is complete
                        print("ROW " + json.dumps(dict(context=n, batch=batch, step_ms=row["step_ms"],
                                                       ratio=row["ratio"])), flush=True)
                if profile_at == (n, b) and name in profile_engines:
                    try:
                        summary = profile_decode(args, engine, run, name, n, b, prompts)
                        result["profiles"].append({k: v for k, v in summary.items() if k != "top"}
                                                  | dict(top=summary["top"][:10]))
                        log(name, f"{n}x{b}: profile {summary['trace']}: {summary['kind']} "
                                  f"{summary['total_us']:.0f} us, top: "
                                  + "; ".join(f"{t['name'][:60]} {t['total_us']:.0f}" for t in summary["top"][:5]))
                    except Exception as e:  # never lose the timing rows to the profiler
                        traceback.print_exc()
                        result["profiles"].append(dict(engine=name, context=n, batch=b, error=repr(e)))
                    save()
            except Exception as e:
                traceback.print_exc()
                info["error"] = repr(e)[:2000]
                log(name, f"{n}x{b}: FAILED: {e!r}"[:2000])
                save()
            finally:
                if engine is not None:
                    try:
                        free_engine(engine)
                    except Exception as e:
                        log(name, f"shutdown failed: {e!r}")
                    engine = None
    save()
    failed = [r for r in result["runs"] if "error" in r]
    print(f"wrote {out_json}: {len(result['rows'])} rows, {len(failed)} failed engine runs", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
