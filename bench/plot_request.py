"""One real request, step by step: which decode steps were fast and which slow, and how many
positions each step's attention read (README's picture).

    python bench/plot_request.py [--budget 128 --window 64 --context 1500 --steps 160]
        -> bench/results/request_steps.{json,png}

Runs `sfi_sglang.Engine` on the embedded model (SmolLM2-135M, CPU engine): an essay prompt,
greedy decoding. A fast step at context t reads min(t, S + K + W + d) positions per layer and
KV head: sinks, selection, and the window, which grows by one token a step (d steps since
the last selection: the prompt's end, or the last slow step); a slow step reads all t
(dense, then the Selector). The slow
steps are the ones the request reports in meta_info["sfi"]["slow_at"] (decode step s makes
output token s), each labelled with the tokens that ended the sentence before it.
"""

from __future__ import annotations

import argparse
import json
import os


def run(args) -> dict:
    import sfi_sglang
    from sfi_sglang.texts import long_text

    engine = sfi_sglang.Engine(sfi_budget=args.budget, sfi_window=args.window, mem_fraction_static=0.1,
                               log_level="error")
    try:
        tok = engine.tokenizer_manager.tokenizer
        chat = [{"role": "user", "content": long_text(tok, args.context, start=3)
                 + "\n\nWhat are the main ideas of this essay? Answer in several sentences."}]
        prompt = tok.encode(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)
        out = engine.generate(input_ids=prompt, sampling_params={
            "temperature": 0, "max_new_tokens": args.steps})
    finally:
        engine.shutdown()
    sfi = out["meta_info"]["sfi"]
    ids = out["output_ids"]
    return dict(args=vars(args), prompt_tokens=len(prompt), sinks=sfi["sinks"], budget=sfi["budget"],
                window=sfi["window"], slow_at=sfi["slow_at"], fast_steps=sfi["fast_steps"],
                slow_steps=sfi["slow_steps"], tokens=[tok.decode([t]) for t in ids])


def plot(res: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n0, held = res["prompt_tokens"], res["sinks"] + res["window"] + res["budget"]
    steps = range(1, len(res["tokens"]))  # decode step s makes output token s
    slow = set(res["slow_at"])
    ctx = [n0 + s for s in steps]
    read, last = [], 0  # the step of the last selection (0: the prompt's end)
    for s, c in zip(steps, ctx):
        read.append(c if s in slow else min(c, held + s - last))
        last = s if s in slow else last
    fig, ax = plt.subplots(figsize=(11, 3.6))
    ax.plot(list(steps), ctx, color="0.5", lw=1, label="dense attention reads the whole context")
    ax.bar(list(steps), read, width=1.0, color=["tab:red" if s in slow else "tab:blue" for s in steps])
    handles = [ax.get_lines()[0],
               Patch(color="tab:blue", label=f"fast step: sinks + selection + window ({held} positions, "
                                             "+1 a step since the last selection)"),
               Patch(color="tab:red", label="slow step: dense, then the Selector makes the next selection")]
    for s in sorted(slow):  # the text before the slow step's input token, and that token
        before = "".join(res["tokens"][:s - 1])[-14:].replace("\n", "\u23ce")
        ax.annotate(f"{before}|{res['tokens'][s - 1].strip()}", (s, n0 + s), xytext=(0, 4),
                    textcoords="offset points", rotation=50, fontsize=7, ha="left")
    ax.set_xlabel("decode step")
    ax.set_ylabel("positions read per layer and KV head")
    ax.set_ylim(0, max(ctx) * 1.45)
    ax.set_title(f"One request on SmolLM2-135M (CPU engine): {res['fast_steps']} fast, "
                 f"{res['slow_steps']} slow steps; labels: the text before each slow step | its input token", fontsize=9)
    ax.legend(handles=handles, loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--context", type=int, default=1500, help="prompt tokens")
    p.add_argument("--steps", type=int, default=160, help="most tokens to generate (greedy, until the end of the answer)")
    p.add_argument("--out", default="bench/results/request_steps", help="writes OUT.json and OUT.png")
    p.add_argument("--from-json", help="redraw from a saved OUT.json without running the engine")
    args = p.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            res = json.load(f)
    else:
        res = run(args)
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump(res, f, indent=1)
    plot(res, args.out + ".png")
    print(f"{res['fast_steps']} fast, {res['slow_steps']} slow steps (at {res['slow_at']}); "
          f"wrote {args.out}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
