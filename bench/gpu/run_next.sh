#!/bin/bash
# First GPU call of the next session: what the third 2026-11-29 session changed but could not run
# on the GPU (its device time ran out). Needs the server wheels: prefix the command with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit;
# (1) runtime/server/routing GPU tests in one process: the load-time JIT test after the driver
#     helper fix, moe_topk round_to on the GPU;
# (2) Qwen3-30B-A3B-shaped (16 layers) decode at batch 1/8 with the fused routing-weight cast,
#     default and compiled with KILN_GEMV=attn (qkv/o through the Triton GEMV; cuBLAS reached 43%
#     of read bandwidth there at batch 1), with a per-kernel profile at batch 1;
# (3) the same compiled with --moe-tune (measured fused-MoE launch table; first run on a GPU).
# Usage: bash bench/gpu/run_next.sh OUTDIR   (6 files; may need two calls: stages are independent)
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
CK=/tmp/ckpt-qwen3moe-L16; ART=/tmp/art-qwen3moe-L16
python bench/make_checkpoint.py --preset qwen3-30b-a3b --num-layers 16 -o $CK > /dev/null 2>&1 &
CKPID=$!
timeout 200 python -m pytest -q -m gpu tests/server/test_gpu_serve.py tests/runtime/test_staging.py \
  tests/runtime/test_gpu_e2e.py tests/ops/test_moe_routing.py -p no:cacheprovider -rf > "$OUT/gpu_tests.log" 2>&1
wait $CKPID
timeout 200 python -m kiln compile $CK -o $ART --force 2>&1 | tail -1
timeout 120 python -m kiln bench latency $ART --batch-sizes 1,8 --input-len 512 --output-len 64 \
  --kv-memory 40 --json "$OUT/moe_latency.json" 2>&1 | grep -v "it/s\]" | tail -3
timeout 100 python bench/gpu/profile_decode.py $ART --batch-sizes 1 --json "$OUT/moe_profile.json" 2>&1 | tail -16
rm -rf $ART
KILN_GEMV=attn timeout 200 python -m kiln compile $CK -o $ART-gemv --force 2>&1 | tail -1
KILN_GEMV=attn timeout 120 python -m kiln bench latency $ART-gemv --batch-sizes 1,8 --input-len 512 --output-len 64 \
  --kv-memory 40 --json "$OUT/moe_latency_gemv_attn.json" 2>&1 | grep -v "it/s\]" | tail -3
rm -rf $ART-gemv
# (3) compile-time MoE tuning (kiln compile --moe-tune): the per-rung report is in the manifest
timeout 400 python -m kiln compile $CK -o $ART-tuned --force --moe-tune 2>&1 | tail -1
python -c "import json,sys; m=json.load(open('$ART-tuned/manifest.json'))['kernel_choices']['moe']; [print(r) for r in m.get('report', [])]" 2>&1 | tail -16
timeout 120 python -m kiln bench latency $ART-tuned --batch-sizes 1,8 --input-len 512 --output-len 64 \
  --kv-memory 40 --json "$OUT/moe_latency_tuned.json" 2>&1 | grep -v "it/s\]" | tail -3
grep -E "passed|failed|FAILED" "$OUT/gpu_tests.log" | tail -6
