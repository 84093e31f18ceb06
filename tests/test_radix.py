"""Shared prefixes share SFI memories (sfi_sglang.radix) on a real `sfi-sglang serve`
(CPU engine, SmolLM2): multi-turn chat, n>1 sampling, a frontend fork, a long shared
system prompt, node splits and eviction in a small KV pool (--max-total-tokens).

S=4, W=64, K=256: contexts up to 324 tokens must give exactly the dense output, also when
the request starts from a shared memory instead of its own bootstrap selection. Counters
come from meta_info["sfi"] per request and GET /sfi/stats per server."""

from __future__ import annotations

import pytest
import requests

from sfi_sglang.texts import long_text

from conftest import Server, chat_prompt

W = 64
POOL_TOKENS = 6144


@pytest.fixture(scope="module")
def server():
    srv = Server("--sfi-budget", "256", "--sfi-window", str(W), "--sfi-sinks", "4",
                 "--max-total-tokens", str(POOL_TOKENS))
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
    """SFI's own tensors are set aside from SGLang's KV budget (sfi_sglang.hooks), for the
    request slots SGLang then makes (sfi-sglang serve's default --max-running-requests)."""
    info = requests.get(server.url + "/server_info", timeout=60).json()
    assert info["max_running_requests"] == 64
    m = info["internal_states"][0]["sfi"]["memory"]
    assert m["allocated_slots"] == m["slots"] == 65
    # the key norms follow the pool's token count (+ SGLang's padding token): 1 MiB slack
    assert 0 < m["allocated"] <= m["reserved"] + 2**20 and m["reserved"] < m["available"]


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
