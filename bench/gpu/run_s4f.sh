#!/bin/bash
# GPU call 6 of the fourth 2026-11-29 session: the final defaults after the host-path work.
# (1) the overlapped-decoding and CUDA-graph GPU tests; (2) Llama-3.1-8B-shaped decode latency
# (host time per step at batch 64) and start-up to first token; (3) Qwen3-30B-A3B-shaped (16 layers)
# batch 1 / 8 with the router on the GEMV.
# Usage: bash bench/gpu/run_s4f.sh OUTDIR   (5 files)
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
CK=/tmp/ckpt-llama8b; ART=/tmp/art-llama8b; MCK=/tmp/ckpt-qwen3moe-L16; MART=/tmp/art-qwen3moe-L16
python bench/make_checkpoint.py --preset llama-3.1-8b -o $CK > /dev/null 2>&1 &
P1=$!
python bench/make_checkpoint.py --preset qwen3-30b-a3b --num-layers 16 -o $MCK > /dev/null 2>&1 &
P2=$!
wait $P1
timeout 100 python -m kiln compile $CK -o $ART --force 2>&1 | tail -1
timeout 70 python -m pytest -q -m gpu tests/runtime/test_gpu_e2e.py -k "overlapped or graph_replay" \
  -p no:cacheprovider -rf > "$OUT/tests.log" 2>&1 &
P3=$!
wait $P2 $P3
timeout 100 python -m kiln bench latency $ART --batch-sizes 1,8,64,256 --input-len 512 --output-len 128 \
  --kv-memory 40 --json "$OUT/latency.json" 2>&1 | grep -v "it/s\]" | tail -6
timeout 60 python -m kiln bench startup $ART --runs 2 --json "$OUT/startup.json" 2>&1 | tail -4
rm -rf $CK $ART
timeout 120 python -m kiln compile $MCK -o $MART --force 2>&1 | tail -1
timeout 60 python -m kiln bench latency $MART --batch-sizes 1,8 --input-len 512 --output-len 64 \
  --kv-memory 40 --json "$OUT/moe_latency.json" 2>&1 | grep -v "it/s\]" | tail -3
python - "$OUT/latency.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["kiln"]:
    print(r["batch"], round(r["decode_tok_s"], 1), "host ms", round(r["host_ms_per_step"], 3),
          {k: round(v, 3) for k, v in r["extra"]["ms_per_step_by_part"].items()})
PY
echo "== tests"; grep -E "passed|failed|FAILED" "$OUT/tests.log" | tail -4
