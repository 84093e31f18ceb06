"""Draw bench/results/speed_h200.json (bench/speed_h200.py): ms per decode step per engine
and row, with SFI's ideal bound, and the split sweep (us per layer of SGLang's triton decode
against the cap `--triton-attention-num-kv-splits`, batch 1 and 8).

  python bench/plot_speed_h200.py [bench/results/speed_h200.json]   -> speed_h200.png beside it
"""

from __future__ import annotations

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

NAMES = {"dense": "dense, SGLang defaults (8 splits)", "dense-best": "dense, best split cap (sweep)",
         "dense-flashinfer": "dense, flashinfer", "sfi": "SFI as shipped"}


def main(path: str = "bench/results/speed_h200.json") -> str:
    res = json.load(open(path))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8))
    rows = res["rows"]
    engines = [e for e in NAMES if any(e in r["step_ms"] for r in rows)]
    width = 0.8 / (len(engines) + 1)
    for i, e in enumerate(engines):
        xs = [j + i * width for j, r in enumerate(rows) if e in r["step_ms"]]
        ys = [r["step_ms"][e] for r in rows if e in r["step_ms"]]
        bars = ax.bar(xs, ys, width, label=NAMES[e])
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    xs = [j + len(engines) * width for j, r in enumerate(rows) if "ideal" in r]
    ax.bar(xs, [r["ideal"]["sfi_ms"] for r in rows if "ideal" in r], width, color="none",
           edgecolor="k", hatch="//", label="SFI's ideal (HBM floor)")
    ax.set_xticks([j + width * len(engines) / 2 for j in range(len(rows))])
    ax.set_xticklabels([f"{r['context'] // 1024}K x {r['batch']}\n{r.get('speedup', '-')}x vs best dense"
                        for r in rows], fontsize=8)
    ax.set_ylabel("ms per decode step")
    ax.set_title("Real SGLang 0.5.23, Qwen3-4B shape, H200 (one run)")
    ax.legend(fontsize=7)
    for b, style in ((1, "-"), (8, "--")):
        for n in sorted({s["context"] for s in res["sweep"]}):
            pts = [(s["cap"], s["us"]) for s in res["sweep"] if s["context"] == n and s["batch"] == b]
            if pts:
                bx.plot(*zip(*pts), style, marker="o", label=f"{n // 1024}K, batch {b}")
    bx.set_xscale("log", base=2)
    bx.set_yscale("log")
    bx.set_xlabel("--triton-attention-num-kv-splits (the cap)")
    bx.set_ylabel("us per layer, SGLang's triton decode")
    bx.set_title("The split sweep (SGLang's kernel and heuristic)")
    bx.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    print(main(*sys.argv[1:]))
