#!/bin/bash
# GPU call 7 of the seventh session (2026-11-30), issue 9: the new 1-token rung of the MoE launch
# table (ops/moe_gemm.py DEFAULT_TABLE) with the defaults: its GPU correctness tests, the MoE op
# chained over 8 layers at 1 / 2 / 4 tokens, and the op alone (one graph replay per call) at 1 token.
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s7g.sh OUTDIR   (3 files)
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
timeout 60 python -m pytest -q -m gpu tests/ops/test_moe_gemm.py -k "T1 or T4 or replay" -p no:cacheprovider -rf \
  > "$OUT/tests.log" 2>&1
echo "== tests"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests.log" | tail -4
cd bench
timeout 60 python -m pytest -q test_bench_moe_decode.py test_bench_moe.py -k "(decode_chain and fused) or (test_fused_moe and 1-triton and not fp8)" \
  -p no:cacheprovider --benchmark-json="$OUT/moe_1tok_rung.json" > /dev/null 2>&1
python -c "import json; [print(b['name'], round(b['extra_info']['ms'] * 1e3 / b['extra_info'].get('layers', 1), 2), 'us', round(b['extra_info']['frac_bw'], 3)) for b in json.load(open('$OUT/moe_1tok_rung.json'))['benchmarks']]"
