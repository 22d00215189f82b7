#!/bin/bash
# GPU call 6 of the seventh session (2026-11-30), issue 9 (MoE decode):
# (1) GPU tests of what changed after the calls before (the L2 prefetch off by default, the fused
#     router opt-in, the last-arrival top-k sum);
# (2) the 1-token MoE GEMV launch sweep (bench/test_bench_moe.py, GEMV candidates; w2 one pair per
#     program now runs with the last-arrival sum), then the best w13 / w2 pair written as a tuning
#     table (the decode rung of the default table replaced) and the MoE op chained over 8 layers
#     (bench/test_bench_moe_decode.py) with it and with the default table, at 1 / 2 / 4 tokens.
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s7f.sh OUTDIR   (6 files)
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
gpu_tests tests.log 90 tests/ops/test_gemv.py tests/ops/test_moe_route.py tests/ops/test_moe_gemm.py \
  -k "pdl or route or sum_last or gemv_variants"
cd bench
timeout 150 python -m pytest -q test_bench_moe.py -k "test_moe_gemm_sweep and 1tok and gemv" -p no:cacheprovider \
  --benchmark-json="$OUT/moe_sweep_1tok.json" > "$OUT/moe_sweep_1tok.log" 2>&1 || tail -3 "$OUT/moe_sweep_1tok.log"
python - "$OUT" <<'PY'
import json, sys
from kiln.ops import moe_gemm as mg
out = sys.argv[1]
rows = [b["extra_info"] for b in json.load(open(f"{out}/moe_sweep_1tok.json"))["benchmarks"]]
best = {}
for r in sorted(rows, key=lambda r: (r["gemm"], r["ms"])):
    print(f"{r['gemm']:4s} {r['config']:28s} {r['ms'] * 1e3:7.2f} us  frac_bw {r['frac_bw']:.3f}")
    best.setdefault(r["gemm"], r["cfg"])
table = json.loads(mg.moe_tuning_table(128, 768, 2048, 8, 4096))
first = min(table, key=int)
table[first] = {"w13": best["w13"], "w2": best["w2"]}
json.dump(table, open(f"{out}/moe_tuning_1tok.json", "w"))
print("tuning rung", first, "->", table[first])
PY
for tab in default tuned; do
  [ $tab = tuned ] && export KILN_MOE_TUNING="$OUT/moe_tuning_1tok.json"
  timeout 90 python -m pytest -q test_bench_moe_decode.py -k "decode_chain and fused" -p no:cacheprovider \
    --benchmark-json="$OUT/moe_chain_$tab.json" > /dev/null 2>&1
  bench_summary "$OUT/moe_chain_$tab.json" $tab
done
