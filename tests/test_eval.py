"""`sfi-sglang eval quality`, reduced: one short text, two methods, one retention."""

import json
import subprocess

from conftest import sfi_cli


def test_eval_quality_smoke(tmp_path):
    out = tmp_path / "q"
    r = subprocess.run([sfi_cli(), "eval", "quality", "--contexts", "512", "--retention", "0.25",
                        "--ablation-retention", "0.25", "--methods", "sfi,streaming", "--texts", "1",
                        "--steps", "6", "--passkey-contexts", "", "--mem-fraction-static", "0.08",
                        "--out", str(out)], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    tf = {row["method"]: row for row in result["rows"] if row["kind"] == "teacher_forced"}
    assert set(tf) == {"sfi", "streaming"}
    for row in tf.values():
        assert row["steps"] == 5  # decode steps 1..5 scored against dense
        assert 0.0 <= row["top1_agreement"] <= 1.0 and row["mean_kl"] >= 0.0
    assert tf["streaming"]["slow_steps"] == 0  # baselines never run slow steps
    assert {row["method"] for row in result["rows"] if row["kind"] == "greedy"} == {"sfi", "streaming"}
    assert "| sfi |" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 1000


def test_eval_rejects_unknown_method():
    r = subprocess.run([sfi_cli(), "eval", "quality", "--methods", "sfi,h2o"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "h2o" in r.stderr


def test_eval_rejects_unknown_passkey_method():
    r = subprocess.run([sfi_cli(), "eval", "quality", "--passkey-methods", "dense,sfi,h2o"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "h2o" in r.stderr
