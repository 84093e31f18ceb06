#!/usr/bin/env bash
# Refactor check on the H200: one real-SGLang row (32K context, batch 8; bench/sglang_h200.py
# also times batch 1 at that context) re-measured in ONE device call with the OLD code (a
# snapshot of a commit in the ignored folder .old) and the NEW code (the working tree),
# alternating old/new/old/new, so that old - new can be judged against the repeat-to-repeat
# noise; dense-graph once as context; optionally the graph check of the new tree.
#
# Here (once):  PYTHON=.venv/bin/python bash bench/sglang_h200.sh pack      # .sgl/ (ignored)
#               echo /.old/ >> .git/info/exclude; mkdir -p .old
#               git archive <OLD_COMMIT> sfi_sglang kernels router bench | tar -x -C .old
# Device:       run(command="bash bench/refactor_h200.sh", carry=[".sgl", ".old"], timeout_s=420)
#
# Each tree gets its own layout, laid out by its own bench/layout.sh (sfi_site): /root/site_old
# from .old, /root/site_new from the working tree; /root/site holds SGLang and its
# dependencies (unpack_site), the sfi-sglang dist-info (plugin entry point) and the
# sitecustomize start-up hook (setup_sfi), and no sfi_sglang of its own (removed after
# setup_sfi). A run of tree T has PYTHONPATH=/root/site_T:/root/site:.sgl/nh (the checkout's
# root is not on it), runs T's own bench/sglang_h200.py, and records which sfi_sglang it
# imported and a hash of that layout.
#
# Environment (all optional):
#   REFACTOR_PLAN      runs in order, TREE:ENGINE, space-separated
#                      (default "old:sfi new:sfi old:sfi new:sfi new:dense-graph")
#   REFACTOR_CONFIG    CONTEXTxBATCH (default 32768x8)    REFACTOR_STEPS  timed steps (48)
#   REFACTOR_BUDGET_S  the script's own deadline in s from its start (default 395): a run is
#                      skipped when the last run's time + 10 % (120 s before any) no longer
#                      fits, and each run is killed at the deadline, so the summary is written
#   REFACTOR_GRAPH_CHECK=0  skip `bench/graph_check_h200.py` (new tree; run only if >= 75 s left)
#   REFACTOR_OLD       the old tree (default .old)
#   REFACTOR_ARGS      more bench/sglang_h200.py options, e.g. "--mem-fraction 0.7" (CPU smoke
#                      test: REFACTOR_ARGS="--shape tiny" REFACTOR_CONFIG=256x2)
# Output ($OUT, default /tmp/refactor_out; at most 8 files come back from a device call, so
# the per-run folders stay in /tmp/refactor_runs and their JSONs are embedded in the summary):
#   refactor_h200.json  per run: tree, engine, repeat, rc, wall_s, step_ms (batch 8 and 1),
#                       the sfi_sglang imported; per (tree, engine) the mean/min/max; new/old
#                       ratios; the full sglang_h200.json of each run; the graph check's result
#   refactor_h200.log   everything printed
#   graph_check/graph_check_h200.json
set -uo pipefail
T0=$(date +%s)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD
OUT=${OUT:-/tmp/refactor_out}
RUNS=${REFACTOR_RUNS:-/tmp/refactor_runs}
PLAN=${REFACTOR_PLAN:-old:sfi new:sfi old:sfi new:sfi new:dense-graph}
CONFIG=${REFACTOR_CONFIG:-32768x8}
STEPS=${REFACTOR_STEPS:-48}
BUDGET=${REFACTOR_BUDGET_S:-395}
OLD=${REFACTOR_OLD:-.old}
mkdir -p "$OUT" "$RUNS"

elapsed() { echo $(( $(date +%s) - T0 )); }

wait_gpu_free() {  # the last run's scheduler processes may still hold memory
  local i used
  for i in $(seq 30); do
    used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | sort -n | tail -1)
    [ -z "$used" ] || [ "$used" -lt 4096 ] && return 0
    sleep 1
  done
  echo "[refactor] GPU still holds ${used} MiB" >&2
}

summarize() {
  PYTHONPATH= python3 - "$RUNS" "$OUT" "$CONFIG" "$STEPS" "$PLAN" "$(elapsed)" <<'PY'
import json, os, sys, statistics as st
runs_dir, out, config, steps, plan, el = sys.argv[1:]
n, b = (int(x) for x in config.split("x"))
meta_path = os.path.join(runs_dir, "runs.jsonl")
runs = [json.loads(l) for l in open(meta_path)] if os.path.exists(meta_path) else []
for r in runs:
    p = os.path.join(r["dir"], "sglang_h200.json")
    r["step_ms"], r["step_ms_b1"] = None, None
    if os.path.exists(p):
        raw = json.load(open(p))
        r["raw"] = raw
        for row in raw.get("rows", []):
            if row["context"] == n and r["engine"] in row["step_ms"]:
                key = "step_ms" if row["batch"] == b else "step_ms_b1" if row["batch"] == 1 else None
                if key:
                    r[key] = row["step_ms"][r["engine"]]
        for info in raw.get("runs", []):
            if info.get("engine") == r["engine"]:
                r["startup_s"], r["prefill_s"] = info.get("startup_s"), info.get("prefill_s")
agg = {}
for r in runs:
    for key in ("step_ms", "step_ms_b1"):
        if r.get(key) is not None:
            agg.setdefault(f"{r['tree']}:{r['engine']}", {}).setdefault(key, []).append(r[key])
stats = {k: {key: dict(values=v, mean=round(st.mean(v), 3), min=min(v), max=max(v),
                       spread_pct=round(100 * (max(v) - min(v)) / st.mean(v), 2))
             for key, v in d.items()} for k, d in agg.items()}
ratio = {}
for key in ("step_ms", "step_ms_b1"):
    o, w = stats.get("old:sfi", {}).get(key), stats.get("new:sfi", {}).get(key)
    if o and w:
        ratio[key] = dict(new_over_old=round(w["mean"] / o["mean"], 4),
                          diff_pct=round(100 * (w["mean"] - o["mean"]) / o["mean"], 2),
                          repeat_spread_pct=max(o["spread_pct"], w["spread_pct"]))
gc = None
gp = os.path.join(out, "graph_check", "graph_check_h200.json")
if os.path.exists(gp):
    gc = json.load(open(gp))
res = dict(config=config, steps=int(steps), plan=plan.split(), script_elapsed_s=int(el),
           summary=[{k: r.get(k) for k in ("tag", "tree", "engine", "repeat", "rc", "wall_s",
                                           "step_ms", "step_ms_b1", "startup_s", "prefill_s",
                                           "sfi_sglang", "layout_sha256")} for r in runs],
           stats=stats, new_vs_old_sfi=ratio, graph_check=gc, runs=runs)
with open(os.path.join(out, "refactor_h200.json.tmp"), "w") as f:
    json.dump(res, f, indent=1)
os.replace(os.path.join(out, "refactor_h200.json.tmp"), os.path.join(out, "refactor_h200.json"))
print("[refactor] SUMMARY " + json.dumps(dict(summary=res["summary"], new_vs_old_sfi=ratio)))
PY
}

main() {
  echo "[refactor] plan: $PLAN; config $CONFIG, steps $STEPS, budget ${BUDGET} s; old tree $OLD"
  [ -d "$OLD/sfi_sglang" ] && [ -f "$OLD/bench/layout.sh" ] || { echo "[refactor] no old tree in $OLD" >&2; return 1; }
  # SGLang into /root/site; setup_sfi's exports (stand-in, env) and its dist-info/sitecustomize
  source bench/sglang_h200.sh
  set +e  # the sourced script sets -e; one failing run must not end this one
  unpack_site "$REPO" || return 1
  setup_sfi
  rm -rf /root/site/sfi_sglang  # each tree has its own layout below
  ( source "$OLD/bench/layout.sh"; sfi_site /root/site_old "$REPO/$OLD" )
  ( source bench/layout.sh; sfi_site /root/site_new "$REPO" )
  BASE_PP=/root/site:$REPO/.sgl/nh
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  PYTHONPATH=$BASE_PP python3 -c 'import sglang, torch, triton; print("sglang", sglang.__version__, "torch", torch.__version__, "triton", triton.__version__)'
  local t
  for t in old new; do
    local sha
    sha=$(cd /root/site_$t && find sfi_sglang -name '*.py' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)
    echo "[refactor] $t layout /root/site_$t: sha256 $sha"
    eval "SHA_$t=$sha"
  done
  [ "$SHA_old" != "$SHA_new" ] || echo "[refactor] NOTE: old and new layouts are identical"
  echo "[refactor] set up in $(elapsed) s"

  : > "$RUNS/runs.jsonl"
  local item tree engine tag src rc t1 wall imported last=0 est left rep
  declare -A count=()
  for item in $PLAN; do
    tree=${item%%:*} engine=${item#*:}
    rep=$(( ${count[$item]:-0} + 1 )); count[$item]=$rep
    tag=${tree}_${engine}_${rep}
    est=$(( last > 0 ? last + last / 10 : 120 ))
    left=$(( BUDGET - $(elapsed) ))
    if [ "$est" -gt "$left" ]; then
      echo "[refactor] skip $tag: about ${est} s needed, ${left} s left"
      continue
    fi
    if [ "$tree" = old ]; then src=$REPO/$OLD; else src=$REPO; fi
    export PYTHONPATH=/root/site_$tree:$BASE_PP
    imported=$(cd /tmp && python3 -P -c 'import importlib.util as u; print(u.find_spec("sfi_sglang").origin, u.find_spec("sfi_sglang.kernels").origin)' 2>/dev/null | tail -1)
    case "$imported" in
      "/root/site_$tree/"*" /root/site_$tree/"*) ;;
      *) echo "[refactor] $tag: sfi_sglang imports from '$imported', not /root/site_$tree: skipped" >&2
         printf '{"tag":"%s","tree":"%s","engine":"%s","repeat":%d,"rc":-1,"dir":"%s","sfi_sglang":"%s"}\n' \
           "$tag" "$tree" "$engine" "$rep" "$RUNS/$tag" "$imported" >> "$RUNS/runs.jsonl"
         continue ;;
    esac
    wait_gpu_free
    echo "[refactor] === $tag ($(elapsed) s in, ${left} s left): $src/bench/sglang_h200.py, sfi_sglang from $imported"
    t1=$(date +%s)
    timeout --kill-after=15 "$left" python3 "$src/bench/sglang_h200.py" --configs "$CONFIG" \
      --engines "$engine" --steps "$STEPS" --out "$RUNS/$tag" ${REFACTOR_ARGS:-}
    rc=$?
    wall=$(( $(date +%s) - t1 ))
    last=$wall
    echo "[refactor] === $tag: rc $rc in ${wall} s"
    local sha_var=SHA_$tree
    printf '{"tag":"%s","tree":"%s","engine":"%s","repeat":%d,"rc":%d,"wall_s":%d,"dir":"%s","sfi_sglang":"%s","layout_sha256":"%s"}\n' \
      "$tag" "$tree" "$engine" "$rep" "$rc" "$wall" "$RUNS/$tag" "$imported" "${!sha_var}" >> "$RUNS/runs.jsonl"
    summarize
  done

  left=$(( BUDGET - $(elapsed) ))
  if [ "${REFACTOR_GRAPH_CHECK:-1}" != 0 ] && [ "$left" -ge 75 ]; then
    wait_gpu_free
    echo "[refactor] === graph check (new tree, $(elapsed) s in, ${left} s left)"
    export PYTHONPATH=/root/site_new:$BASE_PP:$REPO  # the repo last: only for `bench.*` imports
    t1=$(date +%s)
    if grep -q 'from sfi_sglang import bench' bench/graph_check_h200.py && [ ! -f sfi_sglang/bench.py ] \
        && [ -f bench/harness.py ]; then
      # sfi_sglang/bench.py moved to bench/harness.py but this script still imports the old name
      timeout --kill-after=10 "$left" python3 -P -c 'import runpy, sys
sys.path.insert(0, "bench"); import harness, sfi_sglang
sys.modules["sfi_sglang.bench"] = sfi_sglang.bench = harness
sys.argv = ["bench/graph_check_h200.py"] + sys.argv[1:]
runpy.run_path("bench/graph_check_h200.py", run_name="__main__")' --out "$OUT/graph_check"
    else
      timeout --kill-after=10 "$left" python3 -P bench/graph_check_h200.py --out "$OUT/graph_check"
    fi
    echo "[refactor] === graph check: rc $? in $(( $(date +%s) - t1 )) s"
  else
    echo "[refactor] graph check skipped (REFACTOR_GRAPH_CHECK=${REFACTOR_GRAPH_CHECK:-1}, ${left} s left)"
  fi
  summarize
  echo "[refactor] done in $(elapsed) s"
}

main 2>&1 | tee "$OUT/refactor_h200.log"
