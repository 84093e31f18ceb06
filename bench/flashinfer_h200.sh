#!/usr/bin/env bash
# FlashInfer on the H200 machine (no flashinfer, no internet there): a trimmed copy.
#   here:   bench/flashinfer_h200.sh pack   -> .fi/ (ignored; ~15 MB), from this machine's
#           flashinfer-python 0.7.2: its Python files, the headers and JIT sources the decode
#           and prefill modules build from (data/include, cutlass, cccl, spdlog, csrc/*.jinja,
#           batch_decode*.cu, batch_prefill*.cu; cascade and page for SGLang's flashinfer backend), and the cp312 wheels of apache-tvm-ffi and dill.
#   device: run(command="bench/flashinfer_h200.sh", carry=[".fi"]): unpacks into /tmp/site,
#           FlashInfer JIT-builds its decode module with the machine's nvcc, then
#           bench/flashinfer_h200.py checks and times (results under $OUT).
set -euo pipefail
if [ "${1:-}" = pack ]; then
  grep -qx '/.fi/' .git/info/exclude || echo '/.fi/' >> .git/info/exclude
  site=$(python3 -c 'import flashinfer, os; print(os.path.dirname(os.path.dirname(flashinfer.__file__)))')
  rm -rf .fi && mkdir -p .fi/whl
  (cd "$site" && {
    find flashinfer -type f \( -name '*.py' -o -name '*.json' -o -name '*.typed' \) -not -path 'flashinfer/data/*' -not -path '*/__pycache__/*'
    find flashinfer/data/include flashinfer/data/spdlog flashinfer/data/cccl flashinfer/data/cutlass/include flashinfer/data/cutlass/tools/util/include -type f
    find flashinfer/data/csrc -maxdepth 1 -type f \( -name '*.jinja' -o -name '*.h' -o -name '*.cuh' -o -name 'batch_decode.cu' -o -name 'batch_decode_jit_binding.cu' -o -name 'batch_prefill*.cu' -o -name '*cascade*.cu' -o -name '*page*.cu' \)
  } | tar -cJf "$OLDPWD/.fi/flashinfer.tar.xz" -T -)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .fi/whl apache-tvm-ffi==0.1.11 dill
  du -sh .fi
  exit 0
fi
source "$(dirname "$0")/sglang_h200.sh"
unpack_flashinfer
export PYTHONUNBUFFERED=1
exec timeout 540 python3 bench/flashinfer_h200.py --out "${OUT:-bench/results}" "$@"
