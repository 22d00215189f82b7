#!/bin/bash
# Final GPU call of a session: GPU tests (server with the openai client, staging rings, overlapped
# decode, new norm/GEMV/MoE kernels), the norm bench, then the Llama-3.1-8B-shaped end to end:
# compile, start-up, decode beside Hugging Face (default and --overlap). The checkpoint is written
# in the background while the tests run. Usage: bash bench/gpu/run_final2.sh OUTDIR
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
CK=/tmp/ckpt-llama8b; ART=/tmp/art-llama8b
python bench/make_checkpoint.py --preset llama-3.1-8b -o $CK > "$OUT/prep.log" 2>&1 &
CKPID=$!
timeout 170 python -m pytest -q -m gpu tests/server/test_gpu_serve.py tests/runtime/test_staging.py \
  tests/runtime/test_gpu_e2e.py tests/ops/test_norm.py tests/ops/test_gemv.py tests/ops/test_moe_gemm.py \
  -p no:cacheprovider -rf --timeout 150 > "$OUT/gpu_tests.log" 2>&1; grep -E "passed|failed|FAILED|rror" "$OUT/gpu_tests.log" | tail -8
timeout 40 python -m pytest -q bench/test_bench_norm.py -k "test_fused_add_rmsnorm and not sweep and not compile" \
  -p no:cacheprovider --benchmark-json="$OUT/norm_raw.json" > /dev/null 2>&1
python bench/report.py "$OUT/norm_raw.json" "$OUT/norm.json" --command "pytest bench/test_bench_norm.py -k 'test_fused_add_rmsnorm and not sweep and not compile'" \
  | grep -E "ceilings|\[4096-" ; rm -f "$OUT/norm_raw.json"
wait $CKPID
timeout 100 python -m kiln compile $CK -o $ART --force >> "$OUT/prep.log" 2>&1; tail -1 "$OUT/prep.log"
timeout 40 python -m kiln bench startup $ART --runs 1 --json "$OUT/startup.json" 2>&1 | tail -2
timeout 150 python -m kiln bench latency $ART --batch-sizes 1,8,64,256 --input-len 512 --output-len 128 \
  --kv-memory 40 --compare-hf $CK --json "$OUT/latency.json" 2>&1 | grep -v "it/s\]" | tail -6
timeout 60 python -m kiln bench latency $ART --batch-sizes 1,8,64,256 --input-len 512 --output-len 128 \
  --kv-memory 40 --overlap --json "$OUT/latency_overlap.json" 2>&1 | grep -v "it/s\]" | tail -5
