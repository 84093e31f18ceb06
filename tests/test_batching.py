"""Batching never changes what a request gets, on a real `sfi-sglang
serve` (CPU engine, SmolLM2) under SGLang's --enable-deterministic-inference.

Why the mode: SFI's slow steps pick positions by a top-k, a discrete choice, so the float
noise of a GEMM whose result for a row depends on the batch's row count (the CPU's, below
16 rows) changes a selection now and then, and with it the tokens; sfi_sglang.integration.batch_invariant
makes the CPU engine's GEMMs batch-invariant in that mode (bench/results/batch_invariance_cpu.log
has runs with and without it)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from sfi_sglang.texts import long_text

from conftest import Server


@pytest.fixture(scope="module")
def server():
    srv = Server("--sfi-budget", "256", "--sfi-window", "64", "--enable-deterministic-inference",
                 "--sfi-memory-rows", "auto")
    yield srv
    srv.stop()


def test_gemm_rows_do_not_depend_on_the_batch_in_the_mode():
    """What the mode changes on the CPU: a row's product is the same in a GEMM of 1, 3 or
    32 rows, with and without a bias (addmm), for 2-D and 3-D inputs."""
    from sfi_sglang.integration import batch_invariant

    torch.manual_seed(0)
    w, b, x = torch.randn(1536, 576), torch.randn(1536), torch.randn(32, 576)
    linear = torch.nn.functional.linear
    batch_invariant.enable()
    try:
        full, full_b = linear(x, w), linear(x, w, b)
        for m in (1, 3, 15, 16, 17):
            assert torch.equal(linear(x[:m], w), full[:m]), m
            assert torch.equal(linear(x[:m], w, b), full_b[:m]), m
            assert torch.equal(linear(x[:m, None], w)[:, 0], full[:m]), m
            assert torch.equal(x[-m:] @ w.T, full[-m:]), m
    finally:
        batch_invariant.disable()
    assert linear(x[:1], w).shape == (1, 1536)  # the native kernels again


def _garbage(text: str) -> int:
    """Private-use and replacement characters: the garbage stream once reported ("\\uf0f8 ...")."""
    return sum(1 for c in text if 0xE000 <= ord(c) <= 0xF8FF or c == "\ufffd")


def test_a_request_gets_the_same_alone_and_in_a_batch(server, tokenizer):
    """Nine greedy requests at once, then each alone: the same tokens and the same slow
    steps. Mixed prompt lengths (6 to 1,500 tokens; all but one past S+W+K = 324 at budget
    256, two at their own budget of 128), two requests sharing a 1,200-token prefix, one with
    SFI off, one with its own dense layers, outputs of 30 to 112 tokens (the longest sparse
    throughout with a slow step about every 20 tokens: each slow step is a top-k that float
    noise could move; the alone runs take most of the time, one request after another).
    With --sfi-memory-rows auto: a memory row for every request the pool holds past S+W+K,
    so none waits for one, and all are free again once the requests end."""
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    greedy = lambda n, **kw: {"temperature": 0, "max_new_tokens": n, **kw}  # noqa: E731
    prefix = enc(long_text(tokenizer, 1200, start=2))
    b128 = {"custom_params": {"sfi": {"budget": 128}}}
    reqs = [
        (enc(long_text(tokenizer, 1500, start=7) + "\n\nIn short,"), greedy(112, ignore_eos=True)),
        (prefix + enc("\n\nWhat is the main argument above?"), greedy(40)),
        (prefix + enc("\n\nList three examples from the text."), greedy(40, **b128)),
        (enc(long_text(tokenizer, 900, start=11)), greedy(30, custom_params={"sfi": {"enabled": False}})),
        (enc("The capital of France is"), greedy(30)),
        (enc(long_text(tokenizer, 1400, start=13) + "\n\nTo sum up,"), greedy(40, ignore_eos=True)),
        (enc(long_text(tokenizer, 600, start=17)), greedy(30, **b128)),
        (enc(long_text(tokenizer, 400, start=19) + " Therefore"), greedy(40)),
        (enc(long_text(tokenizer, 1100, start=23)), greedy(60, custom_params={"sfi": {"dense_layers": [0, 1, 5, 9]}})),
    ]

    def post(ids, sampling):
        r = requests.post(server.url + "/generate", json={"input_ids": ids, "sampling_params": sampling},
                          timeout=1800)
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(len(reqs)) as pool:
        batch = list(pool.map(lambda r: post(*r), reqs))
    for i, (req, b) in enumerate(zip(reqs, batch)):
        a = post(*req)
        first = next((k for k, (x, y) in enumerate(zip(b["output_ids"], a["output_ids"])) if x != y), None)
        assert b["output_ids"] == a["output_ids"], (i, first)
        assert b["meta_info"]["sfi"]["slow_at"] == a["meta_info"]["sfi"]["slow_at"], (i, b["meta_info"], a["meta_info"])
        assert _garbage(b["text"]) == 0, (i, b["text"][-200:])
    sfi = [o["meta_info"]["sfi"] for o in batch]
    assert len(batch[0]["output_ids"]) == 112 and len(batch[5]["output_ids"]) == 40
    assert sfi[0]["slow_steps"] >= 3 and sfi[0]["fast_steps"] > 90  # sparse throughout
    assert not sfi[3]["enabled"] and sfi[3]["fast_steps"] == 0
    assert sfi[8]["slow_steps"] >= 1 and sfi[8]["fast_steps"] > 0
    assert all(s.get("dense_steps", 0) == 0 for k, s in enumerate(sfi) if k != 4), sfi  # none waited
    assert sfi[4]["dense_steps"] == 29  # within S+W+K: dense rows, no memory row
    info = requests.get(server.url + "/server_info", timeout=60).json()
    m, pool = info["internal_states"][0]["sfi"]["memory"], info["max_total_num_tokens"]
    assert m["allocated_slots"] > 65  # SGLang's default request slots: a slot costs a few bytes
    assert 0 < m["pool_tokens"] <= pool
    assert m["rows"] == min(m["allocated_slots"], m["pool_tokens"] // (4 + 64 + 256) + 1) > len(reqs), (m, pool)
    assert m["rows_free"] == m["rows"] and m["rows_waiting"] == 0, m
    assert 0 < m["allocated"] <= m["reserved"] + 2**20, m  # the reservation covered the rows made
