"""Compile, for a GPU this machine need not have, every kernel variant one SFI decode step
launches, and time each compile (bench/NOTES.md, section 6).

The variants are those of tests/test_kernels.py's launch_decode_step_kernels (every kernel
of a fast and a slow step, driven as the backend drives them over batches 1-8 and contexts
300-1500, fp32, under the Triton interpreter): one process records each launch's Triton
cache key (recorded_variants), a second one compiles each key with Triton's compiler
(`triton.compile` on an `ASTSource`) for the target given (default sm_90, the H200).

    python bench/compile_variants.py [--arch 90]
"""

import argparse
import importlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def record() -> list:
    sys.path.insert(0, str(REPO / "tests"))
    import test_kernels as T

    with T.recorded_variants() as keys:
        T.launch_decode_step_kernels()
    return [(mod, name, spec, kw) for name, v in keys.items() for mod, (spec, kw) in v]


def compile_all(variants, arch: int) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target, total, failed = GPUTarget("cuda", arch, 32), 0.0, 0
    for mod, name, spec, kw in variants:
        fn = getattr(importlib.import_module(f"sfi_sglang.kernels.{mod}"), name)
        cx = {k: v for k, v in kw if k not in ("num_warps", "num_stages")}
        opts = {k: v for k, v in kw if k in ("num_warps", "num_stages")}
        attrs = {}
        for i, (arg, (ty, sp)) in enumerate(zip(fn.arg_names, spec)):  # the positional ones
            if ty == "constexpr":  # an argument Triton specialized to a constant (== 1)
                cx[arg] = sp
            elif sp == "D":
                attrs[(i,)] = [["tt.divisibility", 16]]
        sig = {a: "constexpr" if a in cx else spec[i][0] for i, a in enumerate(fn.arg_names)}
        t = time.perf_counter()
        try:
            triton.compile(ASTSource(fn, sig, cx, attrs), target=target, options=opts)
            dt = time.perf_counter() - t
            total += dt
            print(f"{name:24s} {dt:5.2f} s", flush=True)
        except Exception as e:  # report every failure, then exit non-zero
            failed += 1
            print(f"{name:24s} FAILED: {type(e).__name__}: {str(e)[:500]}", flush=True)
    print(f"{len(variants)} variants, {failed} failed, {total:.1f} s of compiles (sm_{arch})")
    return 1 if failed else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--record", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.record:
        print(json.dumps(record()))
        return 0
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, __file__, "--record"], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"recording the launches failed:\n{r.stderr[-3000:]}")
    variants = [(m, n, [tuple(s) for s in spec], [tuple(k) for k in kw])
                for m, n, spec, kw in json.loads(r.stdout.strip().splitlines()[-1])]
    cache = tempfile.mkdtemp(prefix="sfi-compile-")  # an empty Triton cache: every compile is timed
    os.environ["TRITON_CACHE_DIR"] = cache
    try:
        return compile_all(variants, args.arch)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
