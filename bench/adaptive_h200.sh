#!/bin/bash
# The adaptive trigger's signal cost on the H200, through the `device` tool from the repo root:
#   bash bench/adaptive_h200.sh
# (1) the fast kernel's log-sum-exp output against the float64 reference (real Triton);
# (2) the graphed harness (bench/harness.py, Qwen3-4B shape) with --sfi-refresh interval
#     and adaptive, back to back in one call, one slow step per 24 either way (the harness has
#     no boundary tokens, and at its default threshold the adaptive trigger never fires): the
#     difference is what the trigger's signal costs a step ($OUT/adaptive_h200_{interval,adaptive}.*).
set -o pipefail
source bench/layout.sh
sfi_site /tmp/sfi-site
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python -P -m pytest -q -p no:cacheprovider --noconftest tests/test_kernels.py -k "fast_decode_matches or edge_lengths" 2>&1 | tail -3
for r in interval adaptive; do
  python -P bench/harness.py --sfi-refresh $r --slow-every 24 \
    --configs 8192x1,8192x8,32768x1,131072x1 --out $OUT/adaptive_h200_$r 2>&1 \
    | tee $OUT/adaptive_h200_$r.log | tr '\r' '\n' | grep '^{' | cut -c1-400
done
