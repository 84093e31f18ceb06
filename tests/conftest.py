"""Shared helpers: real SGLang on the CPU engine with the embedded SmolLM2 model."""

from __future__ import annotations

import contextlib
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
# Every test server and Engine runs with these SGLang options:
# - its KV pool takes 8% of the machine's memory: SGLang's CPU engine takes 30% by default
#   (~7 GB here), and the shared server lives beside other modules' servers;
# - --sleep-on-idle: without it an idle SGLang scheduler polls its sockets in a busy loop, a
#   whole core each, and on CI's 2 cores the shared server took one of them from every
#   module after it; with it the scheduler blocks in zmq's poll until a request comes.
TEST_ENGINE_ARGS = {"mem_fraction_static": 0.08, "sleep_on_idle": True}


# test_kernels.py and test_memory.py set TRITON_INTERPRET=1 in this process when they are
# collected, so that their kernels run in Triton's interpreter on the CPU. The servers,
# engines and CLI runs the tests start must run as a user's CPU engine does (the torch path):
# they inherited the variable and ran SFI's Triton kernels interpreted on every layer (a
# 1,500-token prefill: 60-80 s in CI's server logs, 2.5 s without the variable).
def product_env() -> dict[str, str]:
    """This process's environment without TRITON_INTERPRET: for the product's subprocesses."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


@contextlib.contextmanager
def product_environ():
    """os.environ without TRITON_INTERPRET while an in-process Engine spawns its scheduler."""
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


def start_engine(**kwargs):
    """sfi_sglang.Engine(**kwargs) with TEST_ENGINE_ARGS, its processes on the torch path."""
    import sfi_sglang

    with product_environ():
        return sfi_sglang.Engine(**{**TEST_ENGINE_ARGS, **kwargs})


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
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"{log_name}-{self.port}.log"
        self.log = open(self.log_path, "w+")
        self.proc = subprocess.Popen([str(self.port) if a == "{port}" else a for a in cmd],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=product_env())
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if ready(self.url):
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.name} did not become healthy in {timeout}s ({self.log_path}):\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        """The log's last n characters; it is read from its path, so also after stop()."""
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError):  # its children, where they outlived it
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


class Server(Service):
    """`sfi-sglang serve ...`, healthy once /health_generate answers."""

    def __init__(self, *args: str, timeout: float = 600):
        if "--mem-fraction-static" not in args and "--max-total-tokens" not in args:
            args = (*args, "--mem-fraction-static", str(TEST_ENGINE_ARGS["mem_fraction_static"]))
        args = (*args, "--sleep-on-idle")
        super().__init__([sfi_cli(), "serve", "--host", "127.0.0.1", "--port", "{port}", *args],
                         lambda url: requests.get(url + "/health_generate", timeout=30).status_code == 200,
                         timeout, "sfi-serve")


RETRIED_STARTS: list[str] = []  # start_servers' first failures, printed by pytest_terminal_summary


def pytest_terminal_summary(terminalreporter):
    for msg in RETRIED_STARTS:
        terminalreporter.write_sep("-", "a server start failed once and was retried")
        terminalreporter.write_line(msg)


def start_servers(*arg_lists, timeout: float = 420) -> list[Server]:
    """One Server per argument list, started at once (together ~2.5 min on 2 cores). A server
    that does not start is started once more, its first error and log printed at the end of
    the run (a tp=2 server once never became healthy in CI, its log lost); if the second
    try fails too, the others are stopped and the error raised."""
    from concurrent.futures import ThreadPoolExecutor

    def start(args):
        try:
            return Server(*args, timeout=timeout)
        except RuntimeError as e:
            RETRIED_STARTS.append(f"{' '.join(args)}: {e}")
            return Server(*args, timeout=timeout)

    with ThreadPoolExecutor(len(arg_lists)) as pool:
        futures = [pool.submit(start, args) for args in arg_lists]
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
    test_server_boundaries): budget 256, window 64, the grammar backend sfi-xgrammar, SGLang's
    API keys. A module that changes the server-wide boundary table sets it back. The two
    modules' names sort next to each other, so that pytest runs them one after the other and
    the server does not idle beside the other modules' servers: it once died unseen (its log
    just stops) while test_parallel's tp=2 and dp=2 servers ran, about 22 of this machine's
    24 GB together, and every test of test_server failed."""
    srv = Server("--sfi-budget", "256", "--sfi-window", "64", "--grammar-backend", "sfi-xgrammar",
                 "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY)
    yield srv
    srv.stop()
