"""SGLang general plugin (entry point group `sglang.srt.plugins`), executed by SGLang's
`load_plugins()` early in each of its processes: the launcher/tokenizer manager, every
scheduler and the detokenizer."""

from __future__ import annotations

import os

TRACE_ENV = "SFI_SGLANG_PLUGIN_TRACE"


def register() -> None:
    _trace()


def _trace() -> None:
    """If $SFI_SGLANG_PLUGIN_TRACE names a file, append this process's pid and title:
    lets tests check that the plugin ran in every SGLang process."""
    path = os.environ.get(TRACE_ENV)
    if not path:
        return
    try:
        import setproctitle

        title = setproctitle.getproctitle()
    except ImportError:
        title = ""
    import multiprocessing

    with open(path, "a") as f:
        f.write(f"{os.getpid()}\t{multiprocessing.current_process().name}\t{title}\n")
