"""SFI's Prometheus series, served by SGLang's /metrics beside its own (--enable-metrics).

SGLang's schedulers run in subprocesses and export through prometheus_client's
multiprocess mode (PROMETHEUS_MULTIPROC_DIR, set by SGLang before it starts them; the HTTP
process's /metrics reads every process's files). The series are therefore created in the
scheduler process that updates them, when SGLang makes its own scheduler collector
(sfi_sglang.integration.hooks), with the same labels (model_name, engine_type, tp_rank, ...).

Everything is updated where the host reads SFI's state anyway: when a request's output is
sent (its meta_info["sfi"], Slots.request_stats), never per decode step. So a
request's steps are counted when it finishes (aborted requests included).

    sglang:sfi_fast_steps_total                      fast decode steps
    sglang:sfi_slow_steps_total{cause}               slow decode steps: boundary (a sentence
                                                     start after a boundary token, the server's
                                                     table or the request's extra/grammar
                                                     boundaries), interval (max_interval
                                                     reached), bootstrap (the first decode step
                                                     of a request whose prefill made no
                                                     selection), adaptive (--sfi-refresh adaptive:
                                                     the memory stopped covering the query),
                                                     retraction (the re-prefill of a request
                                                     SGLang retracted), other (past the
                                                     per-request log of sfi_sglang.method.step.SLOW_LOG
                                                     slow steps)
    sglang:sfi_deferred_slow_steps_total             slow steps put off a decode step: more rows
                                                     of a step were due one than
                                                     --sfi-max-slow-rows
    sglang:sfi_selections_total{source}              new selections of a request's memory:
                                                     prefill (the Selector at prefill end),
                                                     slow_step, shared_prefix (imported from a
                                                     radix node, no Selector run)
    sglang:sfi_requests_total{sfi}                   finished requests, sfi="on" / "off"
    sglang:sfi_memory_slots_in_use                   requests holding an SFI memory slot
    sglang:sfi_memory_slots                          slots allocated (--max-running-requests + 1)
    sglang:sfi_memory_rows_in_use                    memory rows held by requests (--sfi-memory-rows;
                                                     without it, one per request in a slot)
    sglang:sfi_memory_rows                           memory rows allocated (without
                                                     --sfi-memory-rows, one per slot)
    sglang:sfi_memory_bytes_in_use                   bytes of the memory rows in use
    sglang:sfi_memory_bytes                          bytes allocated (memory + slow-step buffers)
    sglang:sfi_radix_node_memories                   radix nodes holding a memory
    sglang:sfi_radix_memory_hits_total               requests that started from a node's memory
    sglang:sfi_radix_memory_evictions_total{reason}  memories dropped: tree_evict (their node
                                                     was evicted), lru (the pool was full)

Time in the Selector is not exported: it runs on the device inside the decode step (a
CUDA graph's conditional node), and timing it would need a host sync per step.
"""

from __future__ import annotations

from typing import Optional

from sfi_sglang.method.step import SLOW_LOG

CAUSES = ("boundary", "interval", "bootstrap", "adaptive", "retraction", "other")

# this scheduler process's series (hooks._add_sfi_metrics), None without --enable-metrics
METRICS: Optional["SFIMetrics"] = None


def slow_causes(slow_at: list, slow_steps: int, max_interval: int, interval_mode: bool,
                had_selection: bool, adaptive: int = 0, retractions: int = 0) -> dict:
    """Slow steps of one request by cause, from its logged slow decode steps (1-based,
    ascending) as TriggerPolicy decided them: distance d from the last refresh (prefill end:
    step 0) >= max_interval is interval, the first decode step without a selection is
    bootstrap, every other one followed a boundary, except the `adaptive` ones the trigger
    counted (refresh adaptive) and the `retractions` (a retracted request's re-prefill),
    which are taken out of those. Steps past the log are "other"."""
    out = dict.fromkeys(CAUSES, 0)
    prev = 0
    for i, step in enumerate(slow_at):
        if i == 0 and step == 1 and not had_selection:
            out["bootstrap"] += 1
        elif interval_mode or step - prev >= max_interval:
            out["interval"] += 1
        else:
            out["boundary"] += 1
        prev = step
    for cause, n in (("adaptive", adaptive), ("retraction", retractions)):
        for src in ("boundary", "interval"):
            moved = min(n, out[src])
            out[src] -= moved
            out[cause] += moved
            n -= moved
    out["other"] = max(0, slow_steps - len(slow_at)) if len(slow_at) >= SLOW_LOG else 0
    return out


class SFIMetrics:
    """The series of one scheduler process; `labels` are SGLang's scheduler labels."""

    def __init__(self, labels: dict):
        # imported here: prometheus_client picks its multiprocess mode at import, after
        # SGLang has set PROMETHEUS_MULTIPROC_DIR
        from prometheus_client import Counter, Gauge

        self.labels = {k: str(v) for k, v in labels.items()}
        names = list(self.labels)

        def counter(name, doc, extra=()):
            return Counter(f"sglang:sfi_{name}", doc, labelnames=[*names, *extra])

        def gauge(name, doc):
            return Gauge(f"sglang:sfi_{name}", doc, labelnames=names, multiprocess_mode="mostrecent")

        self.fast_steps = counter("fast_steps_total", "SFI fast decode steps.")
        self.slow_steps = counter("slow_steps_total", "SFI slow decode steps, by cause.", ["cause"])
        self.deferred = counter("deferred_slow_steps_total",
                                "SFI slow steps put off a decode step (--sfi-max-slow-rows).")
        self.selections = counter("selections_total", "New selections of SFI memories, by source.",
                                  ["source"])
        self.requests = counter("requests_total", "Finished requests, by SFI on or off.", ["sfi"])
        self.slots_in_use = gauge("memory_slots_in_use", "Requests holding an SFI memory slot.")
        self.slots = gauge("memory_slots", "SFI memory slots allocated.")
        self.rows_in_use = gauge("memory_rows_in_use", "SFI memory rows held by requests.")
        self.rows = gauge("memory_rows", "SFI memory rows allocated.")
        self.bytes_in_use = gauge("memory_bytes_in_use", "Bytes of the SFI memory rows in use.")
        self.bytes = gauge("memory_bytes", "Bytes allocated for SFI (memory rows and the slow step's score buffers).")
        self.node_memories = gauge("radix_node_memories", "Radix tree nodes holding an SFI memory.")
        self.radix_hits = counter("radix_memory_hits_total",
                                  "Requests that started from a radix node's SFI memory.")
        self.radix_evictions = counter("radix_memory_evictions_total",
                                       "SFI memories dropped from radix nodes, by reason.", ["reason"])
        self._radix_seen = {"lookups_hit": 0, "freed_on_evict": 0, "dropped_lru": 0}
        self._sizes = None  # (bytes per memory row, bytes allocated)
        # every labelled series from the start (at 0), so a scraper sees them all
        for cause in CAUSES:
            self.slow_steps.labels(**self._l(cause=cause))
        for source in ("prefill", "slow_step", "shared_prefix"):
            self.selections.labels(**self._l(source=source))
        for sfi in ("on", "off"):
            self.requests.labels(**self._l(sfi=sfi))
        for reason in ("tree_evict", "lru"):
            self.radix_evictions.labels(**self._l(reason=reason))
        self.fast_steps.labels(**self.labels)
        self.deferred.labels(**self.labels)
        self.radix_hits.labels(**self.labels)

    def _l(self, **extra):
        return {**self.labels, **extra}

    def request_finished(self, stats: dict, max_interval: int, interval_mode: bool) -> None:
        """One finished request's meta_info["sfi"] (with the trigger options it ran with)."""
        self.requests.labels(**self._l(sfi="on" if stats["enabled"] else "off")).inc()
        if not stats["enabled"]:
            return
        self.fast_steps.labels(**self.labels).inc(stats["fast_steps"])
        if stats.get("deferred_slow_steps"):
            self.deferred.labels(**self.labels).inc(stats["deferred_slow_steps"])
        causes = slow_causes(stats["slow_at"], stats["slow_steps"], max_interval, interval_mode,
                             stats["bootstrap"], stats.get("adaptive_slow_steps", 0),
                             stats.get("retractions", 0))
        for cause, n in causes.items():
            if n:
                self.slow_steps.labels(**self._l(cause=cause)).inc(n)
        for source, n in (("prefill", stats["bootstrap_computed"]), ("slow_step", stats["slow_steps"]),
                          ("shared_prefix", stats["bootstrap_reused"])):
            if n:
                self.selections.labels(**self._l(source=source)).inc(n)

    def update_state(self, backend, radix_pool) -> None:
        """The gauges and the radix counters, from host state (no device read); radix_pool:
        the radix cache's NodeMemoryPool (sfi_sglang.integration.radix) or None."""
        mem = backend.memory
        if self._sizes is None:  # fixed at allocation
            self._sizes = (mem.row_bytes(), mem.bytes() + backend.scores.bytes())
            self.slots.labels(**self.labels).set(mem.max_slots)
            self.rows.labels(**self.labels).set(mem.rows.total)
            self.bytes.labels(**self.labels).set(self._sizes[1])
        in_use = len(backend.slots.by_rid)
        rows = in_use if mem.rows.count is None else backend.slots.rows_held
        self.slots_in_use.labels(**self.labels).set(in_use)
        self.rows_in_use.labels(**self.labels).set(rows)
        self.bytes_in_use.labels(**self.labels).set(rows * self._sizes[0])
        if radix_pool is None:
            return
        self.node_memories.labels(**self.labels).set(len(radix_pool))
        seen = self._radix_seen
        for key, inc in (("lookups_hit", lambda n: self.radix_hits.labels(**self.labels).inc(n)),
                         ("freed_on_evict", lambda n: self.radix_evictions.labels(
                             **self._l(reason="tree_evict")).inc(n)),
                         ("dropped_lru", lambda n: self.radix_evictions.labels(
                             **self._l(reason="lru")).inc(n))):
            now = radix_pool.counters.get(key, 0)
            if now > seen[key]:
                inc(now - seen[key])
            seen[key] = now


def init(labels: dict) -> SFIMetrics:
    global METRICS
    if METRICS is None:
        METRICS = SFIMetrics(labels)
    return METRICS
