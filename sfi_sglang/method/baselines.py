"""Baselines run by the same backend at the same token budget (S + W + K per KV head), for
the quality evaluation: StreamingLLM, SnapKV-style and Quest-style selection.

SFI itself is selector.py; these functions only decide positions. Shapes follow
selector.py: H = KV heads, G = query heads per KV head, n = context length. `HostPath` runs
them (and requests whose options the device step cannot serve) in eager decode steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SNAPKV_POOL = 7  # SnapKV's 1-D max-pooling kernel over positions


def streaming_window_start(n: int, sinks: int, window: int, budget: int) -> int:
    """StreamingLLM: sinks + a sliding window of the last window + budget tokens."""
    return min(n, max(sinks, n - window - budget))


def snapkv_select(logits: torch.Tensor, lo: int, hi: int, k: int) -> torch.Tensor:
    """SnapKV-style selection, once, from the observation rows.

    logits [H, R', n] (R' = G query heads x observation rows; -inf where masked): each
    row's attention (softmax over the whole context) is summed over rows, max-pooled over
    neighbouring positions, and the top k candidates of [lo, hi) are kept per KV head.
    Returns positions [H, min(k, hi - lo)] sorted ascending."""
    probs = torch.softmax(logits.float(), dim=-1).nan_to_num(0.0)
    score = probs.sum(dim=1)  # [H, n]
    score = F.max_pool1d(score[:, None, :], SNAPKV_POOL, stride=1, padding=SNAPKV_POOL // 2)[:, 0]
    cand = score[:, lo:hi]
    count = min(k, hi - lo)
    top = cand.topk(count, dim=-1).indices + lo
    return top.sort(dim=-1).values


def page_bounds(q: torch.Tensor, keys: torch.Tensor, lo: int, num_pages: int, page: int) -> torch.Tensor:
    """Quest's score [H, num_pages] of the pages of `page` tokens from lo: per KV head, the
    max over the group's query heads q [H, G, D] of sum_d max(q_d * kmin_d, q_d * kmax_d),
    an upper bound of q.k on the page (keys [n, H, D], the request's)."""
    blk = keys[lo: lo + num_pages * page].float().reshape(num_pages, page, *keys.shape[1:])
    kmin, kmax = blk.amin(dim=1), blk.amax(dim=1)  # [P, H, D]
    qf = q.float()[:, :, None, :]  # [H, G, 1, D]
    bound = torch.maximum(qf * kmin.transpose(0, 1)[:, None], qf * kmax.transpose(0, 1)[:, None])
    return bound.sum(-1).amax(dim=1)


def page_positions(pages: torch.Tensor, lo: int, page: int) -> torch.Tensor:
    """Positions [H, pages * page] of page indices [H, pages] counted from lo."""
    pos = lo + pages[:, :, None] * page + torch.arange(page, device=pages.device)
    return pos.reshape(pages.shape[0], -1)


def quest_positions(q: torch.Tensor, keys: torch.Tensor, lo: int, hi: int, k: int,
                    page: int) -> torch.Tensor:
    """Quest-style query-aware page selection for one decode step.

    q [H, G, D] this step's queries, keys [n, H, D] the request's keys. Candidates are the
    whole pages of `page` tokens inside [lo, hi), scored by page_bounds; the top k // page
    pages are kept per KV head. Returns positions [H, pages * page] sorted ascending."""
    num_pages = (hi - lo) // page
    take = min(k // page, num_pages)
    if take <= 0:
        return torch.empty(q.shape[0], 0, dtype=torch.int64, device=q.device)
    score = page_bounds(q, keys, lo, num_pages, page)
    return page_positions(score.topk(take, dim=-1).indices.sort(dim=-1).values, lo, page)


def topup_positions(q: torch.Tensor, keys: torch.Tensor, held: torch.Tensor, lo: int, hi: int,
                    pages: int, page: int) -> torch.Tensor:
    """SFI's per-step top-up: the `pages` whole pages of [lo, hi) (hi: the window's start)
    with the highest page_bounds among those holding none of the held selection held [H, K]
    (-1 padded), so every position read is one the memory lacks (a page partly held is
    where the Selector already looked). Returns positions [H, <= pages * page], -1 padded
    where fewer pages qualify."""
    num_pages = (hi - lo) // page
    take = min(pages, num_pages)
    if take <= 0:
        return torch.empty(q.shape[0], 0, dtype=torch.int64, device=q.device)
    score = page_bounds(q, keys, lo, num_pages, page)
    held = held.long().to(score.device)
    inside = (held >= lo) & (held < lo + num_pages * page)
    covered = torch.zeros(score.shape[0], num_pages + 1, device=score.device)
    covered.scatter_add_(1, torch.where(inside, (held - lo) // page, num_pages), inside.float())
    score = score.masked_fill(covered[:, :num_pages] > 0, float("-inf"))
    top = score.topk(take, dim=-1)
    pos = page_positions(top.indices, lo, page)
    return pos.masked_fill(top.values.isinf().repeat_interleave(page, dim=1), -1)


def baseline_positions(cfg, n: int, q, k_cache, tokens) -> torch.Tensor:
    """Positions [H_kv, L] of a StreamingLLM or Quest fast step at context length n
    (sinks, then the method's middle part, then the window; ascending and disjoint).
    q [H_q, D] is this step's query (Quest uses it)."""
    hkv = k_cache.shape[1]
    dev = tokens.device
    sinks = torch.arange(min(cfg.sinks, n), device=dev).expand(hkv, -1)
    if cfg.method == "streaming":
        start = streaming_window_start(n, cfg.sinks, cfg.window, cfg.budget)
        return torch.cat([sinks, torch.arange(start, n, device=dev).expand(hkv, -1)], dim=1)
    hi = max(cfg.sinks, n - cfg.window)
    keys = k_cache[tokens[:hi].long()]
    sel = quest_positions(q.reshape(hkv, -1, q.shape[-1]), keys, cfg.sinks, hi, cfg.budget,
                          cfg.page_size).to(dev)
    return torch.cat([sinks, sel, torch.arange(min(hi, n), n, device=dev).expand(hkv, -1)], dim=1)


class HostPath:
    """Decode rows the device step cannot serve, run on the host in eager steps after the
    device path ran them dense: the eval's baselines (positions chosen per step), and
    requests with their own budget, window or Selector (their slow steps follow the
    policy's decision, their selection their own config)."""

    def __init__(self, memory, policy, step, selection, monitor):
        self.memory, self.policy, self.step = memory, policy, step
        self._topup: dict[int, tuple] = {}  # slot -> (decode step, its last top-up pages)
        self.selection, self.monitor = selection, monitor

    def decode(self, lid, o, q, kc, vc, r2t, forward_batch, scale, host_rows) -> None:
        """Overwrite o[i] [H_q, D] of each host row (i, slot, request) at layer lid."""
        mem = self.memory
        for i, slot, req in host_rows:
            cfg, n = req.cfg, int(forward_batch.seq_lens[i])
            if lid in cfg.dense_layers:
                continue  # dense: what the device path computed
            rpi = forward_batch.req_pool_indices[i:i + 1]
            if req.baseline:
                pos = baseline_positions(cfg, n, q[i], kc, r2t[slot])
                o[i] = mem.attend_positions(q[i:i + 1], kc, vc, r2t, rpi, [pos], scale, None)[0]
                continue
            sl = forward_batch.seq_lens[i:i + 1]
            if not self.is_slow(slot, req):
                extra = (self.topup(lid, slot, req.host_step, q[i], kc, r2t[slot], cfg)
                         if cfg.topup_pages else None)
                o[i] = mem.attend_fast(lid, q[i:i + 1], kc, vc, r2t, rpi, sl, scale,
                                       lse_out=self.monitor.out(lid, i + 1, i), extra=extra,
                                       reference=cfg.selection_page != mem.cfg.selection_page)[0]
                continue
            # a slow step's output is its dense pass (the device pass skips host rows on the
            # CPU: backend._host_only), and its logits make the new selection
            od, scores = mem.attend_slow(lid, q[i:i + 1], kc, vc, r2t, rpi, sl, scale, max_len=n)
            o[i] = od[0]
            self.selection.layer(lid, rpi, torch.ones(1, dtype=torch.bool, device=scores.device), scores,
                                 sl.to(torch.int64), cfg=cfg)

    def topup(self, lid: int, slot: int, step: int, q, k_cache, tokens, cfg) -> torch.Tensor:
        """The top-up pages [1, H_kv, E] of slot's fast step `step` at layer lid
        (topup_positions between the sinks and its window's start), chosen at the first
        sparse layer of each group of cfg.topup_every and reused by the group's others."""
        sparse = cfg.sparse_layers(self.memory.num_layers)
        last = self._topup.get(slot)
        if sparse.index(lid) % cfg.topup_every and last is not None and last[0] == step:
            return last[1]  # the group's pages
        hkv = k_cache.shape[1]
        held, hi = self.memory.held(lid, slot)
        keys = k_cache[tokens[:hi].long()]
        pos = topup_positions(q.reshape(hkv, -1, q.shape[-1]), keys, held, cfg.sinks, hi,
                              cfg.topup_pages, cfg.page_size)[None]
        self._topup[slot] = (step, pos)
        return pos

    def is_slow(self, slot: int, req) -> bool:
        """Whether a host-path request's step is slow (decided once per step, at its first
        sparse layer): the policy's decision for it (StepPlan.begin), or no selection yet.
        Its counts and decision log are kept here, as StepPlan.begin does for device rows."""
        step = int(self.step.steps[slot])
        if req.host_step != step:
            trig = bool(self.policy.since[slot] == 0) and step > 0
            slow = req.refreshes and (trig if req.cfg.method == "sfi" else not req.has_selection)
            slow = slow or (req.refreshes and not req.has_selection)
            req.host_step, req.host_slow = step, slow
            if slow:
                req.has_selection = True
                self.step.log_slow(slot, step)
            dev = self.memory.device
            self.memory.count_steps(torch.tensor([slot], device=dev), torch.tensor([not slow], device=dev),
                                    torch.tensor([slow], device=dev))
        return req.host_slow

    @staticmethod
    def fast_rows(host_rows) -> list[tuple[int, bool]]:
        """(batch row, ran an SFI fast step) of the host rows, for the adaptive trigger."""
        return [(i, req.enabled and req.cfg.method == "sfi" and not req.host_slow) for i, _, req in host_rows]
