"""sfi_sglang.Engine on real SGLang (CPU engine, SmolLM2, fp32): SFI against dense.

One dense engine (disable_sfi) computes the references first, then one SFI engine runs
every check. S=4, W=64, K=256: contexts up to S+W+K=324 tokens must give exactly the
dense output; a ~1.5K-token essay prompt (past S+W+K) must decode mostly in fast steps."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from sfi_sglang.engine import SFI_MAX_RUNNING_REQUESTS
from sfi_sglang.method.boundary import TriggerPolicy
from sfi_sglang.method.config import SFIConfig
from sfi_sglang.texts import long_text

from conftest import GREEDY, chat_prompt, start_engine

# at most 2 slow rows per decode step (test_a_step_s_slow_rows_are_limited...): the other
# tests run one request, or fitting contexts, where a slow step put off changes nothing
SFI = dict(sfi_sinks=4, sfi_window=64, sfi_budget=256, sfi_max_slow_rows=2)
CFG = SFIConfig(sinks=4, window=64, budget=256, max_slow_rows=2)
FIT_NEW = 48


@pytest.fixture(scope="module")
def prompts(tokenizer):
    fit = [
        chat_prompt(tokenizer, "What is the capital of France?"),
        chat_prompt(tokenizer, "Summarise this in two sentences: " + long_text(tokenizer, 90)),
        chat_prompt(tokenizer, "What is the main point of this text? " + long_text(tokenizer, 200, start=3)),
    ]
    for p in fit:  # prompt + new tokens stay within S+W+K
        assert len(tokenizer.encode(p)) + FIT_NEW <= CFG.sinks + CFG.window + CFG.budget
    long = chat_prompt(tokenizer, long_text(tokenizer, 1500, start=5) + "\n\nWhat is this essay about?")
    assert 1400 < len(tokenizer.encode(long)) < 1700
    return {"fit": fit, "long": long}


def _ids(outs):
    return [o["output_ids"] for o in outs]


@pytest.fixture(scope="module")
def dense(prompts):
    engine = start_engine(disable_sfi=True)
    try:
        refs = {
            "fit_batch": _ids(engine.generate(prompts["fit"], {**GREEDY, "max_new_tokens": FIT_NEW})),
            "fit_single": [engine.generate(p, {**GREEDY, "max_new_tokens": FIT_NEW})["output_ids"]
                           for p in prompts["fit"]],
            "long": engine.generate(prompts["long"], {**GREEDY, "max_new_tokens": 64, "ignore_eos": True})["output_ids"],
            "paris": engine.generate(prompts["fit"][0], {**GREEDY, "max_new_tokens": 16})["text"],
        }
    finally:
        engine.shutdown()
    return refs


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    return tmp_path_factory.mktemp("trace") / "plugin.txt"


# The backend module is imported inside tests only: importing it at collection would import
# the Triton kernels before test_kernels.py / test_memory.py set TRITON_INTERPRET=1.
SYNC_GUARD_ENV = "SFI_SGLANG_SYNC_GUARD"  # sfi_sglang.integration.graph_if.SYNC_GUARD_ENV


@pytest.fixture(scope="module")
def engine(dense, trace_file):
    # every device-path decode layer of this engine runs under no_host_reads: a host read
    # there crashes the scheduler, and the tests below fail
    os.environ.update({"SFI_SGLANG_PLUGIN_TRACE": str(trace_file), SYNC_GUARD_ENV: "1"})
    try:
        # a memory per slot: short prompts run SFI; the top-up on the device path, under the
        # guard, from page summaries (SGLang's pool in pages of the top-up's 16 tokens)
        engine = start_engine(**SFI, sfi_memory_rows=0, sfi_topup_pages=2, page_size=16)
    finally:
        del os.environ["SFI_SGLANG_PLUGIN_TRACE"], os.environ[SYNC_GUARD_ENV]
    yield engine
    engine.shutdown()


def test_plugin_runs_in_every_sglang_process(engine, trace_file):
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES

    assert "sfi" in ATTENTION_BACKEND_CHOICES  # this (tokenizer manager) process registered
    pids = {line.split("\t")[0] for line in trace_file.read_text().splitlines()}
    assert len(pids - {str(os.getpid())}) >= 2  # scheduler + detokenizer, spawned by this engine
    assert "sglang::detokenizer" in trace_file.read_text()


def test_paris(engine, dense, prompts):
    out = engine.generate(prompts["fit"][0], {**GREEDY, "max_new_tokens": 16})
    assert "Paris" in out["text"]
    assert "Paris" in dense["paris"]
    assert out["meta_info"]["sfi"]["bootstrap"] is True


def test_fitting_contexts_equal_dense_token_for_token(engine, dense, prompts):
    for prompt, ref in zip(prompts["fit"], dense["fit_single"]):
        out = engine.generate(prompt, {**GREEDY, "max_new_tokens": FIT_NEW})
        sfi = out["meta_info"]["sfi"]
        assert sfi["fast_steps"] > 0 and sfi["bootstrap"]
        assert out["output_ids"] == ref


def test_fitting_contexts_mixed_batch_equal_dense(engine, dense, prompts):
    outs = engine.generate(prompts["fit"], {**GREEDY, "max_new_tokens": FIT_NEW})
    assert _ids(outs) == dense["fit_batch"]
    assert all(o["meta_info"]["sfi"]["fast_steps"] > 0 for o in outs)


def test_long_prompt_mostly_fast_and_slow_steps_where_policy_says(engine, dense, prompts, tokenizer):
    out = engine.generate(prompts["long"], {**GREEDY, "max_new_tokens": 64, "ignore_eos": True})
    ids, sfi = out["output_ids"], out["meta_info"]["sfi"]
    steps = len(ids) - 1  # the first token comes from prefill
    assert sfi["fast_steps"] + sfi["slow_steps"] == steps
    assert sfi["fast_steps"] >= 0.8 * steps, sfi

    policy = TriggerPolicy.from_tokenizer(tokenizer, CFG, max_slots=1, vocab_size=49152)
    policy.reset(torch.tensor([0]))
    expect = [j for j in range(1, steps + 1)
              if bool(policy.step(torch.tensor([ids[j - 1]]), torch.tensor([0]))[0])]
    assert sfi["slow_at"] == expect

    ref = dense["long"]
    same = next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), min(len(ids), len(ref)))
    agree = sum(a == b for a, b in zip(ids, ref)) / max(len(ref), 1)
    print(f"\n[sfi] 1.5K prompt, K=256 W=64: {sfi['fast_steps']}/{steps} fast steps; "
          f"greedy tokens equal to dense for the first {same}, position-wise agreement {agree:.1%}")


def test_topup_page_summaries_are_kept_per_pool_page(engine, model_path):
    """Under --page-size 16 the top-up's pages' key summaries take one [pool pages, H_kv, 2,
    D] tensor per layer that chooses pages (every sparse layer here), set aside from the
    pool's budget, and /server_info reports them."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    memory = engine.get_server_info()["internal_states"][0]["sfi"]["memory"]
    layers = CFG.replace(topup_pages=2).topup_layers(config["num_hidden_layers"])
    hkv, d = config["num_key_value_heads"], config["hidden_size"] // config["num_attention_heads"]
    per_page = len(layers) * hkv * 2 * d * 4  # fp32 on the CPU engine
    pages = memory["allocated_page_summaries"] / per_page
    assert layers and pages == int(pages) and memory["pool_tokens"] / 16 <= pages <= memory["pool_tokens"] / 16 + 2


def test_a_steps_slow_rows_are_limited_and_the_rest_put_off_a_step(engine, prompts):
    """Three requests in lockstep whose slow steps all come at the same decode steps
    (refresh every 8 steps): the server's --sfi-max-slow-rows 2 lets two of them run each
    such step slow and puts the third off to its next step, where it runs slow alone; from
    then on its refreshes come one step after the others'. Alone, it refreshes with them."""
    sp = {**GREEDY, "max_new_tokens": 40, "ignore_eos": True,
          "custom_params": {"sfi": {"refresh": "interval", "max_interval": 8, "min_gap": 4}}}
    alone = engine.generate(prompts["long"], sp)["meta_info"]["sfi"]
    batch = [o["meta_info"]["sfi"] for o in engine.generate([prompts["long"]] * 3, sp)]
    assert alone["slow_at"] == list(range(8, 40, 8))
    put_off = [b for b in batch if b["slow_at"] != alone["slow_at"]]
    assert len(put_off) == 1, [b["slow_at"] for b in batch]
    assert put_off[0]["slow_at"] == [s + 1 for s in alone["slow_at"]]
    for b in batch:
        assert b["fast_steps"] + b["slow_steps"] == 39
        assert b.get("deferred_slow_steps", 0) == (1 if b is put_off[0] else 0)  # once: then a step apart


def test_host_read_guard_refuses_item_tolist_cpu():
    from sfi_sglang.integration.graph_if import SYNC_GUARD_ENV as env_name, no_host_reads

    assert env_name == SYNC_GUARD_ENV
    t = torch.arange(3)
    for read in (lambda: t.item(), lambda: t.tolist(), lambda: t.cpu()):
        with no_host_reads(), pytest.raises(RuntimeError, match="read a tensor to the host"):
            read()
    assert t.tolist() == [0, 1, 2]  # restored


def test_per_request_disable_gives_dense_output(engine, dense, prompts):
    out = engine.generate(prompts["long"], {**GREEDY, "max_new_tokens": 64, "ignore_eos": True,
                                            "custom_params": {"sfi": {"enabled": False}}})
    assert out["output_ids"] == dense["long"]
    assert out["meta_info"]["sfi"]["fast_steps"] == 0


def test_per_request_options_apply(engine, prompts):
    out = engine.generate(prompts["long"], {**GREEDY, "max_new_tokens": 24, "ignore_eos": True,
                                            "custom_params": {"sfi": {"budget": 128, "max_interval": 8,
                                                                      "min_gap": 4}}})
    sfi = out["meta_info"]["sfi"]
    assert sfi["budget"] == 128
    assert len(out["output_ids"]) == 24 and sfi["slow_steps"] >= 2  # at most 8 steps apart


def test_host_path_slow_steps_are_dense_steps(engine, dense, prompts):
    """A request on the host path (its own budget) whose every step is slow decodes dense's
    tokens: a slow step's output is its dense pass (once it was left unwritten there, and
    every later token attended to a corrupted one)."""
    out = engine.generate(prompts["long"], {**GREEDY, "max_new_tokens": 24, "ignore_eos": True,
                                            "custom_params": {"sfi": {"budget": 128, "max_interval": 1,
                                                                      "min_gap": 1}}})
    assert out["meta_info"]["sfi"]["slow_steps"] >= 20
    assert out["output_ids"] == dense["long"][:24]


@pytest.mark.parametrize("bad, fragment", [
    ({"budget": -1}, "budget"),
    ({"budget": 100000}, "exceeds"),
    ({"sinks": 8}, "cannot differ"),
    ({"fast_path": "flashinfer"}, "cannot differ from the server.s --sfi-fast-path"),
    ({"dense_below": 5}, "cannot differ from the server.s --sfi-dense-below"),
    ({"no_such_option": 1}, "no_such_option"),
    ({"enabled": "yes"}, "enabled"),
    ("fast please", "must be a JSON object, got a string"),
])
def test_bad_request_options_error_and_engine_keeps_serving(engine, prompts, bad, fragment):
    with pytest.raises(ValueError, match=fragment):
        engine.generate(prompts["fit"][0], {**GREEDY, "max_new_tokens": 4, "custom_params": {"sfi": bad}})
    out = engine.generate(prompts["fit"][0], {**GREEDY, "max_new_tokens": 4})
    assert out["meta_info"]["completion_tokens"] == 4


def test_cpu_dense_extend_after_a_prefix_is_sglangs_to_the_bit():
    """The CPU dense backend's extend (integration.dense_cpu) gives SGLang's torch_native
    results (float32, the CPU engine's dtype) on a batch mixing a fresh prompt, rows after a
    cached prefix and a one-row extend (GQA), while attending only from the new rows: bit
    for bit where the call is SGLang's own (no prefix), else to the last bit of float32
    (torch's CPU kernel blocks a query of p + r rows and one of r rows differently; on
    AVX-512 a row of a short block can round differently)."""
    dtype = torch.float32
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from sfi_sglang.integration.dense_cpu import PrefixExtendTorchNative

    gen = torch.Generator().manual_seed(11)
    hq, hkv, d = 6, 2, 16
    seq, prefix = [40, 300, 129], [0, 291, 128]
    new = [n - p for n, p in zip(seq, prefix)]
    slots = sum(seq) + 5
    k_cache, v_cache = (torch.randn(slots, hkv, d, generator=gen, dtype=dtype) for _ in range(2))
    r2t = torch.zeros(4, 320, dtype=torch.int64)
    perm, off = torch.randperm(slots, generator=gen), 0
    for i, n in enumerate(seq):
        r2t[i + 1, :n] = perm[off:off + n]
        off += n
    q = torch.randn(sum(new), hq, d, generator=gen, dtype=dtype)
    args = (k_cache, v_cache, r2t, torch.tensor([1, 2, 3]), torch.tensor(seq), torch.tensor(prefix),
            torch.tensor(new), None)
    kw = dict(scaling=d ** -0.5, enable_gqa=True, causal=True)
    want = TorchNativeAttnBackend._run_sdpa_forward_extend(object.__new__(TorchNativeAttnBackend), q,
                                                             torch.empty_like(q), *args, **kw)
    got = PrefixExtendTorchNative._run_sdpa_forward_extend(object.__new__(PrefixExtendTorchNative), q,
                                                           torch.full_like(q, float("nan")), *args, **kw)
    assert torch.equal(got[:new[0]], want[:new[0]])
    assert (got - want).abs().max() <= 4 * torch.finfo(dtype).eps * want.abs().max()


@pytest.fixture(scope="module")
def below_engine(dense, prompts, tokenizer):
    """An engine with --sfi-dense-below (decode step j of the long prompt alone has n0 + j
    tokens: steps 1..11 hold fewer than n0 - S - W - K + 12 beyond), one memory row and
    prompts prefilled in chunks of 256 tokens (fewer than S + W + K);
    started after the dense engine's references (one engine at a time: SGLang's subprocess
    watchdog of an engine shut down beside another one signals the test process)."""
    n0 = len(tokenizer.encode(prompts["long"]))
    engine = start_engine(**SFI, sfi_dense_below=n0 - CFG.memory_tokens() + 12, sfi_memory_rows=1,
                          chunked_prefill_size=256)
    yield engine
    engine.shutdown()


def test_dense_below_runs_short_batches_dense_then_refreshes(below_engine, dense, prompts):
    """--sfi-dense-below: a step whose batch holds fewer tokens beyond S + W + K than the
    threshold runs the dense backend alone (dense's tokens, counted as dense steps); a
    request's first SFI step after them is slow (its memory is behind), then it runs fast."""
    out = below_engine.generate(prompts["long"], {**GREEDY, "max_new_tokens": 64, "ignore_eos": True})
    fit = below_engine.generate(prompts["fit"][1], {**GREEDY, "max_new_tokens": FIT_NEW})
    ids, sfi = out["output_ids"], out["meta_info"]["sfi"]
    n_dense = sfi["dense_steps"]
    assert 8 <= n_dense <= 14, sfi
    assert sfi["fast_steps"] + sfi["slow_steps"] + n_dense == len(ids) - 1
    assert sfi["slow_at"][0] == n_dense + 1 and sfi["fast_steps"] > 30, sfi
    # the prefill's token, the dense steps' and the slow step's are dense's
    assert ids[:n_dense + 2] == dense["long"][:n_dense + 2]
    # a context within S + W + K never goes sparse: every step dense
    sfi = fit["meta_info"]["sfi"]
    assert sfi["dense_steps"] == len(fit["output_ids"]) - 1 and sfi["fast_steps"] == sfi["slow_steps"] == 0
    assert fit["output_ids"] == dense["fit_single"][1]


def test_a_request_without_a_memory_row_runs_dense_until_one_is_free(below_engine, dense, prompts, tokenizer):
    """--sfi-memory-rows 1: of two long requests started together, the first takes the
    row and runs SFI; the second runs dense (dense's tokens, counted as dense steps) until
    the first ends and SGLang frees its slot, then takes the row, runs a slow step (its
    first selection) and fast steps. The row is free again after both end."""
    other = chat_prompt(tokenizer, long_text(tokenizer, 900, start=9) + "\n\nWhat is this about?")
    sp = {**GREEDY, "ignore_eos": True}
    first, second = below_engine.generate([other, prompts["long"]], [{**sp, "max_new_tokens": 16},
                                                                     {**sp, "max_new_tokens": 48}])
    a, b = first["meta_info"]["sfi"], second["meta_info"]["sfi"]
    assert a.get("dense_steps", 0) == 0 and a["fast_steps"] + a["slow_steps"] == 15, a
    # prompts in chunks of 256 (<= S + W + K): the first took the row at its second chunk and
    # selected at its prompt's end, as unchunked (no slow first decode step)
    assert a["bootstrap_computed"] == 1 and 1 not in a["slow_at"], a
    waited = b["dense_steps"]
    assert 14 <= waited <= 17, b  # while the first ran (its 15 decode steps), give or take a step
    assert b["slow_at"][0] == waited + 1 and b["fast_steps"] + b["slow_steps"] + waited == 47, b
    assert second["output_ids"][:waited + 2] == dense["long"][:waited + 2]
    # the next forward gives the row back (SGLang freed the slot); a short request takes none
    fit = below_engine.generate(prompts["fit"][0], {**GREEDY, "max_new_tokens": 4})
    assert fit["meta_info"]["sfi"]["dense_steps"] == 3
    memory = below_engine.get_server_info()["internal_states"][0]["sfi"]["memory"]
    assert memory["rows"] == 1 and memory["rows_free"] == 1, memory
    # with memory rows a slot holds no memory: the launcher leaves SGLang's request slots
    assert memory["allocated_slots"] > SFI_MAX_RUNNING_REQUESTS + 1, memory


def test_dense_below_graph_variants(engine, model_path):
    """SGLang's decode graph runner gets the `sfi` backend's two graphs per batch size
    (hooks._sfi_graph_variants) and a replay picks by the tokens beyond S + W + K."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.runner import decode_cuda_graph_runner as runner
    from transformers import AutoConfig

    from sfi_sglang.integration import state
    from sfi_sglang.integration.backend import DENSE_VARIANT, SFI_VARIANT, SFIGraphVariants

    variants = SFIGraphVariants(CFG.memory_tokens(), 100)
    pick = lambda lens: variants.select(SimpleNamespace(seq_lens_cpu=None if lens is None else torch.tensor(lens)))  # noqa: E731
    assert pick([324, 100]) == pick([423]) == pick([300, 423]) == DENSE_VARIANT  # 0, 99, 99 beyond
    assert pick([424]) == pick([374, 374]) == pick(None) == SFI_VARIANT  # 100, 50 + 50; no lengths
    hf_config = AutoConfig.from_pretrained(model_path)
    assert runner.create_attention_graph_variants(hf_config) is None  # no backend here: SGLang's
    state.BACKENDS.append(SimpleNamespace(graph_variants=lambda: variants))
    try:
        assert runner.create_attention_graph_variants(hf_config) is variants
    finally:
        state.BACKENDS.pop()
