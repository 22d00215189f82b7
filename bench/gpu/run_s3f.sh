#!/bin/bash
# Which Triton kernels the runtime compiles at load (test_loading_compiles_no_triton_kernel): the
# test alone with direct op dispatch (default) and with KILN_OP_DISPATCH=torch.
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh > /dev/null
for mode in direct torch; do
  KILN_OP_DISPATCH=$mode timeout 140 python -m pytest -q -m gpu tests/runtime/test_gpu_e2e.py -k "loading_compiles" \
    -p no:cacheprovider > "$OUT/load_$mode.log" 2>&1
  echo "== $mode: $(grep -E "passed|failed" "$OUT/load_$mode.log" | tail -1)"
  grep -E "^E +(new|built|tt.func|.*tt.func)" "$OUT/load_$mode.log" | cut -c1-700 | head -8
done
