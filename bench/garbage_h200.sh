#!/usr/bin/env bash
# On the H200: does the garbage stream (private-use characters from one of 32
# concurrent 1,260-token streams, seen once on the CPU engine) come back at 32 concurrent
# 1,000-token outputs, with the REAL SmolLM2 weights and SGLang's default GPU path (decode CUDA
# graphs, overlap scheduler, radix cache)? bench/batch_invariance.py: 32 greedy requests (260
# tokens of an essay + "Summarize it in detail", 1,000 new tokens, ignore_eos) in one batch,
# then the first 8 alone; garbage counted in every output. Runs, in order: SFI at the default
# budget (the probe's setting), dense, SFI at budget 128 / window 64 (sparse throughout), then
# both again under --enable-deterministic-inference (PROBES picks; prefill CUDA graphs off
# to save start-up time, decode graphs on).
#   here:   PYTHON=.venv/bin/python bash bench/sglang_h200.sh pack; python bench/smollm2_h200.py prepare
#   device: the weights go over in chunks first (bench/smollm2_h200.py's docstring: one call per
#           .wN, back to back, each copying it to /root/sfiw), then
#           run(command='for p in sfi_default dense sfi_128; do PROBES=$p PROBE_S=180 setsid bash
#               bench/garbage_h200.sh > /tmp/g_$p.out 2>&1; done; cp /tmp/g_*.out $OUT/', carry=[".sgl", ".w0"])
#           (one probe per invocation: a script given several stopped after the first,
#           cause not found; the committed log came from calls like this one)
# $OUT: garbage_h200_<run>.log, garbage_h200.log (the summary lines).
set -uo pipefail
source bench/sglang_h200.sh
device_env garbage
real_weights || exit 1
M=$SFI_REAL_MODEL
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/garbage_h200.log"
trap '' QUIT  # SGLang's launcher sends SIGQUIT up its process tree when a child dies
probe() {
  local name=$1; shift
  echo "== $name: $*" | tee -a "$OUT/garbage_h200.log"
  setsid timeout ${PROBE_S:-200} python3 -P bench/batch_invariance.py --model-path $M --dtype bfloat16 --source essays \
    --n 32 --prompt-tokens 260 --max-new-tokens 1000 --ignore-eos --alone 8 --mem-fraction-static 0.3 \
    --disable-prefill-cuda-graph "$@" \
    > "$OUT/garbage_h200_$name.log" 2>&1
  echo "rc $?" >> "$OUT/garbage_h200_$name.log"
  grep -E '^(\{|ALL_EQUAL|GARBAGE|rc |ENGINE|BATCH)' "$OUT/garbage_h200_$name.log" | cut -c1-220 | tee -a "$OUT/garbage_h200.log"
  pkill -f sglang:: 2>/dev/null; sleep 2
}
for p in ${PROBES:-sfi_default dense sfi_128}; do
  case $p in
    sfi_default) probe sfi_default --budget 2048 --window 256 ;;
    dense) probe dense --disable-sfi ;;
    sfi_128) probe sfi_128 --budget 128 --window 64 ;;
    sfi_128_det) probe sfi_128_det --budget 128 --window 64 --deterministic ;;
    sfi_default_det) probe sfi_default_det --budget 2048 --window 256 --deterministic ;;
    dense_det) probe dense_det --disable-sfi --deterministic ;;
  esac
done
