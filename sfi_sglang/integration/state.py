"""Process-wide SFI state of an SGLang process: the `sfi` attention backends it made (one per
model runner) and the per-request options its scheduler received. Readers take the backend
through `active()`."""

from __future__ import annotations

# the `sfi` backends of this process, in the order their model runners made them
BACKENDS: list = []
# rid -> custom_params of the requests this scheduler received (set by hooks._record_request_options)
REQUEST_PARAMS: dict[str, dict] = {}


def active():
    """This process's `sfi` backend (the last one made), or None where there is none."""
    return BACKENDS[-1] if BACKENDS else None
