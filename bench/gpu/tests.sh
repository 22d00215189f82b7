#!/bin/bash
# The GPU tests and the kernel microbenchmarks on the GPU machine, in one call. Conventions (DEST,
# BUDGET, DRY, COMMIT, .whl): bench/gpu/lib.sh.
#
# Usage (repo root, GPU machine): [VAR=VALUE ...] bash bench/gpu/tests.sh DEST
#   TESTS=tests          pytest paths run with -m gpu; "none": no tests
#   IGNORE=tests/server  paths left out (--ignore). tests/server needs fastapi and openai, which the
#                        GPU image lacks: its conftest skips at import, and that stops the whole
#                        pytest run. It is left out unless TESTS names it (carry their wheels in .whl).
#   TESTS_K=             pytest -k expression for the tests
#   TESTS_ARGS=          more pytest arguments, e.g. "-v" (each test's outcome in the log even when
#                        the step is cut by its timeout, which loses pytest's summary)
#   TESTS_TIMEOUT=400    seconds for the tests (the whole GPU suite may not finish in one call:
#                        name the folders or files to run)
#   BENCH=               kernel microbenchmarks: "all" (the bench/ folder, test_ceilings.py too) or
#                        names, e.g. "norm gemv decode_step": bench/test_bench_{norm,gemv,decode_step}.py
#   BENCH_K="not sweep and not compile"   their -k expression (e.g. "sweep" for the launch sweeps,
#                        "a3b-1 and default" for one case of the decode-step bench)
#   BENCH_TIMEOUT=240
# Writes DEST/tests.json holding tests.log (pytest's output), bench.json (bench/report.py: each
# kernel's time and fraction of the read-bandwidth / matmul ceilings measured in the run),
# bench_table.txt, nvidia_smi.txt, stamps.
set -o pipefail
source bench/gpu/lib.sh
TESTS=${TESTS:-tests}; TESTS_TIMEOUT=${TESTS_TIMEOUT:-400}
BENCH_K=${BENCH_K:-not sweep and not compile}; BENCH_TIMEOUT=${BENCH_TIMEOUT:-240}
if [[ " $TESTS " == *" tests/server"* ]]; then IGNORE=${IGNORE-}; else IGNORE=${IGNORE-tests/server}; fi
call_begin tests "$1"
[ -z "$DRY" ] && nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv > "$RAW/nvidia_smi.txt" 2>&1

if [ "$TESTS" != none ]; then
  ignore=(); for p in $IGNORE; do ignore+=("--ignore=$p"); done
  # shellcheck disable=SC2086  # paths, split on purpose
  gpu_tests tests.log "$TESTS_TIMEOUT" $TESTS "${ignore[@]}" ${TESTS_K:+-k "$TESTS_K"} $TESTS_ARGS
  stamp tests
fi

if [ -n "$BENCH" ]; then
  files=()
  if [ "$BENCH" = all ]; then files=(bench); else for b in $BENCH; do files+=("bench/test_bench_$b.py"); done; fi
  for f in "${files[@]}"; do
    if [ ! -e "$f" ]; then
      names=(bench/test_bench_*.py); names=("${names[@]#bench/test_bench_}")
      echo "BENCH: no file $f (names: ${names[*]%.py})" >&2; exit 2
    fi
  done
  step bench.log "$BENCH_TIMEOUT" python -m pytest -q "${files[@]}" -k "$BENCH_K" -p no:cacheprovider \
    --benchmark-json="$RAW/bench_raw.json"
  show bench.log "passed|failed|error" 3
  if [ -n "$DRY" ] || [ -f "$RAW/bench_raw.json" ]; then
    step bench_table.txt 60 python bench/report.py "$RAW/bench_raw.json" "$RAW/bench.json" \
      --command "pytest ${files[*]} -k '$BENCH_K'"
    [ -z "$DRY" ] && { rm -f "$RAW/bench_raw.json"; grep -aE "ceilings|^ *test_" "$RAW/bench_table.txt" | head -60; }
  fi
  stamp bench
fi
call_end tests.sh TESTS IGNORE TESTS_K TESTS_ARGS TESTS_TIMEOUT BENCH BENCH_K BENCH_TIMEOUT BUDGET
