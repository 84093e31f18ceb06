"""`sfi-sglang eval quality`, reduced: two short texts (a --text-file and the licences),
two methods, one retention; the interval math and the text windows without an engine."""

import json
import math
import subprocess

import pytest
from conftest import product_env, sfi_cli

from sfi_sglang.texts import essays

# sfi_sglang.eval is imported inside the tests: at collection its SGLang imports would import
# triton before test_kernels.py sets TRITON_INTERPRET=1, breaking the in-process kernel runs
# of test_bench.py in a full run.


def test_eval_quality_smoke(tmp_path):
    from sfi_sglang.eval import BOOTSTRAP_ROWS

    out = tmp_path / "q"
    doc = tmp_path / "doc.txt"
    doc.write_text("\n\n".join(list(essays().values())[:3])[:20000])
    r = subprocess.run([sfi_cli(), "eval", "quality", "--contexts", "512", "--retention", "0.25",
                        "--ablation-retention", "0.25", "--texts", "2",
                        "--methods", "sfi,streaming,sfi-adaptive,sfi-lines-topup,sfi-lines-pages",
                        "--text-file", str(doc), "--builtin-texts", "licenses",
                        "--steps", "6", "--passkey-contexts", "", "--mem-fraction-static", "0.08",
                        "--retrieval-contexts", "512", "--retrieval-prompts", "1", "--retrieval-keys", "2",
                        "--passkey-methods", "dense,sfi",
                        "--out", str(out)], capture_output=True, text=True, timeout=1200,
                       env=product_env())
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    tf = [row for row in result["rows"] if row["kind"] == "teacher_forced"]
    assert sorted((row["method"], row["source"]) for row in tf) == sorted(
        (m, s) for m in ("sfi", "streaming", "sfi-adaptive", "sfi-lines-topup", "sfi-lines-pages") for s in (str(doc), "licenses"))
    for row in tf:
        assert row["steps"] == 5  # decode steps 1..5 scored against dense
        # one prefill per text: each run extended only the rows its own selection reads
        assert row["cached_tokens"] == 512 - BOOTSTRAP_ROWS and row["bootstrap_reused"] == 0
        assert 0.0 <= row["top1_agreement"] <= 1.0 and row["mean_kl"] >= 0.0
        # each scored step's KL (bench/paired_quality.py --by-age), their mean the row's
        assert len(row["kl_steps"]) == 5 and sum(row["kl_steps"]) / 5 == pytest.approx(row["mean_kl"], abs=1e-5)
        assert all(1 <= s <= 6 for s in row["slow_at"]) and len(row["slow_at"]) == row["slow_steps"]
    assert all(row["slow_steps"] == 0 for row in tf if row["method"] == "streaming")  # no slow steps
    # an adaptive method makes the engine adaptive; the others then keep the boundary trigger
    assert {row["refresh"] for row in tf if row["method"] == "sfi"} == {"boundary"}
    # the top-up at the same token budget: a quarter of K (92) as whole pages of 16, the rest held
    assert {(row["budget"], row["topup_pages"]) for row in tf if row["method"] == "sfi-lines-topup"} == {(76, 1)}
    assert {row["selection_page"] for row in tf if row["method"] == "sfi-lines-pages"} == {16}
    assert {row["method"] for row in result["rows"] if row["kind"] == "greedy"} == {
        "sfi", "streaming", "sfi-adaptive", "sfi-lines-topup", "sfi-lines-pages"}
    groups = {g["method"]: g for g in result["summary"]["teacher_forced"]}
    assert set(groups) == {"sfi", "streaming", "sfi-adaptive", "sfi-lines-topup", "sfi-lines-pages"}
    assert groups["streaming"]["slow_rate"] == 0 and groups["sfi"]["slow_rate"] >= 0
    for g in groups.values():  # two texts: an interval around the mean
        assert g["texts"] == 2 and g["top1_ci"][0] <= g["top1_agreement"] <= g["top1_ci"][1]
        assert 0.0 <= g["kl_ci"][0] <= g["mean_kl"] <= g["kl_ci"][1]
    rt = [row for row in result["rows"] if row["kind"] == "retrieval"]
    assert sorted(row["method"] for row in rt) == ["dense", "sfi"] and all(row["keys"] == 2 for row in rt)
    assert [(g["method"], g["total"]) for g in result["summary"]["retrieval"]] == [("dense", 1), ("sfi", 1)]
    md = out.with_suffix(".md").read_text()
    assert "key-value retrieval, exact match (2 keys per prompt)" in md
    assert "| sfi |" in md and "95% CI" in md and "t-interval" in md and "slow-step rate" in md
    assert not out.with_suffix(".png").exists()  # one retention: no curves to draw
    assert out.with_name(out.name + "_rate.png").stat().st_size > 1000  # KL against slow-step rate


def _eval_exit(argv, capsys) -> tuple[int, str]:
    """`sfi-sglang eval quality ARGV` in this process: its exit code and stderr (usage
    errors stop before any engine starts; the CLI's own dispatch is test_cli's)."""
    from sfi_sglang.eval import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    return exit_.value.code, capsys.readouterr().err


def test_eval_rejects_unknown_method(capsys):
    code, err = _eval_exit(["--methods", "sfi,h2o"], capsys)
    assert code == 2 and "h2o" in err


def test_eval_rejects_unknown_passkey_method(capsys):
    code, err = _eval_exit(["--passkey-methods", "dense,sfi,h2o"], capsys)
    assert code == 2 and "h2o" in err


def test_eval_rejects_short_text_file(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("Far too short for a window of 512 + 6 tokens.")
    code, err = _eval_exit(["--contexts", "512", "--steps", "6", "--text-file", str(short)], capsys)
    assert code == 2, err[-3000:]
    assert str(short) in err and "needs at least 518" in err
    assert "Traceback" not in err


def test_intervals_known_cases():
    from sfi_sglang.eval_stats import mean_ci, summary, t975, wilson

    mean, lo, hi = mean_ci([1.0, 2.0, 3.0, 4.0, 5.0])  # sd sqrt(2.5), t(0.975, 4) = 2.7764
    assert mean == 3.0 and lo == pytest.approx(1.0368, abs=1e-3) and hi == pytest.approx(4.9632, abs=1e-3)
    assert mean_ci([0.98, 0.99, 1.0], 0.0, 1.0)[2] == 1.0  # clipped
    assert mean_ci([0.5]) == (0.5, None, None)
    assert t975(1) == pytest.approx(12.706, abs=1e-3) and t975(40) == pytest.approx(2.0211, abs=1e-3)
    assert t975(120) == pytest.approx(1.9799, abs=1e-3)
    assert wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    rows = [{"kind": "teacher_forced", "method": "sfi", "retention": 0.1, "context": 512, "source": "s",
             "steps": 5, "top1_agreement": a, "mean_kl": k} for a, k in ((0.8, 0.1), (1.0, 0.3))]
    rows += [{"kind": "passkey", "method": "sfi", "context": 512, "depth": 0.5, "found": i < 5}
             for i in range(10)]
    summ = summary(rows)
    g = summ["teacher_forced"][0]  # n = 2: mean 0.9, sd 0.1414, half = 12.706 x 0.1 = 1.27
    assert g["top1_agreement"] == pytest.approx(0.9) and g["top1_ci"] == [0.0, 1.0]
    assert g["kl_ci"][0] == 0.0 and g["kl_ci"][1] == pytest.approx(0.2 + 12.7062 * 0.1, abs=1e-3)
    assert summ["passkey"][0]["found"] == 5 and summ["passkey"][0]["total"] == 10
    assert summ["passkey"][0]["ci"] == pytest.approx([0.2366, 0.7634], abs=1e-4)
    assert not math.isnan(g["mean_kl"])


def test_text_windows_distinct_and_skipped():
    from sfi_sglang.eval import TextError, windows

    sources = [("a", list(range(5000)), 1000), ("b", list(range(10000, 13000)), 0), ("c", list(range(100)), 0)]
    got, skipped = windows(sources, 1000, 4)
    assert [(name, start) for name, start, _ in got] == [("a", 1000), ("b", 0), ("a", 2512), ("b", 1512)]
    assert all(len(ids) == 1000 for _, _, ids in got)
    seen = [t for _, _, ids in got for t in ids]
    assert len(seen) == len(set(seen))  # no token of any source in two windows
    assert len(skipped) == 1 and skipped[0].startswith("c: 100 tokens, too short")
    with pytest.raises(TextError, match="only 4 non-overlapping windows"):
        windows(sources, 1000, 5)


def test_read_fraction_counts_each_methods_reads():
    from sfi_sglang.eval_stats import read_fraction

    base = {"context": 8192, "steps": 63, "sinks": 4, "window": 256, "budget": 968}
    assert read_fraction({**base, "method": "streaming"}) == pytest.approx(1228 / 8192)
    # whole pages of 16 (960 of 968) and one token's K and V per page of summaries
    assert read_fraction({**base, "method": "quest"}) == pytest.approx((4 + 256 + 960 + 512) / 8192)
    fast = 4 + 968 + 256 + 63 / 6  # two slow steps: three stretches, the window grows ~10.5
    assert read_fraction({**base, "method": "sfi", "slow_steps": 2}) == pytest.approx(
        (61 * fast + 2 * 8192) / (63 * 8192))
    topup = {**base, "method": "sfi-topup", "budget": 728, "topup_pages": 15, "slow_steps": 0}
    assert read_fraction(topup) == pytest.approx((4 + 728 + 256 + 63 / 2 + 240 + 512) / 8192)
    assert read_fraction({**topup, "topup_every": 8}) == pytest.approx((4 + 728 + 256 + 63 / 2 + 240 + 64) / 8192)
    assert read_fraction({**base, "enabled": False}) == 1.0


def test_retrieval_prompt_holds_every_pair_and_asks_one(tokenizer):
    import random

    from sfi_sglang.texts import retrieval_case, retrieval_prompt

    pairs, ask = retrieval_case(random.Random(1), 6)
    assert len({k for k, _ in pairs}) == 6 and all(len(v) == 7 and v.isdigit() for _, v in pairs)
    text = retrieval_prompt(tokenizer, 2000, pairs, ask)
    assert abs(len(tokenizer.encode(text)) - 2000) <= 20
    places = [text.index(f'The value of key "{k}" is {v}.') for k, v in pairs]
    assert places == sorted(places) and places[0] > 200  # spread over the text, in order
    assert text.endswith(f'What is the value of key "{pairs[ask][0]}"? The value of key "{pairs[ask][0]}" is')
