"""Plot bench/sglang_h200.py's JSON: decode step time (ms) against context (log2 axis) for
each engine, one line per batch kind (batch 1, and the configuration's batch), and below
it the ratio dense_ms / sfi_ms (> 1: SFI is faster).

  python bench/plot_sglang_h200.py bench/results/sglang_h200.json [-o out.png]
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def series(res: dict) -> dict:
    """{(engine, kind): [(context, batch, step_ms)]}, kind "batch 1" or "batch B"."""
    best = {}  # the largest batch measured at each context
    for r in res["rows"]:
        best[r["context"]] = max(best.get(r["context"], 0), r["batch"])
    out: dict = {}
    for r in sorted(res["rows"], key=lambda r: (r["context"], r["batch"])):
        kinds = (["batch 1"] if r["batch"] == 1 else []) + (["batch B"] if r["batch"] == best[r["context"]] else [])
        for engine, ms in r["step_ms"].items():
            for kind in kinds:
                out.setdefault((engine, kind), []).append((r["context"], r["batch"], ms))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json", nargs="?", default="bench/results/sglang_h200.json")
    p.add_argument("-o", "--out", default="", help="PNG (default: the JSON's name with .png)")
    args = p.parse_args(argv)
    with open(args.json) as f:
        res = json.load(f)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = series(res)
    engines = [e for e in res.get("engines", []) if any(k[0] == e for k in data)] or sorted({k[0] for k in data})
    colors = {e: f"C{i}" for i, e in enumerate(engines)}
    styles = {"batch 1": "o--", "batch B": "s-"}
    fig, (ax, axr) = plt.subplots(2, 1, figsize=(8, 8), sharex=True, gridspec_kw=dict(height_ratios=[3, 2]))
    for (engine, kind), pts in sorted(data.items(), key=lambda kv: (engines.index(kv[0][0]), kv[0][1])):
        xs, bs, ys = zip(*pts)
        ax.plot(xs, ys, styles[kind], color=colors[engine], label=f"{engine}, {kind}")
        if kind == "batch B":
            for x, b, y in pts:
                ax.annotate(f"B={b}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8,
                            color=colors[engine])
    ax.set_xscale("log", base=2)
    ax.set_ylabel("decode step (ms)")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"SGLang 0.5.23, {res.get('shape', '')}: dense vs SFI "
                 f"({res.get('steps', '?')} steps, slow step every {res.get('slow_every', '?')})", fontsize=10)
    # ratio dense / sfi per dense engine and batch kind
    best = {}
    for r in res["rows"]:
        best[r["context"]] = max(best.get(r["context"], 0), r["batch"])
    ratios: dict = {}
    for r in sorted(res["rows"], key=lambda r: r["context"]):
        for dense, v in (r.get("ratio") or {}).items():
            if r["batch"] == 1:
                ratios.setdefault((dense, "batch 1"), []).append((r["context"], v))
            if r["batch"] == best[r["context"]]:
                ratios.setdefault((dense, "batch B"), []).append((r["context"], v))
    for (dense, kind), pts in sorted(ratios.items()):
        xs, ys = zip(*pts)
        axr.plot(xs, ys, styles[kind], color=colors.get(dense, "k"), label=f"{dense} / sfi, {kind}")
    axr.axhline(1.0, color="k", lw=0.8)
    axr.set_xscale("log", base=2)
    axr.set_xlabel("context (tokens)")
    axr.set_ylabel("dense ms / SFI ms")
    axr.grid(True, which="both", alpha=0.3)
    if ratios:
        axr.legend(fontsize=8)
    fig.tight_layout()
    out = args.out or os.path.splitext(args.json)[0] + ".png"
    fig.savefig(out, dpi=120)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
