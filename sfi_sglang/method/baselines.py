"""Baselines run by the same backend at the same token budget (S + W + K per KV head), for
the quality evaluation: StreamingLLM, SnapKV-style and Quest-style selection.

SFI itself is selector.py; these functions only decide positions. Shapes follow
selector.py: H = KV heads, G = query heads per KV head, n = context length. `HostPath` runs
them (and requests whose options the device step cannot serve) in eager decode steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sfi_sglang.kernels.reference import extra_positions, page_bounds
from sfi_sglang.method.topup import is_group_start, layer_pages

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
    score = page_bounds(q.float(), keys, lo, num_pages, page)
    return extra_positions(score.topk(take, dim=-1).indices.sort(dim=-1).values, lo, page)


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
                extra = (self.topup(lid, slot, req.host_step, q[i:i + 1], kc, r2t, rpi, sl, cfg)
                         if cfg.topup_pages else None)
                o[i] = mem.attend_fast(lid, q[i:i + 1], kc, vc, r2t, rpi, sl, scale,
                                       lse_out=self.monitor.out(lid, i + 1, i), extra=extra,
                                       extra_page=cfg.page_size, extra_base=cfg.topup_lo,
                                       holes=cfg.selection_page > 1)[0]
                continue
            # a slow step's output is its dense pass (the device pass skips host rows on the
            # CPU: backend._host_only), and its logits make the new selection
            od, scores, norms = mem.attend_slow(lid, q[i:i + 1], kc, vc, r2t, rpi, sl, scale, max_len=n)
            o[i] = od[0]
            self.selection.layer(lid, rpi, torch.ones(1, dtype=torch.bool, device=scores.device), scores,
                                 norms, sl.to(torch.int64), cfg=cfg)

    def topup(self, lid: int, slot: int, step: int, q, k_cache, req_to_token, rpi, seq_lens, cfg) -> torch.Tensor:
        """The top-up pages [1, H_kv, P] of slot's fast step `step` at layer lid
        (topup.layer_pages with the request's config; a group's pages kept per slot)."""
        last = self._topup.get(slot)
        group = (last[1] if last is not None and last[0] == step and not is_group_start(self.memory, lid, cfg)
                 else None)
        pages = layer_pages(self.memory, lid, cfg, q, k_cache, req_to_token, rpi, seq_lens, group)
        if group is None:
            self._topup[slot] = (step, pages)
        return pages

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
