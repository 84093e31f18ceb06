"""Paired differences of a quality result's methods against one of them, text by text, and
the speed price of each SFI row at its measured slow-step rate.

`sfi-sglang eval quality` gives each method's interval on its own; two methods scored on the
same texts are compared more sharply by the per-text difference (the text is the unit, as in
the eval's own intervals). For each context and retention: method minus `--against` in mean
KL and top-1 agreement, with the 95% t-interval over the texts both scored.

`--price`: the graphed harness's refresh curve (bench/plot_refresh.py's JSON): per shape, a
least-squares line of SFI's step time against the slow-step rate through its measured rates,
read at each SFI row's rate of `--price-context`; adaptive rows add the trigger signal's cost,
adaptive minus interval step time of bench/adaptive_h200.sh's two JSONs (`--signal`), where
that shape was measured.

`--by-age METHOD`: each method's KL by steps since METHOD's last slow step, over the same
steps of each text (results whose rows carry `kl_steps` and `slow_at`): whether a held
selection goes stale between refreshes.
  python bench/paired_quality.py bench/results/quality_h200.json --against quest \
      --price bench/results/refresh_h200.json > bench/results/quality_h200_paired.md
"""

from __future__ import annotations

import argparse
import json

from sfi_sglang.eval_stats import mean_ci, summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", nargs="+", help="JSONs written by `sfi-sglang eval quality` (several: runs "
                    "on the same texts, whose rows are paired by each text's source and start)")
    ap.add_argument("--against", default="quest", help="the reference method")
    ap.add_argument("--by-age", metavar="METHOD", help="also each method's mean KL by steps since "
                    "METHOD's last slow step, over the same steps of each text (rows with kl_steps)")
    ap.add_argument("--price", help="a refresh curve JSON (bench/plot_refresh.py)")
    ap.add_argument("--price-context", type=int, default=8000)
    ap.add_argument("--signal", nargs=2, metavar=("INTERVAL", "ADAPTIVE"),
                    default=["bench/results/adaptive_h200_interval.json",
                             "bench/results/adaptive_h200_adaptive.json"])
    args = ap.parse_args()
    rows = [r for path in args.result for r in json.load(open(path))["rows"]]
    by: dict[tuple, dict] = {}
    for r in rows:
        if r["kind"] == "teacher_forced":
            by.setdefault((r["context"], r["retention"], r["method"]), {})[(r["source"], r["start"])] = r

    def ci(values, scale=1.0, fmt="+.4f"):
        m, lo, hi = mean_ci(values)
        return f"{m * scale:{fmt}}" + ("" if lo is None else f" [{lo * scale:{fmt}}, {hi * scale:{fmt}}]")

    print(f"| context | retention | method | texts | mean KL - {args.against}'s (nat) [95% CI] "
          f"| top-1 - {args.against}'s (points) [95% CI] |")
    print("|---|---|---|---|---|---|")
    for (ctx, ret, m), texts in sorted(by.items()):
        ref = by.get((ctx, ret, args.against))
        if ref is None or m == args.against:
            continue
        common = sorted(set(texts) & set(ref))
        if not common:
            continue
        dkl = [texts[t]["mean_kl"] - ref[t]["mean_kl"] for t in common]
        dtop = [texts[t]["top1_agreement"] - ref[t]["top1_agreement"] for t in common]
        print(f"| {ctx} | {ret:.0%} | {m} | {len(common)} | {ci(dkl)} | {ci(dtop, 100, '+.1f')} |")
    print("\nIntervals: 95% Student t-interval over the per-text differences (text = unit).")
    equal_reads(by, args.against, ci)
    if args.by_age:
        by_age(by, args.by_age, ci)
    if args.price:
        price(rows, args)


def equal_reads(by: dict, against: str, ci) -> None:
    """Each method against `against` at the same bytes read per step: per text, the
    reference's mean KL and top-1 at the method's reads (eval.read_fraction), interpolated
    linearly between the reference's retentions on that text; n/a outside their range."""
    lines = []
    for (ctx, ret, m), texts in sorted(by.items()):
        if m == against or "read" not in next(iter(texts.values())):
            continue
        refs = sorted((r for (c, _, mm), r in by.items() if c == ctx and mm == against),
                      key=lambda r: next(iter(r.values()))["read"])
        dkl, dtop = [], []
        for t, row in texts.items():
            pts = [r[t] for r in refs if t in r]
            lo = next((a for a, b in zip(pts, pts[1:]) if a["read"] <= row["read"] <= b["read"]), None)
            if lo is None:
                continue
            hi = pts[pts.index(lo) + 1]
            f = (row["read"] - lo["read"]) / ((hi["read"] - lo["read"]) or 1.0)
            dkl.append(row["mean_kl"] - (lo["mean_kl"] + f * (hi["mean_kl"] - lo["mean_kl"])))
            dtop.append(row["top1_agreement"] - (lo["top1_agreement"] + f * (hi["top1_agreement"]
                                                                             - lo["top1_agreement"])))
        reads = sum(r["read"] for r in texts.values()) / len(texts)
        cells = (f"{len(dkl)} | {ci(dkl)} | {ci(dtop, 100, '+.1f')}" if dkl
                 else f"0 | n/a: outside {against}'s reads | ")
        lines.append(f"| {ctx} | {ret:.0%} | {m} | {reads:.1%} | {cells} |")
    if lines:
        print(f"\nAt equal reads: {against} interpolated, text by text, between its retentions to each"
              " row's bytes read per step (eval.read_fraction):\n")
        print(f"| context | retention | method | reads vs dense | texts | mean KL - {against}'s (nat) [95% CI] "
              f"| top-1 - {against}'s (points) [95% CI] |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(lines))


AGE_BUCKETS = ((1, 4), (5, 9), (10, 19), (20, 10**9))


def by_age(by: dict, clock: str, ci) -> None:
    """KL by steps since the last slow step of `clock` (a method's rows, with `kl_steps` and
    `slow_at`): per text, the step's age is its distance to clock's latest slow step at or
    before it (steps before the first one count from prefill's end, step 0); every method's
    KL is averaged over the same steps of the text, then over texts (95% t-interval). Decode
    step s is kl_steps[s - 1]."""
    lines = []
    for (ctx, ret, m), texts in sorted(by.items()):
        ref = by.get((ctx, ret, clock))
        if ref is None or "kl_steps" not in next(iter(texts.values())):
            continue
        cells = []
        for lo, hi in AGE_BUCKETS:
            means = []
            for t, row in texts.items():
                if t not in ref:
                    continue
                slow = sorted(ref[t].get("slow_at", []))
                ks = [row["kl_steps"][s - 1] for s in range(1, len(row["kl_steps"]) + 1)
                      if lo <= s - max([0] + [x for x in slow if x <= s]) <= hi]
                if ks:
                    means.append(sum(ks) / len(ks))
            cells.append(ci(means, fmt=".4f") if means else "n/a")
        lines.append(f"| {ctx} | {ret:.0%} | {m} | " + " | ".join(cells) + " |")
    if lines:
        print(f"\nMean KL (nat) by steps since {clock}'s last slow step (age 0: the slow step itself, "
              "left out), over the same steps of each text, 95% t-interval over texts:\n")
        print("| context | retention | method | " + " | ".join(
            f"age {lo}-{hi}" if hi < 10**9 else f"age {lo}+" for lo, hi in AGE_BUCKETS) + " |")
        print("|---|---|---|" + "---:|" * len(AGE_BUCKETS))
        print("\n".join(lines))


def price(rows: list[dict], args) -> None:
    rates = {g["method"]: g["slow_rate"] for g in summary(rows)["teacher_forced"]
             if g["context"] == args.price_context and g["method"].startswith("sfi")}
    interval, adaptive = ({(r["context"], r["batch"]): r["sfi_step_ms"] for r in json.load(open(f))["rows"]}
                          for f in args.signal)
    signal = {f"{c}x{b}": adaptive[c, b] - interval[c, b] for c, b in interval if (c, b) in adaptive}
    methods = sorted(rates, key=rates.get)
    print(f"\nSFI / dense decode tokens/s at each SFI row's slow-step rate (context {args.price_context}):\n")
    print("| shape | step ms = a + b r | " + " | ".join(f"{m} (1/{1 / rates[m]:.0f})" for m in methods) + " |")
    print("|---|---|" + "---:|" * len(methods))
    for shape, pts in json.load(open(args.price))["curve"].items():
        xs, ys = [p["slow_rate"] for p in pts], [p["sfi_step_ms"] for p in pts]
        dense = sum(p["dense_step_ms"] for p in pts) / len(pts)
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        a = my - b * mx
        cells = [dense / (a + b * rates[m] + (signal.get(shape, 0.0) if "adaptive" in m else 0.0))
                 for m in methods]
        print(f"| {shape} | {a:.2f} + {b:.2f} r | " + " | ".join(f"{c:.2f}x" for c in cells) + " |")
    print("\nAdaptive rows add the signal's cost (ms per step): "
          + ", ".join(f"{k} {v:+.3f}" for k, v in signal.items()) + "; none where not measured.")


if __name__ == "__main__":
    main()
