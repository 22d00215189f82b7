#!/bin/bash
# Written in the twelfth session for the next one (not yet run): KILN_PREWAIT's opt-in `slab` part
# (the one-row qkv and o GEMVs load their whole weight slab before the PDL wait). GPU tests, the
# step bench default vs prewait_slab for both presets, then `kiln bench latency` on one MoE
# artifact, default / slab / default / slab. Usage: bash bench/gpu/run_s13a.sh OUTDIR
# Since run (2026-12-02): `slab` split into `slab` / `slab_norm`, the plain part only for grids of at most
# 8 programs a SM, and all of it on by default; `all` then slabbed every eligible one-row GEMV.
set -o pipefail
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
call_start s13a "$1"
KILN_PREWAIT=all gpu_tests tests.log 150 tests/ops/test_prewait.py tests/ops/test_gemv.py tests/ops/test_norm_linear.py
stamp tests
step_bench 150 "(a3b-1 or llama-3.1-8b-1) and (default or prewait_slab or prewait_off)"
stamp step
moe_checkpoint; stamp checkpoint
moe_compile; stamp compile
{ moe_latency default ""; moe_latency slab "" KILN_PREWAIT=all; moe_latency default_again "";
  moe_latency slab_again "" KILN_PREWAIT=all; } | tee "$OUT/latency_summary.txt"
stamp latency
call_end
