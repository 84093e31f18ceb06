"""The known harmless start-up noise of SGLang and torch on the CPU engine, named in one
place, so `sfi-sglang generate` prints the answer and SFI's summary, not a page of notices
a user cannot act on.

- Python warnings (`HARMLESS_WARNINGS`): SGLang issues them while importing its modules,
  in every process it spawns (scheduler, detokenizer) before any plugin runs, so
  `install_warning_filters()` runs at interpreter start (`sfi_sglang._startup`). The filters
  are appended after Python's own, so `-W`/`PYTHONWARNINGS` options win: run with
  `PYTHONWARNINGS=default` to see these warnings again.
- Log records (`HARMLESS_LOGS`): `install_log_filters()` runs from the plugin
  (`sfi_sglang.plugin.register`, every SGLang process) and drops WARNING-and-below records of
  the named loggers whose message starts with a named prefix.

Everything not listed is kept, and so is any record at ERROR or above. Keep this module free
of heavy imports: `install_warning_filters()` runs in every Python process of the environment.
"""

from __future__ import annotations

import warnings

# (category, message regex, module regex, why it is harmless). The module regex is matched
# against the warning's module name, so a same-text warning from elsewhere is kept.
HARMLESS_WARNINGS = [
    (UserWarning, r"Only CUDA, HIP and XPU support AWQ currently\.",
     r"sglang\.srt\.layers\.quantization\.awq",
     "SGLang's AWQ module, at import on a machine without CUDA; nothing here loads AWQ weights"),
    (UserWarning, r"Only CUDA, MUSA and NPU support GGUF quantization currently\.",
     r"sglang\.srt\.layers\.quantization\.gguf",
     "SGLang's GGUF module, at import without CUDA; the embedded GGUF model is converted to "
     "float safetensors (sfi_sglang.model) before SGLang loads it"),
    (UserWarning, r"Triton is not supported on current platform, roll back to CPU\.",
     r"sglang\.kernels\.ops\.attention\.fla",
     "SGLang's linear-attention (FLA) kernels, at import without CUDA; SFI's models do not use them"),
]

# (logger name, message prefix, why it is harmless)
HARMLESS_LOGS = [
    ("sglang.srt.utils.common", "Fail to set RLIMIT_NOFILE: current limit exceeds maximum limit",
     "SGLang asks for more open files than the hard limit allows; the server runs on the soft limit"),
    ("sglang.kernels.jit.utils.arch", "Cannot detect CUDA architecture.",
     "the CPU engine has no CUDA device"),
    ("sglang.srt.distributed.bootstrap", "init_cpu_threads_env and shared memory based AllReduce is disabled",
     "the CPU all-reduce serves tensor parallelism, which the CPU engine here does not use"),
]


def install_warning_filters() -> None:
    for category, message, module, _why in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module, append=True)


def install_log_filters() -> None:
    import logging

    class DropHarmless(logging.Filter):
        def __init__(self, prefixes: tuple[str, ...]):
            super().__init__()
            self.prefixes = prefixes

        def filter(self, record: logging.LogRecord) -> bool:
            return record.levelno >= logging.ERROR or not record.getMessage().startswith(self.prefixes)

    by_logger: dict[str, list[str]] = {}
    for name, prefix, _why in HARMLESS_LOGS:
        by_logger.setdefault(name, []).append(prefix)
    for name, prefixes in by_logger.items():
        logger = logging.getLogger(name)
        if not any(type(f).__name__ == "DropHarmless" for f in logger.filters):
            logger.addFilter(DropHarmless(tuple(prefixes)))
