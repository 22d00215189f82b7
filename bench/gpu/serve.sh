#!/bin/bash
# Serving sweep for one model shape on the GPU machine: a random-weight checkpoint of PRESET,
# `kiln compile`, then bench/serve.py once per request rate (and per concurrency cap): each run
# starts `kiln serve ART` on a loopback port and streams /v1/completions with Poisson arrivals;
# TTFT, ITL, TPOT and end-to-end latency (mean, p50, p90, p99) and request/token throughput.
# Conventions (DEST, BUDGET, WORK, DRY, COMMIT, .whl): bench/gpu/lib.sh.
#
# The server needs fastapi, starlette, pydantic, pydantic-core, annotated-types, typing-inspection
# and uvicorn, which the GPU image lacks: download their wheels into .whl here (git-ignored; the
# device tool's notes give the `pip download` line) and carry .whl; they are installed first.
#
# Usage (repo root, GPU machine): [VAR=VALUE ...] bash bench/gpu/serve.sh DEST
#   PRESET=llama-3.1-8b LAYERS= DTYPE=bfloat16 QUANT= COMPILE_ARGS=   the shape, as in bench/gpu/e2e.sh
#   RATES=16             requests per second, a run each (comma list; inf: all at once)
#   CONCURRENCY=         requests in flight at most, a run each per rate (comma list; empty: no cap)
#   NPROMPTS=500 INLEN=512 OUTLEN=128 RANGE=0.5   prompts per run, lengths, spread (uniform, +-RANGE)
#   SERVER_ARGS=         more `kiln serve` flags, e.g. "--max-running 128"
#   BENCH_ARGS=          more bench/serve.py flags, e.g. "--logprobs 0" (an event per token: ITL
#                        per token, where random ids decode to no text)
#   VARIANTS=default:    "NAME:FLAGS;NAME:FLAGS;...", a run each per rate and cap with these
#                        `kiln serve` flags added, e.g. "alt:--no-mixed-steps;mixed:--mixed-steps"
#   GPU_TESTS=           pytest paths run first with -m gpu (tests/server/test_gpu_serve.py needs
#                        openai, jiter, distro and sniffio wheels too)
# Writes DEST/serve_<shape>.json holding serve_r<RATE>[_c<CAP>].json (bench/serve.py's report) and
# its server log, compile.log, tests.log, stamps.
set -o pipefail
source bench/gpu/lib.sh
PRESET=${PRESET:-llama-3.1-8b}; LAYERS=${LAYERS:-}; DTYPE=${DTYPE:-bfloat16}
RATES=${RATES:-16}; NPROMPTS=${NPROMPTS:-500}; INLEN=${INLEN:-512}; OUTLEN=${OUTLEN:-128}; RANGE=${RANGE:-0.5}
NAME=$(shape_name "$PRESET" "$LAYERS" "$DTYPE" "$QUANT")
CK=$CKPT_WORK/ckpt-$(shape_name "$PRESET" "$LAYERS" "$DTYPE" ""); ART=$WORK/art-$NAME
call_begin "serve_$NAME" "$1"
HERE=$PWD
if [ -z "$DRY" ] && ! python -c "import fastapi, uvicorn" 2> /dev/null; then
  echo "serve.sh: fastapi / uvicorn do not import: carry their wheels in .whl (see this script's header)" >&2
  exit 1
fi

if [ -n "$GPU_TESTS" ]; then
  # shellcheck disable=SC2086  # paths, split on purpose
  gpu_tests tests.log 300 $GPU_TESTS
  stamp tests
fi
free_work "$CK" "$ART"
make_checkpoint "$PRESET" "$LAYERS" "$DTYPE" "$CK" || { call_end serve.sh PRESET LAYERS; exit 1; }
stamp checkpoint
# shellcheck disable=SC2086
compile_in "$HERE" compile.log "$CK" "$ART" --dtype "$DTYPE" ${QUANT:+--quant "$QUANT"} $COMPILE_ARGS
stamp compile

IFS=, read -ra rates <<< "$RATES"
IFS=, read -ra caps <<< "${CONCURRENCY:-}"
[ ${#caps[@]} = 0 ] && caps=("")
IFS=';' read -ra vs <<< "${VARIANTS:-default:}"
for rate in "${rates[@]}"; do
  for cap in "${caps[@]}"; do
    for v in "${vs[@]}"; do
      [ -z "$v" ] && continue
      t=${v%%:*}; name=serve_r$rate${cap:+_c$cap}; [ "$t" != default ] && name+=_$t
      # shellcheck disable=SC2086  # BENCH_ARGS: flags, split on purpose
      step "$name.txt" 400 python bench/serve.py --artifact "$ART" --num-prompts "$NPROMPTS" --rate "$rate" \
        --input-len "$INLEN" --output-len "$OUTLEN" --range-ratio "$RANGE" ${cap:+--max-concurrency "$cap"} \
        --server-args "$SERVER_ARGS ${v#*:}" --json "$RAW/$name.json" $BENCH_ARGS
      [ -z "$DRY" ] && [ -f "$RAW/$name.json.server.log" ] && mv "$RAW/$name.json.server.log" "$RAW/${name}_server.log"
      show "$name.txt" "." 18
      stamp "$name"
    done
  done
done
call_end serve.sh PRESET LAYERS DTYPE QUANT COMPILE_ARGS RATES CONCURRENCY NPROMPTS INLEN OUTLEN RANGE SERVER_ARGS BENCH_ARGS VARIANTS \
  GPU_TESTS BUDGET
