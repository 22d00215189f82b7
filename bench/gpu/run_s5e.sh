#!/bin/bash
# GPU call 6 of the fifth 2026-11-29 session (what call 5 left):
# (1) the CUTLASS compile GPU tests (the fixture they lacked); (2) the persistent-norm GPU tests
#     with the dynamic-FP8 output held to one e4m3 code; (3) Qwen3-30B-A3B-shaped (16 layers)
#     compiled with --moe-tune --moe-backend auto (tuner now timing CUDA-graph replays; Triton and
#     CUTLASS per rung), decode at batch 1 / 8.
# Carry: bench/cutlass_probe/whl, bench/cutlass_probe/out. Usage: bash bench/gpu/run_s5e.sh (5 files)
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  bench/cutlass_probe/whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
source bench/gpu/env.sh
export KILN_CUTLASS_LIB=$PWD/bench/cutlass_probe/out/kiln/cutlass_moe_sm90.so KILN_CUTLASS_CACHE=/tmp/kcc
CK=/tmp/ckpt-qwen3moe-L16; ART=/tmp/art-qwen3moe-L16
python bench/make_checkpoint.py --preset qwen3-30b-a3b --num-layers 16 -o $CK > /dev/null 2>&1 &
PCK=$!
timeout 100 python -m pytest -q -m gpu tests/compiler/test_compile_cutlass.py -p no:cacheprovider -rfs > "$OUT/tests.log" 2>&1
timeout 30 python -m pytest -q -m gpu tests/ops/test_norm.py -k persistent -p no:cacheprovider -rf >> "$OUT/tests.log" 2>&1
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests.log" | tail -6
wait $PCK
timeout 220 python -m kiln compile $CK -o $ART --force --moe-tune --moe-backend auto > "$OUT/compile.log" 2>&1
tail -2 "$OUT/compile.log"
python -c "import json; m=json.load(open('$ART/manifest.json'))['kernel_choices']['moe']; print(json.dumps(m, indent=1))" > "$OUT/moe_choices.json" 2>&1
timeout 45 python -m kiln bench latency $ART --batch-sizes 1,8 --input-len 512 --output-len 64 \
  --kv-memory 40 --json "$OUT/moe_latency.json" 2>&1 | grep -v "it/s\]" | tail -3
python - "$OUT/moe_choices.json" <<'PY'
import json, sys
try:
    m = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"no choices ({e})")
for r in m.get("report", []):
    print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()})
PY
