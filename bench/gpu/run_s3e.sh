#!/bin/bash
# GPU call 5 of the third 2026-11-29 session: runtime/server GPU tests (server wheels from .whl
# installed by the caller), Llama-3.1-8B-shaped decode beside HF with the defaults (issue 6), the
# same compiled with KILN_GEMV=attn (Triton GEMV for qkv and o) at batch 1/8, then the fused-MoE kernel
# rows at Qwen3-30B-A3B shapes, Triton beside torch._grouped_mm (CUTLASS) (issue 9).
# Usage: bash bench/gpu/run_s3e.sh OUTDIR   (6 files)
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
rm -rf /tmp/ckpt-qwen3moe-L16 /tmp/art-qwen3moe-L16
CK=/tmp/ckpt-llama8b; ART=/tmp/art-llama8b
python bench/make_checkpoint.py --preset llama-3.1-8b -o $CK > /dev/null 2>&1 &
CKPID=$!
timeout 130 python -m pytest -q -m gpu tests/server/test_gpu_serve.py tests/runtime/test_staging.py \
  tests/runtime/test_gpu_e2e.py -p no:cacheprovider -rf > "$OUT/gpu_tests.log" 2>&1
grep -E "passed|failed|FAILED" "$OUT/gpu_tests.log" | tail -6
wait $CKPID
timeout 100 python -m kiln compile $CK -o $ART --force 2>&1 | tail -1
timeout 200 python -m kiln bench latency $ART --batch-sizes 1,8,64,256 --input-len 512 --output-len 128 \
  --kv-memory 40 --compare-hf $CK --json "$OUT/latency.json" 2>&1 | grep -v "it/s\]" | tail -7
KILN_GEMV=attn timeout 100 python -m kiln compile $CK -o $ART-gemv --force 2>&1 | tail -1
rm -rf $CK
KILN_GEMV=attn timeout 60 python -m kiln bench latency $ART-gemv --batch-sizes 1,8 --input-len 512 --output-len 128 \
  --kv-memory 40 --json "$OUT/latency_gemv.json" 2>&1 | grep -v "it/s\]" | tail -4
KERNELS=1 E2E=0 KTIMEOUT=${KTIMEOUT:-140} bash bench/gpu/run_moe_e2e.sh "$OUT" 2>&1 | tail -30
python - "$OUT/latency.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["kiln"]:
    print(r["batch"], round(r["decode_tok_s"], 1), f"{r['frac_roofline']:.1%}", "host ms", round(r["host_ms_per_step"], 3),
          {k: round(v, 3) for k, v in r["extra"]["ms_per_step_by_part"].items()})
PY
