#!/bin/bash
# GPU call 3 of the fourth 2026-11-29 session: (1) GPU tests of the MoE and sampling kernels with
# PDL; (2) Llama-3.1-8B-shaped decode beside HF with the final defaults (GEMV plan attn:1,mlp:1,
# PDL, separate attention merge); (3) Qwen3-30B-A3B-shaped (16 of 48 layers) decode beside HF with
# the same defaults, and its batch-1 kernel profile.
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s4c.sh OUTDIR   (4 files)
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
CK=/tmp/ckpt-llama8b; ART=/tmp/art-llama8b; MCK=/tmp/ckpt-qwen3moe-L16; MART=/tmp/art-qwen3moe-L16
python bench/make_checkpoint.py --preset llama-3.1-8b -o $CK > /dev/null 2>&1 &
P1=$!
python bench/make_checkpoint.py --preset qwen3-30b-a3b --num-layers 16 -o $MCK > /dev/null 2>&1 &
P2=$!
timeout 100 python -m pytest -q -m gpu tests/ops/test_moe_gemm.py tests/ops/test_moe_routing.py \
  tests/ops/test_moe_align.py tests/ops/test_moe_pdl.py tests/runtime/test_sampler.py -p no:cacheprovider -rf \
  > "$OUT/tests.log" 2>&1
wait $P1 $P2
timeout 100 python -m kiln compile $CK -o $ART --force 2>&1 | tail -1
timeout 200 python -m kiln bench latency $ART --batch-sizes 1,8,64,256 --input-len 512 --output-len 128 \
  --kv-memory 40 --compare-hf $CK --json "$OUT/latency.json" 2>&1 | grep -v "it/s\]" | tail -7
rm -rf $CK $ART
timeout 150 python -m kiln compile $MCK -o $MART --force 2>&1 | tail -1
timeout 150 python -m kiln bench latency $MART --batch-sizes 1,8,64 --input-len 512 --output-len 64 \
  --kv-memory 40 --compare-hf $MCK --json "$OUT/moe_latency.json" 2>&1 | grep -v "it/s\]" | tail -5
timeout 70 python bench/gpu/profile_decode.py $MART --batch-sizes 1 --json "$OUT/moe_profile.json" 2>&1 | tail -18
echo "== tests"; grep -E "passed|failed|FAILED" "$OUT/tests.log" | tail -8
