#!/usr/bin/env bash
# On the H200: bench/load.py against `sfi-sglang serve` with SFI, then against
# the same server with --disable-sfi (SGLang's default dense server: CUDA graphs, overlap
# scheduler, radix cache), in one device call. Model: SmolLM2-135M's config and tokenizer with
# SGLang's dummy (random) weights (--load-format dummy: the real weights do not fit one call's
# carry); texts are meaningless, the serving path is the product's. Both servers: 60% of
# the GPU for weights + KV pool and no prefill CUDA graphs (their capture ran out of memory
# beside a KV pool sized at SGLang's default fraction, for dense and SFI alike); decode CUDA
# graphs, the overlap scheduler and the radix cache stay on.
#   here:   PYTHON=.venv/bin/python bash bench/sglang_h200.sh pack    (.sgl: site, tok, nh)
#   device: run(command="bash bench/load_h200.sh", carry=[".sgl"])
# $OUT: load_h200_{sfi,dense}.json (bench/load.py's JSON), load_h200.log, server logs.
set -euo pipefail
source bench/sglang_h200.sh
device_env load
CLIENTS=${CLIENTS:-64} REQUESTS=${REQUESTS:-384}
for mode in sfi dense; do
  if [ $mode = sfi ]; then flags=(--sfi-budget 128 --sfi-window 64); else flags=(--disable-sfi); fi
  python3 -P -m sfi_sglang.cli serve --model-path .sgl/tok --load-format dummy --host 127.0.0.1 \
    --port 30000 --mem-fraction-static 0.6 --disable-prefill-cuda-graph "${flags[@]}" > "$OUT/load_h200_server_$mode.log" 2>&1 &
  pid=$!
  up=0
  for _ in $(seq 1 150); do
    if python3 -c 'import urllib.request as u; u.urlopen("http://127.0.0.1:30000/health_generate", timeout=20)' 2>/dev/null; then up=1; break; fi
    kill -0 $pid 2>/dev/null || break
    sleep 2
  done
  if [ $up = 1 ]; then
    python3 -P bench/load.py --url http://127.0.0.1:30000 --clients "$CLIENTS" --requests "$REQUESTS" \
      --max-new-tokens 64 --long-chars 16000 --equality 8 --equality-tokens 64 \
      --label "H200, sfi-sglang serve ${flags[*]} (SmolLM2-135M config, dummy weights, CUDA graphs + overlap)" \
      --out "$OUT/load_h200_$mode.json" 2>&1 | grep -v '^\s*$' | tail -40 | tee -a "$OUT/load_h200.log" || true
  else
    echo "$mode: server did not come up" | tee -a "$OUT/load_h200.log"; tail -40 "$OUT/load_h200_server_$mode.log"
  fi
  kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true
  pkill -f sglang:: 2>/dev/null || true; sleep 3
done
