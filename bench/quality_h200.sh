#!/usr/bin/env bash
# The quality eval on the H200: `sfi-sglang eval quality`
# with the real SmolLM2 weights, the run the 2-core CPU cannot finish in hours: 8 texts per
# context from the three built-in sources (the essays travel in .sgl/nh, pydoc topics and
# /usr/share/common-licenses are on the machine) at 2K, 4K and 8K (8000: SmolLM2's context is
# 8192), 64 teacher-forced steps each, 15% retention; SFI, the adaptive trigger at 0.5 and 0.25
# nat, a refresh every 8 tokens and the three baselines; passkey with 10 keys per depth at 8K.
# The eval's engine is eager (every method is a per-request config), so this scores quality,
# not speed (the speed price of each row comes from bench/NOTES.md sections 8 and 13).
#   here:   PYTHON=.venv/bin/python bash bench/sglang_h200.sh pack; python bench/smollm2_h200.py prepare
#   device: the weight chunks first (bench/smollm2_h200.py's docstring), then
#           run(command="setsid bash bench/quality_h200.sh", carry=[".sgl", ".w0"])
# The run does not fit one call's 600 s (eager steps, ~65 ms each; 4-5 s per 64-step run): CONTEXTS=2048,4096 PASSKEY=''
# then CONTEXTS=8000 APPEND=<the first call's JSON, committed>: its rows and this call's make one table.
# $OUT: quality_h200.{json,md,_rate.png} (or quality_h200.partial.json if cut), quality_h200.log
# (no quality_h200.png: one retention, no retention curve).
set -uo pipefail
source bench/sglang_h200.sh
device_env quality
real_weights || exit 1
trap '' QUIT  # SGLang's launcher sends SIGQUIT up its process tree when a child dies
[ -n "${APPEND:-}" ] && cp "$APPEND" "$OUT/quality_h200.json"
timeout ${EVAL_S:-540} python3 -P -m sfi_sglang.cli eval quality --model-path "$SFI_REAL_MODEL" \
  --contexts ${CONTEXTS:-2048,4096,8000} --retention 0.15 --ablation-retention 0.15 \
  --texts ${TEXTS:-8} --steps 64 --mem-fraction-static 0.3 \
  --methods sfi,sfi-adaptive,sfi-adaptive-0.25,sfi-refresh-8,streaming,snapkv,quest \
  --passkey-contexts "${PASSKEY-8000}" --passkey-keys 10 ${APPEND:+--append} --out "$OUT/quality_h200" 2>&1 \
  | grep -v 'Capturing\|it/s\]' | tee "$OUT/quality_h200.log"
