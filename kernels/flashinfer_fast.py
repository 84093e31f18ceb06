"""SFI fast steps through FlashInfer's BatchDecodeWithPagedKVCacheWrapper, inside CUDA graphs.

Page size 1, KV heads folded into the batch: SGLang's per-layer K buffer [slots, H_kv, D]
is viewed as [slots * H_kv, 1 (page size), 1 (KV head), D] (no copy), so page
slot * H_kv + h holds token slot's key of KV head h. The fast list of request b and KV head
h (the sinks [0, n_sinks), the selected positions, the window [win_start, seq_len)) is read
in place through req_to_token: nothing is packed, per request slot nothing is kept but the
positions (SparseMemory.sel_pos).

Why the lists are cut into rows of at most ROW entries. FlashInfer plans on the host from
the lists' lengths, and the lengths depend on the window start, which slow steps decided on
the device (a replayed graph cannot plan). So each (b, h) list, of L <= `cap` entries
(S + K + W + max_interval, the longest a fast step reads), is cut into C = ceil(cap / ROW)
rows of balanced lengths, and every wrapper is planned once, for its batch size, as if each
row held ceil(cap / C) <= ROW entries. At page size 1 FlashInfer's decode never splits a
row shorter than 128 pages (its scheduler's least chunk), so each row is one work tile
whose length the kernel reads from the device indptr at run time (a shorter row, or an
empty one, is read as such: an empty tile writes LSE -inf and output 0). A longer planned
row could be split into tiles that start past its real end, where FlashInfer's chunk
length underflows. The rows' partial outputs are merged by LSE here (`merge_rows`).

Per decode step: `lengths` (one Triton launch) once; per layer: `_lists_kernel` (one Triton
launch: the page lists, the rows' indptr and the query copied to each of its rows),
FlashInfer's decode, `merge_rows` (one Triton launch). No host work, no sync.

The buffers hold CHUNK batch rows at most (0.4 MB a row for Qwen3-4B), not one per request
slot: a larger decode step runs these three launches per chunk of CHUNK rows, each chunk's
lists laid out from the start of the buffers (`lengths` gives offsets within the chunk).
"""

import math

import torch
import triton
import triton.language as tl

from ._common import _memory_row, next_pow2, use_triton

ROW = 128  # entries per FlashInfer row at most (FlashInfer's least split at page size 1)
BLOCK_PAGES = 256
FLOAT_WORKSPACE_BYTES = 32 * 2**20  # split-KV scratch, shared by every batch size's wrapper
INT_WORKSPACE_BYTES = 2**20  # one plan's tile tables (a few int32 per work tile)
CHUNK = 256  # batch rows the buffers hold (a power of two: `lengths` scans chunk by chunk)
LN2 = tl.constexpr(math.log(2.0))


def rows_per_list(cap: int) -> int:
    """C: FlashInfer rows each (request, KV head) list is cut into."""
    return max(1, math.ceil(cap / ROW))


@triton.jit
def _lengths_kernel(Req_pool_indices, Seq_lens, Fast_ws, Packed_len, Len, Start, Ws, Over, B, cap,
                    H: tl.constexpr, NC: tl.constexpr, CH: tl.constexpr):
    i = tl.arange(0, NC)[:, None] * CH + tl.arange(0, CH)[None, :]  # [chunk, row in chunk]
    valid = i < B
    pool = tl.load(Req_pool_indices + i, mask=valid, other=0).to(tl.int64)
    ws = tl.load(Fast_ws + pool, mask=valid, other=0)
    n = tl.load(Seq_lens + i, mask=valid, other=0).to(tl.int64)
    counts = tl.load(Packed_len + pool, mask=valid, other=0).to(tl.int64) + tl.maximum(n - ws, 0)
    counts = tl.where(valid, counts, 0)
    L = tl.minimum(counts, cap)
    tl.store(Len + i, L.to(tl.int32), mask=valid)
    tl.store(Start + i, ((tl.cumsum(L, 1) - L) * H).to(tl.int32), mask=valid)
    tl.store(Ws + i, ws, mask=valid)
    tl.store(Over + i, counts > cap, mask=valid)


def lengths(req_pool_indices, seq_lens, fast_ws, packed_len, cap: int, num_kv_heads: int,
            chunk: int = CHUNK):
    """A decode step's lists, in one launch: (L [B] int32, each (row, KV head) list's
    entries, n_sinks + sel_count + the window [fast_ws, seq_len), capped at cap; start [B]
    int32, where row b's H_kv lists begin in the page buffer (in batch order, from 0 again
    at every `chunk` rows, a power of two); win_start [B] int64, the rows' window starts;
    over [B] bool, lists longer than cap). fast_ws and packed_len (= n_sinks + sel_count)
    are per pool slot. Triton only (the path is CUDA's)."""
    B = req_pool_indices.shape[0]
    dev = seq_lens.device
    L = torch.empty(B, dtype=torch.int32, device=dev)
    start = torch.empty(B, dtype=torch.int32, device=dev)
    ws = torch.empty(B, dtype=torch.int64, device=dev)
    over = torch.empty(B, dtype=torch.bool, device=dev)
    if B:
        CH = max(16, next_pow2(B))
        if B > chunk:  # chunk rows from 0 again (the buffers hold `chunk` rows: a power of two)
            assert chunk == next_pow2(chunk), chunk
            CH = chunk
        _lengths_kernel[(1,)](req_pool_indices, seq_lens, fast_ws, packed_len, L, start, ws, over, B, int(cap),
                              H=num_kv_heads, NC=next_pow2(triton.cdiv(B, CH)), CH=CH)
    return L, start, ws, over


@triton.jit
def _lists_kernel(Q, Qrows, Req_to_token, Req_pool_indices, Len, Start, Win_start, N_sinks,
                  Sel_pos, Sel_count, Indptr, Pages, Row_of, B, stride_qb, stride_qh, stride_rt, stride_sp_slot,
                  stride_sp_h, H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                  C: tl.constexpr, R: tl.constexpr, CP: tl.constexpr, BLOCK: tl.constexpr,
                  HOLES: tl.constexpr, K: tl.constexpr, ROW_OF: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.program_id(2)
    pool = tl.load(Req_pool_indices + b).to(tl.int64)
    L = tl.load(Len + b)
    base = tl.load(Start + b) + h * L
    ns = tl.load(N_sinks + pool).to(tl.int32)
    plen = ns + tl.load(Sel_count + pool).to(tl.int32)
    ws = tl.load(Win_start + b).to(tl.int32)
    sel_row = Sel_pos + _memory_row(Row_of, pool, ROW_OF) * stride_sp_slot + h * stride_sp_h
    Lv = L
    if HOLES:  # whole pages: the head's trailing -1 entries read nothing (they close its region)
        holes = 0
        for e0 in tl.static_range(0, K, BLOCK):
            e = e0 + tl.arange(0, BLOCK)
            x = tl.load(sel_row + e, mask=e < plen - ns, other=0)
            holes += tl.sum((x < 0).to(tl.int32), 0)
        plen = plen - holes
        Lv = L - holes
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    valid = offs < L
    is_sel = (offs >= ns) & (offs < plen)
    sel = tl.load(sel_row + (offs - ns), mask=valid & is_sel, other=0)
    pos = tl.where(offs < ns, offs, tl.where(is_sel, sel, ws + offs - plen))
    pos = tl.where(offs < Lv, pos, 0)  # past the head's list: a page no row reads
    slot = tl.load(Req_to_token + pool * stride_rt + pos, mask=valid, other=0).to(tl.int64)
    tl.store(Pages + base + offs, (slot * H + h).to(tl.int32), mask=valid)
    if blk == 0:
        # the C rows of this list: row c holds entries [c * Lv // C, (c + 1) * Lv // C); with
        # HOLES one more row (its output unread) holds the rest of the region, [Lv, L)
        c = tl.arange(0, CP)
        row = (b * H + h) * R + c
        tl.store(Indptr + row, base + (c * Lv) // C, mask=c < R)
        tl.store(Indptr + B * H * R + c * 0, base + L, mask=(c == 0) & (b == B - 1) & (h == H - 1))
        # the query of this KV head's G heads, once per row
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        gmask = (g < G)[:, None] & (d < D)[None, :]
        qv = tl.load(Q + b * stride_qb + (h * G + g)[:, None] * stride_qh + d[None, :], mask=gmask, other=0.0)
        for r in tl.static_range(R):
            dst = Qrows + (((b * H + h) * R + r) * G + g)[:, None].to(tl.int64) * D + d[None, :]
            tl.store(dst, qv, mask=gmask)


def build_lists(q, req_to_token, req_pool_indices, L, start, seq_lens, win_start, n_sinks, sel_pos,
                sel_count, indptr, pages, qrows, C: int, max_len: int, holes: bool = False, row_of=None):
    """One layer's FlashInfer inputs: pages[start[b] + h * L[b] + i] = the KV page of entry i
    of (b, h)'s list (sinks, sel_pos[pool, h, :sel_count], window, as slot * H + h; L[b]
    entries), indptr of the B * H * R rows (row (b * H + h) * R + c, R = C), and qrows
    [B * H * R, G, D] = q [B, H * G, D] of the row's KV head. max_len >= max(L) (a host bound).
    holes (whole pages, --sfi-selection-page): a head's -1 entries (trailing: the Selector's
    pages are sorted, -1 padded) are left out of its list, whose C rows end that many entries
    early; R = C + 1, the last row holding the rest of the region (its output unread).
    row_of [slots] int32, optional: sel_pos holds slot p's positions at row row_of[p]."""
    B, Hq, D = q.shape
    H = sel_pos.shape[1]
    if B == 0:
        return
    if not use_triton(q):
        from .reference import ref_build_lists
        ref_build_lists(q, req_to_token, req_pool_indices, L, start, seq_lens, win_start, n_sinks,
                        sel_pos, sel_count, indptr, pages, qrows, C, holes, row_of)
        return
    G, R = Hq // H, C + int(holes)
    grid = (B, H, max(1, triton.cdiv(max_len, BLOCK_PAGES)))
    _lists_kernel[grid](q, qrows, req_to_token, req_pool_indices, L, start, win_start, n_sinks,
                        sel_pos, sel_count, indptr, pages, row_of if row_of is not None else L, B, q.stride(0), q.stride(1),
                        req_to_token.stride(0), sel_pos.stride(0), sel_pos.stride(1), H=H, G=G,
                        GP=next_pow2(G), D=D, C=C, R=R, CP=next_pow2(R), BLOCK=BLOCK_PAGES,
                        HOLES=bool(holes), K=sel_pos.shape[2], ROW_OF=row_of is not None)


@triton.jit
def _merge_kernel(O, Lse, Out, Lse_out, stride_ob, stride_oh, H: tl.constexpr, G: tl.constexpr,
                  D: tl.constexpr, C: tl.constexpr, R: tl.constexpr, CP: tl.constexpr, HAS_LSE: tl.constexpr):
    b = tl.program_id(0)
    hq = tl.program_id(1)
    h = hq // G
    g = hq % G
    c = tl.arange(0, CP)
    d = tl.arange(0, D)
    row = ((b * H + h) * R + c).to(tl.int64)
    lse = tl.load(Lse + row * G + g, mask=c < C, other=float("-inf"))  # log2 (FlashInfer's)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - m))
    o = tl.load(O + (row * G + g)[:, None] * D + d[None, :], mask=(c < C)[:, None], other=0.0).to(tl.float32)
    o = tl.where(w[:, None] > 0, o, 0.0)
    den = tl.sum(w, 0)
    acc = tl.sum(w[:, None] * o, 0)
    res = tl.where(den > 0, acc / tl.where(den > 0, den, 1.0), 0.0)
    tl.store(Out + b * stride_ob + hq * stride_oh + d, res.to(Out.dtype.element_ty))
    if HAS_LSE:
        lse_nat = tl.where(den > 0, (m + tl.log2(tl.where(den > 0, den, 1.0))) * LN2, float("-inf"))
        tl.store(Lse_out + b * (H * G) + hq, lse_nat)


def merge_rows(o_rows, lse_rows, out, C: int, lse_out=None, R: int = 0):
    """out [B, H_q, D] = each (b, head)'s first C of R (default C) row outputs o_rows
    [B * H * R, G, D] merged by their log2-sum-exps lse_rows [B * H * R, G] (empty rows: LSE
    -inf, weight 0; a list with no entry gives 0). lse_out [B, H_q] float32, optional: the
    natural log-sum-exp over the whole list."""
    B, Hq, D = out.shape
    if B == 0:
        return out
    G = o_rows.shape[1]
    if not use_triton(out):
        from .reference import ref_merge_rows
        return ref_merge_rows(o_rows, lse_rows, out, C, lse_out, R or C)
    _merge_kernel[(B, Hq)](o_rows, lse_rows, out, lse_out if lse_out is not None else lse_rows,
                           out.stride(0), out.stride(1), H=Hq // G, G=G, D=D, C=C, R=R or C,
                           CP=next_pow2(C), HAS_LSE=lse_out is not None)
    return out


class FlashInferFastDecode:
    """The FlashInfer fast path of one server: buffers for min(max_rows, CHUNK) batch rows
    (`rows`; a larger step runs chunk by chunk) and one planned fa2 decode wrapper per chunk
    size (planned once, on the host, before the batch size's first step or graph capture:
    `plan`); `run` per layer is device work only."""

    def __init__(self, num_kv_heads: int, group: int, head_dim: int, cap: int, max_rows: int,
                 device, dtype, holes: bool = False, kv_dtype=None):
        # dtype: the queries' (and outputs'); kv_dtype: the KV cache's (fp8: read at unit scales)
        self.H, self.G, self.D, self.dtype = num_kv_heads, group, head_dim, dtype
        self.kv_dtype = kv_dtype or dtype
        self.cap, self.C = int(cap), rows_per_list(cap)
        self.holes = bool(holes)  # whole pages: one more row per list (build_lists)
        self.R = self.C + int(self.holes)
        self.row_len = math.ceil(self.cap / self.C)
        self.device = torch.device(device)
        self.rows = min(int(max_rows), CHUNK)
        rows = self.rows * self.H * self.R
        dev = self.device
        self.indptr = torch.zeros(rows + 1, dtype=torch.int32, device=dev)
        self.last_page_len = torch.ones(rows, dtype=torch.int32, device=dev)
        # room for every row at its planned length (>= the lists' cap entries per (b, h))
        self.pages = torch.zeros(max(1, rows * self.row_len), dtype=torch.int32, device=dev)
        self.qrows = torch.zeros(rows, self.G, head_dim, dtype=dtype, device=dev)
        self.o_rows = torch.zeros(rows, self.G, head_dim, dtype=dtype, device=dev)
        self.lse_rows = torch.zeros(rows, self.G, dtype=torch.float32, device=dev)
        self.float_ws = None
        self.wrappers: dict[int, object] = {}

    def buffers(self) -> list:
        """The tensors sized by the batch rows (SparseMemory.bytes counts them)."""
        return [self.indptr, self.last_page_len, self.pages, self.qrows, self.o_rows, self.lse_rows]

    def chunks(self, B: int) -> list:
        """The batch rows [s, e) of a step of B rows that run together."""
        return [(s, min(B, s + self.rows)) for s in range(0, B, self.rows)]

    def plan(self, B: int, sm_scale: float) -> None:
        """Host: make and plan the wrappers a step of B rows runs (one per chunk size), once
        (not while a graph is captured)."""
        for s, e in self.chunks(B):
            self._plan(e - s, sm_scale)

    def _plan(self, B: int, sm_scale: float) -> None:
        if B in self.wrappers or B == 0:
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"SFI: the FlashInfer fast path was not planned for batch size {B} "
                               "before its CUDA graph capture")
        import flashinfer

        if self.float_ws is None:
            self.float_ws = torch.zeros(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        n = B * self.H * self.R
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.float_ws, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=self.indptr[:n + 1],
            paged_kv_indices_buffer=self.pages, paged_kv_last_page_len_buffer=self.last_page_len[:n],
            backend="fa2")
        w.reset_workspace_buffer(self.float_ws, torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8,
                                                            device=self.device))
        indptr = torch.arange(n + 1, dtype=torch.int32) * self.row_len
        w.plan(indptr, torch.zeros(n * self.row_len, dtype=torch.int32), torch.ones(n, dtype=torch.int32),
               self.G, 1, self.D, 1, q_data_type=self.dtype, kv_data_type=self.kv_dtype,
               sm_scale=float(sm_scale))
        self.wrappers[B] = w

    def run(self, q, k_cache, v_cache, req_to_token, req_pool_indices, L, start, seq_lens, win_start,
            n_sinks, sel_pos, sel_count, out=None, lse_out=None, row_of=None):
        """q [B, H_q, D] -> [B, H_q, D] over each row's lists (L, start from `lengths` with
        chunk=rows); sel_pos [slots, H, K] of this layer (by memory row: row_of). The
        wrappers of B (`plan`) must be planned."""
        B, Hq, D = q.shape
        if out is None:
            out = q.new_empty(q.shape)
        kv = (k_cache.view(-1, 1, 1, D), v_cache.view(-1, 1, 1, D))
        for s, e in self.chunks(B):
            n = (e - s) * self.H * self.R
            build_lists(q[s:e], req_to_token, req_pool_indices[s:e], L[s:e], start[s:e], seq_lens[s:e],
                        win_start[s:e], n_sinks, sel_pos, sel_count, self.indptr, self.pages, self.qrows,
                        self.C, self.cap, self.holes, row_of)
            self.wrappers[e - s].run(self.qrows[:n], kv, out=self.o_rows[:n], lse=self.lse_rows[:n],
                                     return_lse=True)
            merge_rows(self.o_rows[:n], self.lse_rows[:n], out[s:e], self.C,
                       None if lse_out is None else lse_out[s:e], self.R)
        return out
