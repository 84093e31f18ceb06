"""`sfi-sglang serve` over real HTTP: SGLang's /generate and OpenAI API with SFI, bad
input answered with 400 while the server keeps serving, SFI's endpoints under SGLang's
API keys, and the examples against it. The server (conftest's shared_server) runs with
--api-key and --admin-api-key, so every request carries a key."""

from __future__ import annotations

import subprocess
import sys

import pytest
import requests

from conftest import ADMIN, ADMIN_KEY, API, API_KEY, REPO, sfi_cli


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


def test_generate_endpoint_reports_sfi(server):
    r = requests.post(server.url + "/generate", json={
        "text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 12}},
        headers=API, timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    assert "Paris" in body["text"]
    sfi = body["meta_info"]["sfi"]
    # a prompt within S + W + K takes no memory row (--sfi-memory-rows auto, the default):
    # its decode steps run dense, which is what a fast step over its whole context computes
    assert sfi["enabled"] and not sfi["bootstrap"] and sfi["fast_steps"] + sfi["slow_steps"] == 0
    assert sfi["dense_steps"] == 11


def test_openai_chat_with_per_request_options(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key=API_KEY)
    out = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=16, extra_body={"custom_params": {"sfi": {"budget": 128}}})
    assert "Paris" in out.choices[0].message.content


def generate_body(sfi=None, **prompt) -> dict:
    """A /generate body of two new tokens: prompt "Hello" unless `prompt` gives text or
    input_ids; custom_params["sfi"] = sfi when given."""
    params = {"max_new_tokens": 2}
    if sfi is not None:
        params["custom_params"] = {"sfi": sfi}
    return {**(prompt or {"text": "Hello"}), "sampling_params": params}


# longer than the boundary-spec limit (sfi_sglang.method.boundary.MAX_SPEC_CHARS, 4096) and valid
# otherwise, so only the limit rejects it
LONG_SPEC = ",".join(["mark:;"] * 700)

# (/generate body, the field the 400's message must name). Without its check, each of these
# crashes the server (the scheduler: empty prompt, ids outside the vocabulary) or is accepted.
BAD_INPUTS = [
    (generate_body({"budget": 0}), "budget"),
    (generate_body({"window": "wide"}), "window"),
    (generate_body({"bogus": 1}), "bogus"),
    (generate_body({"budget": 10 ** 6}), "budget"),
    (generate_body({"window": 1e12}), "window"),
    (generate_body({"window": 10 ** 12}), "window"),            # > the model's context length
    (generate_body({"max_interval": 10 ** 12}), "max_interval"),
    (generate_body({"dense_layers": [999]}), "dense_layers"),   # SmolLM2 has 30 layers
    (generate_body({"extra_boundaries": LONG_SPEC}), "extra_boundaries"),
    (generate_body(text=""), "text"),
    (generate_body(input_ids=[1, 2, 10 ** 8]), "input_ids"),     # >= the vocabulary size
    (generate_body(input_ids=[1, -1]), "input_ids"),
    # SGLang's own checks, kept by the package (a change in SGLang that loses one shows here)
    ('{"text": "Hello", "sampling_params": {', "JSON decode error"),   # invalid JSON
    ("[1, 2, 3]", "GenerateReqInput"),                                # not an object
    ({"text": 5, "sampling_params": {"max_new_tokens": 2}}, "text"),
    ({"text": "Hello", "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens"),
    ({"text": "Hello", "sampling_params": {"max_new_tokens": "four"}}, "four"),
    ({"text": "Hello", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"text": "Hello", "sampling_params": {"bogus_key": 1}}, "bogus_key"),
    (generate_body(input_ids=[100] * 9000), "context length"),       # SmolLM2: 8192 positions
    ({"input_ids": [100] * 8000, "sampling_params": {"max_new_tokens": 1000}}, "context length"),
    # structured generation: bad grammars, and bad SFI options beside good grammars
    ({"text": "Hello", "sampling_params": {"max_new_tokens": 2, "json_schema": "{not json"}}, "json"),
    ({"text": "Hello", "sampling_params": {"max_new_tokens": 2, "regex": "("}}, "regex"),
    ({"text": "Hello", "sampling_params": {"max_new_tokens": 2, "ebnf": "root ::= "}}, "ebnf"),
    ({"text": "Hello", "sampling_params": {"max_new_tokens": 2, "regex": "a+",
                                           "json_schema": '{"type": "string"}'}}, "Only one"),
    ({"text": "Hello", "sampling_params": {"max_new_tokens": 2, "json_schema": '{"type": "string"}',
                                           "custom_params": {"sfi": {"budget": -1}}}}, "budget"),
    ({"text": "Hello", "sampling_params": {"max_new_tokens": 2, "regex": "(yes|no)",
                                           "custom_params": {"sfi": {"extra_boundaries": "mark:"}}}},
     "extra_boundaries"),
    ({"text": "Hello", "sampling_params": {"max_new_tokens": 2, "ebnf": 'root ::= "yes" | "no"',
                                           "custom_params": {"sfi": {"window": 10 ** 12}}}}, "window"),
    # custom_params and its "sfi" entry must be JSON objects (SGLang itself takes any value;
    # a list or string used to be served with the request's SFI options silently dropped)
    ({"text": "Hello", "sampling_params": {"max_new_tokens": 2, "custom_params": [1, 2]}},
     '"custom_params" must be a JSON object, got an array'),
    ({"text": "Hello", "sampling_params": {"max_new_tokens": 2, "custom_params": "sfi"}},
     '"custom_params" must be a JSON object, got a string'),
    ({"text": "Hello", "sampling_params": {"max_new_tokens": 2, "custom_params": {"sfi": [128]}}},
     'custom_params["sfi"] must be a JSON object, got an array'),
]


@pytest.mark.parametrize("body, field", BAD_INPUTS, ids=[f"{i}-{f}" for i, (_, f) in enumerate(BAD_INPUTS)])
def test_bad_request_options_get_400_and_server_keeps_serving(server, body, field):
    """Each bad body gets a 400 whose message names the field (or the bad value), and the
    server keeps serving. A str body is sent as it is (raw JSON text)."""
    send = {"data": body, "headers": {**API, "Content-Type": "application/json"}} \
        if isinstance(body, str) else {"json": body, "headers": API}
    r = requests.post(server.url + "/generate", timeout=300, **send)
    assert r.status_code == 400, r.text
    error = r.json()
    assert field in (error["message"] if "message" in error else str(error["error"])), error
    sampling = body.get("sampling_params", {}) if isinstance(body, dict) else {}
    params = sampling.get("custom_params")
    sfi = params.get("sfi") if isinstance(params, dict) else None
    if sfi is not None:  # the same options through the OpenAI API
        r = requests.post(server.url + "/v1/chat/completions", json={
            "model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "custom_params": {"sfi": sfi}}, headers=API, timeout=300)
        assert r.status_code == 400, r.text
    assert requests.get(server.url + "/health", timeout=60).status_code == 200
    ok = requests.post(server.url + "/generate", json=generate_body(), headers=API, timeout=300)
    assert ok.status_code == 200, ok.text


def test_boundaries_post_over_the_spec_limit_gets_400(server):
    r = requests.post(server.url + "/sfi/boundaries", json={"boundaries": LONG_SPEC},
                      headers=ADMIN, timeout=60)
    assert r.status_code == 400 and "4096" in r.text, r.text


@pytest.mark.parametrize("key, admin_ok, normal_ok", [
    (None, False, False), ("wrong", False, False), (API_KEY, False, True), (ADMIN_KEY, True, False)])
def test_sfi_endpoints_follow_sglang_auth_levels(server, key, admin_ok, normal_ok):
    """POST /sfi/boundaries is an admin endpoint exactly like SGLang's /flush_cache (with
    --admin-api-key only the admin key opens it); GET /sfi/boundaries and /sfi/stats are
    normal endpoints like /generate (the API key)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    def allowed(method, path, **kw):
        r = requests.request(method, server.url + path, headers=headers, timeout=120, **kw)
        assert r.status_code in (200, 401), (method, path, r.status_code, r.text)
        return r.status_code == 200

    assert allowed("POST", "/flush_cache") == admin_ok
    assert allowed("POST", "/sfi/boundaries", json={"boundaries": "default"}) == admin_ok
    assert allowed("GET", "/sfi/boundaries") == normal_ok
    assert allowed("GET", "/sfi/stats") == normal_ok


def test_example_multi_turn_chat(server):
    out = subprocess.run([sys.executable, str(REPO / "examples" / "multi_turn_chat.py"), "--url", server.url,
                          "--api-key", API_KEY],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "turn 3" in out.stdout and "sfi:" in out.stdout
    reused = int(out.stdout.split("computed, ")[1].split(" reused")[0])
    assert reused >= 2  # turns 2 and 3 reuse the memory of the turn before


def test_example_frontend_program(server):
    out = subprocess.run([sys.executable, str(REPO / "examples" / "frontend_program.py"), "--url", server.url,
                          "--api-key", API_KEY],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "summary:" in out.stdout and "question:" in out.stdout


@pytest.mark.parametrize("args, fragment", [
    (["--sfi-budget", "-5"], "--sfi-budget"),
    (["--sfi-fusion", "median"], "--sfi-fusion"),
    (["--sfi-dense-layers", "a,b"], "--sfi-dense-layers"),
    (["--sfi-window", "x"], "--sfi-window"),
])
def test_bad_launch_options_exit_2_naming_the_option(args, fragment):
    out = subprocess.run([sfi_cli(), "serve", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert fragment in out.stderr
