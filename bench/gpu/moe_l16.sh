#!/bin/bash
# Sourced by the seventh session's GPU scripts (after bench/gpu/env.sh, with OUT set): the
# Qwen3-30B-A3B-shaped checkpoint (16 of its 48 layers) and artifact, and the runs they repeat.
MCK=/tmp/ckpt-qwen3moe-L16; MART=/tmp/art-qwen3moe-L16

moe_checkpoint() { python bench/make_checkpoint.py --preset qwen3-30b-a3b --num-layers 16 -o $MCK > /dev/null 2>&1; }

moe_compile() {
  timeout 150 python -m kiln compile $MCK -o $MART --force > "$OUT/compile.log" 2>&1; tail -1 "$OUT/compile.log"
}

moe_latency() {  # NAME "EXTRA ARGS" [VAR=VALUE ...]: batch 1 / 8 -> $OUT/moe_latency_NAME.json, a line per batch
  local name=$1 extra=$2; shift 2
  env "$@" timeout 150 python -m kiln bench latency $MART --batch-sizes 1,8 --input-len 512 --output-len 64 \
    --kv-memory 40 $extra --json "$OUT/moe_latency_$name.json" > /dev/null 2>&1
  python - "$OUT/moe_latency_$name.json" "$name" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["kiln"]:
    hf = d["hf"][str(r["batch"])]["decode_tok_s"] if "hf" in d else None
    print(sys.argv[2], "batch", r["batch"], f"{r['decode_tok_s']:.1f} tok/s", f"{100 * r['frac_roofline']:.1f}%",
          f"HF {hf:.1f}" if hf else "")
PY
}

moe_profile() {  # [LINES]: the batch-1 kernel profile -> $OUT/moe_profile.json
  timeout 80 python bench/gpu/profile_decode.py $MART --batch-sizes 1 --json "$OUT/moe_profile.json" 2>&1 | tail -${1:-14}
}

gpu_tests() {  # LOG TIMEOUT PYTEST-ARGS...: GPU tests -> $OUT/LOG, the summary lines
  local log=$1 limit=$2; shift 2
  timeout "$limit" python -m pytest -q -m gpu "$@" -p no:cacheprovider -rf > "$OUT/$log" 2>&1
  echo "== $log"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/$log" | tail -6
}

bench_summary() {  # JSON [LABEL]: a pytest-benchmark file's rows, per layer where the row chains layers
  python - "$1" "${2:-}" <<'PY'
import json, sys
for b in json.load(open(sys.argv[1]))["benchmarks"]:
    e = b["extra_info"]
    per = e.get("layers", 1)
    print(sys.argv[2], f"{b['name']:40s} {e['ms'] * 1e3 / per:8.2f} us{'/layer' if per > 1 else ''}",
          f"frac_bw {e.get('frac_bw', 0):.3f} frac_mm {e.get('frac_mm', 0):.3f}")
PY
}

# The twelfth session's calls (bench/gpu/run_s12*.sh): raw files in $OUT, one bundle into $DEST.
call_start() {  # NAME [DEST]: $DEST (the tool's $OUT), $OUT (/tmp/raw_NAME), the clock for stamp
  CALL=$1; DEST=${2:-/tmp/out}; OUT=/tmp/raw_$1; mkdir -p "$DEST" "$OUT"; T0=$(date +%s)
}
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/stamps.txt"; }

step_bench() {  # TIMEOUT K-EXPR: bench/test_bench_decode_step.py's cases -> $OUT/decode_step.json, a line each
  (cd bench && timeout "$1" python -m pytest -q test_bench_decode_step.py -p no:cacheprovider -k "$2" \
    --benchmark-json="$OUT/decode_step.json" > "$OUT/decode_step.log" 2>&1)
  bench_summary "$OUT/decode_step.json" | tee "$OUT/step_summary.txt"
}

call_end() {  # bundle $OUT into $DEST/$CALL.json (bench/gpu/bundle.py), then the summaries again
  python bench/gpu/bundle.py "$OUT" "$DEST/$CALL.json" \
    "bash bench/gpu/run_$CALL.sh OUT (commit: ${KILN_COMMIT:-see bench/results/README.md})"
  cat "$OUT"/*_summary.txt
}
