"""On the GPU, under sgl_kernel's torch stand-in: SGLang's fused ops of a Qwen3-4B decode
step in their torch forms against SGLang's JIT CUDA kernels for them (what
bench/sglang_h200.sh runs by default), each against a float64 reference on random
inputs, and timed (kernels_h200.bench_graph: a CUDA graph of many calls, the median
replay) at batch 1 and 8.
Writes OUT/fused_ops_h200.json.
    source bench/sglang_h200.sh; device_env ops; python3 bench/fused_ops_h200.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from kernels_h200 import bench_graph  # bench/, this script's folder


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = p.parse_args()
    import sgl_kernel  # the stand-in (SFI_SGLANG_TORCH_KERNELS=1)
    from sglang.kernels.ops.activation import SiluAndMulOp

    from sfi_sglang.integration import sgl_kernel_standin as standin

    assert getattr(sgl_kernel, "SFI_TORCH_STANDIN", None), "run under sgl_kernel's torch stand-in"
    dev, dt, hidden, inter, eps = "cuda", torch.bfloat16, 2560, 9728, 1e-6
    res = {"device": torch.cuda.get_device_name(), "rows": []}
    silu = SiluAndMulOp()
    for b in (1, 8):
        g = torch.Generator(device=dev).manual_seed(b)
        x = torch.randn(b, hidden, device=dev, dtype=dt, generator=g)
        r = torch.randn(b, hidden, device=dev, dtype=dt, generator=g)
        w = torch.randn(hidden, device=dev, dtype=dt, generator=g)
        h = torch.randn(b, 2 * inter, device=dev, dtype=dt, generator=g)

        def ref_norm(v):
            v = v.double()
            return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w.double()

        out = torch.empty_like(x)
        xs, rs = x.clone(), r.clone()

        def jit_norm():
            sgl_kernel.rmsnorm(x, w, eps, out)

        def torch_norm():
            out.copy_(standin.torch_rmsnorm(x, w, eps))

        def jit_add():
            xs.copy_(x)
            rs.copy_(r)
            sgl_kernel.fused_add_rmsnorm(xs, rs, w, eps)

        def torch_add():
            xs.copy_(x)
            rs.copy_(r)
            rs.add_(xs)
            xs.copy_(standin.torch_rmsnorm(rs, w, eps))

        so = torch.empty(b, inter, device=dev, dtype=dt)
        ops = {
            "rmsnorm": (jit_norm, torch_norm, lambda: out, lambda: ref_norm(x)),
            "fused_add_rmsnorm": (jit_add, torch_add, lambda: xs, lambda: ref_norm(x.double() + r.double())),
            "silu_and_mul": (lambda: silu.forward_jit(h, so), lambda: silu.forward_native(h, so), lambda: so,
                             lambda: torch.nn.functional.silu(h[:, :inter].double()) * h[:, inter:].double()),
        }
        for name, (cuda_fn, torch_fn, got, want) in ops.items():
            row = dict(op=name, batch=b)
            for kind, fn in (("cuda", cuda_fn), ("torch", torch_fn)):
                fn()
                torch.cuda.synchronize()
                row[f"{kind}_max_err"] = float((got().double() - want()).abs().max())
                row[f"{kind}_us"] = round(bench_graph([fn], 0.005)[0] * 1e3, 2)
            # after the first call, which builds the stand-in's kernel (SiLU-and-mul: SGLang's own)
            row["jit_loaded"] = bool(standin.JIT_KERNELS.get((name, hidden, dt))) if name != "silu_and_mul" else True
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fused_ops_h200.json"), "w") as f:
        json.dump(res, f, indent=1)
    ok = all(r["cuda_max_err"] <= 2 * r["torch_max_err"] + 0.05 for r in res["rows"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
