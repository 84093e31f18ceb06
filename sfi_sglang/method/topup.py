"""SFI's per-step top-up (--sfi-topup-pages, docs/method.md): the pages a fast step reads
besides its memory, chosen per sparse layer, or at the first sparse layer of each group of
--sfi-topup-every and reused by the group's others. One home for the device step (the
`sfi` backend, inside CUDA graphs) and the host path (baselines.HostPath, per request).

The pages come from sfi_sglang.kernels.topup (Triton on CUDA, its torch reference on the
CPU); SparseMemory.attend_fast reads them as `extra`."""

from __future__ import annotations

from typing import Optional

import torch


def layer_pages(memory, lid: int, cfg, q, k_cache, req_to_token, req_pool_indices, seq_lens,
                group: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The top-up of one fast step at sparse layer lid for rows req_pool_indices [B] (q
    [B, H_q, D]): page indices [B, H_kv, cfg.topup_pages] int32 counted from the sinks
    (pages of cfg.page_size tokens; -1: none). At the first layer of a group (or without
    `group`, the pages chosen at the group's first layer this step) the best pages of
    [sinks, window start) holding none of this layer's selection; else `group` less the
    pages holding a position this layer holds. No host sync."""
    from sfi_sglang import kernels

    li = memory.layer_index[lid]
    held, row_of = memory.sel_pos[li], memory.rows.kernel_arg()
    rpi = req_pool_indices.to(memory.device).long()
    if group is not None and not is_group_start(memory, lid, cfg):
        return kernels.drop_held(group, rpi, held, cfg.sinks, cfg.page_size, row_of=row_of)
    return kernels.choose_topup(q, k_cache, req_to_token, rpi, seq_lens, memory.win_start[rpi], held,
                                cfg.sinks, cfg.page_size, cfg.topup_pages,
                                req_to_token.shape[1] // cfg.page_size, row_of=row_of)


def is_group_start(memory, lid: int, cfg) -> bool:
    """Whether sparse layer lid chooses its own pages (the first of its group of topup_every)."""
    return cfg.sparse_layers(memory.num_layers).index(lid) % cfg.topup_every == 0


class StepTopUp:
    """The device step's top-up with the server's config: layer_pages for every row of
    the batch, the group's pages kept from its first layer to the next (layers run in
    order within a step, so a captured graph replays the same dependence)."""

    def __init__(self, memory, cfg):
        self.memory, self.cfg = memory, cfg
        self._group: Optional[torch.Tensor] = None

    def pages(self, lid: int, q, k_cache, req_to_token, req_pool_indices, seq_lens) -> torch.Tensor:
        if is_group_start(self.memory, lid, self.cfg):
            self._group = None
        pages = layer_pages(self.memory, lid, self.cfg, q, k_cache, req_to_token, req_pool_indices, seq_lens,
                            self._group)
        if self._group is None:
            self._group = pages
        return pages
