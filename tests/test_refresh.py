"""Refreshes beyond sentence boundaries, on a real Engine (CPU engine, SmolLM2, budget 128,
window 64, SGLang's --enable-deterministic-inference so that a batch gives what alone
gives):

* `--sfi-refresh adaptive`: a slow step also when the fast step's log-sum-exp
  over the sparse memory fell below its value after the last refresh;
* retractions: under SGLANG_TEST_RETRACT, SGLang's own switch, the scheduler
  retracts a request of every decode batch of 2+ rows each SGLANG_TEST_RETRACT_INTERVAL
  forwards, as it does when the KV pool runs out; the request comes back by a prefill that
  recomputes its KV. A request alone (one row) is never retracted."""

from __future__ import annotations

import os

import pytest

from sfi_sglang.texts import long_text

from conftest import start_engine

RETRACT_ENV = {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "12"}


@pytest.fixture(scope="module")
def engine():
    saved = {k: os.environ.get(k) for k in RETRACT_ENV}
    os.environ.update(RETRACT_ENV)  # read by SGLang's scheduler process at its start
    try:
        eng = start_engine(sfi_budget=128, sfi_window=64, sfi_refresh="adaptive",
                           enable_deterministic_inference=True, log_level="error")
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    return [enc(long_text(tokenizer, n, start=s) + "\n\nIn short,") for n, s in
            ((600, 3), (500, 5), (550, 29), (450, 31))]


def greedy(n, **sfi):
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True,
            **({"custom_params": {"sfi": sfi}} if sfi else {})}


def test_adaptive_off_is_the_boundary_trigger(engine, prompts):
    """A threshold no drop reaches gives what refresh "boundary" gives: the same tokens,
    the same slow steps, none of them adaptive."""
    off = engine.generate(input_ids=prompts[0], sampling_params=greedy(40, adaptive_threshold=1e30))
    boundary = engine.generate(input_ids=prompts[0], sampling_params=greedy(40, refresh="boundary"))
    assert off["output_ids"] == boundary["output_ids"]
    assert off["meta_info"]["sfi"]["slow_at"] == boundary["meta_info"]["sfi"]["slow_at"]
    assert off["meta_info"]["sfi"]["adaptive_slow_steps"] == 0


def test_adaptive_fires_between_boundaries(engine, prompts):
    """A low threshold adds slow steps where the boundary trigger has none; each is counted
    as adaptive, and the log still holds every boundary refresh's kind of step."""
    boundary = engine.generate(input_ids=prompts[1], sampling_params=greedy(40, refresh="boundary"))
    low = engine.generate(input_ids=prompts[1], sampling_params=greedy(40, adaptive_threshold=0.02))
    sb, sl = boundary["meta_info"]["sfi"], low["meta_info"]["sfi"]
    assert sl["adaptive_slow_steps"] >= 1, sl
    assert sl["slow_steps"] > sb["slow_steps"], (sl["slow_at"], sb["slow_at"])
    assert sl["fast_steps"] + sl["slow_steps"] == sb["fast_steps"] + sb["slow_steps"] == 39
    # before its first slow step, the adaptive request decided as the boundary one did
    first = sl["slow_at"][0]
    assert [s for s in sb["slow_at"] if s < first] == []


def test_retracted_requests_keep_their_history(engine, prompts):
    """Four requests at once under forced retractions. A retracted request's re-prefill
    recomputes its KV with dense attention, so its sparse memory cannot survive: it resumes
    with a slow step (logged at the decode step the re-prefill stands for) and a new
    selection, and its decision log continues: every decode step counted once, the steps
    before its first retraction as alone. The request with SFI off gets exactly what it
    gets alone, as in plain SGLang."""
    N = 48
    sps = [greedy(N), greedy(N), greedy(N), greedy(N, enabled=False)]
    batch = engine.generate(input_ids=prompts, sampling_params=sps)
    alone = [engine.generate(input_ids=p, sampling_params=sp) for p, sp in zip(prompts, sps)]
    retracted = [b["meta_info"]["sfi"]["retractions"] for b in batch]
    assert sum(retracted) >= 1, retracted
    for b, a in zip(batch, alone):
        sb, sa = b["meta_info"]["sfi"], a["meta_info"]["sfi"]
        assert sa["retractions"] == 0
        assert len(b["output_ids"]) == N
        if not sb["enabled"]:
            assert b["output_ids"] == a["output_ids"]
            continue
        assert sb["fast_steps"] + sb["slow_steps"] == N - 1, sb  # every decode step, once
        assert sb["slow_at"] == sorted(set(sb["slow_at"])) and sb["slow_at"][-1] <= N - 1
        assert len(sb["slow_at"]) == sb["slow_steps"]
        if sb["retractions"] == 0:
            assert b["output_ids"] == a["output_ids"] and sb["slow_at"] == sa["slow_at"]
    # a retracted one: what it got alone up to its first retraction
    for b, a in zip(batch, alone):
        sb, sa = b["meta_info"]["sfi"], a["meta_info"]["sfi"]
        if sb["enabled"] and sb["retractions"]:
            r = sb["retracted_at"][0]  # decode step s makes output token s (0: the prefill's)
            assert set(sb["retracted_at"]) <= set(sb["slow_at"]), sb
            assert [s for s in sb["slow_at"] if s < r] == [s for s in sa["slow_at"] if s < r]
            assert b["output_ids"][:r] == a["output_ids"][:r], r
