"""Shared prefixes share SFI memories (sfi_sglang.integration.radix) on a real `sfi-sglang serve`
(CPU engine, SmolLM2): multi-turn chat, n>1 sampling, a frontend fork, a long shared
system prompt, node splits and eviction in a small KV pool (--max-total-tokens).

S=4, W=64, K=256: contexts up to 324 tokens must give exactly the dense output, also when
the request starts from a shared memory instead of its own bootstrap selection. Counters
come from meta_info["sfi"] per request and GET /sfi/stats per server. The server runs with
--enable-metrics: SFI's Prometheus series follow the requests (sfi_sglang.integration.metrics), and a
loop of finished, stopped, aborted and rejected requests leaves no per-request state."""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from sfi_sglang.texts import long_text

from conftest import Server, chat_prompt

W = 64
POOL_TOKENS = 6144


@pytest.fixture(scope="module")
def server():
    # a memory per request slot (--sfi-memory-rows 0): a short first turn holds a memory too
    srv = Server("--sfi-budget", "256", "--sfi-window", str(W), "--sfi-sinks", "4", "--sfi-memory-rows", "0",
                 "--max-total-tokens", str(POOL_TOKENS), "--enable-metrics")
    yield srv
    srv.stop()


def generate(server, sampling, **body) -> dict | list:
    r = requests.post(server.url + "/generate", json={"sampling_params": sampling, **body},
                      timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def stats(server) -> dict:
    r = requests.get(server.url + "/sfi/stats", timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def greedy(n: int, **extra) -> dict:
    return {"temperature": 0, "max_new_tokens": n, **extra}


DENSE = {"custom_params": {"sfi": {"enabled": False}}}


def test_cache_backend_is_sfi_and_stats_endpoint(server):
    info = requests.get(server.url + "/server_info", timeout=60).json()
    assert info["radix_cache_backend"] == "sfi"
    s = stats(server)
    assert s["radix"]["node_memories"] == 0 and s["radix"]["problems"] == []
    assert info["internal_states"][0]["sfi"]["radix"]["capacity"] == s["radix"]["capacity"]


def test_sfi_memory_comes_out_of_sglang_budget(server):
    """SFI's own tensors are set aside from SGLang's KV budget (sfi_sglang.integration.hooks), for the
    request slots SGLang then makes (sfi-sglang serve's default --max-running-requests)."""
    info = requests.get(server.url + "/server_info", timeout=60).json()
    assert info["max_running_requests"] == 64
    # SFI's dense layers run SGLang's triton decode with more KV splits than its default 8
    # (sfi_sglang.engine.SFI_TRITON_KV_SPLITS); --triton-attention-num-kv-splits wins
    assert info["triton_attention_num_kv_splits"] == 64
    m = info["internal_states"][0]["sfi"]["memory"]
    assert m["allocated_slots"] == m["slots"] == 65
    # what the backend allocated is what was set aside for it (1 MiB slack for rounding)
    assert 0 < m["allocated"] <= m["reserved"] + 2**20 and m["reserved"] < m["available"]
    assert 0 < m["pool_of_dense"] == round(m["kv_budget"] / m["available"], 4) < 1


def test_multi_turn_chat_reuses_turn_one_memory_and_equals_dense(server, tokenizer):
    user1 = "Summarise this in two sentences: " + long_text(tokenizer, 120, start=7)
    turn1 = generate(server, greedy(40), text=chat_prompt(tokenizer, user1))
    assert turn1["meta_info"]["sfi"]["bootstrap_computed"] == 1
    messages = [{"role": "user", "content": user1},
                {"role": "assistant", "content": turn1["text"]},
                {"role": "user", "content": "Now give it a short title."}]
    prompt2 = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert len(tokenizer.encode(prompt2)) + 40 <= 4 + W + 256  # fits S+W+K: SFI == dense
    before = stats(server)
    turn2 = generate(server, greedy(40), text=prompt2)
    sfi = turn2["meta_info"]["sfi"]
    assert sfi["bootstrap_reused"] == 1 and sfi["bootstrap_computed"] == 0, sfi
    assert sfi["bootstrap"] and sfi["fast_steps"] > 0
    after = stats(server)
    assert after["bootstrap_reused"] == before["bootstrap_reused"] + 1
    assert after["bootstrap_computed"] == before["bootstrap_computed"]
    dense = generate(server, greedy(40, **DENSE), text=prompt2)
    assert dense["meta_info"]["sfi"]["fast_steps"] == 0
    assert turn2["output_ids"] == dense["output_ids"]
    assert after["radix"]["problems"] == []


def test_n_samples_share_one_prompt_memory(server, tokenizer):
    prompt = chat_prompt(tokenizer, long_text(tokenizer, 1200, start=11) + "\n\nWhat is this about?")
    outs = generate(server, {"temperature": 0.8, "max_new_tokens": 12, "n": 3}, text=prompt)
    assert isinstance(outs, list) and len(outs) == 3
    counts = [(o["meta_info"]["sfi"]["bootstrap_computed"], o["meta_info"]["sfi"]["bootstrap_reused"])
              for o in outs]
    # SGLang prefills the shared prompt once (a cache-only request), then samples n times
    assert counts == [(0, 1)] * 3, counts


def test_frontend_fork_shares_the_prefix_memory(server, tokenizer):
    """Forks sent together may land in one prefill batch (SGLang shares no KV between
    them either); every fork that hits the cached prefix reuses its memory, and a second
    run of the program hits it with all three."""
    import sglang as sgl

    document = long_text(tokenizer, 1000, start=13)

    @sgl.function
    def ask_three(s, doc, questions):
        s += sgl.user("Read this essay:\n\n" + doc)
        forks = s.fork(len(questions))
        for i, (f, q) in enumerate(zip(forks, questions)):
            f += sgl.user(q)
            f += sgl.assistant(sgl.gen(f"a{i}", max_tokens=8, temperature=0))
        forks.join()  # forks run in their own threads
        for i, f in enumerate(forks):
            s.set_var(f"meta{i}", f.get_meta_info(f"a{i}"))

    sgl.set_default_backend(sgl.RuntimeEndpoint(server.url))
    for run, questions in enumerate([["Who wrote it?", "When?", "Why?"],
                                     ["Where?", "How long is it?", "For whom?"]]):
        state = ask_three.run(doc=document, questions=questions)
        assert state.error() is None
        metas = [state[f"meta{i}"] for i in range(3)]
        for meta in metas:
            sfi, hit = meta["sfi"], meta["cached_tokens"] > 900
            assert (sfi["bootstrap_reused"], sfi["bootstrap_computed"]) == ((1, 0) if hit else (0, 1)), meta
        if run == 1:
            assert all(m["sfi"]["bootstrap_reused"] == 1 for m in metas)
    assert stats(server)["radix"]["problems"] == []


def test_many_requests_share_one_long_system_prompt(server, tokenizer):
    system = "You answer questions about this essay.\n\n" + long_text(tokenizer, 1500, start=17)

    def prompt(question):
        return tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": question}],
            tokenize=False, add_generation_prompt=True)

    first = generate(server, greedy(16), text=prompt("Who is the author?"))
    assert first["meta_info"]["sfi"]["bootstrap_computed"] == 1
    questions = ["What is the main claim?", "Name one example.", "Is it persuasive?",
                 "What is the tone?", "Who is the audience?", "Summarise in five words."]
    outs = generate(server, greedy(16), text=[prompt(q) for q in questions])
    reused = [o["meta_info"]["sfi"]["bootstrap_reused"] for o in outs]
    computed = [o["meta_info"]["sfi"]["bootstrap_computed"] for o in outs]
    assert reused == [1] * len(questions) and computed == [0] * len(questions)
    assert all(o["meta_info"]["cached_tokens"] > 1000 for o in outs)
    assert stats(server)["radix"]["problems"] == []


def test_memory_follows_a_split_to_the_right_node(server, tokenizer):
    """One request publishes a memory with hi = len(P) - W inside one long tree node; a
    request that diverges from P before hi splits the node above hi and must not see the
    memory; one that diverges after hi splits below it and must reuse it."""
    base = tokenizer.encode(long_text(tokenizer, 400, start=19))
    other = tokenizer.encode(long_text(tokenizer, 40, start=23))
    first = generate(server, greedy(1), input_ids=base)
    assert first["meta_info"]["sfi"]["bootstrap_computed"] == 1
    hi = len(base) - W

    early = generate(server, greedy(4), input_ids=base[:hi - 10] + other)
    assert early["meta_info"]["cached_tokens"] == hi - 10
    assert early["meta_info"]["sfi"]["bootstrap_computed"] == 1
    assert early["meta_info"]["sfi"]["bootstrap_reused"] == 0  # would read foreign positions

    late = generate(server, greedy(4), input_ids=base[:hi + 10] + other)
    assert late["meta_info"]["cached_tokens"] == hi + 10
    assert late["meta_info"]["sfi"]["bootstrap_reused"] == 1
    assert late["meta_info"]["sfi"]["bootstrap_computed"] == 0
    assert stats(server)["radix"]["problems"] == []


def test_small_pool_eviction_frees_node_memories_then_idle(server, tokenizer):
    before = stats(server)["radix"]
    assert before["node_memories"] > 0
    # three distinct ~2.5K-token prompts do not fit the 6K-token pool together with the tree
    for start in (29, 31, 37):
        out = generate(server, greedy(4), text=chat_prompt(tokenizer, long_text(tokenizer, 2500, start=start)))
        assert out["meta_info"]["sfi"]["bootstrap_computed"] == 1
    after = stats(server)["radix"]
    assert after["freed_on_evict"] > before["freed_on_evict"], after
    assert after["problems"] == []
    assert after["node_memories"] <= after["capacity"]
    r = requests.post(server.url + "/flush_cache", timeout=60)
    assert r.status_code == 200, r.text
    idle = stats(server)["radix"]
    assert idle["node_memories"] == 0 and idle["problems"] == []


# ---------------------------------------------------------------------- metrics
def scrape(server) -> dict:
    """/metrics' SFI samples: {(name, (label, value), ...): value}, without SGLang's labels."""
    from prometheus_client.parser import text_string_to_metric_families

    r = requests.get(server.url + "/metrics", timeout=60)
    assert r.status_code == 200, r.text
    own = ("cause", "source", "reason", "sfi")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.name.startswith("sglang:sfi_") and not s.name.endswith("_created"):
                key = (s.name, *sorted((k, v) for k, v in s.labels.items() if k in own))
                out[key] = out.get(key, 0.0) + s.value
    return out


def metric(m: dict, name: str, **labels) -> float:
    return m.get((f"sglang:sfi_{name}", *sorted(labels.items())), 0.0)


def test_metrics_follow_the_requests(server, tokenizer):
    """Each finished request adds its meta_info["sfi"] to the counters: fast steps, slow
    steps by cause (interval-mode steps are all `interval`; a default request's slow steps
    before max_interval (96) are all `boundary`), selections by source, requests by SFI on
    or off; radix hits and evictions equal /sfi/stats' pool counters; the gauges show no
    slot in use once the requests are done."""
    before = scrape(server)
    assert metric(before, "memory_slots") == metric(before, "memory_rows") == 65
    assert metric(before, "memory_bytes") > 0
    assert ("sglang:sfi_deferred_slow_steps_total",) in before  # at 0: one request at a time
    essay = chat_prompt(tokenizer, "Continue: " + long_text(tokenizer, 200, start=41))
    early = {"custom_params": {"sfi": {"min_gap": 4}}}  # slow steps soon after a sentence end
    first = generate(server, greedy(32, **early), text=essay)
    again = generate(server, greedy(6, **early), text=essay + " Well")
    interval = generate(server, greedy(30, custom_params={"sfi": {"refresh": "interval", "max_interval": 8, "min_gap": 4}}, ignore_eos=True),
                        text="Tell me a story about a cat.")
    dense = generate(server, greedy(6, **DENSE), text="Hello")
    assert not dense["meta_info"]["sfi"]["enabled"]
    after = scrape(server)
    d = lambda name, **labels: metric(after, name, **labels) - metric(before, name, **labels)
    sfi = [o["meta_info"]["sfi"] for o in (first, again, interval)]
    assert interval["meta_info"]["sfi"]["slow_at"] == [8, 16, 24], interval["meta_info"]
    assert all(s < 96 for s in first["meta_info"]["sfi"]["slow_at"] + again["meta_info"]["sfi"]["slow_at"])
    assert first["meta_info"]["sfi"]["slow_steps"] > 0  # the essay's sentences
    assert again["meta_info"]["sfi"]["bootstrap_reused"] == 1
    assert d("fast_steps_total") == sum(s["fast_steps"] for s in sfi)
    assert d("slow_steps_total", cause="interval") == 3
    assert d("slow_steps_total", cause="boundary") == sfi[0]["slow_steps"] + sfi[1]["slow_steps"]
    assert d("slow_steps_total", cause="bootstrap") == 0 and d("slow_steps_total", cause="other") == 0
    assert d("selections_total", source="slow_step") == sum(s["slow_steps"] for s in sfi)
    assert d("selections_total", source="prefill") == sum(s["bootstrap_computed"] for s in sfi)
    assert d("selections_total", source="shared_prefix") == 1
    assert d("requests_total", sfi="on") == 3 and d("requests_total", sfi="off") == 1
    assert d("radix_memory_hits_total") == 1 and d("deferred_slow_steps_total") == 0
    radix = stats(server)["radix"]
    assert metric(after, "radix_memory_hits_total") == radix["lookups_hit"]
    assert metric(after, "radix_memory_evictions_total", reason="tree_evict") == radix["freed_on_evict"]
    assert metric(after, "radix_memory_evictions_total", reason="lru") == radix["dropped_lru"]
    assert metric(after, "radix_node_memories") == radix["node_memories"] > 0
    assert metric(after, "memory_slots_in_use") == metric(after, "memory_rows_in_use") == 0
    assert metric(after, "memory_bytes_in_use") == 0


def test_metrics_gauges_count_running_requests(server):
    """While a long request streams, its slot and bytes are in use."""
    with requests.post(server.url + "/generate", stream=True, timeout=300, json={
            "text": "Write a long story about the sea.", "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}}) as r:
        lines = r.iter_lines()
        for _ in range(2):  # a few chunks: the request runs
            next(lines)
        m = scrape(server)
        assert metric(m, "memory_slots_in_use") == metric(m, "memory_rows_in_use") == 1
        assert 0 < metric(m, "memory_bytes_in_use") < metric(m, "memory_bytes")
        for _ in lines:
            pass
    time.sleep(0.5)
    assert metric(scrape(server), "memory_slots_in_use") == 0


# ---------------------------------------------------------------------- leaks
def server_rss(server) -> int:
    """Resident bytes of the server's processes (HTTP + tokenizer, scheduler, detokenizer)."""
    import psutil

    root = psutil.Process(server.proc.pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


RSS_TOLERANCE = 64 << 20


def _one_request(server, kind: str, i: int) -> str:
    """One request of the loop: what happened to it."""
    url = server.url + "/generate"
    if kind == "finish":  # max_new_tokens
        body = {"text": f"Count from {i}:", "sampling_params": greedy(2 + i % 4)}
        return str(requests.post(url, json=body, timeout=300).status_code)
    if kind == "stop":  # a stop string
        body = {"text": f"List {i} fruits, separated by commas:",
                "sampling_params": greedy(12, stop=[","])}
        return str(requests.post(url, json=body, timeout=300).status_code)
    if kind == "bad":  # rejected before the scheduler (HTTP 400)
        bodies = [{"text": "", "sampling_params": greedy(4)},
                  {"text": "Hi", "sampling_params": greedy(4, custom_params={"sfi": {"budget": -1}})},
                  {"input_ids": [1, -5], "sampling_params": greedy(4)}]
        return str(requests.post(url, json=bodies[i % 3], timeout=300).status_code)
    if kind == "disconnect":  # the client drops a stream after its first chunks
        body = {"text": f"Tell a long story number {i}.", "stream": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}}
        with requests.post(url, json=body, stream=True, timeout=300) as r:
            lines = r.iter_lines()
            next(lines)
        return "dropped"
    # kind == "abort": SGLang's /abort_request, before or after the request is scheduled
    rid = uuid.uuid4().hex
    body = {"text": f"Tell a long story number {i}.", "rid": rid,
            "sampling_params": {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}}
    result = {}
    t = threading.Thread(target=lambda: result.setdefault(
        "r", requests.post(url, json=body, timeout=300)))
    t.start()
    time.sleep(0.05 * (i % 6))
    assert requests.post(server.url + "/abort_request", json={"rid": rid}, timeout=60).status_code == 200
    t.join()
    return f"abort:{result['r'].json()['meta_info']['finish_reason']['type']}"


def _loop(server, n: int) -> list[str]:
    kinds = ["finish", "stop", "bad", "disconnect", "abort", "finish"]
    with ThreadPoolExecutor(6) as pool:
        return list(pool.map(lambda i: _one_request(server, kinds[i % len(kinds)], i), range(n)))


def _idle_maps(server) -> dict:
    """/sfi/stats once the server has no request left (aborts settle within a few steps)."""
    deadline = time.time() + 60
    while True:
        s = stats(server)
        if s["requests"]["slots_in_use"] == 0 or time.time() > deadline:
            return s
        time.sleep(0.5)


def test_finished_aborted_and_rejected_requests_leave_nothing(server):
    """120 requests, six at a time: a third end by max_new_tokens, a sixth by a stop
    string, a sixth are rejected (HTTP 400), a sixth are dropped mid-stream by the client
    and a sixth aborted through /abort_request. Afterwards no slot is in use, every
    per-request map is empty, the radix memories
    within capacity, and the server's RSS within RSS_TOLERANCE of a warm-up's."""
    _loop(server, 12)  # warm-up: every path once, allocator caches grown
    _idle_maps(server)
    rss0 = server_rss(server)
    outcomes = _loop(server, 120)
    assert outcomes.count("200") == 60 and outcomes.count("400") == 20, outcomes
    assert outcomes.count("dropped") == 20
    assert sum(o.startswith("abort:") for o in outcomes) == 20
    s = _idle_maps(server)
    maps = s["requests"]
    assert maps["slots_in_use"] == 0, maps
    assert {k: v for k, v in maps.items() if v} == {}, maps
    assert s["radix"]["node_memories"] <= s["radix"]["capacity"] and s["radix"]["problems"] == []
    assert metric(scrape(server), "memory_slots_in_use") == 0
    rss1 = server_rss(server)
    assert rss1 - rss0 < RSS_TOLERANCE, (rss0, rss1)
