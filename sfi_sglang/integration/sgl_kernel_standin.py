"""Pure-torch stand-ins for `sgl_kernel`, put in place by `sfi_sglang._startup` when, and
only when, the real module cannot be imported.

Two cases:
- "cpu" (a machine without CUDA): the PyPI build of sgl_kernel is CUDA-only, and SGLang's
  CPU mode (SGLANG_USE_CPU_ENGINE=1) imports a few `*_cpu` ops from it at module level.
  `fill_module` provides those; ops used only by speculative decoding raise an error that
  says so; any other name is missing (AttributeError, as in a real module).
- "torch" (a CUDA machine without sglang-kernel, opt-in with SFI_SGLANG_TORCH_KERNELS=1;
  bench/sglang_h200.sh uses it on the H200, where the sglang-kernel wheel cannot go: 1.2 GB
  and pinned to another torch). SGLang's CUDA modules import about a hundred names from
  sgl_kernel at module level. With SGLANG_FORCE_FUSED_OP_BACKEND=torch, SGLang's own
  switch, its fused ops (RMSNorm, SiluAndMul, rotary, ...) run their `forward_native`, so
  the names only have to exist: `fill_module_torch` gives every name a stub that raises
  when called, naming the op, plus pure-torch versions of the few ops that SGLang calls
  directly on the Llama/Qwen3 decode path (`TORCH_OPS`). Dense and SFI runs share them all.
  Without that switch SGLang dispatches its fused ops as it does on any CUDA machine: SiLU-
  and-mul and rotary to its own JIT CUDA kernels (sglang.kernels.ops), RMSNorm to
  `sgl_kernel.rmsnorm` / `fused_add_rmsnorm`, which here run SGLang's JIT kernels for the same
  ops where they build (`_jit`), the torch forms otherwise: the decode step's non-attention
  part then runs fused kernels, as with sglang-kernel (bench/sglang_h200.sh's default).
"""

from __future__ import annotations

import ctypes
import types

import numpy as np
import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For each request i: req_to_token[req_pool_indices[i], start[i]:end[i]] = the next
    end[i]-start[i] entries of out_cache_loc (requests laid out back to back)."""
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every buffer b (a raw data pointer and its row stride in bytes), copy row
    src_loc[j] to row tgt_loc[j] for all j, reading all sources before writing (safe when
    source and target rows overlap, like SGLang's Triton kernel)."""
    if tgt_loc.numel() == 0:
        return
    src = src_loc.to(torch.int64).numpy()
    tgt = tgt_loc.to(torch.int64).numpy()
    rows = int(max(src.max(), tgt.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        buf = (ctypes.c_uint8 * (rows * stride)).from_address(ptr)
        view = np.frombuffer(buf, dtype=np.uint8).reshape(rows, stride)
        view[tgt] = view[src]


SPECULATIVE_OPS = (
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
)


def _speculative_op(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: speculative decoding is not supported on the CPU engine "
            "without sgl-kernel's CPU build; launch without --speculative-algorithm."
        )

    op.__name__ = name
    return op


def fill_module(module: types.ModuleType, reason: str) -> None:
    """Make `module` (the half-imported `sgl_kernel`) a CPU stand-in."""
    module.assign_req_to_token_pool_cpu = assign_req_to_token_pool_cpu
    module.copy_all_layer_kv_cache_cpu = copy_all_layer_kv_cache_cpu
    for name in SPECULATIVE_OPS:
        setattr(module, name, _speculative_op(name))
    module.SFI_CPU_FALLBACK = reason

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"sgl_kernel.{name} is not available: {reason}; sfi-sglang provides only the "
            "ops of SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1)."
        )

    module.__getattr__ = __getattr__


# ---------------------------------------------------------------- CUDA without sgl_kernel
# (op, hidden size, dtype) -> the SGLang JIT kernel the stand-in built and runs, or None (the torch form)
JIT_KERNELS: dict = {}


def _jit(op: str, x: torch.Tensor):
    """SGLang's own JIT CUDA kernel for `op` of sglang.kernels.ops.layernorm.norm at x's
    hidden size and dtype, built (and checked against the torch form on two rows) at its first
    use, which SGLang makes before any graph capture; None off CUDA or where it does not
    build or agree: the torch form then runs."""
    if not x.is_cuda:
        return None
    key = (op, x.shape[-1], x.dtype)
    if key not in JIT_KERNELS:
        JIT_KERNELS[key] = None
        try:
            from sglang.kernels.ops.layernorm import norm

            fn = getattr(norm, op)
            t = torch.randn(2, x.shape[-1], device=x.device, dtype=x.dtype)
            w = torch.randn(x.shape[-1], device=x.device, dtype=x.dtype)
            if op == "rmsnorm":
                got = torch.empty_like(t)
                fn(t, w, got, 1e-6)
            else:
                res = t.flip(0).clone()
                got = t.clone()
                fn(got, res, w, 1e-6)
            want = torch_rmsnorm(t + t.flip(0) if op != "rmsnorm" else t, w, 1e-6)
            if torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
                JIT_KERNELS[key] = fn
        except Exception as e:  # no JIT toolchain, an unsupported size: the torch form
            import logging

            logging.getLogger(__name__).warning("sgl_kernel stand-in: SGLang's JIT %s at %s: %s; "
                                                "the torch form runs", op, key[1:], e)
    return JIT_KERNELS[key]


def torch_rmsnorm(input, weight, eps):
    x = input.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(input.dtype)


def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    jit = _jit("rmsnorm", input)
    if jit is not None:
        out = out if out is not None else torch.empty_like(input)
        jit(input, weight, out, eps)
        return out
    y = torch_rmsnorm(input, weight, eps)
    if out is None:
        return y
    out.copy_(y)
    return out


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    """In place, like sgl_kernel: residual += input; input = rmsnorm(residual)."""
    jit = _jit("fused_add_rmsnorm", input)
    if jit is not None:
        jit(input, residual, weight, eps)
        return
    residual.add_(input)
    input.copy_(rmsnorm(residual, weight, eps))


def gemma_rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    return rmsnorm(input, weight.float() + 1.0, eps, out)


def gemma_fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    residual.add_(input)
    input.copy_(gemma_rmsnorm(residual, weight, eps))


def _act_and_mul(act, input, out):
    d = input.shape[-1] // 2
    y = act(input[..., :d].float()).mul_(input[..., d:].float()).to(input.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def silu_and_mul(input, out=None, enable_pdl=None):
    return _act_and_mul(torch.nn.functional.silu, input, out)


def gelu_and_mul(input, out=None, enable_pdl=None):
    return _act_and_mul(torch.nn.functional.gelu, input, out)


def gelu_tanh_and_mul(input, out=None, enable_pdl=None):
    return _act_and_mul(lambda x: torch.nn.functional.gelu(x, approximate="tanh"), input, out)


def weak_ref_tensor(tensor):
    """sgl_kernel's version aliases the storage without owning it (CUDA-graph outputs);
    this one keeps the tensor alive, which costs memory the graph pool holds anyway."""
    return tensor


def is_arch_support_pdl() -> bool:
    """sgl_kernel.utils' check, the same logic: programmatic dependent launch from SM90 on
    (SGLang's triton attention backend passes it to its kernels)."""
    try:
        major, _ = torch.cuda.get_device_capability(torch.cuda.current_device())
    except Exception:
        return False
    return major >= 9


# module -> the names it gets as functions (every other name: a stub that raises when called)
TORCH_OPS = {
    "sgl_kernel": {f.__name__: f for f in (rmsnorm, fused_add_rmsnorm, gemma_rmsnorm,
                                           gemma_fused_add_rmsnorm, silu_and_mul, gelu_and_mul,
                                           gelu_tanh_and_mul, weak_ref_tensor)},
    "sgl_kernel.utils": {"is_arch_support_pdl": is_arch_support_pdl},
}


# Submodules SGLang imports under try/except ImportError with a fallback of its own
# (sgl_kernel.scalar_type: plain data, mocked by sglang.srt.layers.quantization.utils):
# these stay missing so that the fallback runs.
NO_STANDIN_SUBMODULES = frozenset({"scalar_type"})


def _missing_op(qualname: str, reason: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"{qualname} has no pure-torch stand-in ({reason}); install sglang-kernel, or run "
            "with SGLANG_FORCE_FUSED_OP_BACKEND=torch and options that avoid this op.")

    op.__name__ = qualname.rsplit(".", 1)[-1]
    return op


def fill_module_torch(module: types.ModuleType, reason: str) -> None:
    """Make `module` (the half-imported `sgl_kernel`, or a submodule) the CUDA stand-in."""
    for name, fn in TORCH_OPS.get(module.__name__, {}).items():
        setattr(module, name, fn)
    module.SFI_TORCH_STANDIN = reason
    # a package whose submodules are stand-ins (sfi_sglang._startup), also where a broken
    # real package lies on disk
    module.__path__ = []

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        op = _missing_op(f"{module.__name__}.{name}", reason)
        setattr(module, name, op)
        return op

    module.__getattr__ = __getattr__
