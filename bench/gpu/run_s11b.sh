#!/bin/bash
# Eleventh session, last GPU call (issue 9): the persistent decode-layer probe once more
# (bench/gpu/mk_probe.py), then the default L16 Qwen3-30B-A3B-shaped artifact's offline throughput
# beside Hugging Face transformers on the same workload (`kiln bench throughput --compare-hf`:
# 200 prompts of 256..1024 tokens, 64..256 out; HF on the first 64 of them at batch 64).
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s11b.sh OUTDIR
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
timeout 120 python bench/gpu/mk_probe.py --json "$OUT/mk_probe.json" > "$OUT/mk_probe.log" 2>&1
grep -v "chunks (stage" "$OUT/mk_probe.log" | tail -6 | cut -c1-600
stamp probe
moe_checkpoint; stamp checkpoint
moe_compile; stamp compile
timeout 330 python -m kiln bench throughput $MART --num-prompts 200 --input-len 256:1024 --output-len 64:256 \
  --kv-memory 40 --compare-hf $MCK --hf-batch-size 64 --hf-num-prompts 64 --json "$OUT/throughput_hf.json" 2>&1 \
  | grep -v "it/s\]" | tail -3
stamp throughput
