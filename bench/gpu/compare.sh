#!/bin/bash
# Before and after in one call: the same `kiln bench latency` figures for two source trees on one
# GPU machine and the same checkpoints. Per shape: one random-weight checkpoint, an artifact
# compiled by each tree (an artifact is tied to the kiln that built it), then the latency runs
# alternating between the trees (old new, new old, old new, ...), and a table side by side.
# Conventions (DEST, BUDGET, WORK, DRY, COMMIT, .whl): bench/gpu/lib.sh.
#
# Make the old tree here and carry it (list it in .git/info/exclude once so it is not committed):
#   echo /.old.tar >> .git/info/exclude; git archive -o .old.tar REV
#   device run: command "bash bench/gpu/compare.sh $OUT", carry [".old.tar"], timeout_s 600
# Usage (repo root, GPU machine): [VAR=VALUE ...] bash bench/gpu/compare.sh DEST
#   OLD=.old.tar         the other tree: a tar of it (unpacked into $WORK/old) or a folder
#   SHAPES="llama-3.1-8b qwen3-30b-a3b:16"   PRESET[:LAYERS] each, in this order
#   BATCHES=1,64 INLEN=512 OUTLEN=64 KV=40   `kiln bench latency` batch sizes, lengths, KV GiB
#   ROUNDS=2             rounds; the order of the two trees swaps every round (old new, new old)
#   COMPILE_ARGS= LAT_ARGS=                     flags for both trees' `kiln compile` / latency runs
#   COMPILE_ARGS_OLD= COMPILE_ARGS_NEW= LAT_ARGS_OLD= LAT_ARGS_NEW=   one tree's only (renamed flags)
#   PARALLEL=1           compile the two trees' artifacts at the same time (the compile measures
#                        nothing; compile times are then not comparable); 0: one after the other
#   OLD_COMMIT=          the old tree's commit, recorded with COMMIT (this tree's) in the command
#   GPU_TESTS=           pytest paths of this tree run first with -m gpu (their time comes off the
#                        budget: the two shapes leave ~150 s)
# Time and disk on one H200 (bench/results stamps, 2026-11-30 to 12-03): Llama-3.1-8B checkpoint
# ~20 s, compile 35-60 s (15 GiB each); Qwen3-30B-A3B L16 checkpoint 20-30 s, compile 65-90 s
# (19.8 GiB each); a latency run at batch 1 and 64, start-up included, 12-20 s. Both shapes, two
# rounds: ~450 s with the compiles one after the other, ~350-400 s with PARALLEL=1, of BUDGET=570.
# Peak disk: a checkpoint and two artifacts, 45 GiB (8B) and 59 GiB (L16; ..._s13c_* held as much
# on the 64 GiB disk); each shape's checkpoint goes once compiled, its artifacts once measured.
# Writes DEST/compare.json holding latency_<shape>_<old|new>_r<N>.json, latency_table.json (per
# shape and batch: each tree's runs, mean, spread, new vs old; also printed), the compile logs,
# tests.log, stamps.
set -o pipefail
source bench/gpu/lib.sh
OLD=${OLD:-.old.tar}; SHAPES=${SHAPES:-llama-3.1-8b qwen3-30b-a3b:16}
BATCHES=${BATCHES:-1,64}; INLEN=${INLEN:-512}; OUTLEN=${OUTLEN:-64}; KV=${KV:-40}
ROUNDS=${ROUNDS:-2}; PARALLEL=${PARALLEL:-1}
call_begin compare "$1"
NEW_DIR=$PWD
if [ -n "$DRY" ] && [ ! -d "$OLD" ]; then
  OLD_DIR=$WORK/old; echo "+ rm -rf $OLD_DIR; mkdir -p $OLD_DIR; tar -xf $OLD -C $OLD_DIR"
elif [ -f "$OLD" ]; then
  OLD_DIR=$WORK/old; rm -rf "$OLD_DIR"; mkdir -p "$OLD_DIR"; tar -xf "$OLD" -C "$OLD_DIR" || exit 2
elif [ -d "$OLD" ]; then
  OLD_DIR=$(cd "$OLD" && pwd)
else
  echo "compare.sh: OLD=$OLD is neither a tar nor a folder (make it with: git archive -o .old.tar REV)" >&2; exit 2
fi
if [ -z "$DRY" ] && [ ! -f "$OLD_DIR/kiln/__init__.py" ]; then
  echo "compare.sh: $OLD_DIR holds no kiln source tree (kiln/__init__.py)" >&2; exit 2
fi
dir_of() { [ "$1" = old ] && echo "$OLD_DIR" || echo "$NEW_DIR"; }
[ -z "$DRY" ] && df -h "$WORK" | tail -1 | tee "$RAW/disk.txt"
if [ -n "$GPU_TESTS" ]; then
  # shellcheck disable=SC2086  # paths, split on purpose
  gpu_tests tests.log 300 $GPU_TESTS
  stamp tests
fi

for shape in $SHAPES; do
  preset=${shape%%:*}; layers=; [[ $shape == *:* ]] && layers=${shape#*:}
  name=$(shape_name "$preset" "$layers" bfloat16 "")
  ck=$WORK/ckpt-$name
  free_work "$ck"
  make_checkpoint "$preset" "$layers" bfloat16 "$ck" || continue
  stamp "$name checkpoint"
  for tree in old new; do
    extra=COMPILE_ARGS_${tree^^}
    # shellcheck disable=SC2086  # flags, split on purpose
    if [ "$PARALLEL" = 1 ] && [ -z "$DRY" ]; then
      compile_in "$(dir_of $tree)" "compile_${name}_$tree.log" "$ck" "$WORK/art-$name-$tree" $COMPILE_ARGS ${!extra} &
    else
      compile_in "$(dir_of $tree)" "compile_${name}_$tree.log" "$ck" "$WORK/art-$name-$tree" $COMPILE_ARGS ${!extra}
    fi
  done
  wait
  stamp "$name compile"
  if [ -n "$DRY" ]; then echo "+ rm -rf $ck"; else rm -rf "$ck"; df -h "$WORK" | tail -1 >> "$RAW/disk.txt"; fi
  for ((r = 1; r <= ROUNDS; r++)); do
    order="old new"; [ $((r % 2)) = 0 ] && order="new old"
    for tree in $order; do
      art=$WORK/art-$name-$tree
      if [ -z "$DRY" ] && [ ! -f "$art/manifest.json" ]; then echo "no artifact $art: see compile_${name}_$tree.log"; continue; fi
      extra=LAT_ARGS_${tree^^}
      # shellcheck disable=SC2086
      latency_in "$(dir_of $tree)" "$name" "$tree" "$r" "$art" $LAT_ARGS ${!extra}
    done
  done
  stamp "$name latency"
  free_work
done
latency_table
call_end compare.sh OLD OLD_COMMIT SHAPES BATCHES INLEN OUTLEN KV ROUNDS COMPILE_ARGS COMPILE_ARGS_OLD COMPILE_ARGS_NEW \
  LAT_ARGS LAT_ARGS_OLD LAT_ARGS_NEW PARALLEL GPU_TESTS BUDGET
