"""A multi-turn chat client (OpenAI API) against `sfi-sglang serve`.

    sfi-sglang serve --port 30000 &
    python examples/multi_turn_chat.py --url http://127.0.0.1:30000

(--api-key KEY when the server was launched with --api-key.)
"""

import argparse

import requests
from openai import OpenAI
from transformers import AutoTokenizer

from sfi_sglang.model import default_model_path
from sfi_sglang.texts import long_text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--context-tokens", type=int, default=800)
    ap.add_argument("--api-key", default=None, help="the server's --api-key, if any")
    args = ap.parse_args()
    client = OpenAI(base_url=args.url + "/v1", api_key=args.api_key or "none")
    auth = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    before = requests.get(args.url + "/sfi/stats", headers=auth).json()
    messages = []
    essay = long_text(AutoTokenizer.from_pretrained(default_model_path()), args.context_tokens)
    for turn, text in enumerate([f"Here is an essay:\n\n{essay}\n\nWhat is it about?",
                                 "Name one idea from it.",
                                 "Thanks. Summarise our chat in one sentence."], start=1):
        messages.append({"role": "user", "content": text})
        reply = client.chat.completions.create(model="default", messages=messages, temperature=0,
                                               max_tokens=48)
        answer = reply.choices[0].message.content
        messages.append({"role": "assistant", "content": answer})
        print(f"turn {turn}\nuser: {text}\nassistant: {answer.strip()}")
    # SGLang's native API carries SFI's counters in meta_info.
    r = requests.post(args.url + "/generate", json={
        "text": "One more: what is 2+2?", "sampling_params": {"temperature": 0, "max_new_tokens": 8}},
        headers=auth)
    r.raise_for_status()
    print("sfi:", r.json()["meta_info"].get("sfi"))
    # Each turn's prompt extends the previous one: later turns start from the memory the
    # radix cache kept for the earlier turn instead of a new bootstrap selection.
    after = requests.get(args.url + "/sfi/stats", headers=auth).json()
    print(f"bootstrap selections in this chat: "
          f"{after['bootstrap_computed'] - before['bootstrap_computed']} computed, "
          f"{after['bootstrap_reused'] - before['bootstrap_reused']} reused")


if __name__ == "__main__":
    main()
