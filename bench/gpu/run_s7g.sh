#!/bin/bash
# The next session's first GPU call (written in the seventh session, 2026-11-30, after its device time ran out), issue 9: the new 1-token rung of the MoE launch
# table (ops/moe_gemm.py DEFAULT_TABLE) with the defaults: its GPU correctness tests, the MoE op
# chained over 8 layers at 1 / 2 / 4 tokens, the op alone (one graph replay per call) at 1 token, and
# Qwen3-30B-A3B-shaped (16 layers) decode at batch 1 / 8 with its batch-1 profile.
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s7g.sh OUTDIR   (8 files)
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
# the MoE decode GEMV at 1 / 4 tokens and under replay, the routing kernels and the capture fallbacks
# (the seventh session's last commits refactored them on CPU: pair_sum, topk_meta, ArrivalCounters)
gpu_tests tests.log 150 tests/ops/test_moe_gemm.py tests/ops/test_moe_routing.py tests/ops/test_moe_route.py \
  tests/ops/test_decode_attention.py tests/ops/test_fp8_gemm.py -k "T1 or T4 or replay or routing or route or capture or fused"
cd bench
# the table without the 1-token rung (1 token then takes the 2..4-token tiles): the same-run baseline
python -c "import json; from kiln.ops import moe_gemm as mg; t = json.loads(mg.moe_tuning_table(128, 768, 2048, 8, 4096)); del t['1']; json.dump(t, open('$OUT/moe_table_old_rung.json', 'w'))"
for tab in default old_rung; do
  [ $tab = old_rung ] && export KILN_MOE_TUNING="$OUT/moe_table_old_rung.json"
  timeout 60 python -m pytest -q test_bench_moe_decode.py test_bench_moe.py -k "(decode_chain and fused) or (test_fused_moe and 1-triton and not fp8)" \
    -p no:cacheprovider --benchmark-json="$OUT/moe_1tok_rung_$tab.json" > /dev/null 2>&1
  bench_summary "$OUT/moe_1tok_rung_$tab.json" $tab
done
unset KILN_MOE_TUNING
cd ..
# end to end with the new rung (compare with run_s7e.sh's defaults: 849.2 / 2648.3 tok/s, 49.1% /
# 71.3% at 4071 GB/s; the chain above is the same-run comparison)
moe_checkpoint
moe_compile
moe_latency default ""
moe_profile 10
