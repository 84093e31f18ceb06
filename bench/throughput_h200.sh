#!/bin/bash
# Issue #5 on the H200 (no SGLang there: the harness of sfi_sglang/bench.py). Run through the
# `device` tool from the repo root; writes $OUT/${NAME:-throughput_h200}.{json,png,log}.
set -o pipefail
ln -sfn ../kernels sfi_sglang/kernels
ln -sfn ../router sfi_sglang/router
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# sanity: fp32, contexts that fit S+W+K -> SFI tokens == dense tokens
python -m sfi_sglang.cli bench throughput --shape tiny --dtype float32 --configs 10x2,60x3 \
  --steps 12 --slow-every 4 --sfi-budget 16 --sfi-window 8 --reps 3 --out $OUT/tiny 2>&1 | tail -3
N=${NAME:-throughput_h200}
python -m sfi_sglang.cli bench throughput "$@" --out $OUT/$N 2>&1 | tee $OUT/$N.log
