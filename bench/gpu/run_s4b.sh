#!/bin/bash
# GPU call 2 of the fourth 2026-11-29 session: (1) GPU tests of the fused decode-attention merge,
# PDL and the GPU end-to-end runtime tests; (2) decode attention fused vs separate merge; (3)
# Llama-3.1-8B-shaped decode beside HF with the new defaults (GEMV plan attn:1,mlp:1 with the tuned
# M = 1 configs, PDL, fused attention merge, Triton argmax), then batch 1 with KILN_PDL=0 and with
# KILN_ATTN_MERGE=separate (run-time switches, same artifact); (4) per-kernel profile at batch 1.
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s4b.sh OUTDIR   (6 files)
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
CK=/tmp/ckpt-llama8b; ART=/tmp/art-llama8b
python bench/make_checkpoint.py --preset llama-3.1-8b -o $CK > /dev/null 2>&1 &
CKPID=$!
timeout 170 python -m pytest -q -m gpu tests/ops/test_decode_attention.py tests/ops/test_gemv.py \
  tests/runtime/test_gpu_e2e.py -k "not test_gpu_matches_reference and not test_gpu_other_paths" \
  -p no:cacheprovider -rf > "$OUT/tests.log" 2>&1
timeout 60 python -m pytest -q bench/test_bench_attention.py -k "test_decode and not sweep and triton" -p no:cacheprovider \
  --benchmark-json="$OUT/attn_raw.json" > /dev/null 2>&1
python bench/report.py "$OUT/attn_raw.json" "$OUT/attention.json" --command \
  "pytest bench/test_bench_attention.py -k 'test_decode and not sweep and triton'" > /dev/null 2>&1; rm -f "$OUT/attn_raw.json"
wait $CKPID
timeout 120 python -m kiln compile $CK -o $ART --force 2>&1 | tail -1
timeout 240 python -m kiln bench latency $ART --batch-sizes 1,8,64,256 --input-len 512 --output-len 128 \
  --kv-memory 40 --compare-hf $CK --json "$OUT/latency.json" 2>&1 | grep -v "it/s\]" | tail -7
KILN_PDL=0 timeout 60 python -m kiln bench latency $ART --batch-sizes 1 --input-len 512 --output-len 128 \
  --kv-memory 40 --json "$OUT/latency_nopdl.json" 2>&1 | grep -v "it/s\]" | tail -2
KILN_ATTN_MERGE=separate timeout 60 python -m kiln bench latency $ART --batch-sizes 1 --input-len 512 --output-len 128 \
  --kv-memory 40 --json "$OUT/latency_sepmerge.json" 2>&1 | grep -v "it/s\]" | tail -2
timeout 100 python bench/gpu/profile_decode.py $ART --batch-sizes 1 --json "$OUT/profile.json" 2>&1 | tail -22
echo "== decode attention (us, frac of read bandwidth)"
python - "$OUT/attention.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    print(f"{r['name'][:60]:<60} {r.get('ms', 0) * 1e3:8.1f} us  bw {r.get('frac_bw', 0):.3f}")
PY
echo "== latency"
python - "$OUT"/latency.json "$OUT"/latency_nopdl.json "$OUT"/latency_sepmerge.json <<'PY'
import json, sys
for f in sys.argv[1:]:
    try:
        d = json.load(open(f))
    except Exception as e:
        print(f, "missing", e); continue
    for r in d["kiln"]:
        print(f.split("/")[-1], r["batch"], round(r["decode_tok_s"], 1), f"{r['frac_roofline']:.1%}", "host ms", round(r["host_ms_per_step"], 3))
    for b, r in (d.get("hf") or {}).items():
        print("  hf", b, round(r.get("decode_tok_s", 0), 1))
PY
echo "== tests"; grep -E "passed|failed|FAILED" "$OUT/tests.log" | tail -8
