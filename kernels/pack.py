"""SFI re-packing: copy the selected tokens' K/V (per KV head) into the contiguous
packed buffers at [req_pool_indices[i], h, :, :].

positions [b, H_kv, P] int: token positions per entry, -1 = unused. Valid entries must
form a prefix (packed_len counts them); entries with -1 are left untouched. One program
per (request, KV head, block of entries), vectorized over D; writes are contiguous rows.
"""

import triton
import triton.language as tl

from ._common import _memory_row, next_pow2, use_triton


@triton.jit
def _pack_kernel(
    K_cache, V_cache, Req_to_token, Req_pool_indices, Positions, Packed_k, Packed_v,
    stride_kcs, stride_kch, stride_vcs, stride_vch, stride_rt,
    stride_pob, stride_poh,
    stride_pkr, stride_pkh, stride_pkp,
    stride_pvr, stride_pvh, stride_pvp,
    P,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    pool = tl.load(Req_pool_indices + i).to(tl.int64)
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    mask_p = offs_p < P
    mask_d = offs_d < D
    pos = tl.load(Positions + i * stride_pob + h * stride_poh + offs_p, mask=mask_p, other=-1)
    valid = mask_p & (pos >= 0)
    slot = tl.load(Req_to_token + pool * stride_rt + pos, mask=valid, other=0).to(tl.int64)
    m = valid[:, None] & mask_d[None, :]
    k = tl.load(K_cache + slot[:, None] * stride_kcs + h * stride_kch + offs_d[None, :], mask=m)
    v = tl.load(V_cache + slot[:, None] * stride_vcs + h * stride_vch + offs_d[None, :], mask=m)
    tl.store(Packed_k + pool * stride_pkr + h * stride_pkh + offs_p[:, None] * stride_pkp
             + offs_d[None, :], k.to(Packed_k.dtype.element_ty), mask=m)
    tl.store(Packed_v + pool * stride_pvr + h * stride_pvh + offs_p[:, None] * stride_pvp
             + offs_d[None, :], v.to(Packed_v.dtype.element_ty), mask=m)


def pack(k_cache, v_cache, req_to_token, req_pool_indices, positions, packed_k, packed_v,
         block_p=None, num_warps=None):
    """Copy K/V of `positions` [b,H_kv,P'] (P' <= P, -1 unused) into packed_k/packed_v
    [max_reqs,H_kv,P,D] at pool slots req_pool_indices[b]. Returns (packed_k, packed_v)."""
    nb, Hkv, Pp = positions.shape
    D = k_cache.shape[2]
    assert Pp <= packed_k.shape[2] and Hkv == k_cache.shape[1]
    if nb == 0 or Pp == 0:
        return packed_k, packed_v
    if not use_triton(k_cache):
        from .reference import ref_pack
        return ref_pack(k_cache, v_cache, req_to_token, req_pool_indices, positions,
                        packed_k, packed_v)
    assert positions.stride(2) == 1 and k_cache.stride(2) == 1 and packed_k.stride(3) == 1
    BLOCK_D = max(16, next_pow2(D))
    BLOCK_P = block_p or max(16, min(128, 8192 // BLOCK_D))
    grid = (nb, Hkv, triton.cdiv(Pp, BLOCK_P))
    _pack_kernel[grid](
        k_cache, v_cache, req_to_token, req_pool_indices, positions, packed_k, packed_v,
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0),
        positions.stride(0), positions.stride(1),
        packed_k.stride(0), packed_k.stride(1), packed_k.stride(2),
        packed_v.stride(0), packed_v.stride(1), packed_v.stride(2),
        Pp, D=D, BLOCK_D=BLOCK_D, BLOCK_P=BLOCK_P, num_warps=num_warps or 4,
    )
    return packed_k, packed_v


@triton.jit
def _store_kernel(
    K_cache, V_cache, Req_to_token, Slots, Rows, Positions, Cnt, Ws, Seq_lens, Row_of,
    Sel_pos, Sel_count, Win_start, N_sinks, Fast_ws, Packed_len, Packed_k, Packed_v,
    stride_kcs, stride_kch, stride_vcs, stride_vch, stride_rt,
    stride_pob, stride_poh, stride_spm, stride_sph,
    stride_pkr, stride_pkh, stride_pkp, stride_pvr, stride_pvh, stride_pvp,
    KP, S: tl.constexpr, K: tl.constexpr,
    HAS_ROWS: tl.constexpr, HAS_LENS: tl.constexpr, PACK: tl.constexpr, ROW_OF: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    pb = tl.program_id(2)
    keep = True
    if HAS_ROWS:
        keep = tl.load(Rows + i) != 0
    if keep:
        pool = tl.load(Slots + i).to(tl.int64)
        mrow = _memory_row(Row_of, pool, ROW_OF)  # Sel_pos and the packed buffers; the rest by slot
        cnt = tl.load(Cnt + i).to(tl.int32)
        if HAS_LENS:
            ns = tl.minimum(tl.load(Seq_lens + i), S).to(tl.int32)
        else:
            ns = tl.full([], S, tl.int32)
        offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)  # packed entry: sinks [0, S), then selected
        k = offs_p - S
        in_k = (k >= 0) & (k < K)
        sel = tl.load(Positions + i * stride_pob + h * stride_poh + k, mask=in_k & (k < KP), other=-1)
        sel = tl.where(k < cnt, sel, -1).to(tl.int32)
        tl.store(Sel_pos + mrow * stride_spm + h * stride_sph + k, sel, mask=in_k)
        if PACK:
            pos = tl.where(offs_p < S, tl.where(offs_p < ns, offs_p, -1), sel)
            offs_d = tl.arange(0, BLOCK_D)
            valid = (offs_p < S + K) & (pos >= 0)
            slot = tl.load(Req_to_token + pool * stride_rt + pos, mask=valid, other=0).to(tl.int64)
            m = valid[:, None] & (offs_d < D)[None, :]
            kk = tl.load(K_cache + slot[:, None] * stride_kcs + h * stride_kch + offs_d[None, :], mask=m)
            vv = tl.load(V_cache + slot[:, None] * stride_vcs + h * stride_vch + offs_d[None, :], mask=m)
            tl.store(Packed_k + mrow * stride_pkr + h * stride_pkh + offs_p[:, None] * stride_pkp
                     + offs_d[None, :], kk.to(Packed_k.dtype.element_ty), mask=m)
            tl.store(Packed_v + mrow * stride_pvr + h * stride_pvh + offs_p[:, None] * stride_pvp
                     + offs_d[None, :], vv.to(Packed_v.dtype.element_ty), mask=m)
        if (h == 0) & (pb == 0):
            ws = tl.load(Ws + i).to(tl.int64)
            tl.store(Sel_count + pool, cnt)
            tl.store(Win_start + pool, ws)
            tl.store(N_sinks + pool, ns)
            tl.store(Fast_ws + pool, tl.where(ns < S, ns.to(tl.int64), tl.maximum(ws, S)))
            tl.store(Packed_len + pool, ns + cnt)


def store_selection(k_cache, v_cache, req_to_token, slots, positions, sel_count, win_start,
                    seq_lens, rows, sinks, sel_pos, sel_count_buf, win_start_buf, n_sinks_buf,
                    fast_ws_buf, packed_len, packed_k, packed_v, num_warps=None, row_of=None):
    """A slow step's record of one layer in one launch (SparseMemory.store's packed path):
    for each row i of `slots` [b] (int64; only where rows [b] bool holds, if given):
      sel_pos[slot, h, :]  = positions[i, h, :sel_count[i]] then -1 (positions [b, H, K'],
                             K' <= K, any int dtype),
      packed[slot, h, :]   = K/V of the sinks [0, min(seq_len, S)) then of those positions
                             (packed_k None: nothing packed, the "triton-pool" fast path),
      sel_count, win_start, n_sinks = min(seq_len, S) (S without seq_lens), fast_ws
      (= n_sinks if < S else max(win_start, S)), packed_len = n_sinks + sel_count.
    sel_count [b], win_start [b], seq_lens [b] or None: device int tensors. row_of [slots]
    int32, optional: sel_pos and the packed buffers hold slot p's memory at row row_of[p].
    No host sync."""
    b, H, KP = positions.shape
    if b == 0:
        return
    D = k_cache.shape[2]
    K = sel_pos.shape[-1]
    assert KP <= K and sel_pos.stride(-1) == 1 and positions.stride(2) == 1
    BLOCK_D = max(16, next_pow2(D))
    BLOCK_P = max(16, min(128, 8192 // BLOCK_D))
    grid = (b, H, triton.cdiv(sinks + K, BLOCK_P))
    pack = packed_k is not None
    pk_strides = (packed_k.stride(0), packed_k.stride(1), packed_k.stride(2)) if pack else (0, 0, 0)
    pv_strides = (packed_v.stride(0), packed_v.stride(1), packed_v.stride(2)) if pack else (0, 0, 0)
    _store_kernel[grid](
        k_cache, v_cache, req_to_token, slots, rows if rows is not None else slots, positions,
        sel_count, win_start, seq_lens if seq_lens is not None else slots,
        row_of if row_of is not None else slots, sel_pos, sel_count_buf, win_start_buf, n_sinks_buf, fast_ws_buf, packed_len,
        packed_k if pack else k_cache, packed_v if pack else v_cache,
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0), positions.stride(0), positions.stride(1),
        sel_pos.stride(0), sel_pos.stride(1), *pk_strides, *pv_strides,
        KP, S=int(sinks), K=K, HAS_ROWS=rows is not None, HAS_LENS=seq_lens is not None, PACK=pack,
        ROW_OF=row_of is not None,
        D=D, BLOCK_D=BLOCK_D, BLOCK_P=BLOCK_P, num_warps=num_warps or 4,
    )
