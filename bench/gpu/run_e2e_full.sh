#!/bin/bash
# GPU run: weight-pack load bench, then Llama-3.1-8B-shaped end to end: compile, start-up, decode
# latency vs HF and the roofline, offline throughput, a per-kernel profile of decode, the report.
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
CK=/tmp/ckpt-llama8b; ART=/tmp/art-llama8b
if [ -n "$WEIGHTS" ]; then
  timeout 200 python bench/weights_load.py --json "$OUT/weights_load.json" --threads 8,16 --chunks-mib 16,64 \
    --reps 2 2>&1 | tail -14
fi
[ -f $CK/config.json ] || python bench/make_checkpoint.py --preset llama-3.1-8b -o $CK 2>&1 | tail -1
[ -f $ART/manifest.json ] || timeout 300 python -m kiln compile $CK -o $ART --force 2>&1 | grep -E "artifact|Error|error" | tail -3
[ -z "$SKIP_LAT" ] && python -m kiln bench startup $ART --runs 2 --json "$OUT/startup.json" 2>&1 | tail -2
[ -z "$SKIP_LAT" ] && timeout 330 python -m kiln bench latency $ART --batch-sizes ${BATCHES:-1,8,64,256} --input-len 512 \
  --output-len ${OUTLEN:-128} --kv-memory 60 --compare-hf $CK --json "$OUT/latency.json" 2>&1 | grep -v "it/s\]" | tail -7
[ -n "$NPROMPTS" ] && timeout 200 python -m kiln bench throughput $ART --num-prompts $NPROMPTS --kv-memory 80 \
  --json "$OUT/throughput.json" 2>&1 | tail -1
[ -n "$PROFILE" ] && timeout 120 python bench/gpu/profile_decode.py $ART --batch-sizes 1,64 --json "$OUT/profile.json" 2>&1 | tail -34
[ -z "$SKIP_LAT" ] && python -m kiln bench report --latency "$OUT/latency.json" --startup "$OUT/startup.json" \
  ${NPROMPTS:+--throughput "$OUT/throughput.json"} --json "$OUT/report.json" --plot "$OUT/report.png" | tail -5
