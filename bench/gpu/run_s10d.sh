#!/bin/bash
# A record: it ran at commit 68526cf; check that commit out to rerun it
# (the second rope-in-attention version it measures was not kept).
# Tenth session, fourth GPU call (issue 9): the rope inside decode attention, its loads before the
# PDL wait and the new k / v from registers, end to end after its GPU tests. L16
# Qwen3-30B-A3B-shaped compiled with the default (KILN_ROPE_IN_ATTN on) and with
# KILN_ROPE_IN_ATTN=0, `kiln bench latency` on each (batch 1 and 8, same machine), then the default
# artifact's batch-1 kernel sequence.
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s10d.sh OUTDIR
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
gpu_tests tests.log 150 tests/ops/test_decode_rope.py tests/ops/test_qkv_rope.py
(cd bench && timeout 90 python -m pytest -q test_bench_decode_step.py -p no:cacheprovider \
  -k "a3b-1-default or a3b-1-rope_kernel" --benchmark-json="$OUT/decode_step.json" > "$OUT/decode_step.log" 2>&1)
bench_summary "$OUT/decode_step.json"
moe_checkpoint
moe_compile
moe_latency default ""
MART_DEFAULT=$MART
MART=/tmp/art-qwen3moe-L16-ropekernel
KILN_ROPE_IN_ATTN=0 timeout 150 python -m kiln compile $MCK -o $MART --force > "$OUT/compile_ropekernel.log" 2>&1
tail -1 "$OUT/compile_ropekernel.log"
moe_latency rope_kernel ""
MART=$MART_DEFAULT
moe_latency default_again ""
timeout 80 python bench/gpu/profile_decode.py $MART_DEFAULT --batch-sizes 1 --sequence 24 \
  --json "$OUT/profile_default.json" > "$OUT/profile_default.txt" 2>&1
tail -32 "$OUT/profile_default.txt"
