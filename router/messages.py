"""ZMQ message types between the tokenizer manager and the schedulers.

Both are msgspec structs on SGLang's BaseReq, so they travel over SGLang's own
tokenizer -> scheduler socket with either IPC encoding (pickle, or msgpack once
`register()` has added them to io_struct's decoder through hook_custom_types).
"""

from __future__ import annotations

from typing import List, Optional

from sglang.srt.managers.io_struct import BaseReq, hook_custom_types


class SFIBoundariesReqInput(BaseReq, kw_only=True):
    """Tokenizer -> every scheduler: install this boundary table (or, with
    `spec` None, only report the current one).

    The table is sparse: token ids in `boundary_ids` are boundaries; ids in
    `neutral_ids` and ids >= `num_tokens` (padded embedding rows) are neither
    boundary nor content; every other id is content.
    """

    spec: Optional[str] = None
    version: int = 0
    vocab_size: int = 0
    num_tokens: int = 0
    boundary_ids: List[int] = []
    neutral_ids: List[int] = []
    reply: bool = True  # the start-up message goes out before anyone waits for a reply


class SFIBoundariesReqOutput(BaseReq, kw_only=True):
    """Scheduler -> tokenizer: what the scheduler now uses (one per DP rank)."""

    success: bool = True
    message: str = ""
    pid: int = 0
    dp_rank: int = 0
    tp_size: int = 1
    sfi: bool = False  # an `sfi` attention backend lives in this scheduler
    spec: Optional[str] = None
    version: int = 0
    num_boundary: int = 0
    num_content: int = 0
    vocab_size: int = 0
    installed_at: float = 0.0
    tp_ranks: List[dict] = []  # every TP rank's installed table (tp_size > 1)

    def summary(self) -> dict:
        return {f: getattr(self, f) for f in self.__struct_fields__
                if f not in ("rid", "http_worker_ipc", "reply")}


_registered = False


def register() -> None:
    """Teach io_struct's msgpack decoder our types (each SGLang process, at plugin load)."""
    global _registered
    if not _registered:
        hook_custom_types(SFIBoundariesReqInput, SFIBoundariesReqOutput)
        _registered = True
