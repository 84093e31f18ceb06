"""Cached key norms ||k_j|| (the pool's dtype: bfloat16) per KV slot and KV head, written when K is written;
the Selector's structural prior reads them (log pi_j = -g log ||k_j||)."""

import torch
import triton
import triton.language as tl

from ._common import next_pow2, use_triton


@triton.jit
def _key_norms_kernel(K, Cache_loc, Norms, stride_kt, stride_kh, stride_ns, H,
                      D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    loc = tl.load(Cache_loc + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mh = offs_h < H
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
                mask=mh[:, None] & (offs_d < D)[None, :], other=0.0).to(tl.float32)
    n = tl.sqrt(tl.sum(k * k, 1))
    tl.store(Norms + loc * stride_ns + offs_h, n.to(Norms.dtype.element_ty), mask=mh)


def store_key_norms(k, cache_loc, norms_pool):
    """norms_pool[cache_loc[t], h] = ||k[t, h, :]||_2 (computed in fp32, stored in the pool's dtype). k [T,H_kv,D]."""
    T, H, D = k.shape
    if T == 0:
        return norms_pool
    if not use_triton(k):
        from .reference import ref_store_key_norms
        return ref_store_key_norms(k, cache_loc, norms_pool)
    assert k.stride(2) == 1 and norms_pool.stride(1) == 1
    _key_norms_kernel[(T,)](k, cache_loc, norms_pool, k.stride(0), k.stride(1),
                            norms_pool.stride(0), H, D=D, BLOCK_H=next_pow2(H),
                            BLOCK_D=next_pow2(D), num_warps=1 if H * D <= 1024 else 4)
    return norms_pool
