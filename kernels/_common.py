"""Shared helpers for the SFI Triton kernels (Triton online softmax, split-K reduce)."""

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1."""
    return t.is_cuda or interpret_mode()


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


# --enable-deterministic-inference on a GPU (set by sfi_sglang.integration.hooks): split-K counts are
# chosen as for a batch of one, so that a row's reduction order, and with it the bits of its
# output, do not depend on how many rows share its launch (each kernel cuts a row's own length
# into that many chunks). Outside the mode the count fills the GPU for the batch at hand.
BATCH_INVARIANT = False


def set_batch_invariant(on: bool) -> None:
    """Turn the batch-invariant split choice on or off (exported as sfi_sglang.kernels.set_batch_invariant)."""
    global BATCH_INVARIANT
    BATCH_INVARIANT = bool(on)


def split_programs(rows: int, heads: int) -> int:
    """The program count a split-K choice plans for: rows x heads, or heads alone in the
    batch-invariant mode."""
    return heads if BATCH_INVARIANT else rows * heads


def choose_num_splits(programs: int, max_len: int, block_n: int, device: torch.device,
                      min_blocks_per_split: int = 2, max_splits: int = 64,
                      programs_per_sm: int = 2, one_wave: bool = False) -> int:
    """Flash-decoding split count: aim for `programs_per_sm` programs per SM in total
    (rounded down when `one_wave`, so that every program is resident at once), keeping at
    least `min_blocks_per_split` BLOCK_N tiles of work per split."""
    sms = num_sms(device)
    target = programs_per_sm * sms
    if one_wave:
        s = target // max(1, programs)
    else:
        s = triton.cdiv(target, max(1, programs))
    max_by_work = max(1, triton.cdiv(max(1, max_len), block_n) // min_blocks_per_split)
    return int(max(1, min(s, max_by_work, max_splits)))


@triton.jit
def _memory_row(Row_of, pool, ROW_OF: tl.constexpr):
    """The memory row holding pool slot `pool`'s sparse memory (int64): Row_of[pool] under
    memory rows (SparseMemory's `rows`), else the slot itself."""
    if ROW_OF:
        return tl.load(Row_of + pool).to(tl.int64)
    else:
        return pool


@triton.jit
def _online_update(q, k, v, mask_n, m_i, l_i, acc, qk_scale_log2, IEEE: tl.constexpr):
    """One tile of online softmax in the log2 domain. Returns (m, l, acc, qk_log2). K and
    V in another dtype than q (an fp8 KV cache, unit scales) are read in q's."""
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = qk * qk_scale_log2
    qk = tl.where(mask_n[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # a tile masked whole before any valid key (holes at a split's start) leaves m at -inf:
    # shift by 0 there, so the softmax stays empty (alpha = p = 0) instead of NaN
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc, qk


@triton.jit
def _write_result(Out, Mid_o, Mid_lse, b, s, hq, mask_g, offs_d, mask_d, m_i, l_i, acc,
                  stride_ob, stride_oh, n_q, num_splits, D: tl.constexpr):
    """One split's result: straight to Out when there is one split, else to the
    partials (see split_partials), whose offsets the kernel computes from num_splits."""
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    mask = mask_g[:, None] & mask_d[None, :]
    if num_splits == 1:
        tl.store(Out + b * stride_ob + hq[:, None] * stride_oh + offs_d[None, :],
                 o.to(Out.dtype.element_ty), mask=mask)
    else:
        part = (b * n_q + hq) * num_splits + s  # [BLOCK_G]
        tl.store(Mid_o + part[:, None] * D + offs_d[None, :], o, mask=mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(Mid_lse + part, lse, mask=mask_g)


@triton.jit
def _merge_partials(Mid_o, Mid_lse, part, mask_s, offs_d, mask_d, D: tl.constexpr):
    """One query head's split-K merge from its partials at offsets `part` [BLOCK_S] (every
    split's loaded at once; .cg: written by other programs of the same launch in the fused
    merge). Returns (out [BLOCK_D] float32, m, den): its LSE in base 2 is m + log2(den)."""
    lse = tl.load(Mid_lse + part, mask=mask_s, other=float("-inf"), cache_modifier=".cg")
    o = tl.load(Mid_o + part[:, None] * D + offs_d[None, :], mask=mask_s[:, None] & mask_d[None, :],
                other=0.0, cache_modifier=".cg")
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    den = tl.sum(w, 0)
    return tl.sum(o * w[:, None], 0) / tl.where(den > 0, den, 1.0), m, den


@triton.jit(do_not_specialize=["num_splits"])
def _splitk_reduce_kernel(Mid_o, Mid_lse, Out, stride_ob, stride_oh, num_splits,
                          D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    hq = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    part = (b * tl.num_programs(1) + hq) * num_splits + offs_s
    res, _m, _den = _merge_partials(Mid_o, Mid_lse, part, offs_s < num_splits, offs_d, mask_d, D)
    tl.store(Out + b * stride_ob + hq * stride_oh + offs_d, res.to(Out.dtype.element_ty), mask=mask_d)


# Split counts and compiled variants. A flash-decoding kernel's split count follows the
# batch size and the context length, so it never is a constexpr here: it is the grid's
# last dimension (tl.num_programs in the kernel), the partials are contiguous with
# offsets computed in the kernel, and the reduce's BLOCK_S is fixed per call site. A new
# batch size or context length then launches an already compiled kernel; as constexprs,
# each new split count built a new variant at its first step (bench/NOTES.md, section 6).
def split_partials(B: int, Hq: int, D: int, num_splits: int, device):
    """Flash-decoding partials: mid_o [B, H_q, S, D], mid_lse [B, H_q, S], float32."""
    return (torch.empty((B, Hq, num_splits, D), dtype=torch.float32, device=device),
            torch.empty((B, Hq, num_splits), dtype=torch.float32, device=device))


def splitk_reduce(mid_o, mid_lse, out, max_splits: int):
    """Merge split partials into out [B, H_q, D]; max_splits bounds the split count of
    the call site (BLOCK_S, a constexpr, is its power of two)."""
    B, Hq, S, D = mid_o.shape
    assert mid_o.is_contiguous() and mid_lse.is_contiguous()
    _splitk_reduce_kernel[(B, Hq)](
        mid_o, mid_lse, out, out.stride(0), out.stride(1), S,
        D=D, BLOCK_D=max(16, next_pow2(D)), BLOCK_S=max(2, next_pow2(max(S, max_splits))),
        num_warps=4 if D >= 128 else 2,
    )
    return out
