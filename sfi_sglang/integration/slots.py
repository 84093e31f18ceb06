"""Request slots of the `sfi` backend: the host-side record of the request in each
ReqToTokenPool slot (its options, what meta_info reports), the slot's start at a request's
first extend, retraction and resumption, and the radix cache's export / import of a slot's
selection. The slot's device state lives in the backend's SparseMemory (selections,
counts), StepPlan (switches, decision log) and TriggerPolicy (counters), indexed by the
same slot; this module starts, saves and restores it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

import torch

from sfi_sglang.integration import state
from sfi_sglang.method.config import SFIConfig
from sfi_sglang.method.memory import NO_WINDOW
from sfi_sglang.method.options import on_device_path, request_config


@dataclass
class Request:
    """Host-side record of the request in a slot: its options and what the output reports."""

    cfg: SFIConfig
    enabled: bool
    rid: Optional[str] = None
    host: bool = False  # runs on the host path (eager only): options.on_device_path
    bootstrap: bool = False
    has_selection: bool = False  # host path: the memory holds a selection
    # bootstrap selections computed here vs imported from a shared prefix (radix)
    bootstrap_computed: int = 0
    bootstrap_reused: int = 0
    imported: bool = False  # this start's selection came from a shared prefix (radix)
    # decode steps whose token a re-prefill made after SGLang retracted the request
    # (Slots.suspend); each counts as a slow step of an SFI request
    retracted_at: tuple = ()
    # host path: the decode step last decided (baselines.HostPath.is_slow) and its verdict
    host_step: Optional[int] = None
    host_slow: bool = True

    @property
    def refreshes(self) -> bool:
        """Whether this request's method keeps a selection (made at prefill end / slow steps)."""
        return self.cfg.method in ("sfi", "snapkv")

    @property
    def baseline(self) -> bool:
        """Methods whose fast steps choose positions per step on the host (eval baselines)."""
        return self.cfg.method in ("streaming", "quest")

    def stats(self, fast_steps: int, slow_steps: int, slow_at: list) -> dict:
        return {"enabled": self.enabled, "fast_steps": fast_steps,
                "slow_steps": slow_steps, "bootstrap": self.bootstrap,
                "bootstrap_computed": self.bootstrap_computed,
                "bootstrap_reused": self.bootstrap_reused,
                "retractions": len(self.retracted_at), "retracted_at": list(self.retracted_at),
                "slow_at": list(slow_at),
                "budget": self.cfg.budget, "window": self.cfg.window, "sinks": self.cfg.sinks}


class Slots:
    """The records of the requests in the backend's slots, by slot and by rid."""

    def __init__(self, cfg: SFIConfig, memory, step, policy, kv, req_to_token, num_layers: int):
        self.cfg, self.memory, self.step, self.policy = cfg, memory, step, policy
        self.kv, self.req_to_token, self.num_layers = kv, req_to_token, num_layers
        self.requests: dict[int, Request] = {}  # slot -> its request
        self.by_rid: dict[str, tuple[int, Request]] = {}  # rid -> (slot, request), for meta_info
        self._configs: dict[str, tuple[bool, SFIConfig]] = {}
        # slots SGLang gave to new requests: reset at their first forward, on the forward
        # stream (with the overlap scheduler the allocation happens while an earlier step runs)
        self._resets: list[int] = []
        # requests SGLang retracted (decode out of KV memory: their KV is freed and recomputed
        # by a later prefill): (rid, slot, record) until the next forward saves their history,
        # then rid -> (record, history) until they resume or finish (see suspend)
        self._retracted: list[tuple[str, int, Request]] = []
        self.suspended: dict[str, tuple[Request, dict]] = {}
        # memory rows (SFIConfig.memory_rows): slots whose SFI request waits for a row ->
        # the context length past which it takes one; slots SGLang freed (their rows are
        # given back at the next forward, on the forward stream)
        self._waiting: dict[int, int] = {}
        self._freed: list[int] = []

    # ------------------------------------------------------------------ SGLang's events
    def on_alloc_rows(self, slots) -> None:
        """SGLang gave these slots to new requests (scheduler, host): their device state is
        reset at their first forward (begin_forward), on the forward stream."""
        self._resets.extend(int(s) for s in slots)
        for slot in slots:
            self.requests.pop(slot, None)

    def on_free_rows(self, slots) -> None:
        """SGLang freed these slots (scheduler, host; hooks._release_sfi_rows): their memory
        rows are given back at the next forward (begin_forward)."""
        self._freed.extend(int(s) for s in slots)

    def suspend(self, rid: str, slot: int) -> None:
        """SGLang retracted the request in `slot` (radix: released unfinished). Its KV is
        recomputed by a later prefill, a dense pass over its whole context, so its sparse
        memory cannot survive; its record and decision history (step count, slow steps,
        fast/slow counts) do, and continue when it resumes (start_requests). Saved at the
        next forward, on the forward stream, before the slot is reused."""
        req = self.requests.get(slot)
        if req is not None and req.rid == rid:
            self._retracted.append((rid, slot, req))

    def clear_resets(self) -> None:
        self._resets.clear()

    def begin_forward(self) -> None:
        """Host part of each forward, on the forward stream: retracted requests' histories
        are saved before their slots are reused."""
        for rid, slot, req in self._retracted:
            self.suspended[rid] = (req, {**self.step.history(slot), "counts": self.memory.counts[slot].clone(),
                                         "fired": self.fired(slot)})
        self._retracted.clear()
        freed, self._freed = self._freed, []
        for slot in freed:
            self.memory.rows.take(slot)
            self._waiting.pop(slot, None)

    # ------------------------------------------------------------------ starts
    def start(self, slot: int, req: Request, seq_len: Optional[int] = None) -> None:
        """Host: a request's record and its slot's device state (memory, step plan, policy).
        With memory rows, an SFI request whose context (seq_len) is past sinks + window +
        budget takes a row now; one that gets none runs dense and waits (claim_rows)."""
        self.requests[slot] = req
        rows = self.memory.rows
        rows.take(slot)  # the slot's last request is gone
        self._waiting.pop(slot, None)
        req.host = req.enabled and not on_device_path(req.cfg, self.cfg)
        need = req.cfg.memory_tokens()
        if req.host or (req.enabled and (seq_len is None or seq_len > need)):
            rows.give(slot)  # none where none is free
        self.memory.reset([slot])
        if req.host and not rows.has(slot):  # host-path methods keep no waiting state
            req.enabled = req.host = False
        waits = req.enabled and not req.host and not rows.has(slot)
        if waits:
            self._waiting[slot] = need
        device_sfi = req.enabled and not req.host and not waits
        self.step.start(slot, device_sfi, req.cfg.dense_layers, waits=waits)
        self.policy.reset(torch.tensor([slot]), req.cfg)
        if req.cfg.method == "snapkv":  # selects once (at prefill end), never refreshes
            self.policy.max_interval[slot] = NO_WINDOW
            self.policy.interval_mode[slot] = True
        if not device_sfi:  # a dense row on the device path: the fast kernel reads nothing
            self.memory.fast_ws[slot] = NO_WINDOW

    def start_requests(self, forward_batch) -> None:
        """A request's first extend makes its record (a prompt's next chunk keeps it; a
        retracted request's re-prefill resumes its old one); its bootstrap selection follows
        in the backend's forward_extend unless a shared prefix's memory is imported here."""
        from sfi_sglang.integration import radix

        if self._resets:
            self.memory.reset(self._resets)
            self._resets.clear()
        slots = forward_batch.req_pool_indices.tolist()
        rids = forward_batch.rids or [None] * len(slots)
        prefix_lens = forward_batch.extend_prefix_lens_cpu or [0] * len(slots)
        seq_lens = forward_batch.seq_lens.tolist()
        for slot, rid, prefix, n in zip(slots, rids, prefix_lens, seq_lens):
            old = self.requests.get(slot)
            if old is not None and old.rid == rid and rid is not None:
                # a prompt's next chunk: a request waiting for a row takes one once its
                # context passes S + W + K, and starts its selection as at a first extend
                if self._claim_row(slot, int(n)):
                    radix.start_request(self, slot, old, rid, int(prefix), int(n))
                continue
            suspended = self.suspended.pop(rid, None) if rid is not None else None
            if suspended is not None:
                req = self._resume(slot, *suspended, int(n))
            else:
                enabled, cfg = self._config(state.REQUEST_PARAMS.get(rid))
                req = Request(cfg=cfg, enabled=enabled, rid=rid)
                self.start(slot, req, int(n))
            if rid is not None:
                self.by_rid[rid] = (slot, req)
            if req.enabled and req.refreshes and slot not in self._waiting:
                radix.start_request(self, slot, req, rid, int(prefix), int(n))

    @property
    def rows_held(self) -> int:
        """Memory rows running requests hold (host; with --sfi-memory-rows): those given
        out less those of slots SGLang freed since the last forward (given back there)."""
        rows = self.memory.rows
        return rows.count - rows.free - len({s for s in self._freed if rows.row(s)})

    @property
    def waiting(self) -> int:
        """SFI requests that wait for a memory row (running dense meanwhile)."""
        return len(self._waiting)

    def claim_rows(self, forward_batch) -> None:
        """Host, at each decode step while some request waits for a memory row: a waiting
        request of the batch whose context passed sinks + window + budget takes a free row,
        and SFI runs for it from this step, whose slow step makes its first selection."""
        if not self._waiting:
            return
        slots, lens = (_host_copy(forward_batch, name) for name in ("req_pool_indices", "seq_lens"))
        if slots is None or lens is None or slots.shape != lens.shape:
            return  # no host copy of the batch: it waits for a step that has one
        for slot, n in zip(slots.tolist(), lens.tolist()):
            self._claim_row(slot, n)

    def _claim_row(self, slot: int, n: int) -> bool:
        """A waiting request whose context (n tokens) passed sinks + window + budget takes a
        free row: SFI runs for it from this forward (a prompt chunk's bootstrap, or a decode
        step's slow step, makes its first selection)."""
        need = self._waiting.get(slot)
        if need is None or n <= need or not self.memory.give_row(slot):
            return False
        del self._waiting[slot]
        self.step.got_row(slot)  # give_row reset its memory
        return True

    def _config(self, custom_params) -> tuple[bool, SFIConfig]:
        """A request's (enabled, config), cached by its options (the tokenizer side checked them)."""
        key = json.dumps(custom_params.get("sfi"), sort_keys=True) if isinstance(custom_params, dict) else "null"
        if key not in self._configs:
            self._configs[key] = request_config(self.cfg, custom_params)
        return self._configs[key]

    def _resume(self, slot: int, old: Request, history: dict, seq_len: int) -> Request:
        """A retracted request's re-prefill: a new record (its selection is made afresh:
        bootstrap or a shared prefix's memory) that keeps the old one's counters, and its
        decision history, where the re-prefill counts as the decode step it replaces, a
        slow one (dense attention over the whole context, then a new selection)."""
        req = Request(cfg=old.cfg, enabled=old.enabled, rid=old.rid,
                      bootstrap_computed=old.bootstrap_computed, bootstrap_reused=old.bootstrap_reused,
                      retracted_at=(*old.retracted_at, int(history["steps"]) + 1))
        self.start(slot, req, seq_len)
        counts = history.pop("counts")
        if self.policy.fired is not None:
            self.policy.fired[slot] = history.pop("fired")
        slow = req.enabled and req.refreshes
        self.step.resume(slot, history, slow)
        self.memory.counts[slot] = counts + torch.tensor([0, int(slow), 0, 0], dtype=counts.dtype,
                                                         device=counts.device)
        return req

    # ------------------------------------------------------------------ bootstrap
    def bootstraps(self, lid: int, forward_batch):
        """(slot, request, first query row, rows, context length) of each request of an
        extend that selects at layer `lid` from its prompt's last rows (host reads: extends
        run eagerly)."""
        starts = forward_batch.extend_start_loc.tolist()
        lens = forward_batch.extend_seq_lens.tolist()
        for i, slot in enumerate(forward_batch.req_pool_indices.tolist()):
            req = self.requests.get(slot)
            if req is None or not req.enabled or not req.refreshes or lid in req.cfg.dense_layers:
                continue
            if req.imported or slot in self._waiting:  # a shared prefix's memory, or no memory row
                continue
            rows = min(req.cfg.bootstrap_rows, lens[i])
            yield slot, req, starts[i] + lens[i] - rows, rows, int(forward_batch.seq_lens[i])

    def bootstrapped(self, slot: int, req: Request) -> None:
        if not req.bootstrap:
            req.bootstrap = req.has_selection = True
            if not req.host:
                self.step.has_sel[slot] = True

    # ------------------------------------------------------------------ radix sharing
    def export_selection(self, slot: int):
        """(positions [L, H_kv, K], count, hi) of the slot's selection, or None (radix)."""
        req = self.requests.get(slot)
        if req is None or not req.enabled or not bool(self.step.has_sel[slot]):
            return None
        return self.memory.export(slot)

    def import_selection(self, slot: int, positions, count: int, hi: int) -> None:
        """Start the slot's request from a shared prefix's selection (radix)."""
        req = self.requests[slot]
        self.memory.import_(slot, positions, count, hi, self.kv, self.req_to_token,
                            req.cfg.sparse_layers(self.num_layers))
        req.bootstrap = req.imported = True
        self.step.has_sel[slot] = True
        req.bootstrap_reused += 1

    # ------------------------------------------------------------------ reporting
    def host_rows(self, rids) -> list:
        """(batch row, slot, request) of a decode batch's rows on the host path."""
        out = []
        for i, rid in enumerate(rids):
            entry = self.by_rid.get(rid)
            if entry is not None and entry[1].host:
                out.append((i, *entry))
        return out

    def fired(self, slot: int) -> int:
        """Slow steps the adaptive trigger caused in the slot's request (host sync)."""
        return int(self.policy.fired[slot]) if self.policy.fired is not None else 0

    def request_stats(self, rid: str, finished: bool) -> Optional[dict]:
        """What meta_info["sfi"] reports for a request (host sync: when its output is sent)."""
        if finished:
            state.REQUEST_PARAMS.pop(rid, None)
            self.suspended.pop(rid, None)  # retracted, then aborted before it resumed
        entry = self.by_rid.pop(rid, None) if finished else self.by_rid.get(rid)
        if entry is None:
            return None
        slot, req = entry
        fast, slow, dense, deferred = self.memory.counts[slot].tolist()
        _, slow_at = self.step.read(slot)
        if finished and self.requests.get(slot) is req:
            # SGLang released the request (its memory published to the radix cache) before
            # its last output; the slot's next request makes a new record
            del self.requests[slot]
        stats = req.stats(fast, slow, slow_at)
        if dense:
            stats["dense_steps"] = dense
        if deferred:
            stats["deferred_slow_steps"] = deferred
        if self.policy.fired is not None:
            stats["adaptive_slow_steps"] = self.fired(slot)
        if finished:  # this rank's decision log (parallel: TP ranks compared)
            from sfi_sglang.integration import parallel

            parallel.record(rid, stats)
        return stats


def _host_copy(forward_batch, name: str) -> Optional[torch.Tensor]:
    """SGLang's host copy of a batch tensor (`<name>_cpu`), or the tensor itself where it
    lives on the host (the CPU engine); None rather than a device read."""
    t = getattr(forward_batch, f"{name}_cpu", None)
    if t is None:
        t = getattr(forward_batch, name, None)
        if t is None or t.device.type != "cpu":
            return None
    return t
