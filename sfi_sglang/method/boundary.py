"""Boundary tokens and the trigger policy that decides slow vs fast decode steps.

Boundary tokens are found by scanning the tokenizer's own vocabulary (any HF
tokenizer, byte-level BPE included), so no model's token ids are hard-coded.
A token is a boundary when its decoded text, after stripping trailing whitespace
and closing quotes/brackets, ends with a sentence mark of the enabled classes.
This is a pure vocabulary scan: abbreviations ("Mr.", "e.g.") and numbered list
items ("1.") count as boundaries when they are single tokens; "3.14" does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:  # only for annotations: config imports this module (spec validation)
    from sfi_sglang.method.config import SFIConfig

MARK_CLASSES = {
    "latin": (".", "?", "!", "\u2026"),          # . ? ! …
    "cjk": ("\u3002", "\uff1f", "\uff01"),       # 。 ？ ！
}
BREAK_CLASSES = {
    "paragraph": ("\n\n", "\r\n\r\n"),                  # a blank line
    "line": ("\n",),                                      # a line end
}
# longest boundary spec accepted (--sfi-boundaries, POST /sfi/boundaries, a request's
# extra_boundaries): each distinct spec costs a vocabulary scan and a cached table
MAX_SPEC_CHARS = 4096
CLOSERS = "\"')]}\u201d\u2019\u300d\u300f\u300b"  # " ' ) ] } ” ’ 」 』 》


def parse_boundary_spec(spec: str) -> tuple[frozenset[str], frozenset[str]]:
    """Spec string -> (sentence marks, breaks: texts a boundary token contains).

    Comma-separated items: "latin" (. ? ! …), "cjk" (。 ？ ！), "paragraph" (tokens
    containing a blank line, "\\n\\n"), "line" (tokens containing a line end: code, logs,
    lists), "default" (= latin,cjk), "mark:X" (the literal
    mark X, e.g. "mark:;"; X cannot contain a comma), or "none" alone (no boundaries:
    only max_interval triggers refreshes), at most MAX_SPEC_CHARS characters. Anything
    else raises ValueError.
    """
    if not isinstance(spec, str):
        raise ValueError(f"boundary spec must be a string, got {spec!r}")
    if len(spec) > MAX_SPEC_CHARS:
        raise ValueError(f"boundary spec is {len(spec)} characters long, over the limit of "
                         f"{MAX_SPEC_CHARS}")
    items = [s.strip() for s in spec.split(",")]
    if items == ["none"]:
        return frozenset(), frozenset()
    marks: set[str] = set()
    breaks: set[str] = set()
    for item in items:
        if item == "default":
            marks.update(MARK_CLASSES["latin"] + MARK_CLASSES["cjk"])
        elif item in MARK_CLASSES:
            marks.update(MARK_CLASSES[item])
        elif item in BREAK_CLASSES:
            breaks.update(BREAK_CLASSES[item])
        elif item.startswith("mark:") and len(item) > len("mark:"):
            marks.add(item[len("mark:"):])
        else:
            raise ValueError(
                f"invalid boundary spec {spec!r} (bad item {item!r}); use a comma-separated "
                f"list of latin, cjk, paragraph, line, default, mark:<text>, or 'none' alone")
    return frozenset(marks), frozenset(breaks)


def _strip_tail(text: str) -> str:
    end = len(text)
    while end and (text[end - 1].isspace() or text[end - 1] in CLOSERS):
        end -= 1
    return text[:end]


def classify_text(text: str, marks: frozenset[str], breaks: frozenset[str]) -> tuple[bool, bool]:
    """(is_boundary, is_content) for one token's decoded text.

    content = not a boundary and not only whitespace / closing quotes and brackets.
    """
    core = _strip_tail(text)
    boundary = bool(core) and core.endswith(tuple(marks)) if marks else False
    if any(b in text for b in breaks):
        boundary = True
    return boundary, (not boundary and bool(core))


def _decode_vocab(tokenizer) -> list[str]:
    n = len(tokenizer)
    ids = [[i] for i in range(n)]
    try:
        return tokenizer.batch_decode(ids, skip_special_tokens=False,
                                      clean_up_tokenization_spaces=False)
    except Exception:  # slow or unusual tokenizers: one id at a time
        return [tokenizer.decode(i, skip_special_tokens=False) for i in ids]


def boundary_tables(tokenizer, spec: str = "default", vocab_size: int | None = None,
                    device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean tables (is_boundary[V], is_content[V]) for V = max(vocab_size, len(tokenizer)).

    Special tokens and ids past the tokenizer (padded embedding rows) are neither.
    """
    marks, breaks = parse_boundary_spec(spec)
    texts = _decode_vocab(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    v = max(vocab_size or 0, len(texts))
    is_b = [False] * v
    is_c = [False] * v
    for i, t in enumerate(texts):
        if i not in special:
            is_b[i], is_c[i] = classify_text(t, marks, breaks)
    return (torch.tensor(is_b, dtype=torch.bool, device=device),
            torch.tensor(is_c, dtype=torch.bool, device=device))


class TriggerPolicy:
    """Decides, per request slot and decode step, whether the step is slow (dense + reselect).

    Batched over request slots with torch tensors on any device; step() does no host sync.

    Time: a refresh (a slow step, or the bootstrap selection at the end of prefill,
    i.e. reset()) happens at distance 0. At each later decode step the input token x
    (the token sampled by the previous step) is at distance d = steps since the
    last refresh (the first decode step after prefill has d = 1).

    Mode "boundary" (cfg.refresh == "boundary"), per slot, at distance d with input x:
      * pending: a boundary token was input at some distance > cooldown since the
        last refresh (boundaries at d <= cooldown are dropped: the refresh just made
        already reflects that sentence end; this is all the cooldown state, so it
        needs no counter of its own).
      * the step is slow if
          (pending and is_content[x] and d >= min_gap)   # first content token after
                                                        # a boundary = sentence start;
                                                        # min_gap defers, never drops
          or d >= max_interval                          # forced refresh
          or force                                      # caller's own reason
        Whitespace-only / closing-quote tokens and further boundaries keep the
        refresh pending; a boundary input at the slow step itself is consumed.
      * after a slow step: distance 0, pending cleared.
    Mode "interval": slow iff d >= max_interval (or force): every max_interval steps.
    Mode "adaptive": "boundary", and also slow when the sparse memory stopped covering the
    query (`observe`): the fast step's log-sum-exp over the memory, mean over the q heads
    of the monitored layers, fell more than adaptive_threshold nats below its value at the
    first fast step after the last refresh (the reference). A query that turns to tokens
    the memory lacks finds lower logits in it. Decided at the step before, on the device.

    min_gap, cooldown, max_interval and the mode are per-slot tensors set by
    reset(slots, cfg), so per-request config overrides work; the boundary tables
    are shared (one tokenizer and boundary spec per server).
    """

    def __init__(self, is_boundary: torch.Tensor, is_content: torch.Tensor, max_slots: int,
                 cfg: SFIConfig, device=None):
        device = device if device is not None else is_boundary.device
        self.cfg = cfg
        self.is_boundary = is_boundary.to(device=device, dtype=torch.bool)
        self.is_content = is_content.to(device=device, dtype=torch.bool)
        self.vocab = self.is_boundary.numel()
        i32 = dict(dtype=torch.int32, device=device)
        self.since = torch.zeros(max_slots, **i32)
        self.pending = torch.zeros(max_slots, dtype=torch.bool, device=device)
        # a slow step the step's row limit put off (`step`): slow at the slot's next step
        self.deferred = torch.zeros(max_slots, dtype=torch.bool, device=device)
        self.min_gap = torch.full((max_slots,), cfg.min_gap, **i32)
        self.cooldown = torch.full((max_slots,), cfg.cooldown, **i32)
        self.max_interval = torch.full((max_slots,), cfg.max_interval, **i32)
        self.interval_mode = torch.full((max_slots,), cfg.refresh == "interval",
                                        dtype=torch.bool, device=device)
        # adaptive mode (made by `monitor`): threshold per slot (inf: off), the reference
        # log-sum-exp [slots, layers, H_q] and whether it is taken, the next step's verdict,
        # and the slow steps it caused (meta_info)
        self.threshold = self.lse_ref = self.ref_ok = self.drift = self.fired = None

    @classmethod
    def from_tokenizer(cls, tokenizer, cfg: SFIConfig, max_slots: int,
                       vocab_size: int | None = None, device=None) -> "TriggerPolicy":
        is_b, is_c = boundary_tables(tokenizer, cfg.boundaries, vocab_size, device)
        return cls(is_b, is_c, max_slots, cfg, device)

    def install(self, is_boundary: torch.Tensor, is_content: torch.Tensor) -> None:
        """A new boundary table (from the tokenizer side, sfi_sglang.router), copied in place,
        so the tables' addresses stay valid in captured graphs; the next decode step uses
        it. Ids past the given tables are neither."""
        for src, dst in ((is_boundary, self.is_boundary), (is_content, self.is_content)):
            n = min(dst.numel(), src.numel())
            full = torch.zeros(dst.numel(), dtype=torch.bool)
            full[:n] = src[:n].cpu()
            dst.copy_(full.to(dst.device))

    def table_summary(self, spec: str, version: int) -> dict:
        """What GET /sfi/boundaries reports of the installed table (host sync)."""
        import time

        return {"spec": spec, "version": version, "vocab_size": self.vocab,
                "num_boundary": int(self.is_boundary.sum()),
                "num_content": int(self.is_content.sum()), "installed_at": time.time()}

    def mark_pending(self, slots: torch.Tensor, rows: torch.Tensor, slow: torch.Tensor) -> None:
        """Per-request boundaries (extra_boundary_rows) at batch rows `rows` of a step whose
        slots and slow rows are given: the refresh is pending after this step, as for a
        table boundary in `step` (outside the cooldown, not at a slow step)."""
        rows = rows.to(slots.device)
        s = slots[rows].to(torch.int64)
        self.pending[s] |= (self.since[s] > self.cooldown[s]) & ~slow[rows]

    def reset(self, slots: torch.Tensor, cfg: SFIConfig | None = None) -> None:
        """New requests in `slots` (or a bootstrap refresh): distance 0, nothing pending,
        per-slot trigger parameters from cfg (default: the policy's cfg)."""
        cfg = cfg or self.cfg
        slots = torch.as_tensor(slots, dtype=torch.int64, device=self.since.device)
        self.since[slots] = 0
        self.pending[slots] = False
        self.deferred[slots] = False
        self.min_gap[slots] = cfg.min_gap
        self.cooldown[slots] = cfg.cooldown
        self.max_interval[slots] = cfg.max_interval
        self.interval_mode[slots] = cfg.refresh == "interval"
        if self.threshold is not None:
            self.threshold[slots] = cfg.adaptive_threshold if cfg.refresh == "adaptive" else float("inf")
            self.ref_ok[slots] = False
            self.drift[slots] = False
            self.fired[slots] = 0

    def monitor(self, num_layers: int, num_q_heads: int) -> None:
        """Adaptive mode's state, for `observe` of num_layers layers of num_q_heads heads."""
        n, dev = self.since.shape[0], self.since.device
        self.threshold = torch.where(torch.full((n,), self.cfg.refresh == "adaptive", device=dev),
                                     self.cfg.adaptive_threshold, float("inf")).to(torch.float32)
        self.lse_ref = torch.zeros(n, num_layers, num_q_heads, dtype=torch.float32, device=dev)
        self.ref_ok = torch.zeros(n, dtype=torch.bool, device=dev)
        self.drift = torch.zeros(n, dtype=torch.bool, device=dev)
        self.fired = torch.zeros(n, dtype=torch.int32, device=dev)

    def observe(self, slots: torch.Tensor, lse: torch.Tensor, fast: torch.Tensor) -> None:
        """A decode step's fast log-sum-exps lse [layers, B, H_q] (natural log) of the rows
        in `slots` [B]; fast [B] bool: the rows that ran a fast step. Sets the verdict that
        the next step of each slot reads (`step`); a row that was not fast drops its
        reference (it refreshed: the next fast step takes a new one). No host sync."""
        slots = slots.to(torch.int64)
        cur = lse.transpose(0, 1)  # [B, layers, H_q]
        ref, ok = self.lse_ref[slots], self.ref_ok[slots]
        drop = (ref - cur).mean((1, 2))
        self.drift[slots] = fast & ok & (drop > self.threshold[slots])
        self.lse_ref[slots] = torch.where((fast & ~ok)[:, None, None], cur, ref)
        self.ref_ok[slots] = fast

    def step(self, last_token_ids: torch.Tensor, slots: torch.Tensor,
             force: torch.Tensor | None = None, limit: int | None = None,
             limited: torch.Tensor | None = None) -> torch.Tensor:
        """slow [B] bool for the decode step whose input tokens are last_token_ids [B]
        in request slots [B] (distinct); updates the slots' state. Token ids outside
        the tables (e.g. -1 padding) are neither boundary nor content. limit: at most this
        many of the rows `limited` [B] bool (default all) are slow, the first in batch
        order; a row beyond them is deferred: fast now, slow at its next step (its distance
        and pending boundary carry on meanwhile). The other rows decide as without a limit
        (the caller runs them otherwise: SFI off, or on the host path, which reads `since`)."""
        slots = slots.to(torch.int64)
        ids = last_token_ids.to(torch.int64)
        in_vocab = (ids >= 0) & (ids < self.vocab)
        ids = ids.clamp(0, self.vocab - 1)
        is_b = self.is_boundary[ids] & in_vocab
        is_c = self.is_content[ids] & in_vocab

        d = self.since[slots] + 1
        pending = self.pending[slots]
        forced = d >= self.max_interval[slots]
        due = pending & is_c & (d >= self.min_gap[slots]) & ~self.interval_mode[slots]
        slow = due | forced
        if self.drift is not None:
            drift = self.drift[slots] & ~slow & ~self.interval_mode[slots]
            self.fired[slots] = self.fired[slots] + drift.to(torch.int32)
            slow = slow | drift
        if force is not None:
            slow = slow | force.to(torch.bool)
        slow = slow | self.deferred[slots]
        if limit is not None and limit < slow.shape[0]:
            wanted = slow if limited is None else slow & limited.to(torch.bool)
            kept = wanted & (torch.cumsum(wanted.to(torch.int32), 0) <= limit)
            self.deferred[slots] = wanted & ~kept
            slow = kept if limited is None else torch.where(limited.to(torch.bool), kept, slow)
        else:  # index_fill_, not `[slots] = False`: no host-to-device copy in a graph's capture
            self.deferred.index_fill_(0, slots, False)

        take = is_b & (d > self.cooldown[slots])
        self.since[slots] = torch.where(slow, torch.zeros_like(d), d)
        self.pending[slots] = ~slow & (pending | take)
        return slow


def extra_boundary_rows(input_ids: torch.Tensor, extra_ids: list, grammars: list):
    """Batch rows [k] int64 whose input token is a per-request boundary, or None (host):
    a request's extra boundary ids (extra_ids[i], a list or None) and grammar-aware
    boundaries (a grammar of sfi_sglang.integration.grammar flags, in `sfi_boundary`, the
    token that ended a JSON field; the flag is consumed here)."""
    if not any(extra_ids) and not any(g is not None for g in grammars):
        return None  # the common case: no host read
    ids = input_ids.tolist()
    hit = []
    for i in range(len(extra_ids)):
        g = grammars[i] if i < len(grammars) else None
        flagged = bool(getattr(g, "sfi_boundary", False))
        if flagged:
            g.sfi_boundary = False
        if flagged or (extra_ids[i] and ids[i] in extra_ids[i]):
            hit.append(i)
    return torch.tensor(hit, dtype=torch.int64) if hit else None


class AdaptiveMonitor:
    """What refresh "adaptive" reads: the fast step's log-sum-exps of the sparse layers at
    1/4, 1/2 and 3/4 of the server's sparse layers (middle layers: the first attend broadly,
    the last follow the output), [layers, rows, H_q], written by the fast kernel and read
    once per step by TriggerPolicy.observe. A buffer made once (graphs write into it); no
    layers and no buffer in the other refresh modes."""

    def __init__(self, policy: TriggerPolicy, sparse_ids: list[int], max_slots: int, num_q_heads: int,
                 device, on: bool):
        self.policy = policy
        self.layers = sorted({sparse_ids[len(sparse_ids) * k // 4] for k in (1, 2, 3)}) if on and sparse_ids else []
        self.index = {lid: i for i, lid in enumerate(self.layers)}
        self.layer_t = torch.tensor(self.layers, dtype=torch.int64, device=device)
        self.lse = None
        if self.layers:
            policy.monitor(len(self.layers), num_q_heads)
            self.lse = torch.full((len(self.layers), max_slots, num_q_heads), float("-inf"),
                                  dtype=torch.float32, device=device)

    def rows(self, rows: int) -> torch.Tensor:
        """The buffer's first `rows` rows [layers, rows, H_q]; grown outside a capture when
        an eager step has more rows than request slots."""
        if self.lse.shape[1] < rows:
            if self.lse.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"SFI: a CUDA graph of {rows} rows was captured beyond the "
                                   f"{self.lse.shape[1]} rows of the adaptive trigger's buffer")
            self.lse = torch.full((self.lse.shape[0], rows, self.lse.shape[2]), float("-inf"),
                                  dtype=torch.float32, device=self.lse.device)
        return self.lse[:, :rows]

    def out(self, lid: int, rows: int, row: Optional[int] = None) -> Optional[torch.Tensor]:
        """The fast kernel's lse_out at layer lid for a step of `rows` rows ([rows, H_q], or
        row `row` alone [1, H_q]), or None where the layer is not monitored."""
        k = self.index.get(lid)
        if k is None:
            return None
        buf = self.rows(rows)[k]
        return buf if row is None else buf[row:row + 1]

    def observe(self, rows, slots: torch.Tensor, b: int, host_fast=()) -> None:
        """The trigger's verdict for each row's next step, from this step's log-sum-exps
        (their fast passes, device rows and host rows: host_fast (row, fast) pairs). A row
        that keeps a monitored layer dense (its own dense_layers) has no memory there to
        judge: it is not observed."""
        fast = rows.on & ~rows.slow & ~rows.dense.index_select(1, self.layer_t).any(1)
        if host_fast:  # eager steps only
            fast = fast.clone()
            for i, f in host_fast:
                fast[i] = f
        self.policy.observe(slots, self.rows(b), fast)
