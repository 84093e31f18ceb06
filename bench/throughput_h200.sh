#!/bin/bash
# The GPU harness of sfi_sglang/bench.py on the H200 (no SGLang there): the graph check of
# issue 14 (bench/graph_check_h200.py), then `sfi-sglang bench throughput "$@"`. Run through
# the `device` tool from the repo root; writes $OUT/graph_check_h200.json and
# $OUT/${NAME:-throughput_h200}.{json,png,log}.
set -o pipefail
source bench/layout.sh
sfi_site /tmp/sfi-site
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -P bench/graph_check_h200.py --out $OUT 2>&1 | tee $OUT/graph_check_h200.log | tail -4
# sanity: fp32, contexts that fit S+W+K -> SFI tokens == dense tokens
python -P -m sfi_sglang.cli bench throughput --shape tiny --dtype float32 --configs 10x2,60x3 \
  --steps 12 --slow-every 4 --sfi-budget 16 --sfi-window 8 --reps 3 --out $OUT/tiny 2>&1 | tail -3
N=${NAME:-throughput_h200}
python -P -m sfi_sglang.cli bench throughput "$@" --out $OUT/$N 2>&1 | tee $OUT/$N.log
