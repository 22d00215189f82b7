#!/bin/bash
# Start-up and artifact checks for one model shape on the GPU machine: optionally the GPU tests
# first, a random-weight checkpoint of PRESET, `kiln compile`, then `kiln bench startup
# --compare-verify` (fresh processes alternating the load-time hash check on and off: ready and
# first-token times of each, their ratio), and with REPRO=1 a second compile into another folder
# and every file's bytes compared (but build-log.json). Conventions (DEST, BUDGET, WORK, DRY,
# COMMIT, .whl): bench/gpu/lib.sh.
#
# Usage (repo root, GPU machine): [VAR=VALUE ...] bash bench/gpu/startup.sh DEST
#   PRESET=llama-3.1-8b LAYERS= DTYPE=bfloat16 QUANT= COMPILE_ARGS=   the shape, as in bench/gpu/e2e.sh
#   RUNS=3               fresh processes per setting
#   REPRO=               1: the reproducible-compile check (a second artifact: disk for two)
#   LOAD_SWEEP=          1: first bench/weights_load.py for the shape (its own checkpoint and pack,
#                        deleted after: packing memory, page-cache and pinned-copy ceilings,
#                        `load_pack` over a sweep of options), with LOAD_ARGS (its flags, e.g.
#                        "--threads 8,16 --chunks-mib 8,16 --reps 2")
#   GPU_TESTS=           pytest paths run first with -m gpu
#   OLD=                 another kiln tree (a tar: `git archive -o .old.tar REV`, carried; or a
#                        folder): instead of the check on/off pairs, `kiln bench startup --runs 1`
#                        of this tree and that one alternating on the same artifact, RUNS rounds
#                        (old new, new old, ...), and the medians side by side; then, with
#                        STARTUP_ARGS, one more run of this tree with those flags ("--imports 15");
#                        ENV_OLD= / ENV_NEW=: VAR=VALUE words for one side's runs (OLD=. compares two
#                        settings of this tree, e.g. ENV_NEW="KILN_STARTUP_GRAPHS=smallest")
# Writes DEST/startup_<shape>.json holding compile.log, startup_verify.json (`kiln bench startup
# --json`), repro.json (the files that differ, if any), weights_load.json, tests.log, stamps.
set -o pipefail
source bench/gpu/lib.sh
PRESET=${PRESET:-llama-3.1-8b}; LAYERS=${LAYERS:-}; DTYPE=${DTYPE:-bfloat16}; RUNS=${RUNS:-3}
NAME=$(shape_name "$PRESET" "$LAYERS" "$DTYPE" "$QUANT")
CK=$CKPT_WORK/ckpt-$(shape_name "$PRESET" "$LAYERS" "$DTYPE" ""); ART=$WORK/art-$NAME
call_begin "startup_$NAME" "$1"
HERE=$PWD

if [ -n "$GPU_TESTS" ]; then
  # shellcheck disable=SC2086  # paths, split on purpose
  gpu_tests tests.log 300 $GPU_TESTS
  stamp tests
fi
free_work "$CK" "$ART"
if [ -n "$LOAD_SWEEP" ]; then
  # shellcheck disable=SC2086  # flags, split on purpose
  step weights_load.log 400 python bench/weights_load.py --preset "$PRESET" ${LAYERS:+--num-layers "$LAYERS"} \
    --workdir "$WORK/weights-load" --json "$RAW/weights_load.json" $LOAD_ARGS
  show weights_load.log "." 12
  [ -z "$DRY" ] && rm -rf "$WORK/weights-load"  # left behind when cut short
  stamp weights_load
fi
make_checkpoint "$PRESET" "$LAYERS" "$DTYPE" "$CK" || { call_end startup.sh PRESET LAYERS; exit 1; }
stamp checkpoint
# shellcheck disable=SC2086
compile_in "$HERE" compile.log "$CK" "$ART" --dtype "$DTYPE" ${QUANT:+--quant "$QUANT"} $COMPILE_ARGS
stamp compile
if [ -z "$OLD" ]; then
  step startup.log 300 python -m kiln bench startup "$ART" --compare-verify --runs "$RUNS" \
    --json "$RAW/startup_verify.json"
  show startup.log "." 3
else  # this tree and OLD alternating, one fresh process each (the artifact format is shared)
  OLD_DIR=$WORK/old
  if [ -d "$OLD" ]; then OLD_DIR=$(cd "$OLD" && pwd); elif [ -z "$DRY" ]; then
    rm -rf "$OLD_DIR"; mkdir -p "$OLD_DIR"; tar -xf "$OLD" -C "$OLD_DIR" || exit 2
  fi
  for ((r = 1; r <= RUNS; r++)); do
    order="old new"; [ $((r % 2)) = 0 ] && order="new old"
    for tree in $order; do
      dir=$HERE; envs=$ENV_NEW; [ "$tree" = old ] && dir=$OLD_DIR && envs=$ENV_OLD
      # shellcheck disable=SC2086  # VAR=VALUE words, split on purpose
      step "startup_${tree}_r$r.log" 90 env -C "$dir" PYTHONPATH="$dir:$dir/tests:$dir/bench" $envs \
        python -m kiln bench startup "$ART" --runs 1 --json "$RAW/startup_${tree}_r$r.json"
      show "startup_${tree}_r$r.log" "first token" 1
    done
  done
  if [ -n "$STARTUP_ARGS" ]; then
    # shellcheck disable=SC2086  # flags, split on purpose
    step startup_extra.log 120 python -m kiln bench startup "$ART" --runs 1 $STARTUP_ARGS --json "$RAW/startup_extra.json"
    show startup_extra.log "." 5
  fi
  [ -z "$DRY" ] && python - "$RAW" <<'PY' | tee "$RAW/startup_table.txt"
import glob, json, statistics, sys
for tree in ("old", "new"):
    runs = [json.load(open(f))["startup"] for f in sorted(glob.glob(f"{sys.argv[1]}/startup_{tree}_r*.json"))]
    if not runs:
        continue
    med = lambda k: statistics.median(r[k] for r in runs)
    after = statistics.median(r["ready_s"] - r["import_s"] for r in runs)
    print(f"{tree}: {len(runs)} runs, median import {med('import_s'):.2f} s, ready {med('ready_s'):.2f} s, "
          f"first token {med('first_token_s'):.2f} s, ready after the imports {after:.2f} s")
PY
fi
stamp startup

if [ -n "$REPRO" ]; then
  # shellcheck disable=SC2086
  compile_in "$HERE" compile2.log "$CK" "$ART-2" --dtype "$DTYPE" ${QUANT:+--quant "$QUANT"} $COMPILE_ARGS
  if [ -n "$DRY" ]; then
    echo "+ (python: compare the bytes of every file of $ART and $ART-2 but build-log.json) > \$RAW/repro.json"
  else
    python - "$ART" "$ART-2" "$RAW/repro.json" <<'PY' | tee "$RAW/repro_summary.txt"
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
    rm -rf "$ART-2"
  fi
  stamp repro
fi
call_end startup.sh PRESET LAYERS DTYPE QUANT COMPILE_ARGS RUNS REPRO LOAD_SWEEP LOAD_ARGS GPU_TESTS OLD ENV_OLD ENV_NEW STARTUP_ARGS BUDGET
