"""Two SFI workers behind the SGLang Model Gateway (`smg`, PyPI `smg`; `sglang-router` is its
older name), on loopback only. Launches both workers and the gateway with its cache-aware
policy, runs two multi-turn chats through the gateway's /generate and shows that each
chat's later turns went back to the worker holding its prefix (they reuse that worker's SFI
memory: meta_info["sfi"]["bootstrap_reused"]), then stops everything.

    pip install smg
    python examples/gateway.py                 # about 2 minutes on 2 CPU cores
    python examples/gateway.py --gateway URL --workers URL URL   # chats over a running fleet

The same by hand:

    sfi-sglang serve --host 127.0.0.1 --port 30001 &
    sfi-sglang serve --host 127.0.0.1 --port 30002 &
    smg launch --host 127.0.0.1 --port 30000 --policy cache_aware \\
        --prometheus-host 127.0.0.1 --prometheus-port 29000 \\
        --worker-urls http://127.0.0.1:30001 http://127.0.0.1:30002

(--sfi-* options as usual on each worker; /sfi/stats and /sfi/boundaries go to each
worker's own port, see README "Scaling out".)
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, path: str, timeout: float = 600) -> None:
    """GET path answers 200; for the gateway (path None) a one-token /generate does: its
    /health answers before the workers are registered."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            r = (requests.get(url + path, timeout=30) if path else requests.post(
                url + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}}, timeout=60))
            if r.status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(2)
    raise RuntimeError(f"{url}{path} not ready in {timeout}s")


def launch(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def tool(name: str) -> str:
    here = Path(sys.executable).with_name(name)
    return str(here) if here.exists() else (shutil.which(name) or name)


def chats(gateway: str, workers: list[str]) -> None:
    """Two three-turn chats through the gateway; how many bootstrap selections each worker
    reused from its radix cache meanwhile."""
    from transformers import AutoTokenizer

    from sfi_sglang.model import default_model_path
    from sfi_sglang.texts import long_text

    tok = AutoTokenizer.from_pretrained(default_model_path())
    before = [requests.get(w + "/sfi/stats").json()["bootstrap_reused"] for w in workers]
    essays = [long_text(tok, 300), long_text(tok, 300, start=5)]
    for chat, essay in enumerate(essays):
        messages = [{"role": "user", "content": f"Here is an essay:\n\n{essay}\n\nWhat is it about?"}]
        for turn, follow_up in enumerate(["Name one idea from it.", "Thanks."], start=1):
            prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            r = requests.post(gateway + "/generate", json={
                "text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 16}}, timeout=600)
            r.raise_for_status()
            out = r.json()
            sfi = out["meta_info"]["sfi"]
            print(f"chat {chat} turn {turn} on {r.headers.get('x-smg-routed-worker-id')}: "
                  f"bootstrap computed {sfi['bootstrap_computed']}, "
                  f"reused {sfi['bootstrap_reused']}: {out['text'].strip()!r}")
            messages += [{"role": "assistant", "content": out["text"]},
                         {"role": "user", "content": follow_up}]
    after = [requests.get(w + "/sfi/stats").json()["bootstrap_reused"] for w in workers]
    for w, b, a in zip(workers, before, after):
        print(f"{w}: {a - b} bootstrap selections reused from its radix cache")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sfi-budget", default="128")
    ap.add_argument("--sfi-window", default="64")
    ap.add_argument("--logs", default=os.environ.get("TMPDIR", "/tmp"))
    ap.add_argument("--gateway", help="a running gateway's URL (launch nothing)")
    ap.add_argument("--workers", nargs="*", default=[], help="with --gateway: its workers' URLs")
    args = ap.parse_args()
    if args.gateway:
        return chats(args.gateway, args.workers)
    procs = []
    try:
        workers = []
        for _ in range(2):
            port = free_port()
            procs.append(launch([tool("sfi-sglang"), "serve", "--host", "127.0.0.1", "--port", str(port),
                                 "--sfi-budget", args.sfi_budget, "--sfi-window", args.sfi_window,
                                 "--max-total-tokens", "16384"], Path(args.logs) / f"sfi-worker-{port}.log"))
            workers.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(workers, procs):
            wait_ready(url, proc, "/health_generate")
        port = free_port()
        gateway = f"http://127.0.0.1:{port}"
        procs.append(launch([tool("smg"), "launch", "--host", "127.0.0.1", "--port", str(port),
                             "--policy", "cache_aware", "--prometheus-host", "127.0.0.1",
                             "--prometheus-port", str(free_port()), "--worker-urls", *workers],
                            Path(args.logs) / f"smg-{port}.log"))
        wait_ready(gateway, procs[-1], None)
        print("workers:", workers, "gateway:", gateway)
        chats(gateway, workers)
    finally:
        for proc in reversed(procs):
            stop(proc)


if __name__ == "__main__":
    main()
