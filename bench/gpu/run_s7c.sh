#!/bin/bash
# GPU call 3 of the seventh session (2026-11-30), issue 9 (MoE decode):
# the L2 prefetch now one piece per thread (call 2's, one row per tensor element, was asked for by
# up to 8 threads each and cost 6% of batch-1 decode), the fused router opt-in.
# (1) GPU tests: every GEMV GPU test, the fused router, the last-arrival top-k sum;
# (2) bench/test_bench_moe_decode.py: the router variants chained over 8 layers;
# (3) Qwen3-30B-A3B-shaped (16 of 48 layers) decode at batch 1 / 8: defaults, KILN_PREFETCH=0,
#     KILN_MOE_ROUTE=fused; the batch-1 kernel profile with the defaults.
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s7c.sh OUTDIR   (8 files)
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
MCK=/tmp/ckpt-qwen3moe-L16; MART=/tmp/art-qwen3moe-L16
python bench/make_checkpoint.py --preset qwen3-30b-a3b --num-layers 16 -o $MCK > /dev/null 2>&1 &
P=$!
timeout 120 python -m pytest -q -m gpu tests/ops/test_moe_route.py tests/ops/test_gemv.py \
  tests/ops/test_moe_gemm.py -k "route or gemv or sum_last" -p no:cacheprovider -rf \
  > "$OUT/tests.log" 2>&1
echo "== tests"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests.log" | tail -6
(cd bench && timeout 200 python -m pytest -q test_bench_moe_decode.py -k route -p no:cacheprovider \
  --benchmark-json="$OUT/moe_decode_chain.json" > "$OUT/moe_decode_chain.log" 2>&1) || tail -5 "$OUT/moe_decode_chain.log"
python - "$OUT/moe_decode_chain.json" <<'PY'
import json, sys
for b in json.load(open(sys.argv[1]))["benchmarks"]:
    e = b["extra_info"]
    print(f"{b['name']:40s} {e['ms'] * 1e3 / e['layers']:7.2f} us/layer  frac_bw {e.get('frac_bw', 0):.3f}")
PY
wait $P
timeout 150 python -m kiln compile $MCK -o $MART --force > "$OUT/compile.log" 2>&1; tail -1 "$OUT/compile.log"
lat() {  # name, env...
  local name=$1; shift
  env "$@" timeout 70 python -m kiln bench latency $MART --batch-sizes 1,8 --input-len 512 --output-len 64 \
    --kv-memory 40 --json "$OUT/moe_latency_$name.json" 2>&1 | grep -v "it/s\]" | tail -2 | sed "s/^/$name /"
}
lat default KILN_X=1
lat noprefetch KILN_PREFETCH=0
lat route_fused KILN_MOE_ROUTE=fused
timeout 80 python bench/gpu/profile_decode.py $MART --batch-sizes 1 --json "$OUT/moe_profile.json" 2>&1 | tail -14
