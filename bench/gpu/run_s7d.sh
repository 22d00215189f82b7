#!/bin/bash
# GPU call 4 of the seventh session (2026-11-30), issue 9 (MoE decode): decode attention's fewest
# keys per split (KILN_ATTN_MIN_KEYS: a request far shorter than its bucket runs fewer, longer
# splits; one split writes directly and the merge kernel exits at once).
# (1) decode attention GPU tests with KILN_ATTN_MIN_KEYS=512; (2) Qwen3-30B-A3B-shaped (16 of 48
# layers) decode at batch 1 / 8 with KILN_ATTN_MIN_KEYS 0 (default) / 256 / 512 / 1024;
# (3) the FP8 / CUTLASS GPU tests the sixth session changed after its last device call (run_next.sh).
# Carry: bench/cutlass_probe/out, bench/cutlass_probe/whl.
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s7d.sh OUTDIR   (7 files)
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
moe_checkpoint &
P=$!
KILN_ATTN_MIN_KEYS=512 gpu_tests tests_attn.log 60 tests/ops/test_decode_attention.py
wait $P
moe_compile
for mk in 0 256 512 1024; do
  moe_latency minkeys$mk "" KILN_ATTN_MIN_KEYS=$mk
done
rm -rf $MCK $MART
# the sixth session's FP8 / CUTLASS GPU tests changed after its last device call (run_next.sh's list
# without the end-to-end file)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  bench/cutlass_probe/whl/*.whl > /dev/null 2>&1
export KILN_CUTLASS_LIB=$PWD/bench/cutlass_probe/out/kiln/cutlass_moe_sm90.so
export KILN_CUTLASS_FP8_LIB=$PWD/bench/cutlass_probe/out/kiln/cutlass_fp8_sm90.so
PYTHONPATH=/tmp/site:$PYTHONPATH gpu_tests tests_fp8.log 170 tests/ops/test_fp8_cutlass.py \
  tests/ops/test_gemv_fp8.py tests/ops/test_fp8_gemm.py tests/ops/test_fp8_linear.py tests/compiler/test_compile_cutlass.py
