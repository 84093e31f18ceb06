"""SFI under SGLang's tensor parallelism: what each TP rank holds, and how to see it.

With --tp-size T every TP rank is a scheduler process of its own with its own `sfi`
backend and `sfi` radix cache, over the KV heads SGLang gives it (H_kv / T; on the CPU
engine a head count that T does not divide is padded first, with zero heads, by
sglang/srt/configs/update_config.py adjust_config_with_unaligned_cpu_tp). So, per rank:

- the sparse memory (selections, packed K/V) of its own KV heads;
- the Selector, and so its cross-head exclusivity, over its own KV heads only: heads of
  other ranks do not compete for positions (nothing is gathered across ranks);
- the radix node memories (its heads' selections of a shared prefix);
- the boundary table: the tokenizer's message goes to the scheduler socket, which every TP
  rank reads (SGLang broadcasts each received request to the TP group), so each rank
  installs it.

The slow/fast decision follows from the tokens (TriggerPolicy.step on the step's input ids)
and the request's options, which every rank sees the same, so every rank takes the same
decisions; only rank 0's are sent with the output (meta_info["sfi"]). To show it, each rank
keeps the decision log of its last MAX_DECISIONS finished requests, and `/sfi/stats`
(Scheduler.get_internal_state, which every TP rank runs for the same request; the hook is
sfi_sglang.integration.hooks._add_sfi_state) gathers every rank's summary over the TP group's CPU
(gloo) group into "tp_ranks"; GET /sfi/boundaries
gathers each rank's installed table the same way.
"""

from __future__ import annotations

import os
from collections import OrderedDict

MAX_DECISIONS = 256
# rid -> this rank's decisions for the request (its slow steps and step counts), finished only
DECISIONS: "OrderedDict[str, dict]" = OrderedDict()

def record(rid, stats: dict) -> None:
    """A finished request's decisions on this rank (from Slots.request_stats)."""
    if rid is None:
        return
    DECISIONS[rid] = {"slow_at": list(stats.get("slow_at", [])),
                      "fast_steps": stats.get("fast_steps"), "slow_steps": stats.get("slow_steps")}
    DECISIONS.move_to_end(rid)
    while len(DECISIONS) > MAX_DECISIONS:
        DECISIONS.popitem(last=False)


def tp_rank() -> int:
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().tp_rank


def tp_gather(scheduler, obj) -> list:
    """`obj` of every rank of this scheduler's TP group, in rank order (a collective: every
    rank must call it for the same request)."""
    tp = getattr(scheduler, "tp_size", 1) or 1
    group = getattr(scheduler, "tp_cpu_group", None)
    if tp <= 1 or group is None:
        return [obj]
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(out, obj, group=group)
    return out


def rank_summary(scheduler) -> dict:
    from sfi_sglang.integration import radix, state

    out = {"tp_rank": tp_rank(), "pid": os.getpid()}
    try:
        be = state.active()
        if be is not None:
            out.update(num_kv_heads=be.memory.num_kv_heads, num_q_heads=be.num_q_heads,
                       boundaries={k: be.boundaries[k] for k in ("spec", "version", "num_boundary")})
        out["node_memories"] = sum(len(c.memories) for c in radix.CACHES)
        out["published"] = sum(c.memories.counters["published"] for c in radix.CACHES)
        out["decisions"] = dict(DECISIONS)
    except Exception as err:  # never skip the collective on one rank
        out["error"] = f"{type(err).__name__}: {err}"
    return out
