#!/bin/bash
# Sixth session, first GPU call: bench/gpu/run_next.sh (GPU tests written after session five's device
# time ran out, then Llama-3.1-8B --quant fp8 with KILN_FP8_GEMM=auto vs cublas), with the CUTLASS
# MoE library carried (bench/cutlass_probe/{whl,out}, git-ignored) so tests/ops/test_moe_cutlass.py
# runs on the GPU instead of skipping.
# Usage (repo root, carry bench/cutlass_probe/whl and bench/cutlass_probe/out): bash bench/gpu/run_s6a.sh OUT
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  bench/cutlass_probe/whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export KILN_CUTLASS_LIB=$PWD/bench/cutlass_probe/out/kiln/cutlass_moe_sm90.so
bash bench/gpu/run_next.sh "$OUT"
