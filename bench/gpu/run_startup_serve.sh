#!/bin/bash
# One GPU call: weight-pack load sweep (issue 3), then on a Llama-3.1-8B-shaped bf16 artifact:
# start-up (issue 6), GPU server/staging/e2e tests, the serving bench (issue 7), decode with
# --overlap. Needs the server wheels carried in .whl (bench/results/README.md).
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_startup_serve.sh OUTDIR
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
CK=/tmp/ckpt-llama8b; ART=/tmp/art-llama8b
timeout 240 python bench/weights_load.py --json "$OUT/weights_load.json" --threads 8,16 --chunks-mib 4,8,16 \
  --depths 2,4 --streams 1,2 --reps 2 > "$OUT/weights_load.log" 2>&1; tail -4 "$OUT/weights_load.log"
python bench/make_checkpoint.py --preset llama-3.1-8b -o $CK > "$OUT/prep.log" 2>&1
timeout 150 python -m kiln compile $CK -o $ART --force >> "$OUT/prep.log" 2>&1; tail -1 "$OUT/prep.log"
timeout 60 python -m kiln bench startup $ART --runs 2 --json "$OUT/startup.json" 2>&1 | tail -3
timeout 200 python -m pytest -q -m gpu tests/server/test_gpu_serve.py tests/runtime/test_staging.py \
  tests/runtime/test_gpu_e2e.py tests/weights -p no:cacheprovider -rf 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
timeout 120 python bench/serve.py --artifact $ART --num-prompts 500 --rate 16 --input-len 512 \
  --output-len 128 --range-ratio 0.5 --json "$OUT/serve.json" > "$OUT/serve.log" 2>&1; tail -14 "$OUT/serve.log"
timeout 100 python -m kiln bench latency $ART --batch-sizes 1,8,64,256 --input-len 512 --output-len 128 \
  --kv-memory 40 --overlap --json "$OUT/latency_overlap.json" 2>&1 | grep -v "it/s\]" | tail -6
