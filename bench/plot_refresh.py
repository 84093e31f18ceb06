"""Merge the graphed harness's runs at several refresh intervals (bench/steps_h200.sh
refresh: refresh_h200_every{K}.json) into one JSON and plot the speedup against the
slow-step interval, one line per context x batch.

    python bench/plot_refresh.py DIR [--out bench/results/refresh_h200]
"""

import argparse
import glob
import json
import os
import re


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--out", default="bench/results/refresh_h200")
    args = ap.parse_args()
    runs = {}
    for path in glob.glob(os.path.join(args.dir, "refresh_h200_every*.json")):
        k = int(re.search(r"every(\d+)\.json$", path).group(1))
        runs[k] = json.load(open(path))
    ks = sorted(runs)
    first = runs[ks[0]]
    curve = {}
    for k in ks:
        for r in runs[k]["rows"]:
            curve.setdefault(f"{r['context']}x{r['batch']}", []).append(
                {"slow_every": k, "speedup": r["speedup"], "ideal_speedup": r["ideal_speedup"],
                 "slow_rate": r["slow_rate"], "dense_step_ms": r["dense_step_ms"],
                 "sfi_step_ms": r["sfi_step_ms"], "slow_step_over_dense": r.get("slow_step_over_dense"),
                 "fast_step_over_dense": r.get("fast_step_over_dense")})
    out = {"shape": first["shape"], "device": first["device"], "config": first["config"],
           "cuda_graphs": first["cuda_graphs"], "slow_every": ks, "curve": curve}
    with open(args.out + ".json", "w") as f:
        json.dump(out, f, indent=1)
    print(f"{'config':>10} " + " ".join(f"{'1/' + str(k):>7}" for k in ks))
    for name, pts in curve.items():
        print(f"{name:>10} " + " ".join(f"{p['speedup']:7.2f}" for p in pts))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, pts in curve.items():
        ax.plot([p["slow_every"] for p in pts], [p["speedup"] for p in pts], "o-", label=name)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", xticks=ks, xticklabels=[f"1/{k}" for k in ks],
           xlabel="slow steps per token", ylabel="decode tokens/s, SFI / dense",
           title=f"{out['shape']} ({out['device']}), CUDA graphs: price of refresh")
    ax.legend(title="context x batch", fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=120)
    print(f"wrote {args.out}.json, {args.out}.png")


if __name__ == "__main__":
    main()
