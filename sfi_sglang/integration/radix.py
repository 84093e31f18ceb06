"""Shared prefixes share SFI memories: the `sfi` radix cache.

A selection made on a context covers the candidate positions [sinks, hi); positions are
positions, so it is valid for every request whose first `hi` tokens are the same.
SFIRadixCache is SGLang's RadixCache plus one attribute per tree node, `sfi_memory`, a
NodeMemory (a copy of the request's selection from the backend's SparseMemory + hi):

* publish: when a request is checkpointed (a prefill chunk, the end of a prefill, its
  finish: SGLang's `checkpoint`), its current selection goes to the node of its path that
  holds position hi-1, i.e. depth(parent) < hi <= depth(node); an existing memory there is
  replaced when the new one reaches at least as far.
* import: a request whose matched prefix ends at that node or below it starts from the
  deepest compatible memory on its path (the backend skips its bootstrap selection); it
  refreshes at its first trigger like any request.
* split at depth d: the memory goes to the upper part when hi <= d, else stays with the
  lower part, so the placement rule above keeps holding.
* eviction frees a node's memory with the node (hi lies inside it, so the memory cannot
  move up); flush frees all of them. The pool of node memories is bounded (LRU).

Lock counting is SGLang's own: a request locks its matched path from admission to
release, so the node it imports from (its path's node or an ancestor) stays in the tree
meanwhile, and a split copies the lock count to the upper part.

This module talks to the backend's request slots (sfi_sglang.integration.slots.Slots)
through `start_request` (a request's first extend) and their `export_selection` /
`import_selection` (copies out of / into a SparseMemory slot, packed K/V included), so the
memory's representation stays the backend's.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.radix_cache import RadixCache, TreeNode

if TYPE_CHECKING:
    from sfi_sglang.integration.slots import Request, Slots
    from sfi_sglang.method.config import SFIConfig

logger = logging.getLogger(__name__)

NAME = "sfi"  # --radix-cache-backend sfi (set by sfi_sglang.engine.launch_kwargs)
DEFAULT_CAPACITY = 256  # node memories per scheduler (each one ~ layers x H_kv x K int32)

# Radix caches of this process (one per scheduler), for the backend and the stats hook.
CACHES: list["SFIRadixCache"] = []
# Bootstrap selections of this process: computed by the backend vs imported from a node.
BOOTSTRAPS = {"computed": 0, "reused": 0}


# ---------------------------------------------------------------------- node memories
@dataclass(frozen=True)
class NodeMemory:
    """A selection made on a context: valid for any request sharing its first `hi` tokens."""

    hi: int  # candidates were [sinks, hi); the window starts at hi
    kind: tuple  # what made it (compat_key of the publisher's config)
    positions: torch.Tensor  # [layers, H_kv, K] int32 sorted positions < hi, -1 padded
    count: int  # valid entries per layer and head

    def fits(self, cfg: SFIConfig, prefix_len: int, seq_len: int) -> bool:
        """Usable by a request with this config, matched prefix and context length: same
        kind of selection, every selected position inside the shared prefix, and a window
        [hi, seq_len) of at most W + K tokens until the first refresh."""
        return (self.kind == compat_key(cfg) and self.hi <= prefix_len
                and seq_len - self.hi <= cfg.window + cfg.budget)


# options a selection does not depend on: when slow steps happen, the window (`fits` checks
# it against hi) and the fast kernel
_NOT_SELECTION = frozenset({"window", "min_gap", "cooldown", "max_interval", "refresh",
                            "adaptive_threshold", "boundaries", "fast_path", "topup_pages",
                            "topup_every", "dense_backend", "dense_below",
                            "max_slow_rows", "memory_rows"})


def compat_key(cfg: SFIConfig) -> tuple:
    """The options a selection depends on for its shape and meaning: every option but
    _NOT_SELECTION's (a request with its own Selector options makes its own selection)."""
    return tuple((name, getattr(cfg, name)) for name in cfg.field_names() if name not in _NOT_SELECTION)


def export_memory(slots: Slots, slot: int) -> Optional[NodeMemory]:
    """The slot's current selection (a copy), if it has one past the sinks."""
    req = slots.requests.get(slot)
    sel = slots.export_selection(slot)
    if sel is None:
        return None
    positions, count, hi = sel
    if hi <= req.cfg.sinks:
        return None
    return NodeMemory(hi=hi, kind=compat_key(req.cfg), positions=positions, count=count)


def start_request(slots: Slots, slot: int, req: Request, rid: Optional[str],
                  prefix_len: int, seq_len: int) -> bool:
    """Called by the backend's Slots at a request's first extend: import a shared memory when its
    matched prefix has one (True), else count a bootstrap selection to compute (False)."""
    mem = None
    for cache in CACHES:
        mem = cache.find_memory(rid, req.cfg, prefix_len, seq_len)
        if mem is not None:
            break
    if mem is None:
        req.bootstrap_computed += 1
        BOOTSTRAPS["computed"] += 1
        return False
    slots.import_selection(slot, mem.positions, mem.count, mem.hi)
    BOOTSTRAPS["reused"] += 1
    return True


class NodeMemoryPool:
    """At most `capacity` tree nodes hold a memory; the least recently used one is dropped
    to make room. Keyed by node id; the memory itself lives on the node."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.capacity = capacity
        self.nodes: OrderedDict[int, TreeNode] = OrderedDict()
        self.counters = {"published": 0, "replaced": 0, "moved_on_split": 0,
                         "freed_on_evict": 0, "dropped_lru": 0, "lookups_hit": 0}

    def __len__(self) -> int:
        return len(self.nodes)

    def put(self, node: TreeNode, mem: NodeMemory) -> None:
        if node.id in self.nodes:
            self.counters["replaced"] += 1
            self.nodes.move_to_end(node.id)
        else:
            while len(self.nodes) >= self.capacity:
                _, old = self.nodes.popitem(last=False)
                old.sfi_memory = None
                self.counters["dropped_lru"] += 1
            self.nodes[node.id] = node
        node.sfi_memory = mem
        self.counters["published"] += 1

    def move(self, src: TreeNode, dst: TreeNode) -> None:
        dst.sfi_memory, src.sfi_memory = src.sfi_memory, None
        del self.nodes[src.id]
        self.nodes[dst.id] = dst
        self.counters["moved_on_split"] += 1

    def free(self, node: TreeNode) -> None:
        if self.nodes.pop(node.id, None) is not None:
            self.counters["freed_on_evict"] += 1
        node.sfi_memory = None

    def touch(self, node: TreeNode) -> None:
        self.nodes.move_to_end(node.id)
        self.counters["lookups_hit"] += 1

    def clear(self) -> None:
        for node in self.nodes.values():
            node.sfi_memory = None
        self.nodes.clear()


# ---------------------------------------------------------------------- the radix cache
def _path(node: TreeNode, root: TreeNode) -> list[tuple[TreeNode, int]]:
    """(node, depth) from `node` up to (not including) the root; depth = tokens up to and
    including the node."""
    nodes = []
    while node is not root and node is not None:
        nodes.append(node)
        node = node.parent
    depth = sum(len(n.key) for n in nodes)
    out = []
    for n in nodes:
        out.append((n, depth))
        depth -= len(n.key)
    return out


def sfi_slots(req_to_token_pool) -> Optional[Slots]:
    """The request slots of the `sfi` attention backend serving this request pool, or None:
    the backend and this cache share SGLang's ReqToTokenPool (the backend indexes its
    memories by its slots) and the backend puts its Slots on it as `sfi_slots`."""
    return getattr(req_to_token_pool, "sfi_slots", None)


class SFIRadixCache(RadixCache):
    """SGLang's RadixCache whose nodes may hold a NodeMemory."""

    def __init__(self, params, capacity: int = DEFAULT_CAPACITY):
        self.memories = NodeMemoryPool(capacity)
        self._reqs: dict[str, object] = {}  # rid -> Req, from its match to its release
        self._started: set[str] = set()  # rids whose first extend has started
        super().__init__(params)
        CACHES.append(self)

    # -------------------------------------------------------------- SGLang's tree API
    def reset(self):
        super().reset()
        self.memories.clear()

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        result = super().match_prefix(params)
        if params.req is not None and not self.disable:
            self._reqs[params.req.rid] = params.req
        return result

    def checkpoint(self, req, *, up_to: int):
        super().checkpoint(req, up_to=up_to)
        if not self.disable:
            self.publish(req)

    def on_release(self, req, *, checkpointed: bool) -> None:
        super().on_release(req, checkpointed=checkpointed)
        if not req.finished():  # a decode retraction: the request comes back by a prefill
            slots = sfi_slots(self.req_to_token_pool)
            slot = getattr(req.kv, "req_pool_idx", None)
            if slots is not None and slot is not None:
                slots.suspend(req.rid, slot)
        self._reqs.pop(req.rid, None)
        self._started.discard(req.rid)

    def _split_node(self, key, child: TreeNode, split_len: int):
        new_node = super()._split_node(key, child, split_len)
        mem = getattr(child, "sfi_memory", None)
        if mem is not None:
            if mem.hi <= _path(new_node, self.root_node)[0][1]:
                self.memories.move(child, new_node)
        return new_node

    def _delete_leaf(self, node):
        super()._delete_leaf(node)
        if getattr(node, "sfi_memory", None) is not None:
            self.memories.free(node)

    # -------------------------------------------------------------- SFI memories
    def publish(self, req) -> Optional[TreeNode]:
        """Put the request's current selection on the node of its path holding hi-1."""
        slots = sfi_slots(self.req_to_token_pool)
        slot = getattr(req.kv, "req_pool_idx", None)
        owner = slots.requests.get(slot) if slots is not None and slot is not None else None
        if owner is None or owner.rid != req.rid:
            return None
        mem = export_memory(slots, slot)
        if mem is None:
            return None
        target = None
        for node, depth in _path(req.last_node, self.root_node):
            if depth - len(node.key) < mem.hi <= depth:
                target = node
                break
        if target is None:
            return None
        old = getattr(target, "sfi_memory", None)
        if old is not None and (old is mem or old.hi > mem.hi):
            return target
        self.memories.put(target, mem)
        return target

    def find_memory(self, rid: Optional[str], cfg: SFIConfig, prefix_len: int,
                    seq_len: int) -> Optional[NodeMemory]:
        """The deepest memory usable by request `rid` at its first extend, on the path to
        the node its matched prefix ends at."""
        req = self._reqs.get(rid) if rid is not None else None
        if req is None or rid in self._started:
            return None
        self._started.add(rid)
        node = getattr(req, "last_node", None)
        if node is None or node is self.root_node or node.evicted:
            return None
        for n, _ in _path(node, self.root_node):
            mem = getattr(n, "sfi_memory", None)
            if mem is not None and mem.fits(cfg, prefix_len, seq_len):
                self.memories.touch(n)
                return mem
        return None

    # -------------------------------------------------------------- checks and stats
    def check_memories(self) -> list[str]:
        """Violations of the placement rule and of the pool's bookkeeping (empty: sound)."""
        problems, seen = [], set()
        stack = [(self.root_node, 0)]
        while stack:
            node, depth = stack.pop()
            mem = getattr(node, "sfi_memory", None)
            if mem is not None:
                seen.add(node.id)
                start = depth - len(node.key)
                if not start < mem.hi <= depth:
                    problems.append(f"node {node.id} [{start}, {depth}) holds hi={mem.hi}")
                if node.id not in self.memories.nodes:
                    problems.append(f"node {node.id} holds a memory the pool does not count")
            for child in node.children.values():
                stack.append((child, depth + len(child.key)))
        for node_id in set(self.memories.nodes) - seen:
            problems.append(f"pool counts node {node_id}, which is not in the tree")
        return problems

    def tracked(self) -> tuple[int, int]:
        """(requests matched and not yet released, those whose first extend started)."""
        return len(self._reqs), len(self._started)

    def stats(self) -> dict:
        return {"node_memories": len(self.memories), "capacity": self.memories.capacity,
                **self.memories.counters, "problems": self.check_memories()}


def stats() -> dict:
    """SFI sharing counters of this process (a scheduler): bootstrap selections computed vs
    reused, and the node-memory pool of its radix cache."""
    out = {"bootstrap_computed": BOOTSTRAPS["computed"], "bootstrap_reused": BOOTSTRAPS["reused"]}
    if CACHES:
        out["radix"] = CACHES[-1].stats()
    return out


def create_sfi_radix_cache(ctx) -> SFIRadixCache:
    """Factory for SGLang's register_radix_cache_backend. The `sfi` cache extends the plain
    RadixCache (page-aligned, single device tier); other tree features (hierarchical cache,
    SWA/mamba components) keep SGLang's own caches."""
    if ctx.is_hybrid_swa or ctx.is_hybrid_ssm or ctx.enable_hierarchical_cache:
        raise ValueError("--radix-cache-backend sfi supports full-attention models without "
                         "the hierarchical cache")
    return SFIRadixCache(ctx.params)


def register() -> None:
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    if get_radix_cache_factory(NAME) is None:
        register_radix_cache_backend(NAME, create_sfi_radix_cache)
