"""SFI fast-step decode attention (one launch + split-K reduce).

Each program handles one (request, KV head, split). It loads the whole GQA group of
queries once, then streams a *virtual* sequence made of

  [0, packed_len)                 the packed sinks + selected tokens, contiguous in
                                  packed_k/packed_v[pool, h, :, :]; or, with sel_pos
                                  (the "triton-pool" fast path, nothing packed), the
                                  sinks [0, n_sinks) then sel_pos[pool, h, :], read in
                                  place through req_to_token
  [packed_len, + E)               with extra_pages only: the top-up's E positions
                                  (kernels.topup's pages), read in place
  [.., .. + Lw)                   the recent window, positions [win_start, seq_len),
                                  read in place through req_to_token

with one online softmax over all. Splits cut the virtual sequence into equal chunks
(per request, so ragged lengths balance), and a small reduce kernel merges them.

Index conventions:
  req_pool_indices [B]   request pool slot of each batch row
  seq_lens         [B]   context length incl. the current token (its KV already written)
  win_start        [B]   first window position of each batch row (per batch row, like
                         seq_lens; gather it from per-pool state with req_pool_indices)
  packed_len  [max_reqs] valid packed entries, indexed by pool slot (like packed_k)
"""

import math

import torch
import triton
import triton.language as tl

from ._common import (LOG2E, _memory_row, _merge_partials, _online_update, _write_result, choose_num_splits, next_pow2,
                      split_programs, split_partials, splitk_reduce, use_triton)

LN2 = tl.constexpr(math.log(2.0))

# Defaults from the H200 sweep (bench/NOTES.md, bench/results/kernels_h200_tune.json):
# BLOCK_N 64, 3 pipeline stages, 4 warps, split-K merged in-launch, and as many splits as
# keep all programs in one wave (2 resident per SM): B=8 -> 4 splits (24.9 us, 71% of
# copy bandwidth), B=1 -> 16 (11.9 us).
FUSED_REDUCE_DEFAULT = True
BLOCK_N_DEFAULT = 64
NUM_STAGES_DEFAULT = 3
NUM_WARPS_DEFAULT = 4
MAX_SPLITS_DEFAULT = 16


@triton.jit
def _store_lse(Lse, offs, m, l, mask):
    """The natural-log LSE of an online softmax's state (m, l in base 2) at Lse[offs]
    ([B, H_q] contiguous); -inf where nothing was attended."""
    lse = tl.where(l > 0, (m + tl.log2(tl.where(l > 0, l, 1.0))) * LN2, float("-inf"))
    tl.store(Lse + offs, lse, mask=mask)


@triton.jit
def _attend_slots(q, K_cache, V_cache, slot, mask_n, mask_d, offs_d, h, stride_kcs, stride_kch, stride_vcs,
                  stride_vch, m_i, l_i, acc, qk_scale_log2, IEEE: tl.constexpr):
    """The online softmax's update with the K/V rows of pool slots `slot` [BLOCK_N] (KV head h)."""
    mkd = mask_n[:, None] & mask_d[None, :]
    k = tl.load(K_cache + slot[:, None] * stride_kcs + h * stride_kch + offs_d[None, :], mask=mkd, other=0.0)
    v = tl.load(V_cache + slot[:, None] * stride_vcs + h * stride_vch + offs_d[None, :], mask=mkd, other=0.0)
    m_i, l_i, acc, _qk = _online_update(q, k, v, mask_n, m_i, l_i, acc, qk_scale_log2, IEEE)
    return m_i, l_i, acc


@triton.jit
def _merge_splits_vector(Mid_o, Mid_lse, Out, Lse, b, h, n_kv, num_splits, offs_d, mask_d, stride_ob, stride_oh,
                         G: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, WRITE_LSE: tl.constexpr):
    """The split-K merge of KV head h's G query heads with every split's partials loaded at
    once per query head (the loop form waits for each split's loads in turn)."""
    offs_s = tl.arange(0, BLOCK_S)
    for g in tl.static_range(G):
        row = b * n_kv * G + h * G + g
        part = row * num_splits + offs_s  # as in _write_result
        res, m, den = _merge_partials(Mid_o, Mid_lse, part, offs_s < num_splits, offs_d, mask_d, D)
        tl.store(Out + b * stride_ob + (h * G + g) * stride_oh + offs_d, res.to(Out.dtype.element_ty), mask=mask_d)
        if WRITE_LSE:
            _store_lse(Lse, row, m, den, True)


@triton.jit
def _fast_decode_kernel(
    Q, K_cache, V_cache, Req_to_token, Req_pool_indices, Seq_lens, Win_start,
    Packed_k, Packed_v, Packed_len, qk_scale_log2,
    Out, Mid_o, Mid_lse, Counters, Lse, Holes, Row_of, Extra,
    stride_qb, stride_qh,
    stride_kcs, stride_kch, stride_vcs, stride_vch,
    stride_rt,
    stride_pkr, stride_pkh, stride_pkp,
    stride_pvr, stride_pvh, stride_pvp,
    stride_ob, stride_oh, stride_hr, stride_hh, hole_base,
    stride_eb, stride_eh, extra_len, extra_base,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, IEEE: tl.constexpr, FUSED_REDUCE: tl.constexpr, BLOCK_S: tl.constexpr,
    WRITE_LSE: tl.constexpr, LISTED: tl.constexpr, HOLES: tl.constexpr, ROW_OF: tl.constexpr,
    EXTRA_PAGE: tl.constexpr,
):
    # LISTED: Packed_k is the layer's sel_pos [slots, H_kv, K] int32 (strides pkr, pkh; -1
    # reads nothing) and Packed_v the slots' n_sinks [slots] int32
    # HOLES (packed): packed entry e >= hole_base is valid only where Holes[pool, h,
    # e - hole_base] >= 0 (the layer's sel_pos: a whole-page selection's -1 entries inside
    # its count hold stale rows)
    # ROW_OF: the memory (Packed_k/v, the LISTED sel_pos, Holes) is indexed by memory row,
    # Row_of[pool]; the per-slot state (Packed_len, n_sinks) and Req_to_token by pool slot
    # EXTRA_PAGE > 0: Extra [B, H_kv, extra_len / EXTRA_PAGE] int32 page indices (the
    # top-up's, per batch row; -1: none), read between the memory and the window: entry e is
    # position extra_base + Extra[b, h, e // EXTRA_PAGE] * EXTRA_PAGE + e % EXTRA_PAGE
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    n_kv = tl.num_programs(1)
    num_splits = tl.num_programs(2)

    pool = tl.load(Req_pool_indices + b).to(tl.int64)
    mrow = _memory_row(Row_of, pool, ROW_OF)
    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    ws = tl.maximum(tl.load(Win_start + b).to(tl.int32), 0)
    lp = tl.load(Packed_len + pool).to(tl.int32)
    lw = tl.maximum(seq_len - ws, 0)
    lpe = lp + extra_len  # the memory, then the top-up's pages, then the window
    total = lpe + lw
    chunk = tl.cdiv(tl.cdiv(total, num_splits), BLOCK_N) * BLOCK_N
    start = s * chunk
    end = tl.minimum(start + chunk, total)

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

    # 1) sinks + selected [start, min(end, lp)): contiguous packed rows, or (LISTED) the
    # positions sinks then sel_pos, read in place
    p_hi = tl.minimum(end, lp)
    if LISTED:
        sp_base = Packed_k + mrow * stride_pkr + h * stride_pkh
        rt_row = Req_to_token + pool * stride_rt
        ns = tl.load(Packed_v + pool).to(tl.int32)
        for n0 in range(start, p_hi, BLOCK_N):
            offs_n = n0 + offs_nb
            in_sel = (offs_n >= ns) & (offs_n < p_hi)
            pos = tl.load(sp_base + (offs_n - ns), mask=in_sel, other=-1)
            pos = tl.where(offs_n < ns, offs_n, pos)
            mask_n = (offs_n < p_hi) & (pos >= 0)
            slot = tl.load(rt_row + pos, mask=mask_n, other=0).to(tl.int64)
            m_i, l_i, acc = _attend_slots(q, K_cache, V_cache, slot, mask_n, mask_d, offs_d, h, stride_kcs,
                                          stride_kch, stride_vcs, stride_vch, m_i, l_i, acc, qk_scale_log2, IEEE)
    else:
        pk_base = Packed_k + mrow * stride_pkr + h * stride_pkh
        pv_base = Packed_v + mrow * stride_pvr + h * stride_pvh
        for n0 in range(start, p_hi, BLOCK_N):
            offs_n = n0 + offs_nb
            mask_n = offs_n < p_hi
            if HOLES:
                sel = tl.load(Holes + mrow * stride_hr + h * stride_hh + (offs_n - hole_base),
                              mask=mask_n & (offs_n >= hole_base), other=0)
                mask_n = mask_n & (sel >= 0)
            mkd = mask_n[:, None] & mask_d[None, :]
            k = tl.load(pk_base + offs_n[:, None] * stride_pkp + offs_d[None, :], mask=mkd, other=0.0)
            v = tl.load(pv_base + offs_n[:, None] * stride_pvp + offs_d[None, :], mask=mkd, other=0.0)
            m_i, l_i, acc, _qk = _online_update(q, k, v, mask_n, m_i, l_i, acc, qk_scale_log2, IEEE)

    # 2) the top-up's pages, offsets [max(start, lp) - lp, min(end, lpe) - lp)
    if EXTRA_PAGE > 0:
        ex_base = Extra + b * stride_eb + h * stride_eh
        rt_row = Req_to_token + pool * stride_rt
        e_hi = tl.minimum(end, lpe) - lp
        for n0 in range(tl.maximum(start, lp) - lp, e_hi, BLOCK_N):
            offs_n = n0 + offs_nb
            mask_n = offs_n < e_hi
            pg = tl.load(ex_base + offs_n // EXTRA_PAGE, mask=mask_n, other=-1)
            mask_n = mask_n & (pg >= 0)
            pos = extra_base + pg * EXTRA_PAGE + offs_n % EXTRA_PAGE
            slot = tl.load(rt_row + pos, mask=mask_n, other=0).to(tl.int64)
            m_i, l_i, acc = _attend_slots(q, K_cache, V_cache, slot, mask_n, mask_d, offs_d, h, stride_kcs,
                                          stride_kch, stride_vcs, stride_vch, m_i, l_i, acc, qk_scale_log2, IEEE)

    # 3) window region, window-relative offsets [max(start, lpe) - lpe, end - lpe).
    w_lo = tl.maximum(start, lpe) - lpe
    w_hi = end - lpe
    rt_base = Req_to_token + pool * stride_rt + ws
    for n0 in range(w_lo, w_hi, BLOCK_N):
        offs_n = n0 + offs_nb
        mask_n = offs_n < w_hi
        slot = tl.load(rt_base + offs_n, mask=mask_n, other=0).to(tl.int64)
        m_i, l_i, acc = _attend_slots(q, K_cache, V_cache, slot, mask_n, mask_d, offs_d, h, stride_kcs,
                                      stride_kch, stride_vcs, stride_vch, m_i, l_i, acc, qk_scale_log2, IEEE)

    _write_result(Out, Mid_o, Mid_lse, b, s, hq, mask_g, offs_d, mask_d, m_i, l_i, acc,
                  stride_ob, stride_oh, n_kv * G, num_splits, D)
    if WRITE_LSE:
        if num_splits == 1:
            _store_lse(Lse, b * n_kv * G + hq, m_i, l_i, mask_g)
    if FUSED_REDUCE:
        if num_splits > 1:
            # Split-K merge without a second launch: the last split of this (request, KV
            # head) to finish (ticket from a per-(b, h) counter) merges all partials and
            # resets the counter for the next launch. Barrier + acq_rel atomic publish
            # this CTA's partials.
            tl.debug_barrier()
            ticket = tl.atomic_add(Counters + b * n_kv + h, 1, sem="acq_rel", scope="gpu")
            if ticket == num_splits - 1:
                tl.debug_barrier()
                if FUSED_REDUCE == 2:
                    _merge_splits_vector(Mid_o, Mid_lse, Out, Lse, b, h, n_kv, num_splits, offs_d, mask_d,
                                         stride_ob, stride_oh, G, D, BLOCK_S, WRITE_LSE)
                else:
                    mask = mask_g[:, None] & mask_d[None, :]
                    m_r = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
                    l_r = tl.zeros([BLOCK_G], dtype=tl.float32)
                    acc_r = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
                    part0 = (b * n_kv * G + hq) * num_splits  # as in _write_result
                    for s2 in range(num_splits):
                        lse_s = tl.load(Mid_lse + part0 + s2, mask=mask_g, other=float("-inf"),
                                        cache_modifier=".cg")
                        o_s = tl.load(Mid_o + (part0 + s2)[:, None] * D + offs_d[None, :], mask=mask,
                                      other=0.0, cache_modifier=".cg")
                        m_new = tl.maximum(m_r, lse_s)
                        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                        alpha = tl.exp2(m_r - m_safe)
                        w = tl.exp2(lse_s - m_safe)
                        acc_r = acc_r * alpha[:, None] + o_s * w[:, None]
                        l_r = l_r * alpha + w
                        m_r = m_new
                    res = acc_r / tl.where(l_r > 0, l_r, 1.0)[:, None]
                    tl.store(Out + b * stride_ob + hq[:, None] * stride_oh + offs_d[None, :],
                             res.to(Out.dtype.element_ty), mask=mask)
                    if WRITE_LSE:
                        _store_lse(Lse, b * n_kv * G + hq, m_r, l_r, mask_g)
                tl.atomic_xchg(Counters + b * n_kv + h, 0, sem="relaxed", scope="gpu")


_COUNTERS = {}


def _counters(device, n):
    """Self-resetting split-K tickets, one int32 per (request, KV head); zero between launches."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def fast_decode(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, win_start,
                packed_k, packed_v, packed_len, sm_scale, out=None, num_splits=None,
                max_window=None, block_n=None, num_warps=None, num_stages=None,
                fused_reduce=None, counters=None, lse_out=None, sel_pos=None, n_sinks=None,
                holes=None, hole_base=0, row_of=None, extra_pages=None, extra_base=0, extra_page=1):
    """SFI fast-step attention. q [B,H_q,D]; k_cache/v_cache [slots,H_kv,D];
    packed_k/packed_v [max_reqs,H_kv,P,D]. Returns out [B,H_q,D] (q.dtype).
    sel_pos [max_reqs,H_kv,K] int32 and n_sinks [max_reqs] int32 instead of packed_k and
    packed_v (None): the sinks [0, n_sinks) and the selected positions are read in place,
    through req_to_token, like the window (nothing packed; packed_len = n_sinks + count).
    holes [max_reqs,H_kv,K] int32 (the packed buffers; the layer's sel_pos): packed entry
    e >= hole_base (the sinks S) is read only where holes[pool, h, e - hole_base] >= 0, so
    a selection with fewer valid positions in a head than its count (whole pages at the
    candidates' edges) reads no stale packed row.
    row_of [max_reqs] int32, optional: packed_k/packed_v, sel_pos and holes hold memory rows,
    slot p's at row row_of[p] (SparseMemory's rows); packed_len and n_sinks stay per slot.
    extra_pages [B, H_kv, P] int32, optional (per batch row; kernels.topup's): also the
    positions extra_base + page * extra_page + [0, extra_page) of each page >= 0, read in
    place through req_to_token in the same softmax (the top-up; disjoint from the memory).

    num_splits: split-K count; None chooses it from the work size (P + max_window,
    max_window defaulting to 512) and the SM count, without reading device values, so
    the call is CUDA-graph safe.
    fused_reduce: merge the splits inside the same launch (last split per (request, KV
    head) reduces, using a self-resetting int32 counter per (request, KV head) from
    `counters`, default a per-device buffer: pass your own for concurrent streams).
    True merges split by split; "vector" loads every split's partials of a query head at
    once (bench/NOTES.md section 58: the default until measured is True); False launches
    a separate reduce.
    lse_out [B, H_q] float32, optional: each q head's log-sum-exp (natural log) of its logits
    over the memory, -inf where it is empty (the adaptive refresh trigger reads it).
    """
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    assert Hq % Hkv == 0, "H_q must be a multiple of H_kv"
    G = Hq // Hkv
    if out is None:
        out = torch.empty_like(q)
    if B == 0:
        return out
    if not use_triton(q):
        from .reference import ref_fast_decode
        return ref_fast_decode(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                               win_start, packed_k, packed_v, packed_len, sm_scale, out=out,
                               lse_out=lse_out, sel_pos=sel_pos, n_sinks=n_sinks, holes=holes,
                               hole_base=hole_base, row_of=row_of, extra_pages=extra_pages,
                               extra_base=extra_base, extra_page=extra_page)
    listed = sel_pos is not None
    assert not (listed and holes is not None), "holes: the packed path's (sel_pos masks itself)"
    if holes is not None:
        assert holes.dtype == torch.int32 and holes.stride(2) == 1
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1 and out.stride(2) == 1
    if listed:
        assert sel_pos.dtype == torch.int32 and sel_pos.stride(2) == 1 and n_sinks.dtype == torch.int32
        packed_k, packed_v = sel_pos, n_sinks
        P = sel_pos.shape[2]  # the work size the splits are chosen for (sinks: a few more)
    else:
        assert packed_k.stride(3) == 1 and packed_v.stride(3) == 1
        P = packed_k.shape[2]
    BLOCK_N = block_n or BLOCK_N_DEFAULT
    extra_len = 0
    if extra_pages is not None:
        assert extra_pages.dtype == torch.int32 and extra_pages.stride(2) == 1
        extra_len = extra_pages.shape[2] * int(extra_page)
        P += extra_len
    if num_splits is None:
        num_splits = choose_num_splits(split_programs(B, Hkv), P + (max_window or 512), BLOCK_N, q.device,
                                       min_blocks_per_split=2, max_splits=MAX_SPLITS_DEFAULT,
                                       programs_per_sm=2, one_wave=True)
    BLOCK_G = max(16, next_pow2(G))
    BLOCK_D = max(16, next_pow2(D))
    ieee = q.dtype == torch.float32
    if fused_reduce is None:
        fused_reduce = FUSED_REDUCE_DEFAULT
    mid_o, mid_lse = split_partials(B, Hq, D, num_splits, q.device)
    assert fused_reduce in (False, True, "vector"), fused_reduce
    fused = bool(fused_reduce)
    reduce_mode = 2 if fused_reduce == "vector" else int(fused)
    block_s = max(2, next_pow2(max(num_splits, MAX_SPLITS_DEFAULT))) if reduce_mode == 2 else 2
    if fused:
        if counters is None:
            counters = _counters(q.device, B * Hkv)
        assert counters.dtype == torch.int32 and counters.numel() >= B * Hkv
    else:
        counters = seq_lens  # unused
    if num_warps is None:
        num_warps = NUM_WARPS_DEFAULT
    if num_stages is None:
        num_stages = NUM_STAGES_DEFAULT
    grid = (B, Hkv, num_splits)
    _fast_decode_kernel[grid](
        q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, win_start,
        packed_k, packed_v, packed_len, float(sm_scale) * LOG2E,
        out, mid_o, mid_lse, counters, lse_out if lse_out is not None else mid_lse,
        holes if holes is not None else seq_lens, row_of if row_of is not None else seq_lens,
        extra_pages if extra_pages is not None else seq_lens,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0),
        packed_k.stride(0), packed_k.stride(1), packed_k.stride(2),
        *((0, 0, 0) if listed else (packed_v.stride(0), packed_v.stride(1), packed_v.stride(2))),
        out.stride(0), out.stride(1),
        *((holes.stride(0), holes.stride(1)) if holes is not None else (0, 0)), int(hole_base),
        *((extra_pages.stride(0), extra_pages.stride(1)) if extra_pages is not None else (0, 0)),
        extra_len, int(extra_base),
        G=G, BLOCK_G=BLOCK_G, D=D, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, IEEE=ieee, FUSED_REDUCE=reduce_mode,
        BLOCK_S=block_s,
        WRITE_LSE=lse_out is not None, LISTED=listed, HOLES=holes is not None,
        ROW_OF=row_of is not None, EXTRA_PAGE=int(extra_page) if extra_pages is not None else 0,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1 and not fused:
        splitk_reduce(mid_o, mid_lse, out, MAX_SPLITS_DEFAULT)
        if lse_out is not None:  # the partials' LSEs are base 2
            lse_out.copy_(torch.logsumexp(mid_lse * math.log(2.0), -1))
    return out
