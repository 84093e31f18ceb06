"""SGLang general plugin (entry point group `sglang.srt.plugins`), executed by SGLang's
`load_plugins()` early in each of its processes: the launcher/tokenizer manager, every
scheduler and the detokenizer."""

from __future__ import annotations

import os

TRACE_ENV = "SFI_SGLANG_PLUGIN_TRACE"
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    _trace()
    from sfi_sglang.integration import quiet

    quiet.install_log_filters()  # SGLang's known harmless log records (named there)
    _register_backend()
    from sfi_sglang.integration import hooks, radix

    radix.register()  # the `sfi` radix cache: shared prefixes share SFI memories
    from sfi_sglang.integration import grammar
    from sfi_sglang.router import messages

    messages.register()  # boundary-table messages on SGLang's tokenizer <-> scheduler IPC
    grammar.register()  # grammar backends sfi-xgrammar / sfi-llguidance

    hooks.install()


def _register_backend() -> None:
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend

    if "sfi" not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices(["sfi"])
    from sfi_sglang.integration import batch_invariant

    batch_invariant.register_backend_choices()  # --enable-deterministic-inference

    @register_attention_backend("sfi")
    def create_sfi_backend(runner):
        from sfi_sglang.integration.backend import SFIAttnBackend
        from sfi_sglang.engine import dense_backend
        from sfi_sglang.method.config import server_config

        name = dense_backend(server_config())
        if name == "torch_native":  # the CPU engine: extends after a cached prefix cost r (p + r)
            from sfi_sglang.integration.dense_cpu import PrefixExtendTorchNative

            return SFIAttnBackend(runner, PrefixExtendTorchNative(runner))
        return SFIAttnBackend(runner, ATTENTION_BACKENDS[name](runner))


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
