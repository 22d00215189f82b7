#!/bin/bash
# Start-up diagnosis: import profile and cProfile of LLM(ART) on the 8B artifact from run_s3a.sh.
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh > /dev/null
ART=/tmp/art-llama8b
[ -f $ART/manifest.json ] || { python bench/make_checkpoint.py --preset llama-3.1-8b -o /tmp/ckpt-llama8b > /dev/null 2>&1; python -m kiln compile /tmp/ckpt-llama8b -o $ART --force 2>&1 | tail -1; }
python -X importtime -c "from kiln import LLM" 2> "$OUT/importtime.txt"
sort -t'|' -k2 -n -r "$OUT/importtime.txt" | head -25
timeout 200 python bench/gpu/prof_startup.py $ART --out "$OUT/prof.txt" 2>&1 | grep -v "^ *$" | head -90
