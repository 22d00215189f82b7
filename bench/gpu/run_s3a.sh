#!/bin/bash
# GPU call 1 of the third 2026-11-29 session: (1) the load-time JIT question
# (test_loading_compiles_no_triton_kernel) and the overlap correctness test; (2) the norm launch
# sweep at 4096 tokens; (3) 8B start-up with graphs as Python source vs .pt2; (4) per-kernel decode
# profile at batch 1 and 64. Five files into OUTDIR; tables printed last.
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s3a.sh OUTDIR
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
timeout 240 python -m pytest -v -m gpu tests/runtime/test_gpu_e2e.py tests/ops/test_gemv.py -k \
  "loading_compiles or overlapped or 14336" -p no:cacheprovider -rf > "$OUT/tests.log" 2>&1
timeout 100 python -m pytest -q bench/test_bench_norm.py -k "fused_add_rmsnorm_sweep and 4096" -p no:cacheprovider \
  --benchmark-json="$OUT/norm_sweep_raw.json" > /dev/null 2>&1
python bench/report.py "$OUT/norm_sweep_raw.json" "$OUT/norm_sweep.json" --command "pytest bench/test_bench_norm.py -k 'fused_add_rmsnorm_sweep and 4096'" > "$OUT/norm_sweep.txt" 2>&1
rm -f "$OUT/norm_sweep_raw.json"
CK=/tmp/ckpt-llama8b; ART=/tmp/art-llama8b
python bench/make_checkpoint.py --preset llama-3.1-8b -o $CK > /dev/null 2>&1
timeout 120 python -m kiln compile $CK -o $ART --force 2>&1 | tail -1
for fmt in python pt2; do
  KILN_GRAPH_FORMAT=$fmt timeout 90 python -m kiln bench startup $ART --runs 1 --json "$OUT/startup_$fmt.json" 2>&1 | tail -3
done
timeout 120 python bench/gpu/profile_decode.py $ART --batch-sizes 1,64 --json "$OUT/profile.json" 2>&1 | tail -34
echo "== norm sweep at 4096 tokens (frac of read bandwidth, us)"
python - "$OUT/norm_sweep.json" <<'PY'
import json, sys
for r in sorted(json.load(open(sys.argv[1]))["results"], key=lambda r: (r.get("variant"), -r.get("frac_bw", 0))):
    print(r.get("variant"), r.get("rows_per_program"), r.get("num_warps"), round(r.get("frac_bw", 0), 3), round(r.get("ms", 0) * 1e3, 1))
PY
echo "== tests"; grep -E "PASS|FAIL|Error|new Triton|passed|failed" "$OUT/tests.log" | head -30
