#!/bin/bash
# First GPU call of the next session: what the fourth 2026-11-29 session could not run (its device
# time ran out). Stages are independent; each fits one call.
#   STAGE=tune  (default) Qwen3-30B-A3B-shaped (16 layers): compile with --moe-tune (the measured
#               fused-MoE launch table, never run on a GPU yet) beside the default table, decode at
#               batch 1/8 for both; the per-rung report is printed from the manifest.
#   STAGE=fp8   issue 4: the Triton FP8 GEMM launch sweep at M = 256 / 512 with the clean L2 flush
#               (bench/conftest.py), against cuBLAS _scaled_mm and bf16.
#   STAGE=norm  the persistent norm GPU tests after the stage cap (tests/ops/test_norm.py -k persistent).
# The CUTLASS probe is its own call: see bench/cutlass_probe/README.md.
# Usage: STAGE=tune bash bench/gpu/run_next.sh OUTDIR
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
case "${STAGE:-tune}" in
tune)
  CK=/tmp/ckpt-qwen3moe-L16; ART=/tmp/art-qwen3moe-L16
  python bench/make_checkpoint.py --preset qwen3-30b-a3b --num-layers 16 -o $CK > /dev/null 2>&1
  timeout 150 python -m kiln compile $CK -o $ART --force 2>&1 | tail -1
  timeout 60 python -m kiln bench latency $ART --batch-sizes 1,8 --input-len 512 --output-len 64 \
    --kv-memory 40 --json "$OUT/moe_latency_default.json" 2>&1 | grep -v "it/s\]" | tail -3
  rm -rf $ART
  timeout 400 python -m kiln compile $CK -o $ART-tuned --force --moe-tune 2>&1 | tail -1
  python -c "import json; m=json.load(open('$ART-tuned/manifest.json'))['kernel_choices']['moe']; [print(r) for r in m.get('report', [])]" 2>&1 | tail -16
  timeout 60 python -m kiln bench latency $ART-tuned --batch-sizes 1,8 --input-len 512 --output-len 64 \
    --kv-memory 40 --json "$OUT/moe_latency_tuned.json" 2>&1 | grep -v "it/s\]" | tail -3
  ;;
fp8)
  KILN_SWEEP_M=256,512 timeout 500 python -m pytest -q bench/test_bench_fp8_linear.py -k "fp8_gemm_sweep" \
    -p no:cacheprovider --benchmark-json="$OUT/raw.json" > "$OUT/fp8.log" 2>&1
  python bench/report.py "$OUT/raw.json" "$OUT/fp8_sweep_clean.json" --command \
    "KILN_SWEEP_M=256,512 pytest bench/test_bench_fp8_linear.py -k fp8_gemm_sweep" > /dev/null 2>&1
  rm -f "$OUT/raw.json"; tail -2 "$OUT/fp8.log"
  ;;
norm)
  timeout 200 python -m pytest -q -m gpu tests/ops/test_norm.py -k persistent -p no:cacheprovider -rf \
    > "$OUT/norm_tests.log" 2>&1
  grep -E "passed|failed|FAILED" "$OUT/norm_tests.log" | tail -6
  ;;
esac
