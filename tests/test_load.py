"""bench/load.py's bookkeeping, without a server: stream parsing, accounting, the equality check."""

import importlib.util
import json

from conftest import REPO

spec = importlib.util.spec_from_file_location("load", REPO / "bench" / "load.py")
load = importlib.util.module_from_spec(spec)
spec.loader.exec_module(load)


def _chunk(text, n, finish=None, slow_at=()):
    meta = {"completion_tokens": n, "prompt_tokens": 5, "finish_reason": finish,
            "sfi": {"enabled": True, "slow_at": list(slow_at)}}
    return "data: " + json.dumps({"text": text, "meta_info": meta})


def test_stream_records_tokens_ttft_itl_and_a_missing_end():
    s = load.Stream("equality", "/generate", t0=0.0)
    s.chunk(1.0, _chunk("a", 1))
    s.chunk(1.5, _chunk("ab", 3))  # two tokens in one chunk: ITL per token
    s.chunk(2.0, _chunk("abc", 4, {"type": "length"}, slow_at=[2]))
    s.chunk(2.0, "data: [DONE]")
    rec = s.close(2.5)
    assert rec["status"] == "ok" and rec["text"] == "abc" and rec["completion_tokens"] == 4
    assert rec["ttft_s"] == 1.0 and rec["itl_s"] == [0.25, 0.5] and rec["slow_at"] == [2]
    s = load.Stream("long", "/generate", t0=0.0)
    s.chunk(1.0, _chunk("a", 1))
    rec = s.close(1.0)
    assert rec["status"] == "error" and "without [DONE]" in rec["reason"]


def test_failed_chat_turn_accounts_for_the_rest_of_the_conversation():
    def send(path, body, kind):
        return {**load.skipped(kind, "HTTP 500: boom"), "path": path}

    records = load.drive_sync(load.chat_job("Paris", 3, 4), send)
    assert len(records) == 3 and all(r["status"] == "error" for r in records)
    assert records[0]["reason"] == "HTTP 500: boom"
    assert records[2]["reason"] == "an earlier turn of the conversation failed"


def test_equality_flags_a_different_text_or_slow_step():
    ok = lambda text, slow: {"status": "ok", "text": text, "slow_at": slow}  # noqa: E731
    same = load.equality([ok("abc", [3])], [ok("abc", [3])])
    assert same["all_same"] and same["compared"] == 1
    text = load.equality([ok("abc", [3])], [ok("abd", [3])])
    assert not text["all_same"] and text["rows"][0]["first_diff_char"] == 2
    slow = load.equality([ok("abc", [3])], [ok("abc", [4])])
    assert not slow["all_same"] and slow["rows"][0]["same_slow_at"] is False
    failed = load.equality([ok("abc", [])], [load.skipped("equality", "timeout")])
    assert not failed["all_same"]
