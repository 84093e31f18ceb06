"""Batch offline generation with sfi_sglang.Engine (sglang.Engine + SFI flags).

    python examples/batch_offline.py [--budget 256 --window 64]
"""

import argparse

import sfi_sglang
from sfi_sglang.texts import long_text


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--context-tokens", type=int, default=1500)
    args = ap.parse_args()

    engine = sfi_sglang.Engine(sfi_budget=args.budget, sfi_window=args.window)
    try:
        tok = engine.tokenizer_manager.tokenizer
        questions = ["What is this text about?", "Name one idea from the text.",
                     "Who might enjoy reading this?"]
        prompts = [tok.apply_chat_template(
            [{"role": "user", "content": long_text(tok, args.context_tokens, start=i) + "\n\n" + q}],
            tokenize=False, add_generation_prompt=True) for i, q in enumerate(questions)]
        outs = engine.generate(prompts, {"temperature": 0, "max_new_tokens": 48})
        for q, out in zip(questions, outs):
            sfi = out["meta_info"]["sfi"]
            print(f"Q: {q}\nA: {out['text'].strip()}\n"
                  f"sfi: {sfi['fast_steps']} fast / {sfi['slow_steps']} slow steps\n")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
