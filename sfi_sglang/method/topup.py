"""SFI's per-step top-up (--sfi-topup-pages, docs/method.md): the pages a fast step reads
besides its memory, chosen per sparse layer, or at the first sparse layer of each group of
--sfi-topup-every and reused by the group's others. One home for the device step (the
`sfi` backend, inside CUDA graphs) and the host path (baselines.HostPath, per request).

The pages come from sfi_sglang.kernels.topup (Triton on CUDA, its torch reference on the
CPU); SparseMemory.attend_fast reads them as `extra`. They start at cfg.topup_lo, the first
page boundary past the sinks. PageSummaries keeps the pool pages' key min/max for the
device step where SGLang's pool comes in the top-up's pages."""

from __future__ import annotations

from typing import Optional

import torch


def _choose(memory, li: int, cfg, q, k_cache, req_to_token, rpi, seq_lens, win_start, summ=None) -> torch.Tensor:
    """The best pages of [topup_lo, window start) holding none of sel_pos[li]
    (kernels.choose_topup; from the pool pages' summaries summ when given)."""
    from sfi_sglang import kernels

    return kernels.choose_topup(q, k_cache, req_to_token, rpi, seq_lens, win_start, memory.sel_pos[li],
                                cfg.topup_lo, cfg.page_size, cfg.topup_pages, req_to_token.shape[1] // cfg.page_size,
                                row_of=memory.rows.kernel_arg(), summ=summ)


def layer_pages(memory, lid: int, cfg, q, k_cache, req_to_token, req_pool_indices, seq_lens,
                group: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The top-up of one fast step at sparse layer lid for rows req_pool_indices [B] (q
    [B, H_q, D]): page indices [B, H_kv, cfg.topup_pages] int32 counted from cfg.topup_lo
    (pages of cfg.page_size tokens; -1: none). At the first layer of a group (or without
    `group`, the pages chosen at the group's first layer this step) the best pages of
    [topup_lo, window start) holding none of this layer's selection; else `group` less the
    pages holding a position this layer holds. No host sync."""
    from sfi_sglang import kernels

    li = memory.layer_index[lid]
    rpi = req_pool_indices.to(memory.device).long()
    if group is not None and not is_group_start(memory, lid, cfg):
        return kernels.drop_held(group, rpi, memory.sel_pos[li], cfg.topup_lo, cfg.page_size,
                                 row_of=memory.rows.kernel_arg())
    return _choose(memory, li, cfg, q, k_cache, req_to_token, rpi, seq_lens, memory.win_start[rpi])


def is_group_start(memory, lid: int, cfg) -> bool:
    """Whether sparse layer lid chooses its own pages (the first of its group of topup_every)."""
    return lid in cfg.topup_layers(memory.num_layers)


class StepTopUp:
    """The device step's top-up with the server's config, what layer_pages gives for every
    row of the batch in fewer launches: the rows' window starts gathered once per step (at
    its first sparse layer), and at a group's first layer, besides its own choice, the
    group's pages less each later layer's held ones in one drop_held launch over their
    selections (layers run in order within a step, so a captured graph replays the same
    dependence; a slow row's selection stored mid-group changes only its fast output,
    which its dense pass replaces). With `summaries` (PageSummaries) the choice scores
    their rows, not the keys."""

    def __init__(self, memory, cfg, summaries: Optional["PageSummaries"] = None):
        self.memory, self.cfg, self.summaries = memory, cfg, summaries
        sparse = [lid for lid in cfg.sparse_layers(memory.num_layers) if lid in memory.layer_index]
        self._first = sparse[0] if sparse else None
        # a group's first layer -> the span of sel_pos rows of its later layers (a view: a row
        # between them that no sparse layer reads, a dense layer's, is dropped for nothing);
        # a later layer -> its index in that span
        self._later: dict[int, Optional[slice]] = {}
        self._slot: dict[int, int] = {}
        e = cfg.topup_every
        for k in range(0, len(sparse), e):
            lis = [memory.layer_index[lid] for lid in sparse[k + 1:k + e]]
            self._later[sparse[k]] = slice(lis[0], lis[-1] + 1) if lis else None
            self._slot.update({lid: li - lis[0] for lid, li in zip(sparse[k + 1:k + e], lis)})
        self._rows = None    # (req_pool_indices as int64, their window starts) of this step
        self._group = None   # [group's later layers, B, H_kv, P]: their pages this step

    def pages(self, lid: int, q, k_cache, req_to_token, req_pool_indices, seq_lens) -> torch.Tensor:
        from sfi_sglang import kernels

        mem, cfg = self.memory, self.cfg
        if lid == self._first or self._rows is None:
            rpi = req_pool_indices.to(mem.device).long()
            self._rows = (rpi, mem.win_start[rpi])
        rpi, ws = self._rows
        if lid not in self._later:
            return self._group[self._slot[lid]]
        summ = None if self.summaries is None else self.summaries.layers[lid]
        pages = _choose(mem, mem.layer_index[lid], cfg, q, k_cache, req_to_token, rpi, seq_lens, ws, summ)
        later = self._later[lid]
        if later is not None:
            self._group = kernels.drop_held(pages, rpi, mem.sel_pos[later], cfg.topup_lo, cfg.page_size,
                                            row_of=mem.rows.kernel_arg())
        return pages


class PageSummaries:
    """The pool pages' per-channel key minimum and maximum (kernels.summarize_pages) at the
    layers that choose top-up pages (cfg.topup_layers), kept as keys are written, where
    SGLang's pool comes in pages of the top-up's (--page-size equal to --sfi-page-size): a
    request's pages are then whole pool pages, so the choice reads two rows per page and
    KV head instead of its keys (1/8 of their bytes at 16-token pages; bench/NOTES.md
    section 54), and requests sharing a radix prefix share its pages' summaries. One
    [pool pages, H_kv, 2, D] tensor per such layer, in K's dtype (min and max are exact)."""

    def __init__(self, layers, tokens: int, num_kv_heads: int, head_dim: int, page: int, dtype, device):
        self.page = int(page)
        shape = (-(-tokens // self.page), num_kv_heads, 2, head_dim)
        self.layers = {lid: torch.zeros(shape, dtype=dtype, device=device) for lid in layers}

    @staticmethod
    def wanted(cfg, server_page_size: int) -> bool:
        """Whether the `sfi` backend keeps them: the device step's top-up on, over SGLang's
        pool pages of cfg.page_size tokens."""
        return bool(cfg.topup_pages) and cfg.method == "sfi" and int(server_page_size) == cfg.page_size

    @classmethod
    def token_bytes(cls, cfg, server_page_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                    itemsize: int) -> float:
        """Their bytes per KV-pool token (the pool's budget sets them aside: memory.kv_budget)."""
        if not cls.wanted(cfg, server_page_size):
            return 0.0
        return len(cfg.topup_layers(num_layers)) * num_kv_heads * 2 * head_dim * itemsize / cfg.page_size

    def store(self, lid: int, k_cache: torch.Tensor, locs: torch.Tensor) -> None:
        """After layer lid's keys were written at locs (a forward's out_cache_loc)."""
        summ = self.layers.get(lid)
        if summ is not None:
            from sfi_sglang import kernels

            kernels.summarize_pages(k_cache, summ, locs, self.page)

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers.values())
