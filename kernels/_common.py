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
def _online_update(q, k, v, mask_n, m_i, l_i, acc, qk_scale_log2, IEEE: tl.constexpr):
    """One tile of online softmax in the log2 domain. Returns (m, l, acc, qk_log2)."""
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = qk * qk_scale_log2
    qk = tl.where(mask_n[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc, qk


@triton.jit
def _write_result(Out, Mid_o, Mid_lse, b, s, hq, mask_g, offs_d, mask_d, m_i, l_i, acc,
                  stride_ob, stride_oh, stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                  NUM_SPLITS: tl.constexpr):
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    mask = mask_g[:, None] & mask_d[None, :]
    if NUM_SPLITS == 1:
        tl.store(Out + b * stride_ob + hq[:, None] * stride_oh + offs_d[None, :],
                 o.to(Out.dtype.element_ty), mask=mask)
    else:
        tl.store(Mid_o + b * stride_mb + hq[:, None] * stride_mh + s * stride_ms + offs_d[None, :],
                 o, mask=mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(Mid_lse + b * stride_lb + hq * stride_lh + s, lse, mask=mask_g)


@triton.jit
def _splitk_reduce_kernel(Mid_o, Mid_lse, Out,
                          stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
                          stride_ob, stride_oh,
                          D: tl.constexpr, BLOCK_D: tl.constexpr,
                          NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    hq = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    mask_d = offs_d < D
    lse = tl.load(Mid_lse + b * stride_lb + hq * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    o = tl.load(Mid_o + b * stride_mb + hq * stride_mh + offs_s[:, None] * stride_ms + offs_d[None, :],
                mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    den = tl.sum(w, 0)
    den = tl.where(den > 0, den, 1.0)
    res = tl.sum(o * w[:, None], 0) / den
    tl.store(Out + b * stride_ob + hq * stride_oh + offs_d, res.to(Out.dtype.element_ty), mask=mask_d)


def splitk_reduce(mid_o, mid_lse, out, num_splits: int):
    B, Hq, _, D = mid_o.shape
    BLOCK_D = max(16, next_pow2(D))
    _splitk_reduce_kernel[(B, Hq)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        D=D, BLOCK_D=BLOCK_D, NUM_SPLITS=num_splits, BLOCK_S=max(2, next_pow2(num_splits)),
        num_warps=4 if D >= 128 else 2,
    )
    return out
