#!/bin/bash
# GPU call 1 of the fourth 2026-11-29 session (kernels only, no model): (1) GPU tests of the
# persistent norm and greedy argmax kernels; (2) the PDL probe; (3) the GEMV launch sweep at M = 1
# in chain mode (distinct weights back to back, as in a decode step) for the 8B and Qwen3-MoE
# projections; (4) the norm sweep with the persistent variants at 4096 tokens; (5) argmax.
# Files into OUTDIR; tables printed last.
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s4a.sh OUTDIR
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
timeout 150 python -m pytest -q -m gpu tests/ops/test_norm.py tests/runtime/test_sampler.py \
  -p no:cacheprovider -rf > "$OUT/tests.log" 2>&1
timeout 60 python bench/gpu/pdl_probe.py --json "$OUT/pdl_probe.json" > "$OUT/pdl.txt" 2>&1
KILN_GEMV_SWEEP_CHAIN=400 KILN_GEMV_SWEEP_M=1 timeout 240 python -m pytest -q bench/test_bench_gemv.py \
  -k "sweep and not lm_head" -p no:cacheprovider --benchmark-json="$OUT/gemv_raw.json" > "$OUT/gemv.log" 2>&1
python bench/test_bench_gemv.py "$OUT/gemv_raw.json" > "$OUT/gemv_summary.txt" 2>&1
timeout 120 python -m pytest -q bench/test_bench_norm.py bench/test_bench_sampler.py \
  -k "(fused_add_rmsnorm_sweep and 4096) or test_argmax" -p no:cacheprovider \
  --benchmark-json="$OUT/kern_raw.json" > "$OUT/kern.log" 2>&1
python bench/report.py "$OUT/kern_raw.json" "$OUT/kernels.json" --command \
  "pytest bench/test_bench_norm.py bench/test_bench_sampler.py -k '(fused_add_rmsnorm_sweep and 4096) or test_argmax'" > /dev/null 2>&1
python bench/report.py "$OUT/gemv_raw.json" "$OUT/gemv_sweep.json" --command \
  "KILN_GEMV_SWEEP_CHAIN=400 KILN_GEMV_SWEEP_M=1 pytest bench/test_bench_gemv.py -k 'sweep and not lm_head'" > /dev/null 2>&1
rm -f "$OUT/kern_raw.json" "$OUT/gemv_raw.json"
echo "== kernels (us, frac of read bandwidth)"
python - "$OUT/kernels.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    print(f"{r['name'][:70]:<70} {r.get('ms', 0) * 1e3:8.1f} us  bw {r.get('frac_bw', 0):.3f}")
PY
echo "== GEMV sweep (chain)"; grep -v "^ " "$OUT/gemv_summary.txt" | head -12; grep -A3 "^qkv\|^o \|^moe" "$OUT/gemv_summary.txt" | head -30
echo "== PDL probe"; cat "$OUT/pdl.txt"
echo "== tests"; grep -E "passed|failed|FAILED|Error" "$OUT/tests.log" | head -12
tail -3 "$OUT/gemv.log"; tail -3 "$OUT/kern.log"
