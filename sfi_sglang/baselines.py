"""Baselines run by the same backend at the same token budget (S + W + K per KV head), for
the quality evaluation: StreamingLLM, SnapKV-style and Quest-style selection.

SFI itself is selector.py; these functions only decide positions. Shapes follow
selector.py: H = KV heads, G = query heads per KV head, n = context length.
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


def quest_positions(q: torch.Tensor, keys: torch.Tensor, lo: int, hi: int, k: int,
                    page: int) -> torch.Tensor:
    """Quest-style query-aware page selection for one decode step.

    q [H, G, D] this step's queries, keys [n, H, D] the request's keys. Candidates are the
    whole pages of `page` tokens inside [lo, hi); each page's score per KV head is
    max over the group's query heads of sum_d max(q_d * kmin_d, q_d * kmax_d), an upper
    bound of q.k on that page. The top k // page pages are kept per KV head.
    Returns positions [H, pages * page] sorted ascending."""
    num_pages = (hi - lo) // page
    take = min(k // page, num_pages)
    if take <= 0:
        return torch.empty(q.shape[0], 0, dtype=torch.int64, device=q.device)
    blk = keys[lo: lo + num_pages * page].float().reshape(num_pages, page, *keys.shape[1:])
    kmin, kmax = blk.amin(dim=1), blk.amax(dim=1)  # [P, H, D]
    qf = q.float()[:, :, None, :]  # [H, G, 1, D]
    bound = torch.maximum(qf * kmin.transpose(0, 1)[:, None], qf * kmax.transpose(0, 1)[:, None])
    score = bound.sum(-1).amax(dim=1)  # [H, P]
    pages = score.topk(take, dim=-1).indices.sort(dim=-1).values  # [H, take]
    pos = lo + pages[:, :, None] * page + torch.arange(page, device=pages.device)
    return pos.reshape(q.shape[0], -1)
