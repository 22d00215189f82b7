#!/bin/bash
# Sixth session: the CUTLASS FP8 GEMM library (ops/cutlass/sm90_fp8_gemm.cu, built on the CPU machine
# into bench/cutlass_probe/out/kiln/cutlass_fp8_sm90.so, carried) against Triton, cuBLAS and bf16.
# Usage (repo root, carry bench/cutlass_probe/out): bash bench/gpu/run_s6b.sh OUT
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
timeout 500 python bench/gpu/fp8_cutlass_bench.py bench/cutlass_probe/out/kiln/cutlass_fp8_sm90.so \
  "$OUT/fp8_cutlass_bench.json" > "$OUT/fp8_cutlass_bench.log" 2>&1
grep -c '"error"' "$OUT/fp8_cutlass_bench.log"; grep '"error"' "$OUT/fp8_cutlass_bench.log" | head -3 | cut -c1-400
sed -n '/^ *m /,$p' "$OUT/fp8_cutlass_bench.log"; tail -3 "$OUT/fp8_cutlass_bench.log"
