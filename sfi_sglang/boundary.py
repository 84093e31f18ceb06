"""Boundary tokens and the trigger policy that decides slow vs fast decode steps.

Boundary tokens are found by scanning the tokenizer's own vocabulary (any HF
tokenizer, byte-level BPE included), so no model's token ids are hard-coded.
A token is a boundary when its decoded text, after stripping trailing whitespace
and closing quotes/brackets, ends with a sentence mark of the enabled classes.
This is a pure vocabulary scan: abbreviations ("Mr.", "e.g.") and numbered list
items ("1.") count as boundaries when they are single tokens; "3.14" does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # only for annotations: config imports this module (spec validation)
    from sfi_sglang.config import SFIConfig

MARK_CLASSES = {
    "latin": (".", "?", "!", "\u2026"),          # . ? ! …
    "cjk": ("\u3002", "\uff1f", "\uff01"),       # 。 ？ ！
}
# longest boundary spec accepted (--sfi-boundaries, POST /sfi/boundaries, a request's
# extra_boundaries): each distinct spec costs a vocabulary scan and a cached table
MAX_SPEC_CHARS = 4096
CLOSERS = "\"')]}\u201d\u2019\u300d\u300f\u300b"  # " ' ) ] } ” ’ 」 』 》


def parse_boundary_spec(spec: str) -> tuple[frozenset[str], bool]:
    """Spec string -> (sentence marks, paragraph flag).

    Comma-separated items: "latin" (. ? ! …), "cjk" (。 ？ ！), "paragraph" (tokens
    containing a blank line, "\\n\\n"), "default" (= latin,cjk), "mark:X" (the literal
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
        return frozenset(), False
    marks: set[str] = set()
    paragraph = False
    for item in items:
        if item == "default":
            marks.update(MARK_CLASSES["latin"] + MARK_CLASSES["cjk"])
        elif item in MARK_CLASSES:
            marks.update(MARK_CLASSES[item])
        elif item == "paragraph":
            paragraph = True
        elif item.startswith("mark:") and len(item) > len("mark:"):
            marks.add(item[len("mark:"):])
        else:
            raise ValueError(
                f"invalid boundary spec {spec!r} (bad item {item!r}); use a comma-separated "
                f"list of latin, cjk, paragraph, default, mark:<text>, or 'none' alone")
    return frozenset(marks), paragraph


def _strip_tail(text: str) -> str:
    end = len(text)
    while end and (text[end - 1].isspace() or text[end - 1] in CLOSERS):
        end -= 1
    return text[:end]


def classify_text(text: str, marks: frozenset[str], paragraph: bool) -> tuple[bool, bool]:
    """(is_boundary, is_content) for one token's decoded text.

    content = not a boundary and not only whitespace / closing quotes and brackets.
    """
    core = _strip_tail(text)
    boundary = bool(core) and core.endswith(tuple(marks)) if marks else False
    if paragraph and ("\n\n" in text or "\r\n\r\n" in text):
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


def boundary_token_ids(tokenizer, spec: str = "default") -> list[int]:
    """Sorted ids of the tokenizer's boundary tokens (special tokens excluded)."""
    is_b, _ = boundary_tables(tokenizer, spec)
    return torch.nonzero(is_b).flatten().tolist()


def boundary_tables(tokenizer, spec: str = "default", vocab_size: int | None = None,
                    device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean tables (is_boundary[V], is_content[V]) for V = max(vocab_size, len(tokenizer)).

    Special tokens and ids past the tokenizer (padded embedding rows) are neither.
    """
    marks, paragraph = parse_boundary_spec(spec)
    texts = _decode_vocab(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    v = max(vocab_size or 0, len(texts))
    is_b = [False] * v
    is_c = [False] * v
    for i, t in enumerate(texts):
        if i not in special:
            is_b[i], is_c[i] = classify_text(t, marks, paragraph)
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

    def reset(self, slots: torch.Tensor, cfg: SFIConfig | None = None) -> None:
        """New requests in `slots` (or a bootstrap refresh): distance 0, nothing pending,
        per-slot trigger parameters from cfg (default: the policy's cfg)."""
        cfg = cfg or self.cfg
        slots = torch.as_tensor(slots, dtype=torch.int64, device=self.since.device)
        self.since[slots] = 0
        self.pending[slots] = False
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
             force: torch.Tensor | None = None) -> torch.Tensor:
        """slow [B] bool for the decode step whose input tokens are last_token_ids [B]
        in request slots [B] (distinct); updates the slots' state. Token ids outside
        the tables (e.g. -1 padding) are neither boundary nor content."""
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

        take = is_b & (d > self.cooldown[slots])
        self.since[slots] = torch.where(slow, torch.zeros_like(d), d)
        self.pending[slots] = ~slow & (pending | take)
        return slow
