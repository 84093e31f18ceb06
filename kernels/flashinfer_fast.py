"""SFI fast steps through FlashInfer's BatchDecodeWithPagedKVCacheWrapper.

Page size 1, KV heads folded into the batch: SGLang's per-layer K buffer [slots, H_kv, D]
is viewed as [slots * H_kv, 1 (page size), 1 (KV head), D] (no copy), so page
slot * H_kv + h holds token slot's key of KV head h. Batch row b * H_kv + h carries the G
query heads of KV head h of request b and its own page list: the sinks [0, n_sinks), the
selected positions, the window [win_start, seq_len), all read in place through
req_to_token. Nothing is packed (the Triton path, kernels.fast_decode, reads a packed copy
of sinks + selected instead).

`plan` runs once per decode step: the lists' lengths are the same in every layer (one
selection count per request), and FlashInfer schedules on the host from them (one host
sync per step, as in SGLang's flashinfer backend). `run`, per layer, writes that layer's
page indices (one Triton launch, `build_pages`) into the planned index buffer, then
attends (one FlashInfer launch). Not CUDA-graph capturable as written (plan syncs).
"""

import torch
import triton
import triton.language as tl

from ._common import use_triton

BLOCK_PAGES = 256
WORKSPACE_BYTES = 128 * 2**20


@triton.jit
def _pages_kernel(Req_to_token, Req_pool_indices, Seq_lens, Win_start, N_sinks, Sel_pos,
                  Sel_count, Indptr, Pages, stride_rt, stride_sp_slot, stride_sp_h,
                  H: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    pool = tl.load(Req_pool_indices + b).to(tl.int64)
    ns = tl.load(N_sinks + pool).to(tl.int32)
    plen = ns + tl.load(Sel_count + pool).to(tl.int32)
    ws = tl.load(Win_start + b).to(tl.int32)
    total = plen + tl.maximum(tl.load(Seq_lens + b).to(tl.int32) - ws, 0)
    valid = offs < total
    is_sel = (offs >= ns) & (offs < plen)
    sel = tl.load(Sel_pos + pool * stride_sp_slot + h * stride_sp_h + (offs - ns), mask=valid & is_sel, other=0)
    pos = tl.where(offs < ns, offs, tl.where(is_sel, sel, ws + offs - plen))
    slot = tl.load(Req_to_token + pool * stride_rt + pos, mask=valid, other=0).to(tl.int64)
    base = tl.load(Indptr + b * H + h)
    tl.store(Pages + base + offs, (slot * H + h).to(tl.int32), mask=valid)


def page_counts(req_pool_indices, seq_lens, win_start, n_sinks, sel_count):
    """Pages of each batch row (the same for every KV head and layer) [B] int64."""
    rpi = req_pool_indices.long()
    return (n_sinks[rpi].long() + sel_count[rpi].long()
            + (seq_lens.long() - win_start.long()).clamp_min(0))


def build_pages(req_to_token, req_pool_indices, seq_lens, win_start, n_sinks, sel_pos, sel_count,
                indptr, pages, max_pages: int):
    """Write each folded row's page list into `pages` at indptr[b * H + h]: sinks, then
    sel_pos[pool, h, :sel_count], then the window, as slot * H + h. sel_pos [slots, H, K]
    (one layer); win_start, seq_lens per batch row; n_sinks, sel_count per pool slot."""
    B = req_pool_indices.shape[0]
    H = sel_pos.shape[1]
    if B == 0 or max_pages == 0:
        return pages
    if not use_triton(req_to_token):
        from .reference import ref_build_pages
        return ref_build_pages(req_to_token, req_pool_indices, seq_lens, win_start, n_sinks,
                               sel_pos, sel_count, indptr, pages)
    grid = (B, H, triton.cdiv(max_pages, BLOCK_PAGES))
    _pages_kernel[grid](req_to_token, req_pool_indices, seq_lens, win_start, n_sinks, sel_pos,
                        sel_count, indptr, pages, req_to_token.stride(0), sel_pos.stride(0),
                        sel_pos.stride(1), H=H, BLOCK=BLOCK_PAGES)
    return pages


class FlashInferFastDecode:
    """One decode wrapper (and its workspace) per device; plan once per step, run per layer."""

    def __init__(self, num_kv_heads: int, group: int, head_dim: int, device, dtype,
                 use_tensor_cores: bool = False):
        import flashinfer

        self.H, self.G, self.D, self.dtype = num_kv_heads, group, head_dim, dtype
        self.device = torch.device(device)
        ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_tensor_cores=use_tensor_cores)
        self.indptr = None  # [B * H + 1] int32 on the device, for build_pages
        self.pages = None
        self.max_pages = 0

    def plan(self, counts: torch.Tensor, sm_scale: float) -> None:
        """counts [B]: pages per batch row (page_counts). One host sync (the counts): the
        row offsets are made on the host, where FlashInfer's scheduler reads them."""
        per_row = counts.cpu().to(torch.int32).repeat_interleave(self.H)
        indptr = torch.zeros(per_row.numel() + 1, dtype=torch.int32)
        torch.cumsum(per_row, 0, out=indptr[1:])
        total = int(indptr[-1])
        self.max_pages = int(per_row.max()) if per_row.numel() else 0
        self.indptr = indptr.to(self.device)
        self.pages = torch.zeros(max(total, 1), dtype=torch.int32, device=self.device)
        last = torch.ones(per_row.numel(), dtype=torch.int32)
        self.wrapper.plan(indptr, self.pages[:total], last, self.G, 1, self.D, 1,
                          q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=float(sm_scale))

    def run(self, q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, win_start,
            n_sinks, sel_pos, sel_count, out=None):
        """q [B, H_q, D] -> [B, H_q, D], rows as in the last plan; sel_pos [slots, H, K]."""
        B, Hq, D = q.shape
        build_pages(req_to_token, req_pool_indices, seq_lens, win_start, n_sinks, sel_pos,
                    sel_count, self.indptr, self.pages, self.max_pages)
        kv = (k_cache.view(-1, 1, 1, D), v_cache.view(-1, 1, 1, D))
        o = None if out is None else out.view(B * self.H, self.G, D)
        res = self.wrapper.run(q.reshape(B * self.H, self.G, D), kv, out=o)
        return res.view(B, Hq, D) if out is None else out
