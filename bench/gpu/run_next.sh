#!/bin/bash
# First GPU call of the next session: what the fifth 2026-11-29 session wrote after its device time
# ran out, then an end-to-end FP8 run of the auto backend (never run end to end yet).
#   (1) GPU tests: tests/runtime/test_gpu_e2e.py (incl. the new FP8 Triton no-JIT test),
#       tests/ops/test_fp8_gemm.py (the final TABLE), tests/ops/test_moe_cutlass.py (capture check).
#   (2) Llama-3.1-8B-shaped, --quant fp8: decode latency at batch 1/8/64/256 and a prefill-heavy
#       throughput run, with KILN_FP8_GEMM=auto (default) and =cublas, same artifact.
# Usage: bash bench/gpu/run_next.sh OUTDIR   (5 files)
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
CK=/tmp/ckpt-llama8b; ART=/tmp/art-llama8b-fp8
python bench/make_checkpoint.py --preset llama-3.1-8b -o $CK > /dev/null 2>&1 &
PCK=$!
timeout 240 python -m pytest -q -m gpu tests/runtime/test_gpu_e2e.py tests/ops/test_fp8_gemm.py \
  tests/ops/test_moe_cutlass.py -p no:cacheprovider -rf > "$OUT/tests.log" 2>&1
grep -E "^FAILED|passed|failed" "$OUT/tests.log" | tail -6
wait $PCK
timeout 150 python -m kiln compile $CK -o $ART --quant fp8 --force 2>&1 | tail -1
for be in auto cublas; do
  KILN_FP8_GEMM=$be timeout 100 python -m kiln bench latency $ART --batch-sizes 1,8,64,256 --input-len 512 \
    --output-len 64 --kv-memory 40 --json "$OUT/fp8_latency_$be.json" 2>&1 | grep -v "it/s\]" | tail -5
  KILN_FP8_GEMM=$be timeout 100 python -m kiln bench throughput $ART --num-prompts 200 --input-len 1024 \
    --output-len 16 --json "$OUT/fp8_throughput_$be.json" 2>&1 | tail -2
done
