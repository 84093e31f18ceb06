"""Issue #5 item 1: real SGLang 0.5.23, dense vs SFI, decode tokens/s at long context.

One engine per call (`--engine`), through `sfi_sglang.Engine` (the product's entry point):
  dense        SGLang's triton attention backend, eager (no CUDA graphs, no overlap
               scheduler): the same server flags as SFI, which needs both off on CUDA
  dense-graph  the same with CUDA graphs and the overlap scheduler on (SGLang's default)
  sfi          the `sfi` backend; slow steps forced every --slow-every tokens
               (refresh="interval": random weights make boundaries meaningless)
Model: a Qwen3-4B config with SGLang's dummy (random) weights, bf16; the tokenizer only
serves SFI's boundary table (skip_tokenizer_init: prompts and outputs are token ids).

Decode time per step, for each CONTEXTxBATCH: the batch's prompts are prefilled once
(max_new_tokens=1, filling the radix cache); then t1 = the same request again (prefix
cached: one token of extend + the first token) and tM = with max_new_tokens=M; a decode
step is (tM - t1) / (M - 1). Batch 1 reuses the batch's first prompt (cached).

On the H200: bench/sglang_h200.sh (it unpacks SGLang and its Python dependencies, puts
the sgl_kernel stand-in in place and runs this). On a CPU (smoke test of this script):
  python bench/sglang_h200.py --shape tiny --configs 256x2 --steps 8 --engine sfi
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

SHAPES = {
    # Qwen3-4B (config.json of Qwen/Qwen3-4B; longer positions for 128K contexts)
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=49152, tie_word_embeddings=True),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


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


def engine_kwargs(args, path: str, max_tokens: int, max_batch: int) -> dict:
    kw = dict(model_path=path, load_format="dummy", skip_tokenizer_init=True,
              sampling_backend="pytorch", context_length=max_tokens, max_running_requests=max_batch,
              log_level="warning")
    import torch

    if torch.cuda.is_available():
        kw.update(dtype="bfloat16", mem_fraction_static=args.mem_fraction)
        if args.engine != "dense-graph":
            kw.update(disable_cuda_graph=True, disable_overlap_schedule=True)
        else:
            kw.update(cuda_graph_max_bs=max_batch)
    if args.engine == "sfi":
        from sfi_sglang.config import SFIConfig

        kw.update(sfi_refresh="interval", sfi_max_interval=args.slow_every,
                  sfi_min_gap=min(args.slow_every, SFIConfig().min_gap))
    else:
        kw.update(disable_sfi=True)
    return kw


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=("dense", "dense-graph", "sfi"), required=True)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-4b")
    p.add_argument("--configs", default="8192x64,32768x20,131072x5",
                   help="CONTEXTxBATCH, comma-separated; batch 1 at each context is measured too")
    p.add_argument("--steps", type=int, default=96, help="timed decode steps (M - 1)")
    p.add_argument("--slow-every", type=int, default=24)
    p.add_argument("--mem-fraction", type=float, default=0.85)
    p.add_argument("--tokenizer", default=os.environ.get("SFI_TOKENIZER_DIR", ""),
                   help="folder with tokenizer.json (default: the embedded SmolLM2's)")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)

    import numpy as np

    import sfi_sglang

    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    if not args.tokenizer:
        from sfi_sglang.model import default_model_path

        args.tokenizer = default_model_path()
    max_tokens = max(n for n, _ in configs) + args.steps + 64
    path = model_dir(args.shape, args.tokenizer, max(max_tokens, 40960))
    max_batch = max(b for _, b in configs)
    kw = engine_kwargs(args, path, max_tokens, max_batch)
    print(f"[{args.engine}] launching: {kw}", flush=True)
    t0 = time.perf_counter()
    engine = sfi_sglang.Engine(**kw)
    startup = time.perf_counter() - t0
    print(f"[{args.engine}] engine up in {startup:.0f} s", flush=True)
    vocab = SHAPES[args.shape]["vocab_size"]
    rng = np.random.default_rng(0)

    def run(prompts, new):
        sp = dict(max_new_tokens=new, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=sp)
        dt = time.perf_counter() - t
        for o in outs:
            assert len(o["output_ids"]) == new, (len(o["output_ids"]), new)
        return dt, outs

    rows = []
    try:
        for n, b in configs:
            prompts = [rng.integers(100, vocab, n).tolist() for _ in range(b)]
            warm, _ = run(prompts, 1)
            print(f"[{args.engine}] {n}x{b}: prefill {warm:.1f} s", flush=True)
            for batch in sorted({1, b}):
                ps = prompts[:batch]
                # warm-up decode past one slow step, so that no first-call compile of a
                # kernel is timed (run S4-5 timed some, section 7 of bench/NOTES.md)
                run(ps, args.slow_every + 2)
                t1, _ = run(ps, 1)
                tm, outs = run(ps, args.steps + 1)
                step_ms = 1e3 * (tm - t1) / args.steps
                sfi = [o["meta_info"].get("sfi") or {} for o in outs]
                slow = sum(s.get("slow_steps", 0) for s in sfi)
                fast = sum(s.get("fast_steps", 0) for s in sfi)
                row = dict(context=n, batch=batch, step_ms=round(step_ms, 3),
                           tokens_per_s=round(batch * 1e3 / step_ms, 1), t1_s=round(t1, 3),
                           tm_s=round(tm, 3), prefill_s=round(warm, 2), slow_steps=slow, fast_steps=fast)
                rows.append(row)
                print(f"[{args.engine}] {json.dumps(row)}", flush=True)
    finally:
        engine.shutdown()
    os.makedirs(args.out, exist_ok=True)
    result = dict(engine=args.engine, shape=args.shape, steps=args.steps, slow_every=args.slow_every,
                  startup_s=round(startup, 1), launch=kw, rows=rows, argv=sys.argv[1:])
    with open(os.path.join(args.out, f"sglang_{args.engine}.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
