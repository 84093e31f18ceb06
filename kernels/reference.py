"""Pure-torch references for the SFI kernels (float64 by default).

These double as the CPU implementation: vectorized gathers per request (no per-token
Python loops). `compute_dtype` selects the arithmetic precision (float64 for checks,
float32 is fine for a CPU backend). If `out` (or `scores_out`) is given the result is
copied into it (cast to its dtype) and returned; otherwise results are in compute_dtype.
"""

import math

import torch


def _attend(qb, keys, vals, sm_scale, G, mask=None):
    """qb [H_q, D]; keys/vals [H_kv, L, D] -> (out [H_q, D], logits [H_q, L]); mask [H_kv, L]
    bool, optional: only where True (logits -inf elsewhere)."""
    Hkv, L, D = keys.shape
    qg = qb.view(Hkv, G, D)
    logits = torch.einsum("hgd,hld->hgl", qg, keys) * sm_scale
    if mask is not None:
        logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    if L == 0:
        return torch.zeros_like(qb), logits.reshape(Hkv * G, 0)
    p = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    o = torch.einsum("hgl,hld->hgd", p, vals)
    return o.reshape(Hkv * G, D), logits.reshape(Hkv * G, L)


def _finish(result, out):
    if out is None:
        return result
    out.copy_(result.to(out.dtype))
    return out


def extra_positions(extra_pages, base: int, page: int) -> torch.Tensor:
    """Positions [..., P * page] of page indices extra_pages [..., P] counted from base
    (-1 for each position of a -1 page): the top-up's pages as positions."""
    pg = extra_pages.long()
    pos = base + pg[..., None] * page + torch.arange(page, device=pg.device)
    return torch.where(pg[..., None] >= 0, pos, -1).flatten(-2)


def ref_fast_decode(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, win_start,
                    packed_k, packed_v, packed_len, sm_scale, out=None,
                    compute_dtype=torch.float64, lse_out=None, sel_pos=None, n_sinks=None, holes=None,
                    hole_base=0, row_of=None, extra_pages=None, extra_base=0, extra_page=1, **_ignored):
    """Attention of q over packed[pool, h, :packed_len[pool]] + window [win_start, seq_len);
    with sel_pos [slots, H_kv, K] and n_sinks [slots] instead of the packed buffers, over
    the positions [0, n_sinks) then sel_pos[pool, h, :packed_len - n_sinks] (-1: none),
    read through req_to_token. holes [slots, H_kv, K] (packed buffers): packed entry
    e >= hole_base counts only where holes[pool, h, e - hole_base] >= 0. lse_out [B, H_q]:
    each head's log-sum-exp of its logits (-inf for an empty memory). row_of [slots]: the
    memory (packed buffers, sel_pos, holes) holds slot p's at row row_of[p]. extra_pages
    [B, H_kv, P] (per batch row): also the pages extra_positions(extra_pages, extra_base,
    extra_page), read through req_to_token (-1: none)."""
    if row_of is not None:  # the memory seen per slot
        packed_k, packed_v, sel_pos, holes = (None if t is None else t[row_of.long()]
                                              for t in (packed_k, packed_v, sel_pos, holes))
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    cd = compute_dtype
    res = torch.empty((B, Hq, D), dtype=cd, device=q.device)
    rpi = req_pool_indices.tolist()
    sl = seq_lens.tolist()
    ws = win_start.tolist()
    extra = None if extra_pages is None else extra_positions(extra_pages, extra_base, extra_page)
    for b in range(B):
        pool = int(rpi[b])
        lp = int(packed_len[pool])
        w0 = max(int(ws[b]), 0)
        w1 = max(int(sl[b]), w0)
        window = torch.arange(w0, w1, device=q.device)
        qb = q[b].to(cd).view(Hkv, G, D)
        lses = []
        for h in range(Hkv):
            if sel_pos is not None:  # its own positions (-1 entries read nothing)
                ns = int(n_sinks[pool])
                sel = sel_pos[pool, h, :lp - ns].long()
                head = [torch.arange(ns, device=sel.device), sel[sel >= 0]]
                keys, vals = [], []
            else:  # the packed entries (less the holes)
                e = torch.arange(lp, device=q.device)
                keep = e < hole_base
                if holes is not None:
                    keep = keep | (holes[pool, h, (e - hole_base).clamp(0, holes.shape[-1] - 1)] >= 0)
                else:
                    keep = torch.ones_like(keep)
                head = []
                keys, vals = [packed_k[pool, h, :lp][keep].to(cd)], [packed_v[pool, h, :lp][keep].to(cd)]
            if extra is not None:
                head.append(extra[b, h][extra[b, h] >= 0])
            slots = req_to_token[pool, torch.cat([*head, window]).long()].long()
            keys.append(k_cache[slots, h].to(cd))
            vals.append(v_cache[slots, h].to(cd))
            o, lg = _attend(qb[h].reshape(G, D), torch.cat(keys)[None], torch.cat(vals)[None], sm_scale, G)
            res[b, h * G:(h + 1) * G] = o
            lses.append(torch.logsumexp(lg, -1))
        if lse_out is not None:
            lse_out[b] = torch.cat(lses).to(lse_out.dtype)
    return _finish(res, out)


def page_bounds(q, keys, lo: int, num_pages: int, page: int) -> torch.Tensor:
    """Quest's score [H, num_pages] of the pages of `page` tokens from lo: per KV head, the
    max over the group's query heads q [H, G, D] of sum_d max(q_d * kmin_d, q_d * kmax_d),
    an upper bound of q.k on the page (keys [n, H, D], the request's), in q's dtype."""
    blk = keys[lo: lo + num_pages * page].to(q.dtype).reshape(num_pages, page, *keys.shape[1:])
    return summary_bounds(q, blk.amin(dim=1), blk.amax(dim=1))


def summary_bounds(q, kmin, kmax) -> torch.Tensor:
    """page_bounds from the pages' per-channel key minima and maxima kmin, kmax [P, H, D]."""
    kmin, kmax = kmin.to(q.dtype), kmax.to(q.dtype)
    qf = q[:, :, None, :]  # [H, G, 1, D]
    bound = torch.maximum(qf * kmin.transpose(0, 1)[:, None], qf * kmax.transpose(0, 1)[:, None])
    return bound.sum(-1).amax(dim=1)


def _held_pages(held, lo: int, page: int, num_pages: int) -> torch.Tensor:
    """[H, num_pages + 1] bool: the pages (from lo) holding a position of held [H, K]
    (-1 padded); the last column collects the rest."""
    held = held.long()
    inside = (held >= lo) & (held < lo + num_pages * page)
    hit = torch.zeros(held.shape[0], num_pages + 1, dtype=torch.bool, device=held.device)
    return hit.scatter_(1, torch.where(inside, (held - lo) // page, num_pages), True)


def ref_summarize_pages(k_cache, summ, locs, page, **_ignored):
    """Reference of topup.summarize_pages: each slot of locs [n] (slots just written, a
    request's in order) that ends its page or a run of consecutive slots in locs writes
    its pool page's per-channel key minimum and maximum over the page's slots up to it
    into summ [slots // page, H, 2, D] (in place)."""
    locs = locs.long()
    nxt = torch.cat([locs[1:], locs.new_full((1,), -1)])
    last = ((locs + 1) % page == 0) | (nxt != locs + 1)
    locs = locs[last]
    first = locs // page * page
    slots = first[:, None] + torch.arange(page, device=locs.device)  # [n, page]
    keys = k_cache[slots.clamp_max(k_cache.shape[0] - 1)].to(torch.float64)  # [n, page, H, D]
    upto = (slots <= locs[:, None])[:, :, None, None]
    kmin = keys.masked_fill(~upto, math.inf).amin(1)
    kmax = keys.masked_fill(~upto, -math.inf).amax(1)
    summ[locs // page] = torch.stack([kmin, kmax], 2).to(summ.dtype)
    return summ


def ref_page_scores(q, k_cache, req_to_token, req_pool_indices, seq_lens, win_start, held, lo, page,
                    max_pages, row_of=None, out=None, compute_dtype=torch.float64, summ=None, **_ignored):
    """Reference of topup.page_scores: per row, page_bounds of the whole pages of
    [lo, min(win_start, seq_len)), -inf past them and on pages holding a held position;
    from the pool pages' summaries summ [slots // page, H, 2, D] when given (lo a
    multiple of page, each request's pages whole pool pages)."""
    if row_of is not None:
        held = held[row_of.long()]
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    res = torch.full((B, Hkv, max_pages), float("-inf"), dtype=compute_dtype, device=q.device)
    for b in range(B):  # int(), not .tolist(): the CPU engine's decode layers refuse host reads
        pool, hi = int(req_pool_indices[b]), min(int(win_start[b]), int(seq_lens[b]))
        n = min(max(hi - lo, 0) // page, max_pages)
        if n == 0:
            continue
        qb = q[b].to(compute_dtype).view(Hkv, Hq // Hkv, D)
        if summ is None:
            score = page_bounds(qb, k_cache[req_to_token[pool, :lo + n * page].long()], lo, n, page)
        else:
            sp = summ[req_to_token[pool, lo:lo + n * page:page].long() // page]  # [n, H, 2, D]
            score = summary_bounds(qb, sp[:, :, 0], sp[:, :, 1])
        res[b, :, :n] = score.masked_fill(_held_pages(held[pool], lo, page, n)[:, :n], float("-inf"))
    return _finish(res, out)


def ref_drop_held(pages, req_pool_indices, held, lo, page, row_of=None, out=None, **_ignored):
    """Reference of topup.drop_held: -1 for each page of pages [B, H_kv, P] that holds a
    position of held (by row_of's memory row, else by slot)."""
    if row_of is not None:
        held = held[row_of.long()]
    res = pages.clone()
    for b in range(pages.shape[0]):
        h = held[int(req_pool_indices[b])].long()
        hp = torch.where(h >= lo, (h - lo) // page, -2)  # [H, K]
        hit = (pages[b].long()[:, :, None] == hp[:, None, :]).any(-1) & (pages[b] >= 0)
        res[b] = torch.where(hit, -1, pages[b])
    return _finish(res, out)


def ref_dense_decode_with_scores(q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                 sm_scale, scores_out=None, out=None, compute_dtype=torch.float64,
                                 n_max=None, score_rows=None, norms_out=None, **_ignored):
    """Dense attention over [0, seq_len) + raw logits q.k*sm_scale ([B,H_q,N_max], -inf past
    seq_len). Returns (out, scores). score_rows [B] (needs scores_out): row b's logits go to
    scores_out[score_rows[b]], none where -1; the other rows of scores_out are untouched.
    norms_out [rows, H_kv, >= N]: the key norms of positions < seq_len, in the logits' rows."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    cd = compute_dtype
    sl = seq_lens.tolist()
    if scores_out is not None:
        n_max = scores_out.shape[2]
    elif n_max is None:
        n_max = max(sl) if B else 0
    res = torch.empty((B, Hq, D), dtype=cd, device=q.device)
    scores = torch.full((B, Hq, n_max), float("-inf"), dtype=cd, device=q.device)
    rpi = req_pool_indices.tolist()
    for b in range(B):
        pool = int(rpi[b])
        n = int(sl[b])
        slots = req_to_token[pool, :n].long()
        keys = k_cache[slots].to(cd).transpose(0, 1)
        vals = v_cache[slots].to(cd).transpose(0, 1)
        res[b], logits = _attend(q[b].to(cd), keys, vals, sm_scale, G)
        scores[b, :, :n] = logits
        r = b if score_rows is None else int(score_rows[b])
        if norms_out is not None and r >= 0:
            norms_out[r, :, :n] = torch.linalg.vector_norm(keys, dim=-1).to(norms_out.dtype)
    if score_rows is not None:
        for b, r in enumerate(score_rows.tolist()):
            if r >= 0:
                scores_out[r] = scores[b].to(scores_out.dtype)
        return _finish(res, out), scores_out
    return _finish(res, out), _finish(scores, scores_out)


def ref_pack(k_cache, v_cache, req_to_token, req_pool_indices, positions, packed_k, packed_v,
             **_ignored):
    """packed[pool_i, h, p] = cache[req_to_token[pool_i, positions[i,h,p]], h] where
    positions >= 0; other entries untouched. In place; returns (packed_k, packed_v)."""
    nb, Hkv, Pp = positions.shape
    rpi = req_pool_indices.tolist()
    heads = torch.arange(Hkv, device=positions.device).view(Hkv, 1).expand(Hkv, Pp)
    ent = torch.arange(Pp, device=positions.device).view(1, Pp).expand(Hkv, Pp)
    for i in range(nb):
        pool = int(rpi[i])
        pos = positions[i].long()
        valid = pos >= 0
        if not bool(valid.any()):
            continue
        h = heads[valid]
        slots = req_to_token[pool].long()[pos[valid]]
        e = ent[valid]
        packed_k[pool, h, e] = k_cache[slots, h].to(packed_k.dtype)
        packed_v[pool, h, e] = v_cache[slots, h].to(packed_v.dtype)
    return packed_k, packed_v


def ref_build_lists(q, req_to_token, req_pool_indices, L, start, seq_lens, win_start, n_sinks, sel_pos,
                    sel_count, indptr, pages, qrows, C, holes=False, row_of=None):
    """Reference of flashinfer_fast.build_lists (KV heads folded into the batch, each list
    cut into C rows; with holes, -1 entries left out and one more row per list; row_of:
    sel_pos by memory row, as in ref_fast_decode)."""
    if row_of is not None:
        sel_pos = sel_pos[row_of.long()]
    B, Hq, D = q.shape
    H = sel_pos.shape[1]
    G = Hq // H
    R = C + int(holes)
    for b, pool in enumerate(req_pool_indices.tolist()):
        ns, c = int(n_sinks[pool]), int(sel_count[pool])
        ws, n, length = int(win_start[b]), int(seq_lens[b]), int(L[b])
        for h in range(H):
            sel = sel_pos[pool, h, :c].long()
            sel = sel[sel >= 0] if holes else sel
            used = length - (c - sel.numel())  # the list's entries; the region's rest is unread
            pos = torch.cat([torch.arange(ns, device=pages.device), sel,
                             torch.arange(ws, max(n, ws), device=pages.device)])[:used]
            pos = torch.cat([pos, pos.new_zeros(length - pos.numel())])
            base = int(start[b]) + h * length
            pages[base: base + length] = (req_to_token[pool, pos].long() * H + h).to(pages.dtype)
            for r in range(R):
                row = (b * H + h) * R + r
                indptr[row] = base + r * used // C
                qrows[row] = q[b, h * G:(h + 1) * G]
            if b == B - 1 and h == H - 1:
                indptr[B * H * R] = base + length
    return pages


def ref_merge_rows(o_rows, lse_rows, out, C, lse_out=None, R=None):
    """Reference of flashinfer_fast.merge_rows (float64): the first C of each list's R rows
    merged by their log2-sum-exps; -inf rows weigh nothing, a list with no entry gives 0."""
    B, Hq, D = out.shape
    G = o_rows.shape[1]
    R = R or C
    lse = lse_rows.double().view(B, Hq // G, R, G)[:, :, :C]
    o = o_rows.double().view(B, Hq // G, R, G, D)[:, :, :C]
    m = lse.amax(2, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.where(torch.isinf(lse), torch.zeros_like(lse), torch.exp2(lse - m))
    den = w.sum(2)                                                           # [B, H, G]
    acc = (w[..., None] * torch.where(w[..., None] > 0, o, torch.zeros_like(o))).sum(2)
    res = torch.where(den[..., None] > 0, acc / den.clamp_min(1e-300)[..., None], torch.zeros_like(acc))
    out.copy_(res.reshape(B, Hq, D).to(out.dtype))
    if lse_out is not None:
        nat = torch.where(den > 0, (m[:, :, 0] + torch.log2(den.clamp_min(1e-300))) * math.log(2),
                          torch.full_like(den, float("-inf")))
        lse_out.copy_(nat.reshape(B, Hq).to(lse_out.dtype))
    return out


def ref_paged_decode(qrows, k_pages, v_pages, indptr, pages, sm_scale):
    """What FlashInfer's decode computes over page lists of page size 1 (float64): per row
    r, its G query heads over the pages [indptr[r], indptr[r + 1]) of k_pages / v_pages
    [pages, D]; (o [R, G, D], log2-sum-exp [R, G]; an empty row: 0 and -inf)."""
    R, G, D = qrows.shape
    o = torch.zeros(R, G, D, dtype=torch.float64)
    lse = torch.full((R, G), float("-inf"), dtype=torch.float64)
    for r in range(R):
        p = pages[int(indptr[r]): int(indptr[r + 1])].long()
        if p.numel() == 0:
            continue
        s = qrows[r].double() @ k_pages[p].double().T * sm_scale               # [G, n]
        lse[r] = torch.logsumexp(s, -1) / math.log(2)
        o[r] = torch.softmax(s, -1) @ v_pages[p].double()
    return o, lse
