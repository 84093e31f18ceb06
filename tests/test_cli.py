"""The command line and the batch example, each a real SGLang run on the CPU engine."""

import re
import subprocess
import sys

import pytest

from conftest import REPO, product_env, sfi_cli

from sfi_sglang.integration.quiet import HARMLESS_LOGS, HARMLESS_WARNINGS


def test_generate_prints_an_answer():
    """README command 1's job: the answer and SFI's summary, none of the named harmless
    warnings (SGLang issues each of them in the launcher, scheduler and detokenizer)."""
    out = subprocess.run([sfi_cli(), "generate", "--prompt", "What is the capital of France?",
                          "--max-new-tokens", "16"], capture_output=True, text=True, timeout=900,
                         env=product_env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Paris" in out.stdout
    assert "fast_steps" in out.stderr  # the [sfi] summary line
    for _category, message, _module, _why in HARMLESS_WARNINGS:
        assert not re.search(message, out.stdout + out.stderr), (message, out.stderr[-3000:])
    for _logger, prefix, _why in HARMLESS_LOGS:
        assert prefix not in out.stdout + out.stderr, (prefix, out.stderr[-3000:])


_FILTER_PROBE = r"""
import logging, sys, warnings
from sfi_sglang.integration import quiet
from sfi_sglang.integration.quiet import HARMLESS_LOGS, HARMLESS_WARNINGS
quiet.install_log_filters()
logging.basicConfig(stream=sys.stderr, format="LOG %(name)s %(levelname)s %(message)s")
for category, message, module, _ in HARMLESS_WARNINGS:
    text = message.replace("\\", "")
    mod = module.replace("\\", "")
    warnings.warn_explicit(text, category, "x.py", 1, module=mod + ".x")           # filtered
    warnings.warn_explicit(text, category, "y.py", 2, module="elsewhere")          # kept: other module
warnings.warn_explicit("some other warning", UserWarning, "z.py", 3, module=mod)   # kept: other text
for name, prefix, _ in HARMLESS_LOGS:
    logging.getLogger(name).warning(prefix + " (dropped)")
    logging.getLogger(name).error(prefix + " (error kept)")
    logging.getLogger(name).warning("another record (kept)")
"""


def test_quiet_filters_only_the_named_ones():
    """The filters come from the start-up hook in a fresh interpreter, drop exactly the named
    warnings and records, and keep the same text from other modules, other texts and errors."""
    out = subprocess.run([sys.executable, "-c", _FILTER_PROBE], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for _category, message, _module, _why in HARMLESS_WARNINGS:
        text = message.replace("\\", "")
        assert out.stderr.count(text) == 1 and f"y.py:2: UserWarning: {text}" in out.stderr, out.stderr
    assert "z.py:3: UserWarning: some other warning" in out.stderr
    for name, prefix, _why in HARMLESS_LOGS:
        assert "(dropped)" not in out.stderr
        assert f"LOG {name} ERROR {prefix} (error kept)" in out.stderr
        assert f"LOG {name} WARNING another record (kept)" in out.stderr
    out = subprocess.run([sys.executable, "-W", "default", "-c", _FILTER_PROBE],
                         capture_output=True, text=True, timeout=120)
    text = HARMLESS_WARNINGS[0][1].replace("\\", "")
    assert out.stderr.count(text) == 2, out.stderr  # -W default shows them again


def test_help_and_bad_usage():
    assert subprocess.run([sfi_cli(), "--help"], capture_output=True).returncode == 0
    out = subprocess.run([sfi_cli(), "generate", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--sfi-budget" in out.stdout
    assert "--sfi-memory-rows SFI_MEMORY_ROWS\n" in out.stdout and "default: auto (a number, or auto)" in out.stdout
    out = subprocess.run([sfi_cli(), "frobnicate"], capture_output=True, text=True)
    assert out.returncode == 2
    out = subprocess.run([sfi_cli(), "generate", "--prompt", "x", "--sfi-min-gap", "50",
                          "--sfi-max-interval", "10"], capture_output=True, text=True)
    assert out.returncode == 2 and "--sfi-max-interval" in out.stderr
    out = subprocess.run([sfi_cli(), "serve", "--sfi-refresh", "adaptive", "--tp-size", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "--tp-size 1" in out.stderr, out.stderr[-2000:]


def test_example_batch_offline():
    out = subprocess.run([sys.executable, str(REPO / "examples" / "batch_offline.py"), "--context-tokens", "400"],
                         capture_output=True, text=True, timeout=900, env=product_env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("Q: ") == 3 and "fast /" in out.stdout


def test_sfi_raises_the_triton_split_cap_unless_given(monkeypatch):
    """SFI's dense layers run SGLang's triton decode: with SFI on, its KV-split cap defaults
    to SFI_TRITON_KV_SPLITS (the served value is checked in test_radix); a user's value wins,
    and --disable-sfi keeps SGLang's own default."""
    from sfi_sglang.engine import SFI_TRITON_KV_SPLITS, launch_kwargs
    from sfi_sglang.method.config import SFIConfig

    import os

    monkeypatch.setattr(os, "environ", os.environ.copy())  # launch_kwargs exports its settings
    base = {"model_path": "m"}
    key = "triton_attention_num_kv_splits"
    assert SFI_TRITON_KV_SPLITS > 8
    assert launch_kwargs(base, SFIConfig(), enabled=True)[key] == SFI_TRITON_KV_SPLITS
    assert launch_kwargs({**base, key: 16}, SFIConfig(), enabled=True)[key] == 16
    assert key not in launch_kwargs(base, SFIConfig(), enabled=False)


def test_dense_backend_other_than_auto_needs_a_gpu(monkeypatch):
    """--sfi-dense-backend flashinfer (or triton) on the CPU engine: refused, saying what to do."""
    import os

    from sfi_sglang.engine import dense_backend, launch_kwargs
    from sfi_sglang.method.config import SFIConfig

    monkeypatch.setattr(os, "environ", os.environ.copy())
    with pytest.raises(ValueError, match="--sfi-dense-backend flashinfer needs a CUDA GPU"):
        launch_kwargs({"model_path": "m"}, SFIConfig(dense_backend="flashinfer"), enabled=True)
    assert dense_backend(SFIConfig(dense_backend="flashinfer")) == "flashinfer"
    assert dense_backend(SFIConfig()) == dense_backend() == "torch_native"


def test_reference_only_options_need_eager_decode_steps(monkeypatch):
    """The top-up runs in the Triton fast paths' kernel (under CUDA graphs) and, on the
    FlashInfer fast path, only in the torch reference (eager steps): a launch with graphs
    on and that path is refused, naming it and what to change; without graphs it launches."""
    import os

    from sfi_sglang.engine import launch_kwargs
    from sfi_sglang.method.config import SFIConfig

    monkeypatch.setattr(os, "environ", os.environ.copy())
    graphs = {"model_path": "m", "disable_cuda_graph": False}
    for fast_path in ("triton", "triton-pool"):
        assert launch_kwargs(dict(graphs), SFIConfig(topup_pages=2, fast_path=fast_path, selection_page=16),
                             enabled=True)["attention_backend"] == "sfi"
    with pytest.raises(ValueError, match="^--sfi-topup-pages: the flashinfer fast path .* triton-pool"):
        launch_kwargs(dict(graphs), SFIConfig(topup_pages=2, fast_path="flashinfer"), enabled=True)
    assert launch_kwargs({"model_path": "m", "disable_cuda_graph": True},
                         SFIConfig(topup_pages=2, fast_path="flashinfer"),
                         enabled=True)["attention_backend"] == "sfi"
    assert launch_kwargs({"model_path": "m", "disable_cuda_graph": True}, SFIConfig(topup_pages=2),
                         enabled=True)["attention_backend"] == "sfi"
