#!/bin/bash
# GPU call 5 of the seventh session (2026-11-30), issue 9 (MoE decode): decode attention with a key
# block's V rows loaded with its K rows (and the block-table row with the length).
# (1) decode attention GPU tests; (2) Qwen3-30B-A3B-shaped (16 of 48 layers) decode at batch 1 / 8:
# the defaults beside Hugging Face, KILN_ATTN_EARLY_V=0 (the old load order), KILN_ATTN_MERGE=fused;
# (3) the batch-1 kernel profile with the defaults.
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s7e.sh OUTDIR   (6 files)
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
moe_checkpoint &
P=$!
gpu_tests tests.log 60 tests/ops/test_decode_attention.py
wait $P
moe_compile
moe_latency default "--compare-hf $MCK"
moe_latency late_v "" KILN_ATTN_EARLY_V=0
moe_latency merge_fused "" KILN_ATTN_MERGE=fused
moe_profile 12
