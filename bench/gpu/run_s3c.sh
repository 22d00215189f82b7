#!/bin/bash
# GPU call 3 of the third 2026-11-29 session: GPU tests of the runtime and server (direct op
# dispatch, overlap on by default, table detokenizer), then the Llama-3.1-8B-shaped end to end:
# compile, start-up (2 runs), decode beside Hugging Face at batch 1/8/64/256 with the defaults.
# Usage: bash bench/gpu/run_s3c.sh OUTDIR   (writes 4 files; the table is printed last)
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
CK=/tmp/ckpt-llama8b; ART=/tmp/art-llama8b
[ -f $CK/config.json ] || python bench/make_checkpoint.py --preset llama-3.1-8b -o $CK > /dev/null 2>&1 &
CKPID=$!
timeout 150 python -m pytest -q -m gpu tests/server/test_gpu_serve.py tests/runtime/test_staging.py \
  tests/runtime/test_gpu_e2e.py -p no:cacheprovider -rf > "$OUT/gpu_tests.log" 2>&1
wait $CKPID
[ -f $ART/graphs/model.py ] || timeout 120 python -m kiln compile $CK -o $ART --force 2>&1 | tail -1
timeout 80 python -m kiln bench startup $ART --runs 2 --json "$OUT/startup.json" 2>&1 | tail -3
timeout 240 python -m kiln bench latency $ART --batch-sizes 1,8,64,256 --input-len 512 --output-len 128 \
  --kv-memory 40 --compare-hf $CK --json "$OUT/latency.json" 2>&1 | grep -v "it/s\]" | tail -8
python - "$OUT/latency.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["kiln"]:
    print(r["batch"], round(r["decode_tok_s"], 1), f"{r['frac_roofline']:.1%}", "host ms", round(r.get("host_ms_per_step", float("nan")), 3),
          {k: round(v, 3) for k, v in r.get("extra", {}).get("ms_per_step_by_part", {}).items()})
PY
grep -E "passed|failed|FAILED" "$OUT/gpu_tests.log" | tail -6
