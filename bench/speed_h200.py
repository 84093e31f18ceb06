"""SFI against the strongest dense server the device can run, in one run.

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
   the other: each engine launched once for every fixed-batch config (its context_length
   the longest of them; dense-best once per split cap), then once per CONTEXTxmax config:
     dense          SGLang's defaults (triton attention, 8 KV splits)
     dense-sN       the same with --triton-attention-num-kv-splits N
     dense-best     dense-sN at the sweep's best N for the context at batch 1
     dense-flashinfer  SGLang's flashinfer attention backend (FlashInfer from bench/flashinfer_h200.sh
                    pack's .fi/, carried: speed_h200.sh unpacks it; its one try failed in
                    prefill on a missing cascade.cu, since packed)
     sfi            the `sfi` backend as shipped (its own split cap: sfi_sglang.engine)
     sfi-sN         the same with an explicit --triton-attention-num-kv-splits N
     sfi-pool       the same with --sfi-fast-path triton-pool (sinks and selection read in
                    place from the pool: no packed copy; the default fast path since NOTES 47)
     sfi-triton     the same with --sfi-fast-path triton (a packed copy per request slot:
                    `sfi` before NOTES 47; its pool holds fewer sequences)
     sfi-fi         the same with --sfi-dense-backend flashinfer (prefill, dense layers and
                    SFI-off rows on FlashInfer; carry .fi)
     sfi-fipath     the same with --sfi-fast-path flashinfer (fast steps through FlashInfer's
                    decode over page lists read in place, in the decode graphs; carry .fi)
     sfi-below      sfi-fi with --sfi-dense-below (--dense-below): steps whose batch holds
                    fewer tokens beyond its sparse memories run FlashInfer's dense decode alone
     sfi-pages      sfi with --sfi-selection-page 16 (the Selector keeps whole pages)
     sfi-pool-pages sfi-pool with --sfi-selection-page 16
     ...-nodense    any sfi engine with --sfi-dense-layers none (every layer sparse)
     ...-fp8        any engine with --kv-cache-dtype fp8_e4m3 (its largest batch bounded at 1
                    byte per K/V entry; the ideal bounds still count 2)
     ...-slowall    any sfi engine with --sfi-max-slow-rows 0: every row due a slow step runs
                    it at once (the bench's requests run in lockstep; as shipped, at most 8 a step)
     ...-rows       any sfi engine with --sfi-memory-rows of half the batch: the other half of
                    the rows hold no memory and run dense (the price of rows given out)
     ...-autorows   any sfi engine with --sfi-memory-rows auto (not on `sfi-triton`)
     ...-topup      any sfi engine with the per-step top-up: 32 pages of 16 chosen per step
                    and layer, the budget 1536 (the same tokens read as sfi's 2048)
     ...-every8-topup  the same with the pages chosen at every 8th sparse layer (--sfi-topup-every 8)
     ...-p16        any engine with --page-size 16 (SGLang's pool in pages of 16: with a top-up, its
                    scores read the pool pages' key summaries; before -fp8 where both)

CONTEXTxmax: each engine at the largest batch its own KV pool holds. The engine captures
decode graphs at 1, 8 and steps of an eighth of an upper bound on that batch (the
device's memory times --mem-fraction, less the weights, over one sequence's KV); after the
launch the largest captured size whose batch x context_length fits /server_info's
max_total_num_tokens is timed, with 1 and 8, after one prefill of all its prompts. Its row
has `batch` "max", `batch_of` and `tokens_per_s` per engine and `throughput_ratio` (SFI's
tokens/s over the best dense engine's).

Output ($OUT or --out): speed_h200.json, rewritten after every measurement: `sweep` (us per
layer and the heuristic's split count per context, batch and cap), `slow_sweep` (SFI's
slow-step dense pass with scores, us per layer and `over_flashinfer`: its ratio to `fi_sweep`), and one row per
(context, batch) with `step_ms` per engine, `best_dense` (the fastest dense engine of the
row), `speedup` (best dense / sfi), and `ideal_ratio`: dense's non-attention time (the best
dense step minus 36 layers of that engine's own kernel's time in the sweep: the triton sweep's
best cap, or `fi_sweep`, FlashInfer's decode as SGLang's flashinfer backend plans it, when
dense-flashinfer is the best) plus each side's attention
at the HBM floor (a copy's 4.3 TB/s on the H200, 3.0 on the H100; bench/NOTES.md section 1) for the bytes it must read per step
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
import statistics
import sys
import time
import traceback
from typing import Optional

import sglang_h200 as S

# bytes/s: a device-to-device copy as measured on each card (the device library's KINDS.md),
# the floor of bench/NOTES.md; set_device_hbm() picks the card's at start
HBM_BY_CARD = {"H200": 4.3e12, "H100": 3.0e12}
HBM = HBM_BY_CARD["H200"]
L2_BYTES = 60 << 20


def set_device_hbm() -> str:
    """HBM (and the `hbm_fraction`s and ideal bounds made from it) for this machine's card:
    the H100's copy moves 3.0 TB/s against the H200's 4.3. Returns the card's name."""
    global HBM
    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    HBM = next((v for k, v in HBM_BY_CARD.items() if k in name), HBM_BY_CARD["H200"])
    return name


def layer_shape(shape: str) -> tuple[int, int, int, int]:
    c = S.SHAPES[shape]
    return c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]


def median_us(call, copies: int, reps: int) -> float:
    """Median of `reps` CUDA-event-timed calls in us, call(c) rotating over `copies` copies
    of the data so that L2 holds none of the next call's (each copy run once first)."""
    import torch

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
    return times[len(times) // 2]


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

                us = median_us(call, copies, reps)
                row = dict(context=n, batch=b, cap=cap, splits=int(nsplit[0]), us=round(us, 1),
                           hbm_fraction=round(kv_bytes / (us * 1e-6) / HBM, 3))
                out.append(row)
                print("SWEEP " + json.dumps(row), flush=True)
            del k, v, idx
            torch.cuda.empty_cache()
    return out


def rotation_points(contexts, batches, hkv: int, d: int):
    """(context, batch, KV bytes, copies) of every swept point whose rotated copies fit in
    40 GB: enough copies of the KV that L2 holds none of the next call's."""
    for n in contexts:
        for b in batches:
            kv_bytes = 2 * n * b * hkv * d * 2
            copies = max(2, math.ceil(4 * L2_BYTES / kv_bytes))
            if copies * kv_bytes <= 40e9:
                yield n, b, kv_bytes, copies


def fi_sweep(shape: str, contexts, batches, reps: int) -> list[dict]:
    """SGLang's flashinfer decode as its backend sets it up (page size 1, NHD, its own
    tensor-core choice, one plan per step) on a Qwen3-4B layer: us per layer at each context
    and batch, as `sweep` times the triton kernel. The `dense-flashinfer` engine's attention
    time, for its rows' ideal bound."""
    import flashinfer
    import torch
    from sglang.srt.layers.attention.flashinfer_backend import should_use_tensor_core

    _, hq, hkv, d = layer_shape(shape)
    dev = torch.device("cuda")
    tc = should_use_tensor_core(torch.bfloat16, hq, hkv)
    out = []
    for n, b, kv_bytes, copies in rotation_points(contexts, batches, hkv, d):
        tokens = n * b
        k = torch.randn(copies * tokens, 1, hkv, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
        indptr = torch.arange(b + 1, device=dev, dtype=torch.int32) * n
        last = torch.ones(b, device=dev, dtype=torch.int32)
        wrappers = []
        for c in range(copies):
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                torch.empty(128 << 20, dtype=torch.uint8, device=dev), "NHD", use_tensor_cores=tc)
            idx = torch.arange(c * tokens, (c + 1) * tokens, device=dev, dtype=torch.int32)
            w.begin_forward(indptr, idx, last, hq, hkv, d, 1, data_type=torch.bfloat16,
                            q_data_type=torch.bfloat16)
            wrappers.append(w)
        us = median_us(lambda c: wrappers[c].forward(q, (k, v)), copies, reps)
        row = dict(context=n, batch=b, engine="dense-flashinfer", tensor_cores=tc, us=round(us, 1),
                   hbm_fraction=round(kv_bytes / (us * 1e-6) / HBM, 3))
        out.append(row)
        print("FI_SWEEP " + json.dumps(row), flush=True)
        del k, v, wrappers
        torch.cuda.empty_cache()
    return out


def slow_sweep(shape: str, contexts, batches, reps: int, fi_rows: list[dict]) -> list[dict]:
    """SFI's slow-step dense pass (kernels.dense_decode_with_scores: the output and every
    position's raw logits, read by the Selector) on a Qwen3-4B layer: us per layer at each
    context and batch, and its ratio to FlashInfer's decode at the same point (`fi_rows`,
    fi_sweep's): what one dense layer of a slow step costs against FlashInfer's."""
    import torch

    from sfi_sglang import kernels

    _, hq, hkv, d = layer_shape(shape)
    dev = torch.device("cuda")
    out = []
    for n, b, kv_bytes, copies in rotation_points(contexts, batches, hkv, d):
        tokens = n * b
        k = torch.randn(copies * tokens, hkv, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
        o = torch.empty_like(q)
        r2t = torch.arange(copies * tokens, device=dev, dtype=torch.int32).view(copies * b, n)
        seq_lens = torch.full((b,), n, device=dev, dtype=torch.int32)
        rows = [torch.arange(c * b, (c + 1) * b, device=dev) for c in range(copies)]
        scores = torch.empty(b, hq, n, device=dev, dtype=torch.float32)

        def call(c):
            kernels.dense_decode_with_scores(q, k, v, r2t, rows[c], seq_lens, d ** -0.5, scores_out=scores,
                                             out=o, max_len=n)

        us = median_us(call, copies, reps)
        fi = [r["us"] for r in fi_rows if r["context"] == n and r["batch"] == b]
        row = dict(context=n, batch=b, us=round(us, 1), hbm_fraction=round(kv_bytes / (us * 1e-6) / HBM, 3),
                   over_flashinfer=round(us / fi[0], 3) if fi else None)
        out.append(row)
        print("SLOW_SWEEP " + json.dumps(row), flush=True)
        del k, v, r2t
        torch.cuda.empty_cache()
    return out


def best_cap(sw: list[dict], n: int, b: int) -> dict:
    """The sweep's fastest cap at context n and batch b; at the nearest swept context where
    n was not swept (a --configs context outside --sweep-contexts)."""
    rows = [r for r in sw if r["batch"] == b] or sw
    near = min({r["context"] for r in rows}, key=lambda c: abs(math.log2(c / n)))
    return min((r for r in rows if r["context"] == near), key=lambda r: r["us"])


def attention_ms(result: dict, engine: str, n: int, b: int, layers: int) -> Optional[float]:
    """One step's attention time of a dense engine from its own kernel's sweep at exactly
    (n, b): the triton sweep's best cap for the triton engines (dense, dense-sN, dense-best),
    the FlashInfer sweep for dense-flashinfer; None where that was not swept."""
    rows = result.get("fi_sweep", []) if engine == "dense-flashinfer" else result["sweep"]
    us = [r["us"] for r in rows if r["context"] == n and r["batch"] == b]
    return layers * min(us) / 1e3 if us else None


def attention_bytes(shape: str, n: int, b: int, sfi: bool, cfg, slow_every: int) -> float:
    """Bytes one decode step's attention must read (module docstring)."""
    L, _, hkv, d = layer_shape(shape)
    cell = 2 * hkv * d * 2  # K and V of one token at one layer, bf16
    if not sfi:
        return L * n * cell * b
    dense = sum(1 for lid in cfg.dense_layers if lid < L)
    held = min(n, cfg.sinks + cfg.window + cfg.budget)
    return b * cell * (dense * n + (L - dense) * (held + n / slow_every))


def largest_batch_guess(shape: str, ctx: int, mem_fraction: float, kv_bytes: int = 2) -> int:
    """An upper bound on the sequences of ctx tokens the KV pool holds: the device's memory
    times --mem-fraction, less the weights, over the KV bytes of ctx tokens (kv_bytes per
    entry: 1 for an fp8 KV cache)."""
    import torch

    if not torch.cuda.is_available():  # the CPU smoke run of this script
        return 4
    c = S.SHAPES[shape]
    L, _, hkv, d = layer_shape(shape)
    h, f = c["hidden_size"], c["intermediate_size"]
    attn = h * d * 2 * (c["num_attention_heads"] + hkv)  # q, k, v, o
    weights = 2 * (L * (attn + 3 * h * f) + c["vocab_size"] * h)
    kv = torch.cuda.get_device_properties(0).total_memory * mem_fraction - weights
    return max(1, int(kv // (2 * L * hkv * d * kv_bytes * ctx)))


def graph_batches(guess: int) -> list[int]:
    """Decode graph sizes for a largest-batch row: 1, 8 and steps of about guess/8 up to it,
    so that the measured largest batch (the largest captured size the pool holds) is within
    one step of the pool's limit."""
    step = max(1, guess // 8)
    return sorted({1, min(8, guess), guess, *range(step, guess + 1, step)})


def launches(args, engines: list[str], configs: list[tuple[int, int]], sweep: list[dict]) -> list[dict]:
    """One engine launch each, in order: {"engine", "parts": [(context, [batches])], "caps"}.
    The configs of a fixed batch share one launch per engine (its context_length the longest
    of theirs: the same graphs, the same kernels, at each context's own lengths), engine by
    engine, so each launch's startup is paid once for every fixed row; dense-best launches
    once per split cap. A CONTEXTxmax config has one launch per engine, after them (its
    graph batch sizes and pool depend on the context)."""
    fixed: dict[int, set] = {}
    for n, b in configs:
        if b:
            fixed.setdefault(n, {1}).add(b)
    cap = {n: best_cap(sweep, n, 1)["cap"] if sweep else None for n, _ in configs}
    out = []
    for name in engines:
        groups: dict = {}
        for n, bs in fixed.items():
            groups.setdefault(cap[n] if name.endswith("-best") else None, []).append((n, sorted(bs)))
        out += [dict(engine=name, parts=parts, caps={"best": c}) for c, parts in groups.items()]
    for n, b in configs:
        if not b:  # each engine at the largest captured batch its pool holds
            for name in engines:
                guess = largest_batch_guess(args.shape, S.context_length(args, n), args.mem_fraction,
                                            1 if name.endswith("-fp8") else 2)
                caps = {"graph_batches": graph_batches(guess), "best": cap[n]}
                out.append(dict(engine=name, parts=[(n, [1, guess])], caps=caps))
    return out


def record_step(row: dict, name: str, step_ms: float) -> None:
    """One launch's step time of engine `name` in a row: every launch's in
    `step_ms_rounds[name]`, their median in `step_ms[name]` (--rounds)."""
    times = row.setdefault("step_ms_rounds", {}).setdefault(name, [])
    times.append(step_ms)
    row["step_ms"][name] = round(statistics.median(times), 3)


def engine_kwargs(args, name: str, path: str, ctx: int, batch: int, caps: dict) -> dict:
    base = "sfi" if name.startswith("sfi") else "dense-graph"
    kw = S.engine_kwargs(args, base, path, ctx, batch)
    if caps.get("graph_batches"):
        kw["cuda_graph_bs_decode"] = caps["graph_batches"]
    if name.endswith("-fp8"):  # SGLang's fp8 KV cache (unit scales)
        kw["kv_cache_dtype"] = "fp8_e4m3"
        name = name[:-len("-fp8")]
    if name.endswith("-p16"):  # SGLang's pool in pages of 16 (--page-size 16): the top-up's page summaries
        kw["page_size"] = 16
        name = name[:-len("-p16")]
    if name.endswith("-rows"):  # memory rows for half the batch (--sfi-memory-rows): the rest run dense
        kw["sfi_memory_rows"] = max(1, batch // 2)
        name = name[:-len("-rows")]
    if name.endswith("-autorows"):  # --sfi-memory-rows auto: a row for every request the pool holds
        kw["sfi_memory_rows"] = "auto"
        name = name[:-len("-autorows")]
    if name.endswith("-slowall"):  # no limit on a step's slow rows
        kw["sfi_max_slow_rows"] = 0
        name = name[:-len("-slowall")]
    if name.endswith("-nodense"):  # no layer kept dense (--sfi-dense-layers none)
        kw["sfi_dense_layers"] = "none"
        name = name[:-len("-nodense")]
    if name.endswith("-topup"):  # the per-step top-up: a quarter of the default budget in pages, chosen
        from sfi_sglang.method.config import SFIConfig  # per step (the eval's sfi-topup: the same tokens read)

        d = SFIConfig()
        kw["sfi_topup_pages"] = d.budget // 4 // d.page_size
        kw["sfi_budget"] = d.budget - kw["sfi_topup_pages"] * d.page_size
        name = name[:-len("-topup")]
    if name.endswith("-every8"):  # its pages chosen at every 8th sparse layer, reused by the next 7
        kw["sfi_topup_every"] = 8
        name = name[:-len("-every8")]
    if name.endswith("-pages"):  # the Selector keeps whole pages of 16
        kw["sfi_selection_page"] = 16
        name = name[:-len("-pages")]
    suffix = name.split("-", 1)[1] if "-" in name else ""
    if suffix == "best":
        suffix = f"s{caps['best']}"
    if name == "sfi-pool":  # the fast kernel reads the pool in place (no packed copy; the default)
        kw["sfi_fast_path"] = "triton-pool"
    elif name == "sfi-triton":  # the fast kernel over a packed copy per request slot
        kw["sfi_fast_path"] = "triton"
    elif name == "sfi-fipath":  # fast steps through FlashInfer (no packed copy either)
        kw["sfi_fast_path"] = "flashinfer"
    elif name in ("sfi-fi", "sfi-below"):  # prefill, dense layers and SFI-off rows on FlashInfer
        kw["sfi_dense_backend"] = "flashinfer"
        if name == "sfi-below":  # and short batches' whole steps
            kw["sfi_dense_below"] = args.dense_below
    elif suffix == "flashinfer":
        kw["attention_backend"] = "flashinfer"
    elif suffix.startswith("s") and suffix[1:].isdigit():
        kw["triton_attention_num_kv_splits"] = int(suffix[1:])
    elif suffix:
        raise SystemExit(f"unknown engine {name!r}")
    return kw


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", default="dense,dense-best,sfi")
    p.add_argument("--configs", default="131072x1,32768x8", help="CONTEXTxBATCH (BATCH max: each engine's largest batch "
                   "that its pool holds, and 8); batch 1 is measured too")
    p.add_argument("--sweep-contexts", default="8192,32768,65536,131072")
    p.add_argument("--sweep-batches", default="1,8")
    p.add_argument("--splits", default="8,16,32,64,128,256")
    p.add_argument("--sweep-reps", type=int, default=25)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--profile-engines", default="", help="comma-separated engines whose batch-1 decode "
                   "steps are also traced (SGLang's profiler: OUT/profile_ENGINE_CONTEXTx1.json, top kernels)")
    p.add_argument("--profile-steps", type=int, default=8)
    p.add_argument("--stream", action="store_true", help="timed requests streamed (an output per token, as "
                   "a chat client gets them; bench/NOTES.md section 59)")
    p.add_argument("--rounds", type=int, default=1, help="launch every engine this many times, round by "
                   "round (A, B, A, B): two launches of one engine differ by 3-6%% at batch 1 "
                   "(bench/NOTES.md section 36); a row's step_ms is each engine's median over rounds")
    S.add_launch_args(p, deadline_s=560)
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    import numpy as np

    import sfi_sglang
    from sfi_sglang.method.config import SFIConfig

    args.tokenizer = S.tokenizer_or_default(args.tokenizer)
    os.makedirs(args.out, exist_ok=True)
    out_json = os.path.join(args.out, "speed_h200.json")
    engines = args.engines.split(",")
    configs = [(int(n), 0 if b == "max" else int(b)) for n, _, b in (c.partition("x") for c in args.configs.split(","))]
    card = set_device_hbm()
    # cuda: SGLang's fused ops (RMSNorm, SiLU-and-mul, rotary) as its JIT CUDA kernels; torch:
    # in their torch forms (bench/sglang_h200.sh SFI_FUSED_OPS)
    fused_ops = "torch" if os.environ.get("SGLANG_FORCE_FUSED_OP_BACKEND") == "torch" else "cuda"
    result = dict(shape=args.shape, argv=sys.argv[1:], engines=engines, slow_every=args.slow_every,
                  steps=args.steps, device=card, hbm_bytes_per_s=HBM, fused_ops=fused_ops,
                  sfi_config=SFIConfig().to_dict(),
                  sweep=[], rows=[], runs=[])

    def save():
        with open(out_json + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(out_json + ".tmp", out_json)

    import torch

    if torch.cuda.is_available():
        points = ([int(x) for x in args.sweep_contexts.split(",")], [int(x) for x in args.sweep_batches.split(",")])
        result["sweep"] = sweep(args.shape, *points, [int(x) for x in args.splits.split(",")], args.sweep_reps)
        save()
        if "dense-flashinfer" in engines:  # its own kernel's time, for its rows' ideal bound
            try:
                result["fi_sweep"] = fi_sweep(args.shape, *points, args.sweep_reps)
            except Exception:  # the engines still run; rows it would bound get no ideal
                result["fi_sweep_error"] = traceback.format_exc()[-2000:]
                print(result["fi_sweep_error"], flush=True)
            save()
        if any(e.startswith("sfi") for e in engines):
            try:
                result["slow_sweep"] = slow_sweep(args.shape, *points, args.sweep_reps, result.get("fi_sweep", []))
            except Exception:
                result["slow_sweep_error"] = traceback.format_exc()[-2000:]
                print(result["slow_sweep_error"], flush=True)
            save()
    max_ctx = max(S.context_length(args, n) for n, _ in configs)
    path = S.model_dir(args.shape, args.tokenizer, max(max_ctx, 40960))
    vocab = S.SHAPES[args.shape]["vocab_size"]
    L = layer_shape(args.shape)[0]
    cfg = SFIConfig()
    rows: dict[tuple[int, int], dict] = {}

    def finish(row):
        if row["batch"] == "max":  # engines at their own largest batch: tokens/s, not ms
            tps = row["tokens_per_s"] = {k: d["tokens_per_s"] for k, d in row["detail"].items()}
            row["batch_of"] = {k: d["batch"] for k, d in row["detail"].items()}
            dense = {k: v for k, v in tps.items() if k.startswith("dense")}
            if dense and "sfi" in tps:
                row["best_dense"] = max(dense, key=dense.get)
                row["throughput_ratio"] = round(tps["sfi"] / dense[row["best_dense"]], 3)
            return
        dense = {k: v for k, v in row["step_ms"].items() if k.startswith("dense")}
        if not dense or "sfi" not in row["step_ms"]:
            return
        best = min(dense, key=dense.get)
        row["best_dense"] = best
        row["speedup"] = round(dense[best] / row["step_ms"]["sfi"], 3)
        row["speedup_vs_defaults"] = (round(dense["dense"] / row["step_ms"]["sfi"], 3)
                                      if "dense" in dense else None)
        attn_ms = attention_ms(result, best, row["context"], row["batch"], L)
        if attn_ms is not None:  # the ideal bound from the best dense engine's own kernel
            non_attn = max(0.0, dense[best] - attn_ms)
            n, b = row["context"], row["batch"]
            ideal_dense = non_attn + 1e3 * attention_bytes(args.shape, n, b, False, cfg, args.slow_every) / HBM
            ideal_sfi = non_attn + 1e3 * attention_bytes(args.shape, n, b, True, cfg, args.slow_every) / HBM
            row["ideal"] = dict(non_attention_ms=round(non_attn, 3), dense_attention_ms=round(attn_ms, 3),
                                dense_ms=round(ideal_dense, 3), sfi_ms=round(ideal_sfi, 3))
            row["ideal_ratio"] = round(ideal_dense / ideal_sfi, 3)
            row["of_ideal"] = round(row["speedup"] / row["ideal_ratio"], 3)

    save()
    plan = launches(args, engines, configs, result["sweep"])
    for rnd, launch in ((r, x) for r in range(args.rounds) for x in plan):
        name, parts, caps = launch["engine"], launch["parts"], launch["caps"]
        ctx = S.context_length(args, max(n for n, _ in parts))
        b = max(max(bs) for _, bs in parts)
        left = args.deadline_s - (time.perf_counter() - t_start)
        info = dict(engine=name, context=parts[0][0], contexts=[n for n, _ in parts], batch=b, context_length=ctx,
                    round=rnd)
        result["runs"].append(info)
        if left < 60:
            info["error"] = f"skipped: {left:.0f} s left before the deadline"
            print(f"[{name}] {info['contexts']}x{b}: {info['error']}", flush=True)
            save()
            continue
        engine = None
        try:
            kw = engine_kwargs(args, name, path, ctx, b, caps)
            if not caps.get("graph_batches"):  # every batch of the launch's configs
                kw["cuda_graph_bs_decode"] = sorted({1, *(x for _, bs in parts for x in bs)})
            info["launch"] = {k: v for k, v in kw.items() if k != "model_path"}
            t0 = time.perf_counter()
            engine = sfi_sglang.Engine(**kw)
            info["startup_s"] = round(time.perf_counter() - t0, 1)
            si = engine.get_server_info()
            state = si["internal_states"][0]
            info["max_total_num_tokens"] = pool = si["max_total_num_tokens"]
            if name.startswith("sfi"):
                info["memory"] = state.get("sfi", {}).get("memory")
                info["triton_attention_num_kv_splits"] = si.get("triton_attention_num_kv_splits")
            run = S.runner(engine, stream=args.stream)
            info["prefill_s"] = {}
            for n, batches in parts:
                largest = None
                if caps.get("graph_batches"):
                    # every request holds its prompt and its decoded tokens at once
                    fits = [g for g in caps["graph_batches"] if g * ctx <= pool]
                    largest = info["largest_batch"] = max(fits)
                    batches = sorted({1, min(8, largest), largest})
                prompts = [np.random.default_rng([n, max(batches), i]).integers(100, vocab, n).tolist()
                           for i in range(max(batches))]
                warm, _ = run(prompts, 1)
                info["prefill_s"][str(n)] = round(warm, 2)
                print(f"[{name}] {n}x{max(batches)}: up in {info['startup_s']} s (pool {pool} tokens), "
                      f"prefill {warm:.1f} s", flush=True)
                for batch in batches:
                    detail, _ = S.time_decode(run, prompts[:batch], args.steps, args.slow_every)
                    detail["batch"] = batch
                    keys = [(n, batch)] + ([(n, "max")] if batch == largest else [])
                    for key in keys:
                        row = rows.get(key)
                        if row is None:
                            row = rows[key] = dict(context=n, batch=key[1], step_ms={}, detail={})
                            result["rows"].append(row)
                        record_step(row, name, detail["step_ms"])
                        row["detail"][name] = detail  # the last round's
                        finish(row)
                    save()
                    print(f"[{name}] {n}x{batch}: {json.dumps(detail)}", flush=True)
                    if batch == 1 and name in args.profile_engines.split(","):
                        prof = S.profile_decode(args, engine, run, name, n, 1, prompts[:1])
                        info.setdefault("profile", {})[str(n)] = {k: prof[k] for k in ("total_us", "wall_s")}
                        print(f"[{name}] {n}x1 profile: " + json.dumps(prof)[:3000], flush=True)
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
    for row in result["rows"]:
        print("ROW " + json.dumps({k: v for k, v in row.items() if k != "detail"}), flush=True)
    save()
    print(f"wrote {out_json} in {time.perf_counter() - t_start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
