"""`sfi-sglang serve` over real HTTP: SGLang's /generate and OpenAI API with SFI, bad
input answered with 400 while the server keeps serving, and the examples against it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import requests

from conftest import REPO, Server, sfi_cli


@pytest.fixture(scope="module")
def server():
    srv = Server("--sfi-budget", "256", "--sfi-window", "64")
    yield srv
    srv.stop()


def test_generate_endpoint_reports_sfi(server):
    r = requests.post(server.url + "/generate", json={
        "text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 12}},
        timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    assert "Paris" in body["text"]
    sfi = body["meta_info"]["sfi"]
    assert sfi["bootstrap"] and sfi["fast_steps"] + sfi["slow_steps"] == 11


def test_openai_chat_with_per_request_options(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    out = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=16, extra_body={"custom_params": {"sfi": {"budget": 128}}})
    assert "Paris" in out.choices[0].message.content


@pytest.mark.parametrize("sfi", [{"budget": 0}, {"window": "wide"}, {"bogus": 1}, {"budget": 10 ** 6}])
def test_bad_request_options_get_400_and_server_keeps_serving(server, sfi):
    r = requests.post(server.url + "/generate", json={
        "text": "Hello", "sampling_params": {"max_new_tokens": 2, "custom_params": {"sfi": sfi}}},
        timeout=300)
    assert r.status_code == 400, r.text
    assert "sfi" in r.text.lower()  # the message names SFI and the bad option
    r = requests.post(server.url + "/v1/chat/completions", json={
        "model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        "custom_params": {"sfi": sfi}}, timeout=300)
    assert r.status_code == 400, r.text
    ok = requests.post(server.url + "/generate", json={
        "text": "Hello", "sampling_params": {"max_new_tokens": 2}}, timeout=300)
    assert ok.status_code == 200


def test_example_multi_turn_chat(server):
    out = subprocess.run([sys.executable, str(REPO / "examples" / "multi_turn_chat.py"), "--url", server.url],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "turn 3" in out.stdout and "sfi:" in out.stdout
    reused = int(out.stdout.split("computed, ")[1].split(" reused")[0])
    assert reused >= 2  # turns 2 and 3 reuse the memory of the turn before


def test_example_frontend_program(server):
    out = subprocess.run([sys.executable, str(REPO / "examples" / "frontend_program.py"), "--url", server.url],
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
