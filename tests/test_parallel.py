"""SFI under SGLang's tensor and data parallelism on the CPU engine (real `sfi-sglang serve`,
SmolLM2-135M, HTTP): --tp-size 2 and --dp-size 2, side by side.

SmolLM2-135M has 9 query and 3 KV heads; tp=2 divides neither, so SGLang's CPU engine pads
the model to 12 query and 4 KV heads (sglang/srt/configs/update_config.py,
adjust_config_with_unaligned_cpu_tp; the padded heads' weights are zeros): each TP rank
holds 6 query and 2 KV heads, rank 1's second KV head being padding. The dp=2 server's
ranks are tp=1 schedulers, the tp=1 reference for the tp=2 tokens.

S=4, W=64, K=128: a context up to 196 tokens is all selected (SFI's fast step is dense),
so there tp=2 and tp=1 must give the same greedy tokens where float order allows; the slow
step decisions are compared rank against rank on the same request (sfi_sglang.integration.parallel)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from sfi_sglang.texts import long_text

from conftest import chat_prompt, start_servers

# --max-total-tokens bounds each rank's KV pool; the CPU engine sizes it from the host's free
# memory before and after its weights load, which the other rank (or server) starting at the
# same time also takes: a lenient --mem-fraction-static keeps that profile from failing
# a memory per request slot (--sfi-memory-rows 0): the short prompts below run SFI, not dense
COMMON = ("--sfi-budget", "128", "--sfi-window", "64", "--sfi-sinks", "4", "--sfi-memory-rows", "0",
          "--max-total-tokens", "16384", "--mem-fraction-static", "0.6")
# slow steps at short outputs: a request's own trigger options (device-path options)
OFTEN = {"custom_params": {"sfi": {"min_gap": 2, "cooldown": 1, "max_interval": 4}}}


@pytest.fixture(scope="module")
def servers():
    tp2, dp2 = start_servers(("--tp-size", "2", *COMMON), ("--dp-size", "2", *COMMON))
    yield tp2, dp2
    tp2.stop()
    dp2.stop()


def generate(server, text, n, **extra) -> dict:
    r = requests.post(server.url + "/generate", json={
        "text": text, "sampling_params": {"temperature": 0, "max_new_tokens": n, **extra}}, timeout=900)
    assert r.status_code == 200, r.text
    return r.json()


def stats(server) -> dict:
    r = requests.get(server.url + "/sfi/stats", timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_tp2_each_rank_holds_its_kv_heads(servers):
    tp2, _ = servers
    ranks = stats(tp2)["tp_ranks"]
    assert [r["tp_rank"] for r in ranks] == [0, 1]
    assert len({r["pid"] for r in ranks}) == 2  # two scheduler processes
    for r in ranks:  # 3 KV heads padded to 4 (module doc), 2 per rank
        assert r["num_kv_heads"] == 2 and r["num_q_heads"] == 6, r
        assert r["boundaries"]["spec"] == "default" and r["boundaries"]["version"] >= 1, r


def test_tp2_same_tokens_as_tp1_on_a_short_prompt(servers, tokenizer):
    tp2, dp2 = servers
    prompt = chat_prompt(tokenizer, "What is the capital of France?")
    a, b = generate(tp2, prompt, 16), generate(dp2, prompt, 16)
    assert "Paris" in a["text"], a["text"]
    assert a["meta_info"]["sfi"]["enabled"] and a["meta_info"]["sfi"]["fast_steps"] > 0
    # the context stays below S + W + K: SFI is dense here, so only float order could differ
    assert a["output_ids"] == b["output_ids"], (a["text"], b["text"])


def test_tp2_ranks_take_the_same_decisions(servers, tokenizer):
    tp2, _ = servers
    prompt = chat_prompt(tokenizer, long_text(tokenizer, 220) + "\n\nSummarise the text above.")
    out = generate(tp2, prompt, 12, **OFTEN)
    sfi, rid = out["meta_info"]["sfi"], out["meta_info"]["id"]
    assert sfi["slow_steps"] >= 2 and sfi["slow_at"], sfi  # sparse context, slow steps taken
    logs = [r["decisions"].get(rid) for r in stats(tp2)["tp_ranks"]]
    assert all(log is not None for log in logs), logs
    assert logs[0] == logs[1], logs  # rank 1 decided as rank 0 did
    assert logs[0]["slow_at"] == sfi["slow_at"] and logs[0]["slow_steps"] == sfi["slow_steps"]


def test_tp2_radix_memories_are_kept_per_rank(servers, tokenizer):
    tp2, _ = servers
    before = stats(tp2)
    essay = long_text(tokenizer, 260, start=3)
    turn1 = chat_prompt(tokenizer, f"{essay}\n\nWhat is this about?")
    first = generate(tp2, turn1, 8)
    turn2 = turn1 + first["text"] + "<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n"
    second = generate(tp2, turn2, 8)
    assert second["meta_info"]["sfi"]["bootstrap_reused"] == 1, second["meta_info"]["sfi"]
    after = stats(tp2)
    for b, a in zip(before["tp_ranks"], after["tp_ranks"]):
        # both ranks published the turns' selections of their own heads, at the same nodes
        assert a["published"] > b["published"] and a["node_memories"] >= 1, (b, a)
    assert after["tp_ranks"][0]["published"] == after["tp_ranks"][1]["published"]
    assert after["tp_ranks"][0]["node_memories"] == after["tp_ranks"][1]["node_memories"]


def test_boundaries_reach_every_rank(servers):
    for server, field in zip(servers, ("tp_ranks", "schedulers")):
        try:
            r = requests.post(server.url + "/sfi/boundaries", json={"boundaries": "latin"}, timeout=120)
            assert r.status_code == 200, r.text
            body = r.json()
            version = body["version"]
            if field == "tp_ranks":  # one scheduler reply, carrying both TP ranks' tables
                (sched,) = body["schedulers"]
                ranks = sched["tp_ranks"]
                assert [t["tp_rank"] for t in ranks] == [0, 1]
            else:  # dp=2: one reply per DP rank
                ranks = body["schedulers"]
                assert [t["dp_rank"] for t in ranks] == [0, 1]
                assert len({t["pid"] for t in ranks}) == 2
            assert all(t["spec"] == "latin" and t["version"] == version and t["success"] for t in ranks), ranks
        finally:
            requests.post(server.url + "/sfi/boundaries", json={"boundaries": "default"}, timeout=120)


def test_dp2_serves_with_sfi_on_both_ranks(servers, tokenizer):
    _, dp2 = servers
    prompts = [chat_prompt(tokenizer, q) for q in
               ("What is the capital of France?", "Name a primary colour.",
                "What is two plus two?", "Say hello.")]
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda p: generate(dp2, p, 8), prompts))
    for out in outs:
        sfi = out["meta_info"]["sfi"]
        assert sfi["enabled"] and sfi["fast_steps"] + sfi["slow_steps"] == 7, sfi
    assert {out["meta_info"]["dp_rank"] for out in outs} == {0, 1}  # round robin over both
    ranks = stats(dp2)["ranks"]
    assert len(ranks) == 2 and all(r["bootstrap_computed"] + r["bootstrap_reused"] >= 2 for r in ranks), ranks


def test_dp2_controller_sleeps_when_idle(servers):
    """Under --sleep-on-idle (every test server) the DP controller waits in a zmq poll when
    no request comes (sfi_sglang.integration.hooks: SGLang's own loop polls without
    blocking and took a whole core, idle, from the schedulers beside it)."""
    import psutil

    _, dp2 = servers
    (ctl,) = [p for p in psutil.Process(dp2.proc.pid).children(recursive=True)
              if "data_parallel_controller" in " ".join(p.cmdline())]
    before = sum(ctl.cpu_times()[:2])
    time.sleep(3)
    assert sum(ctl.cpu_times()[:2]) - before < 0.3  # seconds of CPU in 3 s of idling
