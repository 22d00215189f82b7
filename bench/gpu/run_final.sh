#!/bin/bash
# One GPU call for the newest code: GPU tests (MoE kernels, e2e runtime with overlap), the
# Llama-3.1-8B-shaped end to end (start-up, latency vs HF), the serving bench, the MoE benchmarks.
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
CK=/tmp/ckpt-llama8b; ART=/tmp/art-llama8b
timeout 130 python -m pytest -q -m gpu tests/runtime/test_gpu_e2e.py tests/ops/test_moe_routing.py \
  tests/ops/test_moe_align.py tests/ops/test_moe_gemm.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" \
  | grep -E "passed|failed|FAILED|Error" | tail -8
python bench/make_checkpoint.py --preset llama-3.1-8b -o $CK 2>&1 | tail -1
timeout 100 python -m kiln compile $CK -o $ART --force 2>&1 | grep -E "artifact|Error|error" | tail -2
timeout 50 python -m kiln bench startup $ART --runs 2 --json "$OUT/startup.json" 2>&1 | tail -2
timeout 170 python -m kiln bench latency $ART --batch-sizes 1,8,64,256 --input-len 512 --output-len 128 \
  --kv-memory 60 --compare-hf $CK --json "$OUT/latency.json" 2>&1 | grep -v "it/s\]" | tail -6
timeout 80 python bench/serve.py --artifact $ART --num-prompts 200 --rate 10 --input-len 512 --output-len 128 \
  --json "$OUT/serve.json" 2>&1 | tail -8
timeout 70 python -m pytest -q bench/test_bench_moe.py -k "not compile and not sweep" -p no:cacheprovider \
  --benchmark-json="$OUT/moe_raw.json" 2>&1 | tail -1
python bench/report.py "$OUT/moe_raw.json" "$OUT/moe.json" --command "pytest bench/test_bench_moe.py" > "$OUT/moe_table.txt"
grep -E "4096|\[1-|\[8-|ceilings" "$OUT/moe_table.txt" | head -12
