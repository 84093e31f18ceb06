"""The command line and the batch example, each a real SGLang run on the CPU engine."""

import subprocess
import sys

from conftest import REPO, sfi_cli


def test_generate_prints_an_answer():
    out = subprocess.run([sfi_cli(), "generate", "--prompt", "What is the capital of France?",
                          "--max-new-tokens", "16"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Paris" in out.stdout
    assert "fast_steps" in out.stderr  # the [sfi] summary line


def test_help_and_bad_usage():
    assert subprocess.run([sfi_cli(), "--help"], capture_output=True).returncode == 0
    out = subprocess.run([sfi_cli(), "generate", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--sfi-budget" in out.stdout
    out = subprocess.run([sfi_cli(), "frobnicate"], capture_output=True, text=True)
    assert out.returncode == 2
    out = subprocess.run([sfi_cli(), "generate", "--prompt", "x", "--sfi-min-gap", "50",
                          "--sfi-max-interval", "10"], capture_output=True, text=True)
    assert out.returncode == 2 and "--sfi-max-interval" in out.stderr


def test_example_batch_offline():
    out = subprocess.run([sys.executable, str(REPO / "examples" / "batch_offline.py")],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("Q: ") == 3 and "fast /" in out.stdout
