"""SFI's per-step top-up on the device: which pages a fast step reads besides its memory.

Per (batch row, KV head), the pages of PAGE tokens inside [lo, hi) (lo: the sinks; hi: the
row's window start, at most its length) are scored by Quest's bound from the page's
per-channel min/max keys, read in place through req_to_token,

    bound(page) = max over the group's query heads g of sum_d max(q_gd * kmin_d, q_gd * kmax_d),

pages holding a held position (the layer's selection, -1 padded) score -inf, and the top
`pages` are kept: page indices counted from lo, -1 where fewer qualify. Two launches, with
no host sync, so they run inside SGLang's decode CUDA graphs:
  page_scores  every page (grid: rows x KV heads x tiles of 8 pages, a fixed grid for a
               captured batch size: programs past a row's pages write -inf);
  pick_pages   one program per (row, KV head): an exact radix select over the row's own
               pages' scores (4 passes of 8 bits, 256-bin histograms, as kernels.topk does
               across programs; on scores held in registers up to PICK_BLOCK_MAX columns,
               else a loop over blocks), then the chosen pages in ascending order, -1 padded; ties
               at the last chosen score go to the lowest pages. torch.topk + where took
               several launches per layer (bench/NOTES.md section 52).
kernels.fast_decode reads the chosen pages as its `extra_pages`.

`drop_held` is the reuse across layers (--sfi-topup-every): the pages chosen at a group's
first layer, less those holding a position the current layer holds (the fast kernel reads
a position once); given the selections of several layers at once, one launch for them all.

References: reference.ref_page_scores, choose_pages (torch.topk), reference.ref_drop_held
(also the CPU path).
"""

import torch
import triton
import triton.language as tl

from ._common import _memory_row, next_pow2, use_triton
from .topk import _ordered

BLOCK_P_DEFAULT = 8  # pages per program: BLOCK_P x PAGE x D keys in registers
SUMM_BLOCK_P_DEFAULT = 32  # pages per program from the summaries: BLOCK_P x 2 x D values
PICK_BLOCK_MAX = 8192  # pick_pages holds up to this many scores per (row, KV head) in registers (128K at page 16)


@triton.jit
def _held_pages(Held, mrow, h, stride_hr, stride_hh, lo, PAGE: tl.constexpr, K_HELD: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """The page (from lo) of each held position of (memory row, KV head), -1 for none."""
    offs_k = tl.arange(0, BLOCK_K)
    held = tl.load(Held + mrow * stride_hr + h * stride_hh + offs_k, mask=offs_k < K_HELD, other=-1)
    return tl.where(held >= lo, (held - lo) // PAGE, -1)


@triton.jit
def _summarize_kernel(K_cache, Summ, Locs, n, stride_kcs, stride_kch, stride_mp, stride_mh, stride_mk,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    loc = tl.load(Locs + i).to(tl.int64)
    nxt = tl.load(Locs + i + 1, mask=i + 1 < n, other=-1).to(tl.int64)
    if ((loc + 1) % PAGE == 0) | (nxt != loc + 1):  # the last of its page or of its run writes the page
        first = loc // PAGE * PAGE
        offs_j = tl.arange(0, PAGE)
        offs_d = tl.arange(0, BLOCK_D)
        mask = ((first + offs_j) <= loc)[:, None] & (offs_d < D)[None, :]
        k = tl.load(K_cache + (first + offs_j)[:, None] * stride_kcs + h * stride_kch + offs_d[None, :],
                    mask=mask, other=0.0).to(tl.float32)  # fp8 has no inf; float32 holds every K dtype exactly
        kmin = tl.min(tl.where(mask, k, float("inf")), axis=0)
        kmax = tl.max(tl.where(mask, k, float("-inf")), axis=0)
        out = Summ + (loc // PAGE) * stride_mp + h * stride_mh + offs_d
        tl.store(out, kmin.to(Summ.dtype.element_ty), mask=offs_d < D)
        tl.store(out + stride_mk, kmax.to(Summ.dtype.element_ty), mask=offs_d < D)


@triton.jit
def _page_scores_kernel(
    Q, K_cache, Summ, Req_to_token, Req_pool_indices, Seq_lens, Win_start, Held, Row_of, Scores,
    stride_qb, stride_qh, stride_kcs, stride_kch, stride_mp, stride_mh, stride_mk, stride_rt, stride_hr,
    stride_hh, stride_sb, stride_sh, lo, max_pages,
    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_P: tl.constexpr,
    K_HELD: tl.constexpr, BLOCK_K: tl.constexpr, ROW_OF: tl.constexpr, SUMM: tl.constexpr,
):
    # one tile of BLOCK_P pages per program: many small programs keep many gathers in
    # flight (a loop over tiles waited on each one's latency: 0.6 TB/s on an H200)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    pool = tl.load(Req_pool_indices + b).to(tl.int64)
    hi = tl.minimum(tl.load(Win_start + b).to(tl.int64), tl.load(Seq_lens + b).to(tl.int64))
    num_pages = tl.minimum(tl.maximum(hi - lo, 0) // PAGE, max_pages)
    valid = offs_p < num_pages
    out = Scores + b * stride_sb + h * stride_sh + offs_p
    if tl.program_id(2) * BLOCK_P < num_pages:
        mrow = _memory_row(Row_of, pool, ROW_OF)
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        if SUMM:  # the pool page of each page's first slot: its summary, 1/PAGE of the keys' bytes x 2
            slot = tl.load(Req_to_token + pool * stride_rt + lo + offs_p * PAGE, mask=valid, other=0).to(tl.int64)
            summ = Summ + (slot // PAGE)[:, None] * stride_mp + h * stride_mh + offs_d[None, :]
            mask = valid[:, None] & mask_d[None, :]
            kmin = tl.load(summ, mask=mask, other=0.0).to(tl.float32)
            kmax = tl.load(summ + stride_mk, mask=mask, other=0.0).to(tl.float32)
        else:
            pos = lo + offs_p[:, None] * PAGE + tl.arange(0, PAGE)[None, :]
            slot = tl.load(Req_to_token + pool * stride_rt + pos, mask=valid[:, None], other=0).to(tl.int64)
            k = tl.load(K_cache + slot[:, :, None] * stride_kcs + h * stride_kch + offs_d[None, None, :],
                        mask=valid[:, None, None] & mask_d[None, None, :], other=0.0).to(tl.float32)
            kmin = tl.min(k, axis=1)
            kmax = tl.max(k, axis=1)
        best = tl.full([BLOCK_P], float("-inf"), tl.float32)
        for g in tl.static_range(G):
            qg = tl.load(Q + b * stride_qb + (h * G + g) * stride_qh + offs_d, mask=mask_d, other=0.0).to(tl.float32)
            best = tl.maximum(best, tl.sum(tl.maximum(qg[None, :] * kmin, qg[None, :] * kmax), axis=1))
        hpage = _held_pages(Held, mrow, h, stride_hr, stride_hh, lo, PAGE, K_HELD, BLOCK_K)
        held = tl.max((hpage[None, :] == offs_p[:, None]).to(tl.int32), axis=1) > 0
        tl.store(out, tl.where(valid & ~held, best, float("-inf")), mask=offs_p < max_pages)
    else:
        tl.store(out, tl.full([BLOCK_P], float("-inf"), tl.float32), mask=offs_p < max_pages)


@triton.jit
def _digit_hist(o, inb, prefix, p: tl.constexpr):
    """The 256-bin histogram of radix pass p's digit (8 bits, from the top) of the ordered
    keys o in bounds whose higher digits equal prefix."""
    if p == 0:
        match = inb
    else:
        match = inb & ((o >> (32 - 8 * p)) == prefix)
    return tl.histogram(((o >> (24 - 8 * p)) & 255).to(tl.int32), 256, mask=match)


@triton.jit
def _next_digit(acc, prefix, r, offs_b):
    """After a pass's 256-bin histogram acc of the keys still matching prefix: prefix with
    the bin of the r-th largest appended, and r less the keys in the bins above it."""
    incl = tl.sum(acc, 0) - tl.cumsum(acc, 0) + acc  # keys in bins >= each bin
    bin = tl.max(tl.where(incl >= r, offs_b, -1), 0)
    r = r - (tl.sum(tl.where(offs_b == bin, incl, 0), 0) - tl.sum(tl.where(offs_b == bin, acc, 0), 0))
    return (prefix << 8) | bin.to(tl.uint32), r


@triton.jit
def _pick_pages_kernel(Scores, Out, Seq_lens, Win_start, stride_sb, stride_sh, stride_ob, stride_oh, lo, max_pages,
                       P: tl.constexpr, BLOCK_PP: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
                       RESIDENT: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    hi = tl.minimum(tl.load(Win_start + b).to(tl.int64), tl.load(Seq_lens + b).to(tl.int64))
    n = tl.minimum(tl.maximum(hi - lo, 0) // PAGE, max_pages).to(tl.int32)  # the row's pages; the rest are -inf
    base = Scores + b.to(tl.int64) * stride_sb + h * stride_sh
    offs_b = tl.arange(0, 256)
    # radix select of the P-th largest ordered key t (uint32) and r, how many keys equal to t are taken
    prefix = tl.zeros([], tl.uint32)
    r = tl.zeros([], tl.int32) + P
    if RESIDENT:  # every column in one block: loaded once, the passes run on registers
        offs = tl.arange(0, BLOCK)
        inb = offs < n
        o = _ordered(tl.load(base + offs, mask=inb, other=float("-inf")))
        for p in tl.static_range(4):
            prefix, r = _next_digit(_digit_hist(o, inb, prefix, p), prefix, r, offs_b)
    else:
        for p in tl.static_range(4):
            acc = tl.zeros([256], tl.int32)
            for n0 in range(0, n, BLOCK):
                offs = n0 + tl.arange(0, BLOCK)
                inb = offs < n
                acc += _digit_hist(_ordered(tl.load(base + offs, mask=inb, other=float("-inf"))), inb, prefix, p)
            prefix, r = _next_digit(acc, prefix, r, offs_b)
    all_taken = n <= P  # then every finite key is taken (the passes found no bin)
    t = tl.where(all_taken, 0x007FFFFF, prefix)  # 0x007FFFFF: -inf's ordered bits, never taken
    r = tl.where(all_taken, 0, r)
    t_fin = t != 0x007FFFFF
    obase = Out + b.to(tl.int64) * stride_ob + h * stride_oh
    out_pos = tl.zeros([], tl.int32)
    eq_seen = tl.zeros([], tl.int32)
    for n0 in range(0, n, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        inb = offs < n
        o = _ordered(tl.load(base + offs, mask=inb, other=float("-inf")))
        is_eq = (inb & (o == t) & t_fin).to(tl.int32)
        eq_rank = eq_seen + tl.cumsum(is_eq, 0) - is_eq
        take = (inb & (o > t)) | ((is_eq > 0) & (eq_rank < r))
        ti = take.to(tl.int32)
        pos = out_pos + tl.cumsum(ti, 0) - ti
        tl.store(obase + pos, offs, mask=take & (pos < P))
        out_pos += tl.sum(ti, 0)
        eq_seen += tl.sum(is_eq, 0)
    offs_pp = tl.arange(0, BLOCK_PP)
    tl.store(obase + offs_pp, tl.full([BLOCK_PP], -1, tl.int32), mask=(offs_pp >= out_pos) & (offs_pp < P))


@triton.jit
def _drop_held_kernel(Pages, Out, Req_pool_indices, Held, Row_of, stride_pb, stride_ph, stride_ol, stride_ob,
                      stride_oh, stride_hl, stride_hr, stride_hh, lo, P: tl.constexpr, BLOCK_PP: tl.constexpr,
                      PAGE: tl.constexpr, K_HELD: tl.constexpr, BLOCK_K: tl.constexpr, ROW_OF: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    layer = tl.program_id(2)
    pool = tl.load(Req_pool_indices + b).to(tl.int64)
    mrow = _memory_row(Row_of, pool, ROW_OF)
    hpage = _held_pages(Held + layer * stride_hl, mrow, h, stride_hr, stride_hh, lo, PAGE, K_HELD, BLOCK_K)
    offs = tl.arange(0, BLOCK_PP)
    pg = tl.load(Pages + b * stride_pb + h * stride_ph + offs, mask=offs < P, other=-1)
    held = tl.max((hpage[None, :] == pg[:, None]).to(tl.int32), axis=1) > 0
    tl.store(Out + layer * stride_ol + b * stride_ob + h * stride_oh + offs, tl.where(held, -1, pg).to(tl.int32),
             mask=offs < P)


def summarize_pages(k_cache, summ, locs, page: int):
    """Keep the pool pages' key summaries after keys were written at locs [n] (slots, a
    request's in order, as out_cache_loc lists them; the pool allocated in pages of `page`
    slots, so a request's pages are whole pool pages): each slot that ends its page or a
    run of consecutive slots in locs writes its page's per-channel key minimum and maximum
    over the page's slots up to it into summ [slots // page, H_kv, 2, D] (k_cache's dtype:
    exact). One launch; a decode step's and an extend's writes alike."""
    n = locs.shape[0]
    if n == 0:
        return summ
    if not use_triton(k_cache):
        from .reference import ref_summarize_pages

        return ref_summarize_pages(k_cache, summ, locs, page)
    assert page & (page - 1) == 0 and k_cache.stride(2) == 1 and summ.stride(3) == 1
    H, D = k_cache.shape[1], k_cache.shape[2]
    _summarize_kernel[(n, H)](k_cache, summ, locs, n, k_cache.stride(0), k_cache.stride(1), summ.stride(0),
                              summ.stride(1), summ.stride(2), D=D, BLOCK_D=max(16, next_pow2(D)), PAGE=int(page),
                              num_warps=4)
    return summ


def page_scores(q, k_cache, req_to_token, req_pool_indices, seq_lens, win_start, held, lo: int, page: int,
                max_pages: int, row_of=None, out=None, summ=None, block_p: int | None = None,
                num_warps: int = 4):
    """Scores [B, H_kv, max_pages] float32 of the pages of `page` tokens from lo (see the
    module doc): -inf past a row's whole pages in [lo, min(win_start, seq_len)) and on
    pages holding a position of held [rows, H_kv, K] (-1 padded; by memory row, row_of
    [slots] int32 when given, else by slot). q [B, H_q, D]; win_start [B] per batch row.
    summ: the pool pages' key summaries (summarize_pages; lo a multiple of page), read in
    place of the keys. block_p pages per program (default 8 from the keys, 32 from the
    summaries) and num_warps: within 3% of the best measured on keys (bench/NOTES.md section
    53) and 5% on summaries, where 8 pages took up to 23% longer (section 54)."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    if out is None:
        out = torch.empty((B, Hkv, max_pages), dtype=torch.float32, device=q.device)
    if B == 0 or max_pages == 0:
        return out
    assert summ is None or lo % page == 0, f"summaries need pages aligned to the pool's: lo {lo}, page {page}"
    if not use_triton(q):
        from .reference import ref_page_scores

        return ref_page_scores(q, k_cache, req_to_token, req_pool_indices, seq_lens, win_start, held, lo,
                               page, max_pages, row_of=row_of, out=out, compute_dtype=torch.float32, summ=summ)
    assert page & (page - 1) == 0, f"the top-up's page ({page}) must be a power of two"
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and held.stride(2) == 1 and out.stride(2) == 1
    assert summ is None or summ.stride(3) == 1
    sm = summ if summ is not None else k_cache
    block_p = block_p or (SUMM_BLOCK_P_DEFAULT if summ is not None else BLOCK_P_DEFAULT)
    K = held.shape[2]
    grid = (B, Hkv, triton.cdiv(max_pages, block_p))
    _page_scores_kernel[grid](
        q, k_cache, sm, req_to_token, req_pool_indices, seq_lens, win_start, held,
        row_of if row_of is not None else req_pool_indices, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), sm.stride(0), sm.stride(1),
        sm.stride(2) if summ is not None else 0, req_to_token.stride(0),
        held.stride(0), held.stride(1), out.stride(0), out.stride(1), int(lo), int(max_pages),
        G=Hq // Hkv, D=D, BLOCK_D=max(16, next_pow2(D)), PAGE=int(page), BLOCK_P=int(block_p), K_HELD=K,
        BLOCK_K=max(16, next_pow2(K)), ROW_OF=row_of is not None, SUMM=summ is not None, num_warps=num_warps,
    )
    return out


def choose_pages(scores: torch.Tensor, pages: int) -> torch.Tensor:
    """The top `pages` of scores [B, H_kv, P] per (row, KV head) by torch.topk (pick_pages'
    reference and CPU path): page indices [B, H_kv, pages] int32 in topk's order, -1 where
    the score is -inf (fewer pages qualify)."""
    take = min(int(pages), scores.shape[-1])
    top = scores.topk(take, dim=-1)
    return torch.where(top.values == float("-inf"), -1, top.indices).to(torch.int32)


def pick_pages(scores, pages: int, seq_lens, win_start, lo: int, page: int, out=None) -> torch.Tensor:
    """The top `pages` of each row's own pages of scores [B, H_kv, max_pages] (page_scores'
    output; row b's are the first (min(win_start, seq_len) - lo) // page): page indices
    [B, H_kv, pages] int32, ascending, -1 padded; -inf never chosen. One launch; the same
    set as choose_pages but for ties (here the lowest pages), which it falls back to on CPU."""
    B, H, N = scores.shape
    if out is None:
        out = torch.empty((B, H, int(pages)), dtype=torch.int32, device=scores.device)
    if B == 0 or pages == 0:
        return out
    if not use_triton(scores):
        top = choose_pages(scores, pages).long()
        top = torch.where(top < 0, N, top).sort(-1).values  # ascending, -1 (as N) last
        out.fill_(-1)[..., :top.shape[-1]] = torch.where(top == N, -1, top)
        return out
    assert scores.stride(2) == 1 and out.stride(2) == 1
    block = min(max(256, next_pow2(N)), PICK_BLOCK_MAX)
    _pick_pages_kernel[(B, H)](
        scores, out, seq_lens, win_start, scores.stride(0), scores.stride(1), out.stride(0), out.stride(1),
        int(lo), int(N), P=int(pages), BLOCK_PP=max(16, next_pow2(pages)), PAGE=int(page), BLOCK=block,
        RESIDENT=N <= block, num_warps=max(4, min(16, block // 512)),
    )
    return out


def choose_topup(q, k_cache, req_to_token, req_pool_indices, seq_lens, win_start, held, lo: int, page: int,
                pages: int, max_pages: int, row_of=None, summ=None):
    """The top-up of one fast step at one layer: page indices [B, H_kv, pages] int32 from
    lo (-1: none); page_scores (from the summaries summ when given) then pick_pages."""
    scores = page_scores(q, k_cache, req_to_token, req_pool_indices, seq_lens, win_start, held, lo, page,
                         max_pages, row_of=row_of, summ=summ)
    return pick_pages(scores, pages, seq_lens, win_start, lo, page)


def drop_held(pages, req_pool_indices, held, lo: int, page: int, row_of=None):
    """pages [B, H_kv, P] int32 (a group's top-up) with -1 for each page holding a position
    of held [rows, H_kv, K] (this layer's selection): a new tensor. Given held [L, rows,
    H_kv, K] (the selections of L layers), one launch makes [L, B, H_kv, P]."""
    B, H, P = pages.shape
    layers = held.dim() == 4
    h4 = held if layers else held[None]
    out = torch.empty((h4.shape[0], B, H, P), dtype=pages.dtype, device=pages.device)
    if B == 0 or P == 0 or h4.shape[0] == 0:
        return out if layers else out[0]
    if not use_triton(pages):
        from .reference import ref_drop_held

        for i in range(h4.shape[0]):
            ref_drop_held(pages, req_pool_indices, h4[i], lo, page, row_of=row_of, out=out[i])
        return out if layers else out[0]
    assert h4.stride(3) == 1
    K = h4.shape[3]
    _drop_held_kernel[(B, H, h4.shape[0])](
        pages, out, req_pool_indices, h4, row_of if row_of is not None else req_pool_indices,
        pages.stride(0), pages.stride(1), out.stride(0), out.stride(1), out.stride(2), h4.stride(0), h4.stride(1),
        h4.stride(2), int(lo), P=P, BLOCK_PP=max(16, next_pow2(P)), PAGE=int(page), K_HELD=K,
        BLOCK_K=max(16, next_pow2(K)), ROW_OF=row_of is not None, num_warps=4,
    )
    return out if layers else out[0]
