#!/bin/bash
# The bench harness (bench/harness.py: the product's backend, which imports SGLang, over
# SGLang-layout pools) on the H200: the graph check (bench/graph_check_h200.py),
# then `python bench/harness.py "$@"`. Run through the `device` tool from the repo root with
# carry [".sgl"] (bench/sglang_h200.sh pack: SGLang's closure and the tokenizer the
# backend's boundary table reads); writes $OUT/graph_check_h200.json and
# $OUT/${NAME:-throughput_h200}.{json,png,log}.
set -o pipefail
source bench/sglang_h200.sh
device_env throughput
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -P bench/graph_check_h200.py --out $OUT 2>&1 | tee $OUT/graph_check_h200.log | tail -4
# sanity: fp32, contexts that fit S+W+K -> SFI tokens == dense tokens
python -P bench/harness.py --shape tiny --dtype float32 --configs 10x2,60x3 \
  --steps 12 --slow-every 4 --sfi-budget 16 --sfi-window 8 --reps 3 --out $OUT/tiny 2>&1 | tail -3
N=${NAME:-throughput_h200}
python -P bench/harness.py "$@" --out $OUT/$N 2>&1 | tee $OUT/$N.log
