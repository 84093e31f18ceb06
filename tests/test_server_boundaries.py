"""Tokenizer-side boundary tables over ZMQ, and structured generation with SFI, on a real
`sfi-sglang serve` (CPU engine, SmolLM2) with the grammar backend `sfi-xgrammar`
(conftest's shared_server: requests carry its API key, table updates its admin key).

Where slow steps must fire is computed independently from each response's own output
tokens with the trigger rule of docs/method.md (a boundary token makes the refresh pending;
the next content token runs the slow step). Requests use min_gap 1, cooldown 0 and
max_interval at the model's context length (the largest a request may ask for), so every
slow step comes from a boundary."""

from __future__ import annotations

import json
import os
import re

import jsonschema
import pytest
import requests

from sfi_sglang.method.boundary import boundary_tables
from sfi_sglang.integration.grammar import JsonTracker, token_texts
from sfi_sglang.texts import long_text

from conftest import ADMIN, API, chat_prompt

EAGER = {"min_gap": 1, "cooldown": 0, "max_interval": 8192}  # SmolLM2's context length

SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "minItems": 1, "maxItems": 3},
        "rating": {"type": "number", "minimum": 0, "maximum": 5}},
     "required": ["title", "tags", "rating"], "additionalProperties": False},
    {"type": "object", "properties": {
        "topic": {"type": "string", "enum": ["startups", "art", "programming", "money"]},
        "summary": {"type": "object", "properties": {
            "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
            "confident": {"type": "boolean"}},
            "required": ["sentiment", "confident"], "additionalProperties": False}},
     "required": ["topic", "summary"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


@pytest.fixture(scope="module")
def long_prompt(tokenizer):
    return long_text(tokenizer, 1500, start=2)


@pytest.fixture(scope="module")
def texts(tokenizer):
    return token_texts(tokenizer)


def generate(server, text, max_new_tokens=48, sfi=None, **sampling):
    params = {"temperature": 0, "max_new_tokens": max_new_tokens, **sampling}
    if sfi is not None:
        params["custom_params"] = {"sfi": sfi}
    r = requests.post(server.url + "/generate", json={"text": text, "sampling_params": params},
                      headers=API, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def set_boundaries(server, spec):
    r = requests.post(server.url + "/sfi/boundaries", json={"boundaries": spec}, headers=ADMIN,
                      timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["success"] and all(s["spec"] == spec for s in body["schedulers"])
    return body


def expected_slow(out_ids, n_steps, is_b, is_c, events=()):
    """Decode steps (1-based) that must be slow: step d reads output token d-1."""
    slow, pending = [], False
    for d in range(1, n_steps + 1):
        x = out_ids[d - 1]
        if pending and bool(is_c[x]):
            slow.append(d)
            pending = False
        elif bool(is_b[x]) or (d - 1) in events:
            pending = True
    return slow


def steps(body):
    sfi = body["meta_info"]["sfi"]
    return sfi, sfi["fast_steps"] + sfi["slow_steps"]


def scheduler_pids(server) -> set[int]:
    """Every process under the server's process group other than the launcher."""
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == server.proc.pid and int(entry) != server.proc.pid:
                pids.add(int(entry))
    return pids


# ---------------------------------------------------------------- the message
def test_startup_table_reaches_every_scheduler(server):
    generate(server, "Hello", max_new_tokens=2)  # the table goes out ahead of the first request
    body = requests.get(server.url + "/sfi/boundaries", headers=API, timeout=60).json()
    scheds = body["schedulers"]
    assert len(scheds) == 1  # one per DP rank (dp_size 1 here)
    (s,) = scheds
    assert s["sfi"] and s["success"] and s["spec"] == "default"
    assert s["version"] >= 1  # installed from the tokenizer side (the backend's own table is v0)
    assert 50 < s["num_boundary"] < 1000 and s["num_content"] > 40000
    assert s["pid"] != server.proc.pid and s["pid"] in scheduler_pids(server)


def test_run_time_update_moves_slow_steps(server, tokenizer, long_prompt):
    prompt = chat_prompt(tokenizer, "Continue this essay in the same style, with long sentences:\n\n"
                         + long_prompt)
    slow_at = {}
    for spec in ("default", "none", "mark:and,mark:the"):
        info = set_boundaries(server, spec)
        body = generate(server, prompt, max_new_tokens=64, sfi=EAGER, ignore_eos=True)
        sfi, n = steps(body)
        is_b, is_c = boundary_tables(tokenizer, spec, len(tokenizer))
        assert sfi["slow_at"] == expected_slow(body["output_ids"], n, is_b, is_c), spec
        assert body["meta_info"]["sfi"]["boundary_version"] == info["version"]
        slow_at[spec] = sfi["slow_at"]
    assert slow_at["none"] == []
    assert slow_at["mark:and,mark:the"] and slow_at["mark:and,mark:the"] != slow_at["default"]
    set_boundaries(server, "default")


@pytest.mark.parametrize("body", [{"boundaries": "bogus"}, {"boundaries": "latin,mark:"},
                                  {"boundaries": 3}, {"spec": "latin"}, None])
def test_bad_spec_gets_400_and_server_keeps_serving(server, body):
    before = requests.get(server.url + "/sfi/boundaries", headers=API, timeout=60).json()
    r = requests.post(server.url + "/sfi/boundaries", timeout=60, headers=ADMIN,
                      **({"json": body} if body is not None else {"data": "not json"}))
    assert r.status_code == 400, r.text
    assert "boundar" in r.text.lower()
    after = requests.get(server.url + "/sfi/boundaries", headers=API, timeout=60).json()
    assert after["schedulers"][0]["version"] == before["schedulers"][0]["version"]
    assert generate(server, "The capital of France is", max_new_tokens=4)["text"]


def test_per_request_extra_boundaries(server, tokenizer, long_prompt):
    set_boundaries(server, "none")
    try:
        prompt = chat_prompt(tokenizer, "Continue this essay:\n\n" + long_prompt)
        body = generate(server, prompt, max_new_tokens=64, ignore_eos=True,
                        sfi={**EAGER, "extra_boundaries": "mark:and,latin"})
        sfi, n = steps(body)
        is_b, is_c = boundary_tables(tokenizer, "mark:and,latin", len(tokenizer))
        assert sfi["slow_at"] == expected_slow(body["output_ids"], n, is_b, is_c)
        assert sfi["slow_at"]
        plain = generate(server, prompt, max_new_tokens=64, ignore_eos=True, sfi=EAGER)
        assert plain["meta_info"]["sfi"]["slow_at"] == []
        r = requests.post(server.url + "/generate", timeout=60, headers=API, json={
            "text": "Hi", "sampling_params": {"max_new_tokens": 2, "custom_params": {
                "sfi": {"extra_boundaries": "nonsense"}}}})
        assert r.status_code == 400 and "extra_boundaries" in r.text
    finally:
        set_boundaries(server, "default")


# ---------------------------------------------------------------- structured generation
def _json_prompt(tokenizer, long_prompt, schema):
    return chat_prompt(tokenizer, long_prompt + "\n\nDescribe the essay above as JSON matching "
                       "this schema: " + json.dumps(schema))


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "review", "nested"])
def test_json_schema_outputs_validate_after_long_prompt(server, tokenizer, long_prompt, schema):
    body = generate(server, _json_prompt(tokenizer, long_prompt, schema), max_new_tokens=160,
                    json_schema=json.dumps(schema))
    jsonschema.validate(json.loads(body["text"]), schema)
    sfi = body["meta_info"]["sfi"]
    assert sfi["enabled"] and sfi["bootstrap"] and sfi["fast_steps"] > 0


def test_regex_and_ebnf_outputs_match(server, tokenizer, long_prompt):
    regex = r"(yes|no), because [a-z ]{5,40}\."
    body = generate(server, chat_prompt(tokenizer, long_prompt + "\n\nIs this essay about startups?"),
                    max_new_tokens=64, regex=regex)
    assert re.fullmatch(regex, body["text"]), body["text"]
    ebnf = 'root ::= "Topic: " word ("," " " word){1,2} "."\nword ::= [a-z]{2,12}'
    body = generate(server, chat_prompt(tokenizer, long_prompt + "\n\nName two or three topics."),
                    max_new_tokens=64, ebnf=ebnf)
    assert re.fullmatch(r"Topic: [a-z]{2,12}(, [a-z]{2,12}){1,2}\.", body["text"]), body["text"]


def test_grammar_boundaries_fire_at_json_field_ends(server, tokenizer, long_prompt, texts):
    set_boundaries(server, "none")  # only the grammar can trigger a slow step
    try:
        is_b, is_c = boundary_tables(tokenizer, "none", len(tokenizer))
        for schema in SCHEMAS[1:]:
            body = generate(server, _json_prompt(tokenizer, long_prompt, schema), max_new_tokens=160,
                            json_schema=json.dumps(schema), sfi=EAGER)
            jsonschema.validate(json.loads(body["text"]), schema)
            sfi, n = steps(body)
            tracker = JsonTracker(texts)
            events = {i for i, t in enumerate(body["output_ids"]) if tracker.feed(t)}
            assert len(events) >= 3  # fields end inside the object
            assert sfi["slow_at"] == expected_slow(body["output_ids"], n, is_b, is_c, events)
            assert len(sfi["slow_at"]) >= 2
        # a regex grammar has no field ends: no slow step
        body = generate(server, chat_prompt(tokenizer, "Say a number."), max_new_tokens=16,
                        regex=r"[0-9]{1,3}(, [0-9]{1,3}){3}", sfi=EAGER)
        assert body["meta_info"]["sfi"]["slow_at"] == []
    finally:
        set_boundaries(server, "default")
