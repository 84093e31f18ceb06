"""Structured generation with SFI through llguidance (grammar backend `sfi-llguidance`)
on sfi_sglang.Engine, and the Engine methods for run-time boundary updates. (xgrammar,
the HTTP endpoint and the ZMQ plumbing: test_server_boundaries.py.)"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from sfi_sglang.method.boundary import boundary_tables
from sfi_sglang.integration.grammar import JsonTracker, token_texts
from sfi_sglang.texts import long_text

from conftest import chat_prompt, start_engine
from test_server_boundaries import EAGER, SCHEMAS, expected_slow


@pytest.fixture(scope="module")
def engine():
    engine = start_engine(sfi_budget=256, sfi_window=64, grammar_backend="sfi-llguidance")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def long_prompt(tokenizer):
    return long_text(tokenizer, 1500, start=4)


def _gen(engine, prompt, max_new_tokens=160, sfi=None, **params):
    params = {"temperature": 0, "max_new_tokens": max_new_tokens, **params}
    if sfi is not None:
        params["custom_params"] = {"sfi": sfi}
    return engine.generate(prompt, params)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "review", "nested"])
def test_llguidance_json_schema_outputs_validate(engine, tokenizer, long_prompt, schema):
    prompt = chat_prompt(tokenizer, long_prompt + "\n\nDescribe the essay above as JSON matching "
                         "this schema: " + json.dumps(schema))
    out = _gen(engine, prompt, json_schema=json.dumps(schema))
    jsonschema.validate(json.loads(out["text"]), schema)
    assert out["meta_info"]["sfi"]["bootstrap"] and out["meta_info"]["sfi"]["fast_steps"] > 0


def test_llguidance_regex_and_grammar(engine, tokenizer, long_prompt):
    regex = r"(yes|no), because [a-z ]{5,40}\."
    out = _gen(engine, chat_prompt(tokenizer, long_prompt + "\n\nIs this essay about startups?"),
               max_new_tokens=64, regex=regex)
    assert re.fullmatch(regex, out["text"]), out["text"]
    grammar = 'start: "Topic: " WORD (", " WORD)~1..2 "."\nWORD: /[a-z]{2,12}/'
    out = _gen(engine, chat_prompt(tokenizer, long_prompt + "\n\nName two or three topics."),
               max_new_tokens=64, ebnf=grammar)
    assert re.fullmatch(r"Topic: [a-z]{2,12}(, [a-z]{2,12}){1,2}\.", out["text"]), out["text"]


def test_engine_methods_update_boundaries(engine, tokenizer, long_prompt):
    state = engine.get_sfi_boundaries()
    assert [s["spec"] for s in state["schedulers"]] == ["default"]
    with pytest.raises(ValueError, match="boundaries"):
        engine.update_sfi_boundaries("latin,bogus")
    assert engine.get_sfi_boundaries()["schedulers"][0]["version"] == state["schedulers"][0]["version"]
    prompt = chat_prompt(tokenizer, "Continue this essay:\n\n" + long_prompt)
    try:
        result = engine.update_sfi_boundaries("mark:and,mark:the")
        assert result["success"] and result["schedulers"][0]["spec"] == "mark:and,mark:the"
        out = _gen(engine, prompt, max_new_tokens=48, sfi=EAGER, ignore_eos=True)
        sfi = out["meta_info"]["sfi"]
        is_b, is_c = boundary_tables(tokenizer, "mark:and,mark:the", len(tokenizer))
        n = sfi["fast_steps"] + sfi["slow_steps"]
        assert sfi["slow_at"] == expected_slow(out["output_ids"], n, is_b, is_c)
        assert sfi["boundary_version"] == result["version"]
    finally:
        engine.update_sfi_boundaries("default")


def test_llguidance_grammar_boundaries(engine, tokenizer, long_prompt):
    engine.update_sfi_boundaries("none")
    try:
        schema = SCHEMAS[1]
        prompt = chat_prompt(tokenizer, long_prompt + "\n\nDescribe the essay above as JSON matching "
                             "this schema: " + json.dumps(schema))
        out = _gen(engine, prompt, json_schema=json.dumps(schema), sfi=EAGER)
        jsonschema.validate(json.loads(out["text"]), schema)
        sfi = out["meta_info"]["sfi"]
        tracker = JsonTracker(token_texts(tokenizer))
        events = {i for i, t in enumerate(out["output_ids"]) if tracker.feed(t)}
        is_b, is_c = boundary_tables(tokenizer, "none", len(tokenizer))
        n = sfi["fast_steps"] + sfi["slow_steps"]
        assert sfi["slow_at"] == expected_slow(out["output_ids"], n, is_b, is_c, events)
        assert len(sfi["slow_at"]) >= 2
    finally:
        engine.update_sfi_boundaries("default")


def test_json_tracker_marks_field_and_value_ends():
    pieces = ['{"', 'a', '":', ' 1', ',', ' "', 'b,', '":', ' [', '2', ',', ' 3', ']', '}']
    tracker = JsonTracker(pieces)
    ends = [i for i in range(len(pieces)) if tracker.feed(i)]
    assert ends == [4, 10, 12, 13]  # the comma inside "b," is part of a string
    tracker.rollback(3)
    assert (tracker.depth, tracker.in_string) == (2, False)
