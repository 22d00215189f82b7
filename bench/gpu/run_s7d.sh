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
MCK=/tmp/ckpt-qwen3moe-L16; MART=/tmp/art-qwen3moe-L16
python bench/make_checkpoint.py --preset qwen3-30b-a3b --num-layers 16 -o $MCK > /dev/null 2>&1 &
P=$!
KILN_ATTN_MIN_KEYS=512 timeout 60 python -m pytest -q -m gpu tests/ops/test_decode_attention.py \
  -p no:cacheprovider -rf > "$OUT/tests_attn.log" 2>&1
echo "== attention tests (min keys 512)"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests_attn.log" | tail -4
wait $P
timeout 150 python -m kiln compile $MCK -o $MART --force > "$OUT/compile.log" 2>&1; tail -1 "$OUT/compile.log"
for mk in 0 256 512 1024; do
  KILN_ATTN_MIN_KEYS=$mk timeout 70 python -m kiln bench latency $MART --batch-sizes 1,8 --input-len 512 \
    --output-len 64 --kv-memory 40 --json "$OUT/moe_latency_minkeys$mk.json" > /dev/null 2>&1
  python -c "import json; d=json.load(open('$OUT/moe_latency_minkeys$mk.json')); [print('min_keys $mk batch', r['batch'], round(r['decode_tok_s'], 1), 'tok/s', round(100 * r['frac_roofline'], 1), '%') for r in d['kiln']]"
done
rm -rf $MCK $MART
# the sixth session's FP8 / CUTLASS GPU tests changed after its last device call (run_next.sh's list
# without the end-to-end file)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  bench/cutlass_probe/whl/*.whl > /dev/null 2>&1
export KILN_CUTLASS_LIB=$PWD/bench/cutlass_probe/out/kiln/cutlass_moe_sm90.so
export KILN_CUTLASS_FP8_LIB=$PWD/bench/cutlass_probe/out/kiln/cutlass_fp8_sm90.so
PYTHONPATH=/tmp/site:$PYTHONPATH timeout 170 python -m pytest -q -m gpu tests/ops/test_fp8_cutlass.py \
  tests/ops/test_gemv_fp8.py tests/ops/test_fp8_gemm.py tests/ops/test_fp8_linear.py \
  tests/compiler/test_compile_cutlass.py -p no:cacheprovider -rf > "$OUT/tests_fp8.log" 2>&1
echo "== FP8 / CUTLASS tests"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests_fp8.log" | tail -6
