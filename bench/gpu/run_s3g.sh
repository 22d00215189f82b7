#!/bin/bash
# The load-time JIT test after the server and staging tests in one pytest process (how it failed).
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh > /dev/null
timeout 150 python -m pytest -q -m gpu tests/server/test_gpu_serve.py tests/runtime/test_staging.py \
  tests/runtime/test_gpu_e2e.py -p no:cacheprovider -rf > "$OUT/tests.log" 2>&1
grep -E "passed|failed" "$OUT/tests.log" | tail -2
grep -E "^E +(new|built|tt.func|.*tt.func)" "$OUT/tests.log" | cut -c1-900 | head -10
