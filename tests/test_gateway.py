"""Two SFI workers behind the SGLang Model Gateway (`smg launch`, PyPI `smg`), all on
loopback: real `sfi-sglang serve` workers (CPU engine, SmolLM2) and the real gateway with
its cache-aware policy, over HTTP.

- multi-turn chats through the gateway go back to the worker that holds their prefix and
  start from its SFI memory (meta_info["sfi"]["bootstrap_reused"], read through the gateway);
- SFI's own endpoints (/sfi/stats, /sfi/boundaries) are per worker: what the gateway does
  with them is checked here (README "Scaling out");
- under a bounded load of concurrent chats one worker is killed (SIGKILL, its process
  group): the gateway's retries run the requests it held again on the other worker, every
  request completes, and the gateway keeps serving.

Which worker served a request is read from the workers themselves: each keeps the rids of
its last finished requests (sfi_sglang.integration.parallel.DECISIONS, in /sfi/stats "tp_ranks"), and
the tests give every request its own rid."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from sfi_sglang.texts import long_text

from conftest import REPO, Service, chat_prompt, free_port, start_servers

pytest.importorskip("smg", reason="the gateway tests need the PyPI package smg")

WORKER_ARGS = ("--sfi-budget", "128", "--sfi-window", "64", "--sfi-sinks", "4",
               "--max-total-tokens", "16384", "--mem-fraction-static", "0.6")


def smg_cli() -> str:
    here = Path(sys.executable).with_name("smg")
    return str(here) if here.exists() else shutil.which("smg")


class Gateway(Service):
    """`smg launch` with the cache-aware policy over the given workers, on loopback only
    (its Prometheus listener too, which defaults to 0.0.0.0:29000); ready once a one-token
    /generate answers (its /health answers before the workers are registered)."""

    name = "gateway"

    def __init__(self, workers: list[str], *extra: str, timeout: float = 120):
        super().__init__(
            [smg_cli(), "launch", "--host", "127.0.0.1", "--port", "{port}", "--policy", "cache_aware",
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *extra,
             "--worker-urls", *workers],
            lambda url: requests.post(url + "/generate", json={
                "text": "Hi", "sampling_params": {"max_new_tokens": 1}}, timeout=60).status_code == 200,
            timeout, "smg")


@pytest.fixture(scope="module")
def fleet():
    workers = start_servers(WORKER_ARGS, WORKER_ARGS)
    try:
        gateway = Gateway([w.url for w in workers], *GATEWAY_ARGS)
    except Exception:
        for w in workers:
            w.stop()
        raise
    yield gateway, workers
    gateway.stop()
    for w in workers:
        w.stop()


# health checks every second on a route that runs no generation (SGLang's /health, the
# default, generates a token each time): a killed worker leaves the rotation within seconds
GATEWAY_ARGS = ("--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                "--health-check-endpoint", "/model_info")
ROUTED = "x-smg-routed-worker-id"  # the gateway's response header: the worker's URL


def post(url, prompt, n, rid=None, timeout=600) -> requests.Response:
    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": n}}
    if rid is not None:
        body["rid"] = rid
    return requests.post(url + "/generate", json=body, timeout=timeout)


def served_rids(worker) -> set:
    ranks = requests.get(worker.url + "/sfi/stats", timeout=60).json()["tp_ranks"]
    return set(ranks[0]["decisions"])


def in_flight(worker) -> int:
    """Requests the worker is running now (they hold an SFI memory slot)."""
    return requests.get(worker.url + "/sfi/stats", timeout=60).json()["requests"]["slots_in_use"]


def turn2(prompt: str, answer: str, tokenizer) -> str:
    return prompt + answer + "<|im_end|>\n" + chat_prompt(tokenizer, "Name one idea from it.").split(
        "<|im_end|>\n", 1)[1]


def test_chats_return_to_the_worker_holding_their_prefix(fleet, tokenizer):
    gateway, workers = fleet
    chats = [chat_prompt(tokenizer, long_text(tokenizer, 240, start=i) + "\n\nWhat is this about?")
             for i in range(4)]
    rids = [[f"chat{i}-t{t}-{uuid.uuid4().hex[:8]}" for t in (1, 2)] for i in range(4)]
    with ThreadPoolExecutor(4) as pool:  # the first turns at once: spread over the workers
        firsts = list(pool.map(lambda i: post(gateway.url, chats[i], 8, rids[i][0]), range(4)))
    assert all(r.status_code == 200 for r in firsts), [r.text for r in firsts]
    seconds = [post(gateway.url, turn2(chats[i], firsts[i].json()["text"], tokenizer), 8, rids[i][1])
               for i in range(4)]
    assert all(r.status_code == 200 for r in seconds), [r.text for r in seconds]
    served = [served_rids(w) for w in workers]
    urls = [w.url for w in workers]
    for i, (a, b) in enumerate(zip(firsts, seconds)):
        assert a.json()["meta_info"]["id"] == rids[i][0]  # the gateway keeps the client's rid
        assert a.headers[ROUTED] in urls and b.headers[ROUTED] == a.headers[ROUTED], (i, a.headers, b.headers)
        home = urls.index(a.headers[ROUTED])
        assert {rids[i][0], rids[i][1]} <= served[home], i  # the worker itself saw both turns
        sfi = b.json()["meta_info"]["sfi"]  # SFI's counters come through the gateway
        assert sfi["bootstrap_reused"] == 1 and sfi["bootstrap_computed"] == 0, (i, sfi)


def test_sfi_endpoints_are_per_worker(fleet):
    gateway, workers = fleet
    for w in workers:  # each worker answers for itself
        assert "bootstrap_computed" in requests.get(w.url + "/sfi/stats", timeout=60).json()
        assert requests.get(w.url + "/sfi/boundaries", timeout=60).json()["schedulers"]
    # the gateway serves neither: they must go to each worker (README "Scaling out")
    for method, path in (("GET", "/sfi/stats"), ("GET", "/sfi/boundaries"), ("POST", "/sfi/boundaries")):
        r = requests.request(method, gateway.url + path, json={"boundaries": "latin"}, timeout=60)
        assert r.status_code == 404, (path, r.status_code, r.text[:200])
        assert r.json()["error"]["code"] == "unknown_url", r.text


def test_example_gateway_chats(fleet):
    """examples/gateway.py's chats over this fleet: later turns reuse a worker's memory."""
    gateway, workers = fleet
    out = subprocess.run([sys.executable, str(REPO / "examples" / "gateway.py"), "--gateway", gateway.url,
                          "--workers", *[w.url for w in workers]], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "chat 1 turn 2" in out.stdout, out.stdout
    reused = sum(int(line.split(": ")[1].split()[0]) for line in out.stdout.splitlines()
                 if line.endswith("reused from its radix cache"))
    assert reused >= 2, out.stdout  # the second turn of each chat


def test_a_killed_workers_requests_complete_on_the_other_worker(fleet, tokenizer):
    gateway, workers = fleet
    # texts no earlier request began with: no cached prefix pins them, so the cache-aware
    # policy spreads them by load
    prompts = [chat_prompt(tokenizer, long_text(tokenizer, 120, start=10 + i) + "\n\nSummarise it.")
               for i in range(8)]
    rids = [f"load{i}-{uuid.uuid4().hex[:8]}" for i in range(8)]

    def one(i):
        try:
            r = post(gateway.url, prompts[i], 48, rids[i], timeout=300)
            return r.status_code, r.headers.get(ROUTED), r.text
        except requests.RequestException as err:
            return None, None, f"{type(err).__name__}: {err}"

    with ThreadPoolExecutor(8) as pool:  # a bounded load: 8 concurrent chats
        futures = [pool.submit(one, i) for i in range(8)]
        deadline = time.time() + 120
        # the cache-aware policy may put all 8 on one worker (their chat template's prefix is
        # the same): the victim is a worker running at least 2 of them, the other one's may be 0
        while time.time() < deadline:
            load = [in_flight(w) for w in workers]
            if min(load) > 0 or max(load) >= 2:
                break
            time.sleep(0.5)
        assert max(load) > 0, "no request reached a worker"
        victim = workers[0] if load[0] >= load[1] else workers[1]
        survivor = workers[1] if victim is workers[0] else workers[0]
        done_before = served_rids(victim)
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        results = [f.result() for f in futures]
    on_survivor = served_rids(survivor)
    failed = [(rids[i], code, worker, text) for i, (code, worker, text) in enumerate(results) if code != 200]
    # smg retries a request whose worker went away (--retry-max-retries, default 5): the
    # victim's in-flight requests run again, from scratch, on the survivor and complete
    # (its log: "Failed to send typed request worker_url=<victim> ... error sending request");
    # under --disable-retries they would fail instead (not tested here)
    assert not failed, failed
    for i, (code, worker, _) in enumerate(results):
        assert worker == survivor.url or rids[i] in done_before, (rids[i], worker)
        if rids[i] not in done_before:
            assert rids[i] in on_survivor, rids[i]
    # the gateway keeps serving, on the survivor
    for i in range(3):
        r = post(gateway.url, chat_prompt(tokenizer, f"Say the number {i}."), 4)
        assert r.status_code == 200 and r.headers[ROUTED] == survivor.url, (r.status_code, r.text)
