# shellcheck shell=bash
# Shared by the GPU scripts bench/gpu/{tests,e2e,startup,serve,compare}.sh; sourced from the repo
# root. What every call does the same way:
#   - its one argument, DEST, is the folder whose files come back (the device tool's $OUT;
#     default /tmp/out). Raw outputs (logs, kiln's JSON reports, stamps.txt) go to
#     RAW=$WORK/raw_<call>, emptied first; call_end folds them into the one file DEST/<call>.json
#     with bench/gpu/bundle.py (env: date, GPU, versions; command; results by file name): the file
#     to copy into bench/results/ (renamed DATE_h200_<what>.json);
#   - each step runs under `timeout`, cut to what is left of BUDGET seconds (default 570: a 600 s
#     device command less the bundle), so the bundle is written even when a step overruns;
#   - checkpoints and artifacts live in WORK=/tmp/kb (ckpt-<shape>, art-<shape>); before making new
#     ones a call deletes the others there (a warm machine may hold the last call's; 64 GB disk);
#     CKPT_WORK (default WORK) puts the checkpoints elsewhere: CKPT_WORK=/dev/shm/kb keeps one in
#     memory (128 GB) so that a checkpoint and its artifact fit where the disk holds only one (the
#     full 48-layer Qwen3-30B-A3B: 61 GB each in bf16); make_checkpoint checks the free space first;
#   - wheels carried in .whl (git-ignored; e.g. fastapi for the server) are installed into
#     /tmp/site and put on PYTHONPATH first;
#   - COMMIT (the commit under test) is recorded in the bundle's command: write the hash into the
#     command sent; `$(git rev-parse --short HEAD)` on the GPU machine reads a stale .git there
#     (session 34's bundles named the previous session's last commit);
#   - DRY=1 prints each step's command instead of running it (no GPU, no kiln import), to check a
#     parameter set anywhere.

WORK=${WORK:-/tmp/kb}
CKPT_WORK=${CKPT_WORK:-$WORK}
BUDGET=${BUDGET:-570}
COMMIT=${COMMIT:-${KILN_COMMIT:-}}
RESERVE=25  # seconds kept for the bundle

call_begin() {  # NAME [DEST]: RAW, DEST, the clock, kiln's environment (bench/gpu/env.sh)
  CALL=$1; DEST=${2:-/tmp/out}; RAW=$WORK/raw_$CALL; T0=$(date +%s)
  BASE_PYTHONPATH=${PYTHONPATH:-}
  if [ -n "$DRY" ]; then echo "# DRY=1: $CALL -> $DEST/$CALL.json (raw files in $RAW)"; return 0; fi
  mkdir -p "$DEST" "$WORK"; rm -rf "$RAW"; mkdir -p "$RAW"
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl || { echo "could not install .whl/*.whl" >&2; exit 1; }
    BASE_PYTHONPATH=/tmp/site${BASE_PYTHONPATH:+:$BASE_PYTHONPATH}; export PYTHONPATH=$BASE_PYTHONPATH
  fi
  # shellcheck source=bench/gpu/env.sh
  source bench/gpu/env.sh > "$RAW/versions.txt" 2>&1
  local rc=$?
  cat "$RAW/versions.txt"
  [ $rc = 0 ] || { echo "kiln does not import from $PWD (bench/gpu/env.sh)" >&2; exit 1; }
}

elapsed() { echo $(( $(date +%s) - T0 )); }

stamp() {  # WHAT: "[N s] WHAT" (seconds since call_begin) to stdout and RAW/stamps.txt
  [ -n "$DRY" ] && return 0
  echo "[$(elapsed) s] $*" | tee -a "$RAW/stamps.txt"
}

quote() {  # WORDS...: each word as a shell reads it back, single-quoted where it needs to be
  local w
  for w in "$@"; do
    if [[ $w =~ ^[A-Za-z0-9_.,:/=+@%-]+$ ]]; then printf '%s ' "$w"; else printf "'%s' " "${w//\'/\'\\\'\'}"; fi
  done
}

step() {  # LOG LIMIT CMD...: CMD under `timeout` (LIMIT s, cut to the budget), its output to RAW/LOG
  local log=$1 limit=$2 left rc; shift 2
  if [ -n "$DRY" ]; then echo "+ $(quote "$@")> \$RAW/$log  # at most $limit s"; return 0; fi
  left=$(( BUDGET - $(elapsed) - RESERVE ))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 5 ]; then echo "skipped, no time left: $log" | tee -a "$RAW/stamps.txt"; return 125; fi
  timeout -k 10 "$limit" "$@" > "$RAW/$log" 2>&1
  rc=$?
  # progress bars (tqdm redraws with \r) would fill the log: one line per update
  tr '\r' '\n' < "$RAW/$log" | grep -avE '[0-9]%\||it/s\]|s/it\]' > "$RAW/$log.tmp"; mv "$RAW/$log.tmp" "$RAW/$log"
  if [ $rc = 124 ] || [ $rc = 137 ]; then
    echo "timed out after $limit s: $log" | tee -a "$RAW/stamps.txt"
  elif [ $rc != 0 ]; then
    echo "exit $rc: $log:"; tail -4 "$RAW/$log"
  fi
  return $rc
}

show() {  # LOG REGEX [N]: the last N (8) lines of RAW/LOG matching REGEX
  [ -n "$DRY" ] && return 0
  grep -aE "$2" "$RAW/$1" | tail -"${3:-8}"
}

params() {  # NAME...: "NAME=value" for each of these variables that is set non-empty, quoted
  local n out=
  for n in "$@"; do [ -n "${!n}" ] && out+="$n=$(quote "${!n}")"; done
  echo "$out"
}

call_end() {  # SCRIPT PARAM-NAMES...: bundle RAW into DEST/$CALL.json, the command recorded
  local script=$1; shift
  local cmd; cmd="$(params "$@")bash bench/gpu/$script OUT (commit: ${COMMIT:-not given})"
  if [ -n "$DRY" ]; then echo "+ python bench/gpu/bundle.py $RAW $DEST/$CALL.json $(quote "$cmd")"; return 0; fi
  stamp end
  python bench/gpu/bundle.py "$RAW" "$DEST/$CALL.json" "$cmd"
}

tree_path() {  # DIR: the PYTHONPATH that imports kiln from the source tree DIR (as env.sh does)
  echo "$1:$1/tests:$1/bench${BASE_PYTHONPATH:+:$BASE_PYTHONPATH}"
}

shape_name() {  # PRESET LAYERS DTYPE QUANT: llama-3.1-8b, qwen3-30b-a3b-L16, llama-3.1-8b-fp8, ...
  local n=$1
  [ -n "$2" ] && n+=-L$2
  [ -n "$3" ] && [ "$3" != bfloat16 ] && n+=-$3
  [ -n "$4" ] && n+=-$4
  echo "$n"
}

free_work() {  # KEEP...: delete the checkpoints (CKPT_WORK's and WORK's: an earlier call may have
  # used the other) and WORK's artifacts and unfinished compiles, other than these
  local p k keep
  for p in "$CKPT_WORK"/ckpt-* "$WORK"/ckpt-* "$WORK"/art-* "$WORK"/.art-*.kiln-build-*; do
    [ -e "$p" ] || continue
    keep=
    for k in "$@"; do [ "$p" = "$k" ] && keep=1; done
    [ -n "$keep" ] && continue
    if [ -n "$DRY" ]; then echo "+ rm -rf $p"; else rm -rf "$p"; fi
  done
}

make_checkpoint() {  # PRESET LAYERS DTYPE CKPT [FLAGS...]: random weights (bench/make_checkpoint.py, given
  # FLAGS too, e.g. --successor); kept if there
  local preset=$1 layers=$2 dtype=$3 ck=$4; shift 4
  if [ -z "$DRY" ] && [ -f "$ck/config.json" ]; then echo "checkpoint $ck: kept from an earlier call"; return 0; fi
  [ -z "$DRY" ] && rm -rf "$ck.part"
  if [ -z "$DRY" ]; then
    mkdir -p "${ck%/*}"
    local need free
    need=$(python bench/make_checkpoint.py --preset "$preset" ${layers:+--num-layers "$layers"} --dtype "$dtype" --bytes)
    free=$(df -B1 --output=avail "${ck%/*}" | tail -1)
    if [ "$need" -gt "$free" ]; then
      echo "make_checkpoint: $ck needs $need bytes, ${ck%/*} has $free free (set CKPT_WORK elsewhere)" >&2
      return 1
    fi
  fi
  step "checkpoint_${ck##*/ckpt-}.log" 400 python bench/make_checkpoint.py --preset "$preset" ${layers:+--num-layers "$layers"} \
    --dtype "$dtype" "$@" -o "$ck.part" || return 1
  if [ -n "$DRY" ]; then echo "+ mv $ck.part $ck"; return 0; fi
  mv "$ck.part" "$ck"; show "checkpoint_${ck##*/ckpt-}.log" "^wrote" 1
}

compile_in() {  # DIR LOG CKPT ART ARGS...: `kiln compile` of the source tree DIR (--force)
  local dir=$1 log=$2 ck=$3 art=$4; shift 4
  step "$log" 450 env -C "$dir" PYTHONPATH="$(tree_path "$dir")" python -m kiln compile "$ck" -o "$art" --force "$@"
  local rc=$?
  show "$log" "artifact .* in [0-9.]+ s|Error" 2
  return $rc
}

latency_in() {  # DIR GROUP LABEL ROUND ART WORDS...: one `kiln bench latency` run of the tree DIR
  # WORDS: VAR=VALUE (its environment) or flags (kiln bench latency's, after BATCHES INLEN OUTLEN KV).
  # Report: RAW/latency_<label>_r<round>.json, listed in RAW/runs.txt for bench/gpu/tables.py.
  local dir=$1 group=$2 label=$3 rnd=$4 art=$5 w; shift 5
  local envs=() args=()
  for w in "$@"; do
    if [[ $w =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; then envs+=("$w"); else args+=("$w"); fi
  done
  local name=latency_${group}_${label}_r$rnd
  [ -z "$DRY" ] && printf '%s\t%s\t%s\t%s\n' "$group" "$label" "$rnd" "$RAW/$name.json" >> "$RAW/runs.txt"
  step "$name.log" 300 env -C "$dir" PYTHONPATH="$(tree_path "$dir")" "${envs[@]}" python -m kiln bench latency \
    "$art" --batch-sizes "$BATCHES" --input-len "$INLEN" --output-len "$OUTLEN" --kv-memory "$KV" "${args[@]}" \
    --json "$RAW/$name.json"
  local rc=$?
  show "$name.log" "^ +[0-9]+ +[0-9.]+ " 12 | sed "s/^/$label r$rnd /"
  return $rc
}

latency_table() {  # the runs side by side (bench/gpu/tables.py), into RAW/latency_table.json too
  if [ -n "$DRY" ]; then echo "+ python bench/gpu/tables.py $RAW"; return 0; fi
  python bench/gpu/tables.py "$RAW" | tee "$RAW/latency_table.txt"
}

gpu_tests() {  # LOG LIMIT PYTEST-ARGS...: `pytest -m gpu` into RAW/LOG; prints failures and the summary
  local log=$1 limit=$2; shift 2
  step "$log" "$limit" python -m pytest -q -m gpu -p no:cacheprovider -rf "$@"
  local rc=$?
  show "$log" "^(FAILED|ERROR)|[0-9]+ (passed|failed|errors?|skipped)|no tests ran" 14
  return $rc
}
