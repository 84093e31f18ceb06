"""SFI slow-step decode: dense flash-decoding (split-K) attention over the whole history
that also writes the raw scaled logits q.k*sm_scale of every position (the Selector's
evidence) in the same pass over KV.

scores [B, H_q, N_max] float32: positions < seq_len hold the logits, positions in
[seq_len, N_max) are written as -inf by the same launch (no separate fill pass). With
score_rows [B] int32, row b's logits go to scores[score_rows[b]] and rows at -1 write none
(a decode step's few slow rows among its dense rows: scores has only their rows).
norms [B, H_kv, N_max] (optional, bfloat16): the key norms ||k_j|| of positions < seq_len
(the Selector's structural prior), from the keys the pass reads anyway; the tail is not
written (the Selector reads candidates only), so no copy of the norms lives beside the pool.
Extra bytes: scores write = G*4 bytes per (token, KV head) and a norm 2 bytes against 2*D*elt
bytes of K+V read, i.e. 18 vs 512 bytes (3.5%) at G=4, D=128, bf16.
"""

import torch
import triton
import triton.language as tl

from ._common import (LOG2E, _online_update, _write_result, choose_num_splits, next_pow2, split_programs,
                      split_partials, splitk_reduce, use_triton)

MAX_SPLITS = 128


@triton.jit
def _dense_scores_kernel(
    Q, K_cache, V_cache, Req_to_token, Req_pool_indices, Seq_lens, qk_scale_log2,
    Out, Mid_o, Mid_lse, Scores, Score_rows, Norms,
    stride_qb, stride_qh,
    stride_kcs, stride_kch, stride_vcs, stride_vch,
    stride_rt,
    stride_ob, stride_oh,
    stride_sb, stride_sh, N_max, stride_nb, stride_nh,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, IEEE: tl.constexpr, WRITE_SCORES: tl.constexpr, ROW_MAP: tl.constexpr,
    WRITE_NORMS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    n_kv = tl.num_programs(1)
    num_splits = tl.num_programs(2)

    pool = tl.load(Req_pool_indices + b).to(tl.int64)
    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = s * chunk
    end = tl.minimum(start + chunk, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_nb = tl.arange(0, BLOCK_N)
    mask_g = offs_g < G
    mask_d = offs_d < D
    hq = h * G + offs_g
    q = tl.load(Q + b * stride_qb + hq[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)

    rt_base = Req_to_token + pool * stride_rt
    if ROW_MAP:
        srow = tl.load(Score_rows + b).to(tl.int64)
    else:
        srow = b.to(tl.int64)
    mask_s = mask_g & (srow >= 0)  # the heads whose logits this program writes
    sc_base = Scores + tl.maximum(srow, 0) * stride_sb + hq[:, None] * stride_sh
    nm_base = Norms + tl.maximum(srow, 0) * stride_nb + h * stride_nh
    inv_log2e = 1.0 / 1.4426950408889634
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + offs_nb
        mask_n = offs_n < end
        slot = tl.load(rt_base + offs_n, mask=mask_n, other=0).to(tl.int64)
        mkd = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K_cache + slot[:, None] * stride_kcs + h * stride_kch + offs_d[None, :],
                    mask=mkd, other=0.0)
        v = tl.load(V_cache + slot[:, None] * stride_vcs + h * stride_vch + offs_d[None, :],
                    mask=mkd, other=0.0)
        m_i, l_i, acc, qk = _online_update(q, k, v, mask_n, m_i, l_i, acc, qk_scale_log2, IEEE)
        if WRITE_SCORES:
            tl.store(sc_base + offs_n[None, :], qk * inv_log2e,
                     mask=mask_s[:, None] & mask_n[None, :])
        if WRITE_NORMS:
            if srow >= 0:  # a row that keeps no logits computes no norms (bench/NOTES.md 58)
                kf = k.to(tl.float32)
                tl.store(nm_base + offs_n, tl.sqrt(tl.sum(kf * kf, 1)).to(Norms.dtype.element_ty),
                         mask=mask_n)

    if WRITE_SCORES:
        # Tail [seq_len, N_max) -> -inf, split evenly over the num_splits programs (none
        # for a row without a score row: no loop over N_max of masked stores)
        tail = tl.where(srow >= 0, tl.maximum(N_max - seq_len, 0), 0)
        tchunk = tl.cdiv(tl.cdiv(tail, num_splits), BLOCK_N) * BLOCK_N
        t_lo = seq_len + s * tchunk
        t_hi = tl.minimum(t_lo + tchunk, N_max)
        neg = tl.full([BLOCK_G, BLOCK_N], float("-inf"), dtype=tl.float32)
        for n0 in range(t_lo, t_hi, BLOCK_N):
            offs_n = n0 + offs_nb
            tl.store(sc_base + offs_n[None, :], neg,
                     mask=mask_s[:, None] & (offs_n < t_hi)[None, :])

    _write_result(Out, Mid_o, Mid_lse, b, s, hq, mask_g, offs_d, mask_d, m_i, l_i, acc,
                  stride_ob, stride_oh, n_kv * G, num_splits, D)


def _dense_launch(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, sm_scale,
                  out, scores, write_scores, num_splits, max_len, block_n, num_warps, num_stages,
                  score_rows=None, norms=None):
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    BLOCK_N = block_n or 64
    if num_splits is None:
        # H200, 128K B=8, with scores: 16 splits 1062 us, 8: 1079, 5: 1197-1211, 17: 1245
        # (bench/NOTES.md): ~8 programs per SM, rounded down to a power of two.
        num_splits = choose_num_splits(split_programs(B, Hkv), max_len, BLOCK_N, q.device,
                                       min_blocks_per_split=4, max_splits=MAX_SPLITS, programs_per_sm=8)
        num_splits = 1 << (num_splits.bit_length() - 1)
    BLOCK_G = max(16, next_pow2(G))
    BLOCK_D = max(16, next_pow2(D))
    ieee = q.dtype == torch.float32
    mid_o, mid_lse = split_partials(B, Hq, D, num_splits, q.device)
    sc = scores if write_scores else out
    nm = norms if norms is not None else out
    grid = (B, Hkv, num_splits)
    _dense_scores_kernel[grid](
        q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, float(sm_scale) * LOG2E,
        out, mid_o, mid_lse, sc, score_rows if score_rows is not None else seq_lens, nm,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0),
        out.stride(0), out.stride(1),
        sc.stride(0) if write_scores else 0, sc.stride(1) if write_scores else 0,
        scores.shape[2] if write_scores else 0,
        nm.stride(0) if norms is not None else 0, nm.stride(1) if norms is not None else 0,
        G=G, BLOCK_G=BLOCK_G, D=D, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
        IEEE=ieee, WRITE_SCORES=write_scores, ROW_MAP=score_rows is not None,
        WRITE_NORMS=norms is not None,
        num_warps=num_warps or 4, num_stages=num_stages or 2,
    )
    if num_splits > 1:
        splitk_reduce(mid_o, mid_lse, out, MAX_SPLITS)
    return out


def dense_decode_with_scores(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                             sm_scale, scores_out=None, out=None, num_splits=None, max_len=None,
                             block_n=None, num_warps=None, num_stages=None, score_rows=None,
                             norms_out=None):
    """Dense decode attention + raw scaled logits. Returns (out [B,H_q,D], scores
    [B,H_q,N_max] float32). N_max = scores_out.shape[2] if given, else max_len if given,
    else max(seq_lens) (a host sync; slow steps run eagerly). score_rows [B] int32
    (needs scores_out): row b's logits at scores_out[score_rows[b]], none where -1.
    norms_out [rows, H_kv, >= N] (optional, last dim contiguous): the key norms of each
    row's positions < seq_len, in the same rows as its logits."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    assert Hq % Hkv == 0
    if out is None:
        out = torch.empty_like(q)
    assert score_rows is None or scores_out is not None, "score_rows needs scores_out"
    if scores_out is None:
        n_max = max_len if max_len is not None else (int(seq_lens.max()) if B > 0 else 0)
        scores_out = torch.empty((B, Hq, n_max), dtype=torch.float32, device=q.device)
    assert scores_out.dtype == torch.float32 and scores_out.stride(2) == 1
    if B == 0:
        return out, scores_out
    if not use_triton(q):
        from .reference import ref_dense_decode_with_scores
        return ref_dense_decode_with_scores(q, k_cache, v_cache, req_to_token, req_pool_indices,
                                            seq_lens, sm_scale, scores_out=scores_out, out=out,
                                            score_rows=score_rows, norms_out=norms_out)
    if max_len is None:
        max_len = scores_out.shape[2]
    _dense_launch(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, sm_scale,
                  out, scores_out, True, num_splits, max_len, block_n, num_warps, num_stages, score_rows,
                  norms_out)
    return out, scores_out


def dense_decode(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, sm_scale,
                 out=None, num_splits=None, max_len=None, block_n=None, num_warps=None,
                 num_stages=None):
    """Same kernel without the score write (used by the benchmark to price the scores)."""
    if out is None:
        out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    if max_len is None:
        max_len = int(seq_lens.max())
    return _dense_launch(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, sm_scale,
                         out, None, False, num_splits, max_len, block_n, num_warps, num_stages)
