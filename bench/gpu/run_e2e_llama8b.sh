#!/bin/bash
# GPU run: Llama-3.1-8B-shaped checkpoint (random bf16 weights) -> kiln compile -> start-up and
# decode latency beside Hugging Face transformers on the same weights.
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_e2e_llama8b.sh OUTDIR
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
CK=/tmp/ckpt-llama8b; ART=/tmp/art-llama8b
[ -n "$GPU_TESTS" ] && timeout 200 python -m pytest -q -m gpu $GPU_TESTS -p no:cacheprovider 2>&1 \
  | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|Error|new Triton" | tail -12
t0=$(date +%s)
[ -f $CK/config.json ] || python bench/make_checkpoint.py --preset llama-3.1-8b -o $CK 2>&1 | tail -2
echo "checkpoint: $(( $(date +%s) - t0 )) s"; df -h /tmp | tail -1
[ -f $ART/manifest.json ] || timeout 400 python -m kiln compile $CK -o $ART --force 2>&1 | grep -v "it/s\]" \
  | tee "$OUT/compile.log" | tail -4
python -m kiln bench startup $ART --runs 2 --json "$OUT/startup.json" 2>&1 | tail -2
timeout ${LAT_TIMEOUT:-300} python -m kiln bench latency $ART --batch-sizes ${BATCHES:-1,8,64} --input-len 512 \
  --output-len ${OUTLEN:-128} --kv-memory 60 ${HF:+--compare-hf $CK} --json "$OUT/latency.json" 2>&1 \
  | grep -v "it/s\]" | tail -8
