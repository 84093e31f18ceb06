"""Shared helpers: real SGLang on the CPU engine with the embedded SmolLM2 model."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

REPO = Path(__file__).resolve().parent.parent
GREEDY = {"temperature": 0.0}

# The shared server's keys (SGLang's --api-key / --admin-api-key): every request carries one.
API_KEY, ADMIN_KEY = "secret", "admin"
API = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
# SGLang's CPU engine sizes its KV pool as a fraction of the machine's memory (0.3 by default,
# ~7 GB here); test servers take less, since the shared server lives beside other modules' ones.
TEST_MEM_FRACTION = "0.08"


def sfi_cli() -> str:
    return str(Path(sys.executable).with_name("sfi-sglang"))


def chat_prompt(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """A server command in its own process group on a free loopback port (`{port}` in the
    command), its output in a log file; ready once `ready(url)` is true."""

    name = "server"

    def __init__(self, cmd: list[str], ready, timeout: float, log_name: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"{log_name}-{self.port}.log", "w+")
        self.proc = subprocess.Popen([str(self.port) if a == "{port}" else a for a in cmd],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if ready(self.url):
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        self.stop()
        raise RuntimeError(f"{self.name} did not become healthy in {timeout}s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-n:]

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


class Server(Service):
    """`sfi-sglang serve ...`, healthy once /health_generate answers."""

    def __init__(self, *args: str, timeout: float = 600):
        if "--mem-fraction-static" not in args and "--max-total-tokens" not in args:
            args = (*args, "--mem-fraction-static", TEST_MEM_FRACTION)
        super().__init__([sfi_cli(), "serve", "--host", "127.0.0.1", "--port", "{port}", *args],
                         lambda url: requests.get(url + "/health_generate", timeout=30).status_code == 200,
                         timeout, "sfi-serve")


def start_servers(*arg_lists) -> list[Server]:
    """One Server per argument list, started at once (each takes ~1 min on 2 cores); if one
    fails, the others are stopped and the error raised."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(arg_lists)) as pool:
        futures = [pool.submit(Server, *args) for args in arg_lists]
        try:
            return [f.result() for f in futures]
        except Exception:
            for f in futures:
                if f.exception() is None:
                    f.result().stop()
            raise


@pytest.fixture(scope="session")
def model_path() -> str:
    from sfi_sglang.model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="session")
def shared_server():
    """One `sfi-sglang serve` for the modules that need nothing else (test_server,
    test_boundaries_zmq): budget 256, window 64, the grammar backend sfi-xgrammar, SGLang's
    API keys. A module that changes the server-wide boundary table sets it back."""
    srv = Server("--sfi-budget", "256", "--sfi-window", "64", "--grammar-backend", "sfi-xgrammar",
                 "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY)
    yield srv
    srv.stop()
