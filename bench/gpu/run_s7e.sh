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
MCK=/tmp/ckpt-qwen3moe-L16; MART=/tmp/art-qwen3moe-L16
python bench/make_checkpoint.py --preset qwen3-30b-a3b --num-layers 16 -o $MCK > /dev/null 2>&1 &
P=$!
timeout 60 python -m pytest -q -m gpu tests/ops/test_decode_attention.py -p no:cacheprovider -rf > "$OUT/tests.log" 2>&1
echo "== attention tests"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests.log" | tail -4
wait $P
timeout 150 python -m kiln compile $MCK -o $MART --force > "$OUT/compile.log" 2>&1; tail -1 "$OUT/compile.log"
lat() {  # name, extra args, env...
  local name=$1 extra=$2; shift 2
  env "$@" timeout 150 python -m kiln bench latency $MART --batch-sizes 1,8 --input-len 512 --output-len 64 \
    --kv-memory 40 $extra --json "$OUT/moe_latency_$name.json" > /dev/null 2>&1
  python -c "import json; d=json.load(open('$OUT/moe_latency_$name.json')); [print('$name batch', r['batch'], round(r['decode_tok_s'], 1), 'tok/s', round(100 * r['frac_roofline'], 1), '%', 'HF', round(d['hf'][str(r['batch'])]['decode_tok_s'], 1) if 'hf' in d else '-') for r in d['kiln']]"
}
lat default "--compare-hf $MCK" KILN_X=1
lat late_v "" KILN_ATTN_EARLY_V=0
lat merge_fused "" KILN_ATTN_MERGE=fused
timeout 80 python bench/gpu/profile_decode.py $MART --batch-sizes 1 --json "$OUT/moe_profile.json" 2>&1 | tail -12
