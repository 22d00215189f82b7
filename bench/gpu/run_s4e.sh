#!/bin/bash
# GPU call 5 of the fourth 2026-11-29 session: issue 4's norm (4096 tokens) and FP8 linear (M = 256)
# rows with the clean L2 flush (the bench/conftest.py default; run_s4d.sh's clean half failed on a
# torch.sum overload), beside the same rows with the dirty flush in the same run.
# Usage: bash bench/gpu/run_s4e.sh OUTDIR   (2 files)
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
SEL="(fused_add_rmsnorm_sweep and 4096 and not persistent) or (test_fp8_linear and 256- and not ref_eager and not compile)"
for mode in clean dirty; do
  KILN_BENCH_FLUSH=$mode timeout 150 python -m pytest -q bench/test_bench_norm.py bench/test_bench_fp8_linear.py \
    -k "$SEL" -p no:cacheprovider --benchmark-json="$OUT/raw_$mode.json" > "$OUT/log_$mode.txt" 2>&1
  tail -3 "$OUT/log_$mode.txt"
  KILN_BENCH_FLUSH=$mode python bench/report.py "$OUT/raw_$mode.json" "$OUT/kernels_$mode.json" --command \
    "KILN_BENCH_FLUSH=$mode pytest bench/test_bench_norm.py bench/test_bench_fp8_linear.py -k '$SEL'" > /dev/null 2>&1
  rm -f "$OUT/raw_$mode.json" "$OUT/log_$mode.txt"
done
echo "== kernels: clean / dirty L2 flush (us, frac of read bandwidth, fp8 speedup vs bf16)"
python - "$OUT/kernels_clean.json" "$OUT/kernels_dirty.json" <<'PY'
import json, sys
c, d = (json.load(open(f))["results"] for f in sys.argv[1:])
dd = {r["name"]: r for r in d}
for r in c:
    o = dd.get(r["name"], {})
    sp = f" x{r['speedup_vs_bf16']:.2f} / x{o.get('speedup_vs_bf16', 0):.2f}" if "speedup_vs_bf16" in r else ""
    print(f"{r['name'][15:70]:<55} {r['ms'] * 1e3:6.1f} / {o.get('ms', 0) * 1e3:6.1f} us  bw {r.get('frac_bw', 0):.3f} / {o.get('frac_bw', 0):.3f}{sp}")
PY
