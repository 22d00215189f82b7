#!/bin/bash
# One GPU call: serving bench (issue 7) + GPU server/staging/e2e tests, decode with and without
# --overlap, and the attention/qkv launch-configuration sweeps (issue 4), on a Llama-3.1-8B-shaped
# bf16 checkpoint. Needs the server wheels carried in .whl (see bench/results/README.md).
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_serve_sweeps.sh OUTDIR
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
CK=/tmp/ckpt-llama8b; ART=/tmp/art-llama8b
( python bench/make_checkpoint.py --preset llama-3.1-8b -o $CK > "$OUT/prep.log" 2>&1 &&
  timeout 150 python -m kiln compile $CK -o $ART --force >> "$OUT/prep.log" 2>&1 ) &
PREP=$!
timeout 150 python -m pytest -q bench/test_bench_attention.py bench/test_bench_qkv_rope.py -k sweep \
  -p no:cacheprovider --benchmark-json="$OUT/sweeps_raw.json" > "$OUT/sweeps.log" 2>&1
python bench/report.py "$OUT/sweeps_raw.json" "$OUT/sweeps.json" --command "pytest bench -k sweep" \
  > "$OUT/sweeps_table.txt" 2>&1
wait $PREP; tail -2 "$OUT/prep.log"
timeout 200 python -m pytest -q -m gpu tests/server/test_gpu_serve.py tests/runtime/test_staging.py \
  tests/runtime/test_gpu_e2e.py -p no:cacheprovider -rf 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
timeout 120 python bench/serve.py --artifact $ART --num-prompts 500 --rate 16 --input-len 512 \
  --output-len 128 --range-ratio 0.5 --json "$OUT/serve.json" > "$OUT/serve.log" 2>&1; tail -14 "$OUT/serve.log"
for ov in "" "--overlap"; do
  timeout 90 python -m kiln bench latency $ART --batch-sizes 1,64 --input-len 512 --output-len 128 \
    --kv-memory 40 $ov --json "$OUT/latency${ov:+_overlap}.json" 2>&1 | grep -v "it/s\]" | tail -3
done
echo "== sweeps: best 3 per case (fraction, ms, config, splits)"
python - "$OUT/sweeps.json" <<'PY'
import collections, json, sys
rows = json.load(open(sys.argv[1]))["results"]
best = collections.defaultdict(list)
for r in rows:
    if "ms" not in r:
        continue
    key = (r["name"].split("[")[0], r.get("prefix"), r.get("batch"), r.get("ctx"), r.get("tokens"))
    best[key].append((round(r.get("frac_bw", r.get("frac_mm", 0)), 3), round(r["ms"], 4), r.get("config"), r.get("num_splits")))
for k, v in sorted(best.items(), key=str):
    print(k, sorted(v, key=lambda t: -t[0])[:3])
PY
