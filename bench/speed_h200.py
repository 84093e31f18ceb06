"""Issue 27: SFI against the strongest dense server the device can run, in one run.

Two parts, one process:
1. The split sweep: SGLang's own triton decode kernel (decode_attention_fwd) with SGLang's own
   per-step split heuristic (get_num_kv_splits_triton) under each cap of --splits, on a
   Qwen3-4B layer's shape (32 query heads, 8 KV heads, head_dim 128, bf16), at every
   CONTEXT and at batch 1 and BATCH of --configs: the cap is what
   `--triton-attention-num-kv-splits` sets. Median of CUDA-event-timed calls, rotating over
   enough copies of the KV that L2 (60 MB) holds none of the next call's. Its best cap per
   context at batch 1 is the `dense-best` engine's flag.
2. Real SGLang 0.5.23 engines (bench/sglang_h200.py's model, prompts and timing: decode
   graphs + overlap + radix on, a slow step every --slow-every tokens for SFI), one after
   the other per configuration:
     dense          SGLang's defaults (triton attention, 8 KV splits)
     dense-sN       the same with --triton-attention-num-kv-splits N
     dense-best     dense-sN at the sweep's best N for the context at batch 1
     dense-flashinfer  SGLang's flashinfer attention backend (needs FlashInfer importable on
                    the device: bench/flashinfer_h200.sh's copy; not run yet)
     sfi            the `sfi` backend as shipped (its own split cap: sfi_sglang.engine)
     sfi-sN         the same with an explicit --triton-attention-num-kv-splits N

Output ($OUT or --out): speed_h200.json, rewritten after every measurement: `sweep` (us per
layer and the heuristic's split count per context, batch and cap), and one row per
(context, batch) with `step_ms` per engine, `best_dense` (the fastest dense engine of the
row), `speedup` (best dense / sfi), and `ideal_ratio`: dense's non-attention time (the best
dense step minus 36 layers of the sweep's best attention time) plus each side's attention
at the HBM floor (4.3 TB/s, bench/NOTES.md section 1) for the bytes it must read per step
(dense: the whole KV of every layer; SFI: the whole KV of its dense layers, sinks + window +
budget of the others, and one slow step's whole KV per --slow-every steps); `of_ideal` =
speedup / ideal_ratio. For SFI engines `memory` is /server_info's SFI memory reservation.

On the H200:
  run(command="source bench/sglang_h200.sh && device_env speed && python3 bench/speed_h200.py "
              "--configs 131072x1,32768x8 --engines dense,dense-best,sfi", carry=[".sgl"])
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import sglang_h200 as S

HBM = 4.3e12  # bytes/s: the device-to-device copy (KINDS.md), the floor of bench/NOTES.md
L2_BYTES = 60 << 20


def layer_shape(shape: str) -> tuple[int, int, int, int]:
    c = S.SHAPES[shape]
    return c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]


def sweep(shape: str, contexts, batches, splits, reps: int) -> list[dict]:
    import torch
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton

    _, hq, hkv, d = layer_shape(shape)
    dev = torch.device("cuda")
    cores = torch.cuda.get_device_properties(dev).multi_processor_count
    out = []
    for n in contexts:
        for b in batches:
            tokens = n * b
            kv_bytes = 2 * tokens * hkv * d * 2
            # SGLang's kernel addresses the pool with int32 element offsets: no pool it serves
            # holds 2**31 elements per layer (the H200's ~100 GB KV pool: ~650K Qwen3-4B tokens)
            fit = (2**31 - 1) // (tokens * hkv * d)
            if fit < 1:
                print(f"SWEEP skip {n}x{b}: beyond int32 pool offsets", flush=True)
                continue
            copies = min(fit, max(2, math.ceil(4 * L2_BYTES / kv_bytes)))
            k = torch.randn(copies * tokens, hkv, d, device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
            o = torch.empty_like(q)
            indptr = (torch.arange(b + 1, device=dev, dtype=torch.int32) * n)
            idx = [torch.arange(c * tokens, (c + 1) * tokens, device=dev, dtype=torch.int32) for c in range(copies)]
            seq_lens = torch.full((b,), n, device=dev, dtype=torch.int32)
            for cap in splits:
                logits = torch.empty(b, hq, cap, d, device=dev, dtype=torch.float32)
                lse = torch.empty(b, hq, cap, device=dev, dtype=torch.float32)
                nsplit = torch.empty(b, device=dev, dtype=torch.int32)
                get_num_kv_splits_triton[(1,)](nsplit, seq_lens, b, 1, hq, hkv, cap, cores,
                                               MAX_NUM_SEQ=max(256, 1 << (b - 1).bit_length()))

                def call(c):
                    decode_attention_fwd(q, k, v, o, indptr, idx[c], logits, lse, nsplit, cap, d ** -0.5, 1.0, 1.0)

                for c in range(copies):
                    call(c)
                torch.cuda.synchronize()
                times = []
                for i in range(reps):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    call(i % copies)
                    e1.record()
                    e1.synchronize()
                    times.append(e0.elapsed_time(e1) * 1e3)
                times.sort()
                us = times[len(times) // 2]
                row = dict(context=n, batch=b, cap=cap, splits=int(nsplit[0]), us=round(us, 1),
                           hbm_fraction=round(kv_bytes / (us * 1e-6) / HBM, 3))
                out.append(row)
                print("SWEEP " + json.dumps(row), flush=True)
            del k, v, idx
            torch.cuda.empty_cache()
    return out


def best_cap(sw: list[dict], n: int, b: int) -> dict:
    return min((r for r in sw if r["context"] == n and r["batch"] == b), key=lambda r: r["us"])


def attention_bytes(shape: str, n: int, b: int, sfi: bool, cfg, slow_every: int) -> float:
    """Bytes one decode step's attention must read (module docstring)."""
    L, _, hkv, d = layer_shape(shape)
    cell = 2 * hkv * d * 2  # K and V of one token at one layer, bf16
    if not sfi:
        return L * n * cell * b
    dense = sum(1 for lid in cfg.dense_layers if lid < L)
    held = min(n, cfg.sinks + cfg.window + cfg.budget)
    return b * cell * (dense * n + (L - dense) * (held + n / slow_every))


def engine_kwargs(args, name: str, path: str, ctx: int, batch: int, caps: dict) -> dict:
    base = "sfi" if name.startswith("sfi") else "dense-graph"
    kw = S.engine_kwargs(args, base, path, ctx, batch)
    suffix = name.split("-", 1)[1] if "-" in name else ""
    if suffix == "best":
        suffix = f"s{caps['best']}"
    if suffix == "flashinfer":
        kw["attention_backend"] = "flashinfer"
    elif suffix.startswith("s") and suffix[1:].isdigit():
        kw["triton_attention_num_kv_splits"] = int(suffix[1:])
    elif suffix:
        raise SystemExit(f"unknown engine {name!r}")
    return kw


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", default="dense,dense-best,sfi")
    p.add_argument("--shape", choices=sorted(S.SHAPES), default="qwen3-4b")
    p.add_argument("--configs", default="131072x1,32768x8", help="CONTEXTxBATCH; batch 1 is measured too")
    p.add_argument("--sweep-contexts", default="8192,32768,65536,131072")
    p.add_argument("--sweep-batches", default="1,8")
    p.add_argument("--splits", default="8,16,32,64,128,256")
    p.add_argument("--sweep-reps", type=int, default=25)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--slow-every", type=int, default=24)
    p.add_argument("--mem-fraction", type=float, default=0.8)
    p.add_argument("--deadline-s", type=float, default=560, help="launch no engine after this")
    p.add_argument("--tokenizer", default=os.environ.get("SFI_TOKENIZER_DIR", ""))
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    import numpy as np

    import sfi_sglang
    from sfi_sglang.method.config import SFIConfig

    if not args.tokenizer:
        from sfi_sglang.model import default_model_path

        args.tokenizer = default_model_path()
    os.makedirs(args.out, exist_ok=True)
    out_json = os.path.join(args.out, "speed_h200.json")
    engines = args.engines.split(",")
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    result = dict(shape=args.shape, argv=sys.argv[1:], engines=engines, slow_every=args.slow_every,
                  steps=args.steps, hbm_bytes_per_s=HBM, sfi_config=SFIConfig().to_dict(),
                  sweep=[], rows=[], runs=[])

    def save():
        with open(out_json + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(out_json + ".tmp", out_json)

    import torch

    if torch.cuda.is_available():
        result["sweep"] = sweep(args.shape, [int(x) for x in args.sweep_contexts.split(",")],
                                [int(x) for x in args.sweep_batches.split(",")],
                                [int(x) for x in args.splits.split(",")], args.sweep_reps)
        save()
    max_ctx = max(S.context_length(args, n) for n, _ in configs)
    path = S.model_dir(args.shape, args.tokenizer, max(max_ctx, 40960))
    vocab = S.SHAPES[args.shape]["vocab_size"]
    L = layer_shape(args.shape)[0]
    cfg = SFIConfig()
    rows: dict[tuple[int, int], dict] = {}

    def finish(row):
        dense = {k: v for k, v in row["step_ms"].items() if k.startswith("dense")}
        if not dense or "sfi" not in row["step_ms"]:
            return
        best = min(dense, key=dense.get)
        row["best_dense"] = best
        row["speedup"] = round(dense[best] / row["step_ms"]["sfi"], 3)
        row["speedup_vs_defaults"] = (round(dense["dense"] / row["step_ms"]["sfi"], 3)
                                      if "dense" in dense else None)
        sw = [r for r in result["sweep"] if r["context"] == row["context"] and r["batch"] == row["batch"]]
        if sw:
            attn_ms = L * min(r["us"] for r in sw) / 1e3
            non_attn = max(0.0, dense[best] - attn_ms)
            n, b = row["context"], row["batch"]
            ideal_dense = non_attn + 1e3 * attention_bytes(args.shape, n, b, False, cfg, args.slow_every) / HBM
            ideal_sfi = non_attn + 1e3 * attention_bytes(args.shape, n, b, True, cfg, args.slow_every) / HBM
            row["ideal"] = dict(non_attention_ms=round(non_attn, 3), dense_attention_ms=round(attn_ms, 3),
                                dense_ms=round(ideal_dense, 3), sfi_ms=round(ideal_sfi, 3))
            row["ideal_ratio"] = round(ideal_dense / ideal_sfi, 3)
            row["of_ideal"] = round(row["speedup"] / row["ideal_ratio"], 3)

    save()
    for n, b in configs:
        ctx = S.context_length(args, n)
        prompts = [np.random.default_rng([n, b, i]).integers(100, vocab, n).tolist() for i in range(b)]
        caps = {}
        if result["sweep"]:
            caps["best"] = best_cap(result["sweep"], n, 1)["cap"]
        for name in engines:
            left = args.deadline_s - (time.perf_counter() - t_start)
            info = dict(engine=name, context=n, batch=b, context_length=ctx)
            result["runs"].append(info)
            if left < 60:
                info["error"] = f"skipped: {left:.0f} s left before the deadline"
                print(f"[{name}] {n}x{b}: {info['error']}", flush=True)
                save()
                continue
            engine = None
            try:
                kw = engine_kwargs(args, name, path, ctx, b, caps)
                info["launch"] = {k: v for k, v in kw.items() if k != "model_path"}
                t0 = time.perf_counter()
                engine = sfi_sglang.Engine(**kw)
                info["startup_s"] = round(time.perf_counter() - t0, 1)
                if name.startswith("sfi"):
                    si = engine.get_server_info()
                    info["memory"] = si["internal_states"][0].get("sfi", {}).get("memory")
                    info["triton_attention_num_kv_splits"] = si.get("triton_attention_num_kv_splits")
                run = S.runner(engine)
                warm, _ = run(prompts, 1)
                info["prefill_s"] = round(warm, 2)
                print(f"[{name}] {n}x{b}: up in {info['startup_s']} s, prefill {warm:.1f} s", flush=True)
                for batch in sorted({1, b}):
                    detail, _ = S.time_decode(run, prompts[:batch], args.steps, args.slow_every)
                    row = rows.get((n, batch))
                    if row is None:
                        row = rows[(n, batch)] = dict(context=n, batch=batch, step_ms={}, detail={})
                        result["rows"].append(row)
                    row["step_ms"][name] = detail["step_ms"]
                    row["detail"][name] = detail
                    finish(row)
                    save()
                    print(f"[{name}] {n}x{batch}: {json.dumps(detail)}", flush=True)
            except Exception as e:
                traceback.print_exc()
                info["error"] = repr(e)[:2000]
                save()
            finally:
                if engine is not None:
                    try:
                        S.free_engine(engine)
                    except Exception as e:
                        print(f"[{name}] shutdown failed: {e!r}", flush=True)
        for batch in sorted({1, b}):
            if (n, batch) in rows:
                print("ROW " + json.dumps({k: v for k, v in rows[(n, batch)].items() if k != "detail"}), flush=True)
    save()
    print(f"wrote {out_json} in {time.perf_counter() - t_start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
