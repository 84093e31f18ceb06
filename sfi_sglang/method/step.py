"""The device-side decode step plan: which rows of a decode batch are fast, slow or dense,
decided on the device from the tokens just sampled, with no host sync.

Per request slot (SGLang's ReqToTokenPool index) it keeps device tensors:
    sfi       [slots]      SFI runs on the device path for the slot's request
    waits     [slots]      its request runs SFI but holds no memory row yet
                           (SFIConfig.memory_rows): a dense row until it gets one
    has_sel   [slots]      the slot's memory holds a selection (bootstrap, import, slow step)
    dense     [slots, L]   layers that are dense for the slot's request (its dense_layers)
    steps     [slots]      decode steps so far
    slow_log  [slots, LOG] the decode steps (1-based) that were slow, -1 past slow_n
    slow_n    [slots]      slow steps so far (the log keeps the first LOG of them)
The trigger policy (sfi_sglang.method.boundary.TriggerPolicy) keeps the boundary table (a tensor
indexed by token id) and the per-slot counters.

`begin(input_ids, slots)` runs once per decode forward, before the first layer: in
SGLang's init_forward_metadata_in_graph, so a CUDA graph of the step records it and every
replay decides afresh. It leaves per-row tensors for the layers:
    slow      [B]     the row runs a slow step (dense attention + Selector)
    dense     [B, L]  the row is dense at layer l (SFI off for it, one of its dense layers,
                      or no selection yet and its first slow step put off: `bare`)
    need      [L]     some row of the batch needs the dense pass at layer l (a slow or a
                      dense row): the predicate of that layer's conditional graph node
    need_l    [L, B]  per layer: the rows of its dense pass
At most `max_slow` rows of a step are slow (SFIConfig.max_slow_rows; the others are put
off to their next step by the trigger policy), so the slow pass's logits and the Selector
take R = min(B, max_slow) rows, the step's slow rows in batch order (`score_row`), not B:
    score_row [B]     the row's row of the step's score buffer, -1: none (not slow)
    sel_slots, sel_lens [R]  slot and context length of each score row (0: no slow row)
    sel_l     [L, R]  the score rows that select at layer l
Host bookkeeping (slow_at, step counts for meta_info) is read back by `read` when a
request reports, not per step.

Slot 0 is SGLang's padding slot (never given to a request; CUDA-graph padding rows point
at it): it is never slow and never dense.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from sfi_sglang.method.selector import NORM_DTYPE

SLOW_LOG = 1024  # slow steps whose decode step meta_info lists per request


@dataclass
class Rows:
    on: torch.Tensor  # [B] bool: SFI runs on the device path for the row
    slow: torch.Tensor  # [B] bool
    dense: torch.Tensor  # [B, L] bool
    need: torch.Tensor  # [L] bool
    need_l: torch.Tensor  # [L, B] bool: the row needs layer l's dense pass (slow or dense)
    any_slow: torch.Tensor  # [] bool: some row is slow (the step's end selects)
    bare: torch.Tensor  # [B] bool: an SFI row without a selection, not slow (put off): dense
    deferred: torch.Tensor  # [B] bool: a slow step put off to the row's next step (the limit)
    score_row: torch.Tensor  # [B] int32: the row's score row (rank among slow rows), -1: none
    sel_slots: torch.Tensor  # [R] int64: each score row's slot (0, the padding slot: none)
    sel_lens: torch.Tensor  # [R]: each score row's context length (0: none)
    sel_l: torch.Tensor  # [L, R] bool: the score rows that select at layer l


class StepPlan:
    def __init__(self, policy, max_slots: int, num_layers: int, device, max_slow: int = 0,
                 memory_rows: int = 0):
        self.policy = policy
        self.max_slow = int(max_slow)  # 0: no limit
        self.memory_rows = int(memory_rows)  # 0: a memory row per slot
        dev = torch.device(device)
        self.sfi = torch.zeros(max_slots, dtype=torch.bool, device=dev)
        self.waits = torch.zeros(max_slots, dtype=torch.bool, device=dev)
        self.has_sel = torch.zeros(max_slots, dtype=torch.bool, device=dev)
        self.dense = torch.zeros(max_slots, num_layers, dtype=torch.bool, device=dev)
        self.steps = torch.zeros(max_slots, dtype=torch.int32, device=dev)
        self.slow_log = torch.full((max_slots, SLOW_LOG), -1, dtype=torch.int32, device=dev)
        self.slow_n = torch.zeros(max_slots, dtype=torch.int32, device=dev)
        self.sfi[0] = True  # the padding slot: a fast row over an empty memory
        self.has_sel[0] = True

    # ------------------------------------------------------------------ host side
    def start(self, slot: int, sfi: bool, dense_layers, has_sel: bool = False, waits: bool = False) -> None:
        """A request starts in `slot` (host, at its first extend); `waits`: it runs SFI from
        when it gets a memory row (`sfi` False until then)."""
        self.sfi[slot] = bool(sfi)
        self.waits[slot] = bool(waits)
        self.has_sel[slot] = bool(has_sel)
        row = torch.zeros(self.dense.shape[1], dtype=torch.bool)
        for lid in dense_layers:
            if 0 <= lid < row.numel():
                row[lid] = True
        self.dense[slot] = row.to(self.dense.device)
        self.steps[slot] = 0
        self.slow_n[slot] = 0
        self.slow_log[slot] = -1

    def got_row(self, slot: int) -> None:
        """A waiting request got its memory row (host): SFI runs for it from this step,
        whose slow step makes its first selection."""
        self.sfi[slot] = True
        self.waits[slot] = False
        self.has_sel[slot] = False

    def history(self, slot: int) -> dict:
        """The slot's decision history (device copies): what `resume` continues."""
        return {"steps": self.steps[slot].clone(), "slow_log": self.slow_log[slot].clone(),
                "slow_n": self.slow_n[slot].clone()}

    def resume(self, slot: int, history: dict, slow: bool) -> None:
        """A retracted request's re-prefill in `slot` (after `start`): its history continues,
        the re-prefill counted as the decode step it replaces, slow when `slow` (an SFI
        request: dense attention over the whole context, then a new selection)."""
        steps, n = history["steps"] + 1, history["slow_n"]
        log = history["slow_log"].clone()
        if slow:
            at = n.clamp(max=SLOW_LOG - 1)
            log[at] = torch.where(n < SLOW_LOG, steps, log[at])
            n = n + 1
        self.steps[slot], self.slow_log[slot], self.slow_n[slot] = steps, log, n

    def log_slow(self, slot: int, step: int) -> None:
        """The host path's slow step `step` of the slot's request (host; eager steps), logged
        as `begin` logs a device row's."""
        self.slow_log[slot, min(int(self.slow_n[slot]), SLOW_LOG - 1)] = step
        self.slow_n[slot] += 1

    def read(self, slot: int) -> tuple[int, list[int]]:
        """(decode steps, slow decode steps) of the slot's request (host sync: at report time)."""
        steps, n = int(self.steps[slot]), int(self.slow_n[slot])
        return steps, self.slow_log[slot, :min(n, SLOW_LOG)].tolist()

    # ------------------------------------------------------------------ device side
    def skip(self, slots: torch.Tensor) -> None:
        """A decode step the whole batch ran dense (dense_step): each row's step is counted,
        and its memory, behind by this token, wants a refresh at its next SFI step (the
        trigger's `deferred`: slow there, or, past the step's limit, fast over the selection
        it still holds until its turn). Device ops, no host sync: CUDA-graph capturable."""
        slots = slots.to(torch.int64)
        self.steps[slots] = self.steps[slots] + 1
        self.policy.deferred[slots] = self.policy.deferred[slots] | (slots != 0)  # not the padding slot

    def begin(self, input_ids: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor,
              force_dense=None) -> Rows:
        """Decide this step's rows from the input tokens (the tokens just sampled) and
        their context lengths. No host sync, static shapes: CUDA-graph capturable.
        force_dense [B] bool, optional: rows the caller runs outside the device path
        (eager-only methods)."""
        slots = slots.to(torch.int64)
        B = slots.shape[0]
        R = score_rows(B, self.max_slow, self.memory_rows)
        on = self.sfi[slots]
        if force_dense is not None:
            on = on & ~force_dense
        device = on & (slots != 0)  # the rows whose slow steps the limit counts
        slow = self.policy.step(input_ids, slots, force=on & ~self.has_sel[slots], limit=R, limited=device)
        slow = slow & device
        steps = self.steps[slots] + 1
        self.steps[slots] = steps
        n = self.slow_n[slots]
        at = n.clamp(max=SLOW_LOG - 1).to(torch.int64)
        old = self.slow_log[slots, at]
        self.slow_log[slots, at] = torch.where(slow & (n < SLOW_LOG), steps, old)
        self.slow_n[slots] = n + slow.to(torch.int32)
        has_sel = self.has_sel[slots] | slow
        self.has_sel[slots] = has_sel
        # a row whose first slow step the limit put off has no memory to read yet (an empty
        # one, or a reused row's stale one): it runs dense this step, as a row without SFI
        bare = on & ~has_sel
        dense = self.dense[slots] | ~(on & ~bare)[:, None]
        need = dense | slow[:, None]
        slow_l = (slow[:, None] & ~dense).t()  # [L, B]: the row selects at layer l
        # the score rows: slow rows in batch order (at most R of them, policy.step's limit);
        # the rest of R hold the padding slot and select nothing
        rank = torch.cumsum(slow.to(torch.int32), 0) - 1
        score_row = torch.where(slow, rank, -1).to(torch.int32)
        row_of = torch.zeros(R + 1, dtype=torch.int64, device=slots.device)
        row_of.scatter_(0, torch.where(slow, rank.to(torch.int64), R), torch.arange(B, device=slots.device))
        row_of = row_of[:R]
        used = torch.arange(R, device=slots.device) < slow.sum()
        sel_slots = torch.where(used, slots[row_of], 0)
        sel_lens = torch.where(used, seq_lens[row_of], 0)
        # per-layer rows made once per step, so a layer indexes them (no launch per layer)
        return Rows(on=on, slow=slow, dense=dense, need=need.any(0), need_l=need.t().contiguous(),
                    any_slow=slow.any(), bare=bare, deferred=self.policy.deferred[slots] & device,
                    score_row=score_row, sel_slots=sel_slots, sel_lens=sel_lens,
                    sel_l=slow_l[:, row_of] & used[None, :])


def score_rows(batch: int, max_slow: int, memory_rows: int = 0) -> int:
    """R: the score rows of a decode step of `batch` rows, its most slow rows
    (SFIConfig.max_slow_rows; 0: no limit): only rows with a memory row are slow
    (SFIConfig.memory_rows; 0: one per slot)."""
    for cap in (max_slow, memory_rows):
        if cap > 0:
            batch = min(batch, cap)
    return batch


def dense_step(seq_lens_cpu: Optional[torch.Tensor], memory_tokens: int, below: int) -> bool:
    """Whether a decode step runs the dense backend alone (--sfi-dense-below): its rows hold
    fewer than `below` tokens beyond their sparse memories, sum of max(0, context -
    memory_tokens). Decided on the host from SGLang's host copy of the lengths (no sync);
    without it, SFI."""
    if below <= 0 or seq_lens_cpu is None or seq_lens_cpu.numel() == 0:
        return False
    return int((seq_lens_cpu.to(torch.int64) - memory_tokens).clamp(min=0).sum()) < below


@dataclass
class FastLists:
    """A decode step's FlashInfer list lengths (SparseMemory.fast_lists), [B] each."""

    lengths: torch.Tensor  # int32, capped at fast_cap
    start: torch.Tensor  # int32, where the row's lists begin in the page buffer (within its chunk)
    win_start: torch.Tensor  # int64, the window starts
    over: torch.Tensor  # bool, lists longer than fast_cap


@dataclass
class StepMetadata:
    """One forward's SFI metadata, built once before the first layer (the backend's
    init_forward_metadata, or its out-graph / in-graph halves around a CUDA graph) and only
    read by the layers; the sibling of the dense backends' ForwardMetadata."""

    rows: Optional[Rows] = None  # the step plan's rows (None: not a decode step, or a dense one)
    dense_step: bool = False  # a decode step the dense backend runs alone (dense_step)
    # (batch row, slot, Request) of rows on the host path (eager steps only)
    host_rows: list = field(default_factory=list)
    # batch rows whose input token is a per-request boundary (host; eager steps only)
    extra_rows: Optional[torch.Tensor] = None
    ref_len: Optional[int] = None  # the torch reference's length (its longest context)
    win_start: Optional[torch.Tensor] = None  # [B] the fast kernel's window starts
    # the batched Selector's ([L_sparse, B, H_q, N] scores, [L_sparse, B, H_kv, N] key norms)
    layer_scores: Optional[tuple] = None
    fast_plan: Optional[FastLists] = None  # the FlashInfer fast path's list lengths
    # the torch reference: [L, B] host rows whose own pass replaces the device pass at a layer
    host_only: Optional[torch.Tensor] = None


# A slow step keeps every sparse layer's scores until the step's end and runs the Selector
# once for all layers (rows = layers x requests: ~15 launches instead of ~15 per layer)
# while the scores of a step fit in this many bytes; larger steps select layer by layer.
SELECT_BATCH_BYTES = 256 << 20  # scores and key norms


class ScoreBuffers:
    """The slow pass's logits, float32 [rows, H_q, N], and key norms, NORM_DTYPE [rows, H_kv,
    N'] (N' = N rounded up to 16 bytes, so that every row and layer starts 16-byte aligned:
    Triton specializes on pointer alignment, and one kernel variant serves every layer), N =
    req_to_token's width (the torch reference: the step's longest context). On the
    kernel path (`packed`) the buffers are made once, at the backend's start, and never
    replaced (a CUDA graph holds no reference to the tensors it writes): `rows` of them for
    one layer at a time (a decode step's score rows: its slow rows, at most
    SFIConfig.max_slow_rows, else at most one per request slot; `score_rows`), and, for the
    batched Selector of a step's every sparse layer, as many rows as fit SELECT_BATCH_BYTES.
    SGLang's KV budget sets their bytes aside (`reserve_bytes`, hooks._reserve_sfi_memory),
    so a full pool under load cannot run the device out of memory at a slow step."""

    def __init__(self, device, packed: bool, rows: int, num_sparse: int, num_q_heads: int,
                 num_kv_heads: int, width: int, batched: bool):
        self.device, self.packed = torch.device(device), packed
        self.num_sparse, self.num_q_heads, self.num_kv_heads, self.width = num_sparse, num_q_heads, num_kv_heads, width
        per16 = 16 // NORM_DTYPE.itemsize
        self.norm_width = -(-width // per16) * per16
        self.one: Optional[tuple] = None  # (scores, norms) of one layer
        self.layers: Optional[tuple] = None  # (scores, norms) of every sparse layer, flat
        if not packed:
            return
        self.one = self._pair(rows)
        per_row = num_sparse * self._row_bytes()
        cap = min(SELECT_BATCH_BYTES // per_row, rows) if batched and num_sparse > 0 else 0
        if cap >= 1:
            self.layers = tuple(t.view(-1) for t in self._pair(cap * num_sparse))

    def _pair(self, rows: int) -> tuple:
        return (torch.empty((rows, self.num_q_heads, self.width), dtype=torch.float32, device=self.device),
                torch.empty((rows, self.num_kv_heads, self.norm_width), dtype=NORM_DTYPE, device=self.device))

    def _row_bytes(self) -> int:
        return 4 * self.num_q_heads * self.width + NORM_DTYPE.itemsize * self.num_kv_heads * self.norm_width

    @staticmethod
    def reserve_bytes(rows: int, num_sparse: int, num_q_heads: int, num_kv_heads: int, width: int,
                      batched: bool) -> int:
        """Bytes the kernel path's buffers take (measured on the meta device, so it cannot
        drift from the allocation)."""
        return ScoreBuffers("meta", True, rows, num_sparse, num_q_heads, num_kv_heads, width, batched).bytes()

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in (self.one, self.layers) if pair is not None
                   for t in pair)

    def layer(self, rows: int, ref_len: Optional[int]) -> tuple:
        """One layer's (logits [rows, H_q, N], key norms [rows, H_kv, >= N])."""
        if not self.packed:
            return (torch.empty((rows, self.num_q_heads, ref_len), dtype=torch.float32, device=self.device),
                    torch.empty((rows, self.num_kv_heads, ref_len), dtype=NORM_DTYPE, device=self.device))
        if rows > self.one[0].shape[0]:
            raise RuntimeError(f"SFI: a decode step of {rows} score rows, beyond the "
                               f"{self.one[0].shape[0]} its score buffer was made for")
        return self.one[0][:rows], self.one[1][:rows]

    def step(self, rows: int) -> Optional[tuple]:
        """([L_sparse, rows, H_q, N] scores, [L_sparse, rows, H_kv, N'] norms) for a step
        whose Selectors run batched at its end, or None: layer by layer (more than
        SELECT_BATCH_BYTES of buffers, or the batched Selector off)."""
        n = self.num_sparse * rows
        if self.layers is None or n * self.num_q_heads * self.width > self.layers[0].numel():
            return None
        return (self.layers[0][:n * self.num_q_heads * self.width].view(self.num_sparse, rows, self.num_q_heads,
                                                                          self.width),
                self.layers[1][:n * self.num_kv_heads * self.norm_width].view(self.num_sparse, rows, self.num_kv_heads,
                                                                                self.norm_width))
