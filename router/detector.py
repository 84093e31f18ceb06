"""Tokenizer-side boundary detector: turns a boundary spec (`--sfi-boundaries` syntax)
into the tokenizer's boundary / content token tables, and into the ZMQ message that
carries them to the schedulers. Tables are cached per spec; building one decodes the
whole vocabulary once (about 0.2-0.6 s for a 50K vocabulary), which is why it runs
here and not in the scheduler's loop. The cache keeps the MAX_TABLES most recently used
specs (requests choose their own extra_boundaries, so the set of specs is unbounded)."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from sfi_sglang.method.boundary import boundary_tables, parse_boundary_spec
from sfi_sglang.router.messages import SFIBoundariesReqInput


class BoundaryDetector:
    MAX_TABLES = 64  # specs whose tables stay cached (least recently used dropped first)

    def __init__(self, tokenizer, vocab_size: int | None = None):
        self.tokenizer = tokenizer
        self.num_tokens = len(tokenizer)
        self.vocab_size = max(vocab_size or 0, self.num_tokens)
        self.version = 0
        self.spec: str | None = None
        self._tables: OrderedDict[str, tuple[list[int], list[int]]] = OrderedDict()
        self._lock = threading.Lock()

    def tables(self, spec: str) -> tuple[list[int], list[int]]:
        """(boundary ids, neutral ids below num_tokens) for a spec; ValueError on a bad one."""
        parse_boundary_spec(spec)
        with self._lock:
            if spec not in self._tables:
                is_b, is_c = boundary_tables(self.tokenizer, spec, self.num_tokens)
                neutral = ~(is_b | is_c)
                self._tables[spec] = (torch.nonzero(is_b).flatten().tolist(),
                                      torch.nonzero(neutral).flatten().tolist())
                while len(self._tables) > self.MAX_TABLES:
                    self._tables.popitem(last=False)
            self._tables.move_to_end(spec)
            return self._tables[spec]

    def boundary_ids(self, spec: str) -> list[int]:
        return self.tables(spec)[0]

    def message(self, spec: str, reply: bool = True) -> SFIBoundariesReqInput:
        """The install message for `spec`, with the next version number."""
        boundary, neutral = self.tables(spec)
        with self._lock:
            self.version += 1
            self.spec = spec
            version = self.version
        return SFIBoundariesReqInput(spec=spec, version=version, vocab_size=self.vocab_size,
                                     num_tokens=self.num_tokens, boundary_ids=boundary,
                                     neutral_ids=neutral, reply=reply)


def decode_tables(msg: SFIBoundariesReqInput, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense (is_boundary[vocab], is_content[vocab]) from a message (scheduler side)."""
    is_b = torch.zeros(vocab, dtype=torch.bool)
    is_c = torch.zeros(vocab, dtype=torch.bool)
    is_c[:min(msg.num_tokens, vocab)] = True
    for ids, table, value in ((msg.neutral_ids, is_c, False), (msg.boundary_ids, is_c, False),
                              (msg.boundary_ids, is_b, True)):
        idx = torch.tensor([i for i in ids if 0 <= i < vocab], dtype=torch.int64)
        table[idx] = value
    return is_b, is_c
