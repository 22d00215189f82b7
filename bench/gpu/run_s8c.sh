#!/bin/bash
# Eighth session, third GPU call (issue 9): the decode w2 GEMV streaming its weight slabs before
# its PDL wait (KILN_MOE_EARLY_W2=1, ops/moe_gemm.py early / late_trigger): GPU tests, the MoE op
# chained over 8 layers and alone with and without it (and with 16-row w2 programs), and
# Qwen3-30B-A3B-shaped (16 layers) decode with and without it on one artifact, with its profile.
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s8c.sh OUTDIR
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
gpu_tests tests.log 150 tests/ops/test_moe_gemm.py tests/ops/test_moe_pdl.py -k "early or replay or gemv_variants or pdl"
cd bench
python -c "import json; from kiln.ops import moe_gemm as mg; t = json.loads(mg.moe_tuning_table(128, 768, 2048, 8, 4096)); t['1']['w2']['BLOCK_N'] = 16; json.dump(t, open('$OUT/moe_table_w2n16.json', 'w'))"
for v in off on on_n16; do
  [ $v = off ] && export KILN_MOE_EARLY_W2=0 || export KILN_MOE_EARLY_W2=1
  [ $v = on_n16 ] && export KILN_MOE_TUNING="$OUT/moe_table_w2n16.json"
  timeout 60 python -m pytest -q test_bench_moe_decode.py test_bench_moe.py -k "(decode_chain and fused) or (test_fused_moe and 1-triton and not fp8)" \
    -p no:cacheprovider --benchmark-json="$OUT/moe_early_$v.json" > /dev/null 2>&1
  bench_summary "$OUT/moe_early_$v.json" $v
done
unset KILN_MOE_TUNING KILN_MOE_EARLY_W2
cd ..
moe_checkpoint
moe_compile
moe_latency early_off "" KILN_MOE_EARLY_W2=0
moe_latency early_on "" KILN_MOE_EARLY_W2=1
KILN_MOE_EARLY_W2=1 moe_profile 10
