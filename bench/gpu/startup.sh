#!/bin/bash
# Start-up and artifact checks on the GPU machine, for one model shape:
#   1. GPU_TESTS="paths ..." (optional): those GPU tests first (-> gpu_tests.log);
#   2. a checkpoint of PRESET (random weights, LAYERS layers if set) and `kiln compile` of it;
#   3. `kiln bench startup --compare-verify`: fresh processes alternating the artifact check on and
#      off (-> startup_verify.json: ready and first-token times of each, their ratio);
#   4. REPRO=1: a second compile into another directory, then every file's bytes compared but
#      build-log.json (-> repro.json: the files that differ, if any).
# Everything lands in OUTDIR, bundled into OUTDIR/startup_PRESET.json for bench/results/.
# Usage (repo root): PRESET=llama-3.1-8b [LAYERS=N] [RUNS=3] [REPRO=1] bash bench/gpu/startup.sh OUTDIR
set -o pipefail
DEST=${1:-/tmp/out}; OUT=/tmp/raw_startup; mkdir -p "$DEST" "$OUT"
source bench/gpu/env.sh
PRESET=${PRESET:-llama-3.1-8b}; RUNS=${RUNS:-3}
NAME=$PRESET${LAYERS:+-L$LAYERS}; CK=/tmp/ckpt-$NAME; ART=/tmp/art-$NAME
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/stamps.txt"; }
if [ -n "$GPU_TESTS" ]; then
  timeout "${TESTS_TIMEOUT:-300}" python -m pytest -q -m gpu $GPU_TESTS -p no:cacheprovider -rf \
    > "$OUT/gpu_tests.log" 2>&1
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -8; stamp tests
fi
[ -f $CK/config.json ] || python bench/make_checkpoint.py --preset $PRESET ${LAYERS:+--num-layers $LAYERS} \
  -o $CK > "$OUT/checkpoint.log" 2>&1
stamp checkpoint
timeout 600 python -m kiln compile $CK -o $ART --force 2>&1 | grep -v "it/s\]" > "$OUT/compile.log"
tail -1 "$OUT/compile.log"; stamp compile
python -m kiln bench startup $ART --compare-verify --runs "$RUNS" --json "$OUT/startup_verify.json" 2>&1 \
  | tail -3 | tee "$OUT/startup_summary.txt"
stamp startup
if [ -n "$REPRO" ]; then
  timeout 600 python -m kiln compile $CK -o $ART-2 --force > "$OUT/compile2.log" 2>&1
  python - "$ART" "$ART-2" "$OUT/repro.json" <<'PY' | tee "$OUT/repro_summary.txt"
import json, pathlib, sys, xxhash
a, b = map(pathlib.Path, sys.argv[1:3])
def files(root):
    return {p.relative_to(root).as_posix(): xxhash.xxh3_128_hexdigest(p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "build-log.json"}
fa, fb = files(a), files(b)
differ = sorted(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))
json.dump({"files": len(fa), "differ": differ}, open(sys.argv[3], "w"), indent=1)
print(f"reproducible compile: {len(fa)} files, {len(differ)} differ {differ[:8]}")
PY
  rm -rf "$ART-2"; stamp repro
fi
python bench/gpu/bundle.py "$OUT" "$DEST/startup_$NAME.json" \
  "PRESET=$PRESET LAYERS=$LAYERS RUNS=$RUNS REPRO=$REPRO GPU_TESTS='$GPU_TESTS' bash bench/gpu/startup.sh OUT (commit: ${KILN_COMMIT:-?})"
cat "$OUT/startup_summary.txt" "$OUT"/repro_summary.txt 2>/dev/null
