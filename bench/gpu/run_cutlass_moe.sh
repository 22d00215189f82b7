#!/bin/bash
# The CUTLASS backend of the fused MoE op (ops/moe_cutlass.py) on the H200: GPU tests, Triton and
# CUTLASS side by side in the MoE benchmark, a per-stage split of the CUTLASS path, and tiny
# Qwen3-MoE compile with --moe-backend cutlass and the auto choice at one rung. At most BUDGET seconds
# (default 330) after the setup: each stage gets min(its cap, what is left), in priority order.
#
#   here (CPU, once):  bash bench/gpu/run_cutlass_moe.sh prep     # the library, ~1 min (nvcc; cached)
#   GPU:  run(carry=["bench/cutlass_probe/whl", "bench/cutlass_probe/out"],
#             command="bash bench/gpu/run_cutlass_moe.sh")
#
# prep writes bench/cutlass_probe/out/kiln/cutlass_moe_sm90.so (git-ignored, carried); without it,
# or if it does not load there, the GPU side builds it with its own nvcc (~1 min more).
# Writes to $OUT: gpu_tests.log, bench.log, moe_cutlass_bench.json, stages.json, compile_tests.log.
set -uo pipefail
LIB=bench/cutlass_probe/out/kiln/cutlass_moe_sm90.so
WHL=bench/cutlass_probe/whl
site() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$1" $WHL/*.whl; }

if [ "${1:-}" = prep ]; then
  [ -d $WHL ] || { echo "no $WHL: run bench/cutlass_probe/prep.sh first"; exit 1; }
  site /tmp/kiln_cutlass_site || exit 1
  PYTHONPATH=/tmp/kiln_cutlass_site .venv/bin/python -c "
from kiln.compiler.cutlass_build import build_library; print(build_library('$(dirname $LIB)', verbose=True))"
  ls -la $LIB; exit
fi

OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DEADLINE=$((SECONDS + ${BUDGET:-330} + 60))  # + the setup below
cap() { local left=$((DEADLINE - SECONDS)); [ "$left" -lt 1 ] && left=1; [ "$left" -lt "$1" ] && echo "$left" || echo "$1"; }
site /tmp/site && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || exit 1  # headers, if a build is needed
source bench/gpu/env.sh
nvidia-smi -L; nvcc --version 2>/dev/null | tail -1
export KILN_CUTLASS_CACHE=/tmp/kiln_cutlass_cache
if python3 -c "import ctypes, sys; assert ctypes.CDLL(sys.argv[1]).kg_abi() == 1" "$LIB" 2>/dev/null; then
  export KILN_CUTLASS_LIB=$PWD/$LIB; echo "prebuilt library: $KILN_CUTLASS_LIB"
else
  echo "building the library here"
  timeout 240 python3 -c "from kiln.compiler.cutlass_build import build_library; print(build_library('/tmp/kg', verbose=True))" \
    && export KILN_CUTLASS_LIB=/tmp/kg/cutlass_moe_sm90.so
fi

echo "== 1. GPU tests: fused_moe_cutlass vs fused_moe_ref, empty experts, expert map, CUDA graph replay"
timeout $(cap 150) python3 -m pytest -q -m gpu tests/ops/test_moe_cutlass.py -p no:cacheprovider -rfs > "$OUT/gpu_tests.log" 2>&1
tail -3 "$OUT/gpu_tests.log"

echo "== 2. bench: kiln.fused_moe (Triton) vs the CUTLASS backend, E=128 top-8 H=2048 I=768, CUDA graphs"
timeout $(cap 120) python3 -m pytest -q bench/test_bench_moe.py -p no:cacheprovider --benchmark-json="$OUT/raw.json" \
  -k "test_fused_moe and not sweep and not fp8 and (triton or cutlass_sm90)" > "$OUT/bench.log" 2>&1
tail -2 "$OUT/bench.log"
python3 bench/report.py "$OUT/raw.json" "$OUT/moe_cutlass_bench.json" --command \
  "bash bench/gpu/run_cutlass_moe.sh (pytest bench/test_bench_moe.py -k 'test_fused_moe and (triton or cutlass_sm90)')" > /dev/null 2>&1
rm -f "$OUT/raw.json"

echo "== 3. stages of the CUTLASS path (us per call, CUDA events, L2 warm)"
timeout $(cap 50) python3 - "$OUT/stages.json" <<'EOF' 2>&1 | tail -4
import json, sys, torch
from kiln.ops import activation, moe_cutlass as mc, moe_permute as mp
mc.load_library(__import__("os").environ["KILN_CUTLASS_LIB"])
H, I, E, K = 2048, 768, 128, 8
g = torch.Generator("cuda").manual_seed(0)
w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H**0.5).bfloat16()
w2 = (torch.randn(E, H, I, device="cuda", generator=g) / I**0.5).bfloat16()
res = {}
for t in (1024, 4096):
    x = torch.randn(t, H, device="cuda", generator=g).bfloat16()
    ids = torch.rand(t, E, device="cuda", generator=g).topk(K, dim=1).indices.int()
    w = torch.full((t, K), 1.0 / K, device="cuda")
    p = t * K
    a, gu, h, y, out = (x.new_empty(s) for s in ((p, H), (p, 2 * I), (p, I), (p, H), (t, H)))
    dst, cnt, st = mp.moe_sort(ids, None, E)
    steps = {
        "sort": lambda: mp.moe_sort(ids, None, E),
        "gather": lambda: mp.gather_rows(x, dst, K, a),
        "w13_cutlass": lambda: mc.cutlass_grouped_gemm(a, w13, gu, cnt, st),
        "silu_and_mul": lambda: activation.silu_and_mul_launch(gu, None, 0, h, None),
        "w2_cutlass": lambda: mc.cutlass_grouped_gemm(h, w2, y, cnt, st),
        "unsort_combine": lambda: mp.unsort_combine(y, dst, w, out),
        "whole_cutlass": lambda: mc.fused_moe_cutlass(x, w13, w2, w, ids, None, out=out),
        "whole_triton": lambda: torch.ops.kiln.fused_moe(x, w13, w2, w, ids, None, None, None, ""),
    }
    row = {}
    for name, fn in steps.items():
        fn(); torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20):
            fn()
        e.record(); torch.cuda.synchronize()
        row[name] = round(s.elapsed_time(e) * 1e3 / 20, 1)
    res[t] = row
    print(t, row, flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
EOF

echo "== 4. tiny Qwen3-MoE compile --moe-backend cutlass (vs KILN_MOE_CUTLASS=0), auto at one rung"
timeout $(cap 150) python3 -m pytest -q -m gpu tests/compiler/test_compile_cutlass.py -p no:cacheprovider -rfs \
  > "$OUT/compile_tests.log" 2>&1
tail -3 "$OUT/compile_tests.log"

echo "== summary: fused MoE per call, us (bench rows; CUTLASS / Triton < 1: CUTLASS faster)"
python3 - "$OUT/moe_cutlass_bench.json" <<'EOF'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["results"]
except Exception as e:
    sys.exit(f"no bench results ({e})")
ms = {}
for r in rows:
    if "ms" in r:
        ms.setdefault(r["t"], {})[r["impl"]] = r["ms"] * 1e3
print(f"{'tokens':>7} {'triton':>9} {'cutlass':>9} {'ratio':>6}")
for t in sorted(ms):
    a, b = ms[t].get("triton"), ms[t].get("cutlass_sm90")
    ratio = f"{b / a:6.2f}" if a and b else "     -"
    print(f"{t:>7} {a or float('nan'):9.1f} {b or float('nan'):9.1f} {ratio}")
EOF
grep -hE "passed|failed|error" "$OUT/gpu_tests.log" "$OUT/compile_tests.log" | tail -4
