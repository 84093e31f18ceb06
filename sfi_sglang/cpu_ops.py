"""Pure-torch versions of the `sgl_kernel` CPU ops that SGLang's CPU engine imports.

The PyPI build of sgl_kernel is CUDA-only; SGLang's CPU mode (SGLANG_USE_CPU_ENGINE=1)
imports a few `*_cpu` ops from it at module level. `sfi_sglang._startup` puts these into
the `sgl_kernel` module when, and only when, the real one cannot be imported on a machine
without CUDA. Ops used only by speculative decoding raise an error that says so.
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
