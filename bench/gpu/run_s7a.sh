#!/bin/bash
# GPU call 1 of the seventh session (2026-11-30), issue 9 (MoE decode):
# (1) GPU tests of the fused decode router (ops/moe_route.py), the w2 GEMV's last-arrival top-k sum
#     and the rest of the MoE kernels; (2) the fused MoE op at 1 / 8 / 4096 tokens with the combine
#     kernel vs the last-arrival sum; (3) Qwen3-30B-A3B-shaped (16 of 48 layers) decode at batch 1 / 8
#     with both fusions on (default) and off (KILN_MOE_ROUTE=separate KILN_MOE_COMBINE=separate), and
#     the batch-1 kernel profile with the defaults.
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s7a.sh OUTDIR   (7 files)
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
MCK=/tmp/ckpt-qwen3moe-L16; MART=/tmp/art-qwen3moe-L16
python bench/make_checkpoint.py --preset qwen3-30b-a3b --num-layers 16 -o $MCK > /dev/null 2>&1 &
P=$!
timeout 150 python -m pytest -q -m gpu tests/ops/test_moe_route.py tests/ops/test_moe_gemm.py \
  tests/ops/test_moe_routing.py tests/ops/test_moe_pdl.py -p no:cacheprovider -rf > "$OUT/tests.log" 2>&1
echo "== tests"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests.log" | tail -8
for mode in separate fused; do
  KILN_MOE_COMBINE=$mode timeout 120 python -m pytest -q bench/test_bench_moe.py \
    -k "test_fused_moe and (1-triton or 8-triton or 4096-triton) and not fp8" -p no:cacheprovider \
    --benchmark-json="$OUT/moe_op_$mode.json" > "$OUT/moe_op_$mode.log" 2>&1 || tail -5 "$OUT/moe_op_$mode.log"
done
python - "$OUT" <<'PY'
import json, sys
for mode in ("separate", "fused"):
    try:
        rows = json.load(open(f"{sys.argv[1]}/moe_op_{mode}.json"))["results"]
    except Exception as e:
        print(mode, "no results", e); continue
    for r in rows:
        print(f"moe op {mode:8s} T={r['t']:5d} {r['ms']*1e3:8.1f} us frac_bw {r.get('frac_bw', 0):.3f} frac_mm {r.get('frac_mm', 0):.3f}")
PY
wait $P
timeout 150 python -m kiln compile $MCK -o $MART --force > "$OUT/compile.log" 2>&1; tail -1 "$OUT/compile.log"
timeout 70 python -m kiln bench latency $MART --batch-sizes 1,8 --input-len 512 --output-len 64 \
  --kv-memory 40 --json "$OUT/moe_latency_fused.json" 2>&1 | grep -v "it/s\]" | tail -3
KILN_MOE_ROUTE=separate KILN_MOE_COMBINE=separate timeout 70 python -m kiln bench latency $MART \
  --batch-sizes 1,8 --input-len 512 --output-len 64 --kv-memory 40 --json "$OUT/moe_latency_separate.json" \
  2>&1 | grep -v "it/s\]" | tail -3
timeout 80 python bench/gpu/profile_decode.py $MART --batch-sizes 1 --json "$OUT/moe_profile.json" 2>&1 | tail -16
