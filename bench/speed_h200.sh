#!/usr/bin/env bash
# Speed on the H200, one device call: the graph check of this tree (tokens equal with
# graphs on and off, no sync in replays), then bench/speed_h200.py (the split sweep and the
# real-SGLang engines; options after the script name go to it).
#   run(command="bash bench/speed_h200.sh --configs 131072x1,32768x8 --engines sfi,dense-best,dense",
#       carry=[".sgl/site.tar.xz", ".sgl/tok.tar.xz", ".sgl/wheels.txt"] (+ ".fi" for FlashInfer
#       engines; the whole .sgl with .fi passes the 64 MiB limit), timeout_s=590)
# Results in $OUT: speed_h200.json, speed_h200.log, graph_check.log, graph_check/graph_check_h200.json.
set -uo pipefail
source "$(dirname "$0")/sglang_h200.sh"
device_env speed
if [ -f .fi/flashinfer.tar.xz ]; then unpack_flashinfer; fi  # the dense-flashinfer engine (carry .fi)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ "${SPEED_GRAPH_CHECK:-1}" = 1 ]; then  # SPEED_GRAPH_CHECK=0 skips it; GRAPH_CHECK_ARGS="--selection-page 16"
  timeout --kill-after=5 90 python3 bench/graph_check_h200.py --out "$OUT/graph_check" ${GRAPH_CHECK_ARGS:-} > "$OUT/graph_check.log" 2>&1
  echo "graph check: rc $?"; grep -v '^\[20' "$OUT/graph_check.log" | tail -8
fi
python3 bench/speed_h200.py --out "$OUT" "$@" 2>&1 | tee "$OUT/speed_h200.log" | grep -v '^\[20.*Triton kernel'
