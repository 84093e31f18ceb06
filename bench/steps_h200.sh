#!/bin/bash
# Slow and fast steps on the H200, through the `device` tool from the repo root:
#   bash bench/steps_h200.sh layers   what bounds the fast kernel at batch 1
#                                     ($OUT/kernels_h200_floor.json) and one layer's whole
#                                     fast and slow pass, as the backend runs them in CUDA
#                                     graphs, against dense attention ($OUT/steps_h200.*)
#   bash bench/steps_h200.sh all      both
#   bash bench/steps_h200.sh refresh  the graphed harness at one slow step per 8, 16, 24 and
#                                     48 tokens ($OUT/refresh_h200_every{K}.*); merge and plot
#                                     here with bench/plot_refresh.py
set -o pipefail
source bench/layout.sh
sfi_site /tmp/sfi-site
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
layers() {
    python -P bench/graph_check_h200.py --out $OUT 2>&1 | tee $OUT/graph_check_h200.log | tail -4
    python -P -m pytest -q -p no:cacheprovider --noconftest tests/test_memory.py tests/test_kernels.py -k "kernel or store or variant" 2>&1 | tail -3
    python -P bench/kernels_h200.py --phase floor --out $OUT 2>&1 | tee $OUT/kernels_h200_floor.log | grep -v '^  '
    python -P bench/harness.py --parts-only --layers 2 --sfi-dense-layers "" \
      --configs 8192x1,8192x8,32768x1,32768x8,131072x1,131072x8 --out $OUT/steps_h200 2>&1 | tee $OUT/steps_h200.log \
      | tr '\r' '\n' | grep '^{' | cut -c1-400
}
refresh() {
    for k in 8 16 24 48; do
      python -P bench/harness.py --slow-every $k \
        --configs 8192x1,8192x8,32768x1,32768x8,131072x1,131072x4 --out $OUT/refresh_h200_every$k 2>&1 \
        | tee $OUT/refresh_h200_every$k.log | tr '\r' '\n' | grep '^{' | cut -c1-300
    done
}
case "$1" in
  layers) layers ;;
  refresh) refresh ;;
  all) layers; refresh ;;
  *) echo "usage: bash bench/steps_h200.sh layers|refresh|all" >&2; exit 2 ;;
esac
# the device tool returns at most 8 files: one archive of them all
(cd $OUT && tar czf steps_h200_out.tgz --remove-files $(ls | grep -v '^steps_h200_out.tgz$'))
