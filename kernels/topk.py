"""Exact top-k positions of a ranking key, by radix select (no sort, no host sync).

topk_positions(key [B, H, N] float32, k) -> [B, H, k] int64: the positions of the k
largest keys of each row, in ascending position order, the positions whose key is -inf
dropped and the tail padded with -1. The same function as sfi_sglang.method.selector's torch
path (`torch.topk` + drop -inf + sort), with one documented tie rule:

    ties at the k-th value are broken by position, the lowest positions first
    (the rule of torch.topk's CUDA radix select, which also compares the key bits below).

Order: keys are compared as the usual order-preserving uint32 map of the float32 bits
(x >= 0: bits | 2^31, x < 0: ~bits), as torch's radix select does: -0.0 ranks below +0.0;
keys must not be NaN (the Selector never produces one).

Algorithm, per row, all launches over a (rows, chunks) grid so that 8-64 rows of 8K-128K
still fill the GPU:
  1. six histogram passes over the ordered bits, 6+6+5+5+5+5 bits (64 bins each,
     tl.histogram, merged across the programs of a row with atomics into hist[pass, row]).
     Pass p first re-derives, from passes < p, the bits of the k-th value found so far
     (a 64-entry suffix sum per pass, recomputed by every program: no extra launch) and
     counts only the elements that still match them; tiles with no match skip the
     histogram, so passes 3-6 cost little more than a read of the key.
     After pass 6 every program knows t (the k-th largest, as ordered bits) and
     r = how many keys equal to t are taken.
  2. count: per (row, chunk) the number of keys > t and == t.
  3. write: each chunk's output offset from the counts of the chunks before it (exclusive
     prefix, in-program), then a stable in-order compaction (tl.cumsum) of the positions
     with key > t, or key == t and rank among the equal ones < r; keys equal to -inf are
     never written; the last chunk pads [total, k) with -1.
Nine launches (a zero-fill, six passes, count, write); the key is read eight times
(34 MB at 128K B=8, mostly from L2).
"""

import torch
import triton
import triton.language as tl

from ._common import next_pow2, num_sms

NB = 64          # histogram bins per pass
NPASS = 6        # digit widths 6, 6, 5, 5, 5, 5 (sum 32)
ORD_NEG_INF = 0x007FFFFF   # ordered bits of float32 -inf


@triton.jit
def _ordered(x):
    u = x.to(tl.uint32, bitcast=True)
    return tl.where((u >> 31) == 1, u ^ 0xFFFFFFFF, u | 0x80000000)


WIDTHS = (6, 6, 5, 5, 5, 5)
SHIFTS = (26, 20, 15, 10, 5, 0)   # bits below the digit of each pass


@triton.jit
def _derive(Hist, row, rows, k, NDONE: tl.constexpr, NBINS: tl.constexpr):
    """(prefix, r) after passes 0..NDONE-1: prefix = the top bits of the k-th largest
    ordered key (uint32), r = how many keys with exactly those top bits are still taken."""
    offs = tl.arange(0, NBINS)
    prefix = tl.zeros([], tl.uint32)
    r = tl.zeros([], tl.int32) + k
    for p in tl.static_range(NDONE):
        h = tl.load(Hist + (p * rows + row) * NBINS + offs)
        tot = tl.sum(h, 0)
        incl = tot - tl.cumsum(h, 0) + h            # keys in bins >= b
        b = tl.max(tl.where(incl >= r, offs, -1), 0)
        hb = tl.sum(tl.where(offs == b, h, 0), 0)
        ib = tl.sum(tl.where(offs == b, incl, 0), 0)
        r = r - (ib - hb)
        if p < 2:
            prefix = (prefix << 6) | b.to(tl.uint32)
        else:
            prefix = (prefix << 5) | b.to(tl.uint32)
    return prefix, r


@triton.jit(do_not_specialize=["rows"])
def _hist_kernel(Key, Hist, rows, N, CHUNK, k,
                 PASS: tl.constexpr, SHIFT: tl.constexpr, PREV_SHIFT: tl.constexpr,
                 DMASK: tl.constexpr, NBINS: tl.constexpr, BLOCK: tl.constexpr,
                 USE_HIST: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    prefix, r = _derive(Hist, row, rows, k, PASS, NBINS)
    base = Key + row.to(tl.int64) * N
    c0 = c * CHUNK
    c1 = tl.minimum(c0 + CHUNK, N)
    offs_b = tl.arange(0, NBINS)
    acc = tl.zeros([NBINS], tl.int32)
    for n0 in range(c0, c1, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        inb = offs < c1
        o = _ordered(tl.load(base + offs, mask=inb, other=float("-inf")))
        if PASS == 0:
            match = inb
        else:
            match = inb & ((o >> PREV_SHIFT) == prefix)
        if tl.sum(match.to(tl.int32), 0) > 0:
            d = ((o >> SHIFT) & DMASK).to(tl.int32)
            if USE_HIST:
                acc += tl.histogram(d, NBINS, mask=match)
            else:
                acc += tl.sum(((d[:, None] == offs_b[None, :]) & match[:, None]).to(tl.int32), 0)
    tl.atomic_add(Hist + (PASS * rows + row) * NBINS + offs_b, acc, mask=acc > 0)


@triton.jit
def _threshold(Hist, row, rows, k, ALL: tl.constexpr, NBINS: tl.constexpr):
    if ALL:   # N <= k: every key is taken (t = -inf, no ties needed)
        t = tl.zeros([], tl.uint32) + 0x007FFFFF
        r = tl.zeros([], tl.int32)
    else:
        t, r = _derive(Hist, row, rows, k, 6, NBINS)
    return t, r


@triton.jit(do_not_specialize=["rows", "NC"])
def _count_kernel(Key, Hist, Counts, rows, N, CHUNK, k, NC,
                  ALL: tl.constexpr, NBINS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    t, r = _threshold(Hist, row, rows, k, ALL, NBINS)
    base = Key + row.to(tl.int64) * N
    c0 = c * CHUNK
    c1 = tl.minimum(c0 + CHUNK, N)
    n_gt = tl.zeros([], tl.int32)
    n_eq = tl.zeros([], tl.int32)
    for n0 in range(c0, c1, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        inb = offs < c1
        o = _ordered(tl.load(base + offs, mask=inb, other=float("-inf")))
        n_gt += tl.sum((inb & (o > t)).to(tl.int32), 0)
        n_eq += tl.sum((inb & (o == t)).to(tl.int32), 0)
    tl.store(Counts + (row * NC + c) * 2, n_gt)
    tl.store(Counts + (row * NC + c) * 2 + 1, n_eq)


@triton.jit(do_not_specialize=["rows", "NC"])
def _write_kernel(Key, Hist, Counts, Out, rows, N, CHUNK, k, NC,
                  ALL: tl.constexpr, NBINS: tl.constexpr, BLOCK: tl.constexpr,
                  BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    t, r = _threshold(Hist, row, rows, k, ALL, NBINS)
    t_fin = t != 0x007FFFFF                         # keys equal to -inf are never written
    offs_c = tl.arange(0, BLOCK_C)
    cm = offs_c < NC
    gt = tl.load(Counts + (row * NC + offs_c) * 2, mask=cm, other=0)
    eq = tl.load(Counts + (row * NC + offs_c) * 2 + 1, mask=cm, other=0)
    before = offs_c < c
    gt_before = tl.sum(tl.where(before, gt, 0), 0)
    eq_before = tl.sum(tl.where(before, eq, 0), 0)
    tot_eq = tl.sum(eq, 0)
    out_pos = gt_before + tl.where(t_fin, tl.minimum(eq_before, r), 0)
    base = Key + row.to(tl.int64) * N
    obase = Out + row.to(tl.int64) * k
    c0 = c * CHUNK
    c1 = tl.minimum(c0 + CHUNK, N)
    eq_rank0 = eq_before
    for n0 in range(c0, c1, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        inb = offs < c1
        o = _ordered(tl.load(base + offs, mask=inb, other=float("-inf")))
        is_eq = (inb & (o == t)).to(tl.int32)
        eq_rank = eq_rank0 + tl.cumsum(is_eq, 0) - is_eq
        take = (inb & (o > t)) | ((is_eq > 0) & (eq_rank < r) & t_fin)
        ti = take.to(tl.int32)
        pos = out_pos + tl.cumsum(ti, 0) - ti
        tl.store(obase + pos, offs.to(tl.int64), mask=take & (pos < k))
        out_pos += tl.sum(ti, 0)
        eq_rank0 += tl.sum(is_eq, 0)
    if c == NC - 1:
        total = tl.sum(gt, 0) + tl.where(t_fin, tl.minimum(tot_eq, r), 0)
        for p0 in range(0, k, BLOCK_K):
            offs_k = p0 + tl.arange(0, BLOCK_K)
            tl.store(obase + offs_k, tl.full([BLOCK_K], -1, tl.int64), mask=(offs_k >= total) & (offs_k < k))


_USE_HIST = [True]
PROGRAMS_PER_SM = 4  # _grid's target: rows x chunks


# rows (B x H) and the chunk count follow the batch and the context: neither is a
# constexpr or specialized on (do_not_specialize above), and BLOCK_C covers the most
# chunks _grid makes on this device, so a new batch or context builds no new variant.
def _max_chunks(device):
    return next_pow2(PROGRAMS_PER_SM * num_sms(device))


def _grid(rows, N, block, device):
    target = PROGRAMS_PER_SM * num_sms(device)
    nc = max(1, min(triton.cdiv(target, max(1, rows)), triton.cdiv(N, block)))
    chunk = triton.cdiv(triton.cdiv(N, nc), block) * block
    nc = triton.cdiv(N, chunk)
    return nc, chunk


def topk_positions(key: torch.Tensor, k: int, block: int = 1024, num_warps: int = 4,
                   use_hist=None) -> torch.Tensor:
    """[B, H, k] int64 positions of the k largest keys per row (see the module doc).
    key [B, H, N] float32 (made contiguous), -inf = never chosen. No host sync."""
    assert key.dim() == 3
    B, H, N = key.shape
    out = torch.empty((B, H, k), dtype=torch.int64, device=key.device)
    rows = B * H
    if rows == 0 or k == 0:
        return out
    if N == 0:
        return out.fill_(-1)
    key = key.contiguous().float()
    nc, chunk = _grid(rows, N, block, key.device)
    all_taken = N <= k
    hist = torch.zeros((NPASS, rows, NB), dtype=torch.int32, device=key.device)
    counts = torch.empty((rows, nc, 2), dtype=torch.int32, device=key.device)
    uh = _USE_HIST[0] if use_hist is None else use_hist
    if not all_taken:
        for p in range(NPASS):
            args = (key, hist, rows, N, chunk, k)
            cx = dict(PASS=p, SHIFT=SHIFTS[p], PREV_SHIFT=SHIFTS[p - 1] if p else 0,
                      DMASK=(1 << WIDTHS[p]) - 1, NBINS=NB, BLOCK=block, num_warps=num_warps)
            try:
                _hist_kernel[(rows, nc)](*args, USE_HIST=uh, **cx)
            except Exception:
                if not uh or use_hist is not None:
                    raise
                # tl.histogram did not compile here: one-hot counts instead (same result)
                _USE_HIST[0] = uh = False
                _hist_kernel[(rows, nc)](*args, USE_HIST=False, **cx)
    _count_kernel[(rows, nc)](key, hist, counts, rows, N, chunk, k, nc, ALL=all_taken,
                              NBINS=NB, BLOCK=block, num_warps=num_warps)
    _write_kernel[(rows, nc)](key, hist, counts, out, rows, N, chunk, k, nc, ALL=all_taken,
                              NBINS=NB, BLOCK=block, BLOCK_C=_max_chunks(key.device),
                              BLOCK_K=1024, num_warps=num_warps)
    return out
