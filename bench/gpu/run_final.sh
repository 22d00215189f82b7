#!/bin/bash
# One GPU call for the newest code: GPU tests of MoE kernels and the e2e runtime, the MoE kernel
# benchmarks, the Llama-3.1-8B-shaped end to end (latency vs HF, start-up), and the serving bench.
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
CK=/tmp/ckpt-llama8b; ART=/tmp/art-llama8b
timeout 150 python -m pytest -q -m gpu ${GPU_TESTS:-tests/ops/test_moe_gemm.py tests/ops/test_moe_routing.py tests/ops/test_moe_align.py tests/runtime/test_gpu_e2e.py} \
  -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|Error" | tail -8
[ -f bench/test_bench_moe.py ] && timeout 90 python -m pytest -q bench/test_bench_moe.py -k "not compile and not sweep" \
  -p no:cacheprovider --benchmark-json="$OUT/moe_raw.json" 2>&1 | tail -1 && \
  python bench/report.py "$OUT/moe_raw.json" "$OUT/moe.json" --command "pytest bench/test_bench_moe.py" > "$OUT/moe_table.txt"
grep -E "4096|\[1-|\[8-|ceilings" "$OUT/moe_table.txt" 2>/dev/null | head -14
python bench/make_checkpoint.py --preset llama-3.1-8b -o $CK 2>&1 | tail -1
timeout 120 python -m kiln compile $CK -o $ART --force 2>&1 | grep -E "artifact|Error|error" | tail -2
timeout 60 python -m kiln bench startup $ART --runs 2 --json "$OUT/startup.json" 2>&1 | tail -2
timeout 200 python -m kiln bench latency $ART --batch-sizes 1,8,64,256 --input-len 512 --output-len 128 \
  --kv-memory 60 --compare-hf $CK --json "$OUT/latency.json" 2>&1 | grep -v "it/s\]" | tail -7
[ -f bench/serve.py ] && timeout 100 python bench/serve.py --artifact $ART ${SERVE_ARGS:---num-prompts 200 --rate 10} \
  --json "$OUT/serve.json" 2>&1 | tail -12
