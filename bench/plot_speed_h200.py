"""Draw bench/results/speed_h200.json (bench/speed_h200.py): ms per decode step per engine
and row, with SFI's ideal bound; tokens/s of each engine at its own largest batch; and the
split sweep (us per layer of SGLang's triton decode against the cap
`--triton-attention-num-kv-splits`).

  python bench/plot_speed_h200.py [bench/results/speed_h200.json]   -> speed_h200.png beside it
  python bench/plot_speed_h200.py --merge OUT.json RUN.json...      -> OUT.json and OUT.png

--merge: one table from several device calls. Each row is copied whole from one call (a later
RUN.json wins a (context, batch) it shares with an earlier one) and names it in `source`, so
that every ratio in a row was measured in one run; `sweep` is the union, each entry with its
`source`. The runs must share `fused_ops` (how SGLang's fused ops ran: their torch forms, or
its JIT CUDA kernels; a run before the key was recorded ran "torch"): the non-attention part
of a step differs by ~3 ms between the two, so their rows do not go in one table.
"""

from __future__ import annotations

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

NAMES = {"dense": "dense, SGLang defaults (8 splits)", "dense-best": "dense, best split cap (sweep)",
         "dense-flashinfer": "dense, flashinfer", "sfi": "SFI, default flags of its run",
         "sfi-pool": "SFI, fast path reading the pool", "sfi-triton": "SFI, packed fast path", "sfi-fi": "SFI, dense passes on flashinfer",
         "sfi-below": "SFI, flashinfer, dense steps below the threshold",
         "sfi-pages": "SFI, whole pages of 16", "sfi-pool-pages": "SFI, pool read, whole pages of 16",
         "sfi-pool-autorows": "SFI, pool read, memory rows auto",
         "sfi-fipath-autorows": "SFI, flashinfer fast path, memory rows auto"}


def merge(out: str, runs: list[str]) -> str:
    rows, sweep, modes = {}, [], {}
    for path in runs:
        res = json.load(open(path))
        src = os.path.basename(path)
        modes[src] = res.get("fused_ops", "torch")
        if len(set(modes.values())) > 1:
            raise SystemExit(f"--merge: runs with different fused_ops ({modes}); merge each kind on its own")
        for r in res["rows"]:
            ms = r["step_ms"]
            sfi = {k: v for k, v in ms.items() if k.startswith("sfi")}
            dense = {k: v for k, v in ms.items() if k.startswith("dense")}
            if sfi and dense:
                extra = {}
                if r["batch"] != "max":  # each SFI engine against the row's best dense one
                    best = min(dense, key=dense.get)
                    extra = dict(best_dense=best, speedups={k: round(dense[best] / v, 3) for k, v in sfi.items()})
                rows[(r["context"], str(r["batch"]))] = dict(r, **extra, source=src, argv=res["argv"])
        sweep += [dict(s, source=src) for s in res["sweep"]]
    order = sorted(rows, key=lambda k: (k[0], k[1] == "max", int(k[1]) if k[1] != "max" else 0))
    with open(out, "w") as f:
        json.dump(dict(merged_from=[os.path.basename(p) for p in runs], shape=res["shape"], device=res.get("device"),
                       fused_ops=modes[src], slow_every=res["slow_every"], steps=res["steps"], rows=[rows[k] for k in order],
                       sweep=sweep), f, indent=1)
    return main(out)


def main(path: str = "bench/results/speed_h200.json") -> str:
    res = json.load(open(path))
    fig, (ax, cx, bx) = plt.subplots(1, 3, figsize=(18, 4.8), gridspec_kw=dict(width_ratios=[3, 1.2, 1.6]))
    top = [r for r in res["rows"] if r["batch"] == "max"]
    rows = [r for r in res["rows"] if r["batch"] != "max"]
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
    ax.set_xticklabels([f"{r['context'] // 1024}K x {r['batch']}\n{r.get('speedup') or max(r['speedups'].values())}x"
                        for r in rows], fontsize=8)
    ax.set_xlabel("context x batch, SFI's speed-up over the row's best dense server")
    ax.set_ylabel("ms per decode step")
    card = str(res.get("device") or "H200").replace("NVIDIA ", "")
    ops = {"torch": "fused ops in torch", "cuda": "fused ops as JIT kernels"}[res.get("fused_ops", "torch")]
    ax.set_title(f"SGLang 0.5.23, Qwen3-4B shape, {card}, {ops}; a row = one run", fontsize=10)
    ax.legend(fontsize=7)
    for i, e in enumerate(engines):
        xs = [j + i * width for j, r in enumerate(top) if e in r.get("tokens_per_s", {})]
        ys = [r["tokens_per_s"][e] for r in top if e in r.get("tokens_per_s", {})]
        bars = cx.bar(xs, ys, width, label=NAMES[e])
        cx.bar_label(bars, labels=[f"{y:.0f}\nB{r['batch_of'][e]}" for y, r in
                                   zip(ys, [r for r in top if e in r.get("tokens_per_s", {})])], fontsize=6)
    cx.set_xticks([j + width * (len(engines) - 1) / 2 for j in range(len(top))])
    cx.set_xticklabels([f"{r['context'] // 1024}K\n{r.get('throughput_ratio', '-')}x" for r in top], fontsize=8)
    cx.set_ylabel("tokens/s, each engine at its largest batch")
    cx.set_title("Largest batch that fits (B = batch)")
    for b, style in ((1, "-"), (5, ":"), (8, "--"), (20, "-.")):
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
    a = sys.argv[1:]
    print(merge(a[1], a[2:]) if a[:1] == ["--merge"] else main(*a))
