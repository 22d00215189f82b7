#!/bin/bash
# First GPU call of the next session: the GPU tests the sixth 2026-11-29 session changed after its
# last device call (graph-replay helper shared by the FP8 tests; the compile test that now checks the
# loader reloads the artifact's CUTLASS FP8 library; TMA alignment / stand-in checks in
# ops/fp8_cutlass.py), with the carried FP8 library; then every FP8 and CUTLASS GPU test.
# Usage (repo root, carry bench/cutlass_probe/out and bench/cutlass_probe/whl): bash bench/gpu/run_next.sh OUT
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  bench/cutlass_probe/whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
source bench/gpu/env.sh
export KILN_CUTLASS_LIB=$PWD/bench/cutlass_probe/out/kiln/cutlass_moe_sm90.so
export KILN_CUTLASS_FP8_LIB=$PWD/bench/cutlass_probe/out/kiln/cutlass_fp8_sm90.so
timeout 400 python -m pytest -q -m gpu tests/ops/test_fp8_cutlass.py tests/ops/test_gemv_fp8.py \
  tests/ops/test_fp8_gemm.py tests/ops/test_fp8_linear.py tests/compiler/test_compile_cutlass.py \
  tests/ops/test_moe_cutlass.py tests/runtime/test_gpu_e2e.py -p no:cacheprovider -rf > "$OUT/tests.log" 2>&1
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests.log" | tail -10
