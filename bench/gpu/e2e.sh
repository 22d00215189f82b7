#!/bin/bash
# One model shape end to end on the GPU machine: a random-weight checkpoint of PRESET
# (bench/make_checkpoint.py) -> `kiln compile` -> `kiln bench latency`, once per variant and round
# on the same artifact (alternating, so variants compare inside one call); on request the GPU
# tests first, start-up, offline throughput, the per-kernel decode profile and a CUDA-graph
# replay's timeline. Conventions (DEST, BUDGET, WORK, DRY, COMMIT, .whl): bench/gpu/lib.sh.
#
# Usage (repo root, GPU machine): [VAR=VALUE ...] bash bench/gpu/e2e.sh DEST
#   PRESET=llama-3.1-8b  a bundled config (compiler/configs: llama-3.1-8b, qwen3-30b-a3b, ...)
#   LAYERS=              keep the shapes, this many layers (qwen3-30b-a3b: 16, for the 64 GB disk)
#   CKPT_WORK=           where the checkpoint goes (lib.sh): /dev/shm/kb for the full qwen3-30b-a3b,
#                        whose 61 GB checkpoint and artifact do not both fit the disk
#   DTYPE=bfloat16       checkpoint dtype and `kiln compile --dtype`
#   QUANT=               fp8: `kiln compile --quant fp8`
#   SUCCESSOR=           1: a successor checkpoint (bench/make_checkpoint.py --successor: greedy decoding
#                        emits next(t) after t, every weight still read) and `--prompt-kind cycle` in every
#                        latency run (prompts holding their own continuation): the n-gram speculative
#                        decoding workload, e.g. with COMPILE_ARGS="--verify-lengths 4,8" BATCHES=1,8,32
#                        VARIANTS="plain:--speculative off;ngram4:--speculative ngram --num-draft-tokens 4;
#                        ngram8:--speculative ngram --num-draft-tokens 8;gaps4:--speculative ngram
#                        --num-draft-tokens 4 --cycle-skip 3" (gaps: every 3rd token of the prompt's
#                        stretch dropped, lower acceptance); the latency JSON has spec_acceptance_rate,
#                        spec_mean_emitted and verify_steps per batch. Llama-family untied presets only
#   HEAD=                with SUCCESSOR=1: an EAGLE-3 head that drafts the successor's tokens (bench/make_checkpoint.py
#                        --eagle3-head, written into CKPT/eagle3-head) compiled into the artifact (`--eagle3`, with
#                        `--verify-lengths 4,6` unless COMPILE_ARGS has them); HEAD is its --decoy: 0 = its first
#                        draft right (a chain's later drafts wrong: 2 tokens a step), 1.2 = its best wrong and its second right (chains accept ~nothing, trees of
#                        width 2 ~everything), e.g. VARIANTS="plain:--speculative off;chain4:--speculative draft
#                        --num-draft-tokens 4;tree4:--speculative draft --num-draft-tokens 4 --draft-branches 2"
#   DRAFT=               a bundled config (e.g. llama-3.2-1b, same vocabulary as llama-3.1-8b): its random
#                        checkpoint compiled into the artifact as the draft model (`--draft-model`, with
#                        `--verify-lengths 4,8` unless COMPILE_ARGS has them); VARIANTS pick
#                        "--speculative draft|off" and --num-draft-tokens. Random weights accept ~nothing:
#                        the runs give the draft and verify step costs (docs/speculative.md section 7)
#   COMPILE_ARGS=        more `kiln compile` flags, e.g. "--max-batch-size 64 --page-size 16"
#   REUSE=               1: use the artifact a warm machine holds from an earlier call of this shape
#   ALT_COMPILE=         "NAME:FLAGS;...": a compile option's A/B on the same checkpoint: last in the call
#                        (after every other step on the artifact), each NAME's artifact (COMPILE_ARGS and
#                        FLAGS; the previous one deleted first, for the disk) gets the same latency
#                        variants, labelled NAME-variant, and the table again, e.g.
#                        "latent:--gemv-plan attn:1,mlp:1,router:1,latent:64"
#   BATCHES=1,8,64 INLEN=512 OUTLEN=64 KV=40   `kiln bench latency` batch sizes, lengths, KV GiB
#   LAT_ARGS=            more `kiln bench latency` flags for every run, e.g. --no-overlap
#   HF=                  1: the first latency run also runs Hugging Face transformers (--compare-hf)
#   VARIANTS=default:    "NAME:WORDS;NAME:WORDS;...", a latency run each per round; WORDS are
#                        VAR=VALUE (the run's environment) or latency flags, e.g.
#                        "default:;no_overlap:--no-overlap;no_pdl:KILN_PDL=0"
#   ROUNDS=1             rounds over the variants
#   NPROMPTS=0           >0: `kiln bench throughput` over that many prompts of TP_INLEN=256:1024
#                        tokens, TP_OUTLEN=64:256 out; TP_HF=N: HF on the first N at batch 64
#   TP_VARIANTS=default: "NAME:WORDS;...", a throughput run each (as VARIANTS), e.g.
#                        "default:;mixed:--mixed-steps"; TP_HF goes with the first
#   STARTUP=0            >0: `kiln bench startup --runs N` (process start to first token, by phase);
#                        STARTUP_ARGS: more of its flags, e.g. "--imports 15" (the costliest imports)
#   PROFILE=             batch sizes, e.g. 1,64: bench/gpu/profile_decode.py (GPU time per kernel);
#                        PROFILE_ARGS: more of its flags, e.g. "--drafts 0,4,8" (verify steps' kernels)
#                        or "--engine-extend 512 --mixed off,on" (whole prefill steps beside PROFILE
#                        decoding requests: step times, kernels and host functions)
#                        or, with SUCCESSOR=1, "--engine-ngram 4" / "--engine-draft 4" (whole speculative engine steps:
#                        wall, GPU kernel time and host parts per step)
#   TIMELINE=            a batch size, e.g. 1: bench/gpu/replay_timeline.py (a replay's critical path)
#   ACCURACY=0           >0: `kiln bench accuracy` of the artifact over that many sequences of ACC_SEQLEN=512
#                        tokens against a reference build of the same checkpoint, compiled with
#                        --dtype DTYPE and ACC_REF_ARGS (default none: e.g. QUANT=fp8 against bf16)
#   GPU_TESTS=           pytest paths run first with -m gpu (see bench/gpu/tests.sh for tests/server)
# Writes DEST/e2e_<shape>.json (shape: PRESET[-L<LAYERS>][-<DTYPE>][-<QUANT>][-successor]) holding compile.log,
# latency_<shape>_<variant>_r<N>.json (per batch: tok/s, ITL, host ms, TTFT, roofline; HF),
# latency_table.json (the runs side by side, also printed), throughput_<variant>.json, startup.json,
# profile.json, timeline.json, accuracy.json, tests.log when asked, stamps (seconds at each step's end).
# Time on an H200 (bench/results stamps): Llama-3.1-8B checkpoint ~20 s, compile 35-60 s;
# Qwen3-30B-A3B L16 checkpoint 20-30 s, compile 65-90 s; a latency run (start-up included) 12-20 s.
set -o pipefail
source bench/gpu/lib.sh
PRESET=${PRESET:-llama-3.1-8b}; LAYERS=${LAYERS:-}; DTYPE=${DTYPE:-bfloat16}
BATCHES=${BATCHES:-1,8,64}; INLEN=${INLEN:-512}; OUTLEN=${OUTLEN:-64}; KV=${KV:-40}
VARIANTS=${VARIANTS:-default:}; ROUNDS=${ROUNDS:-1}; NPROMPTS=${NPROMPTS:-0}; STARTUP=${STARTUP:-0}; STARTUP_ARGS=${STARTUP_ARGS:-}
TP_INLEN=${TP_INLEN:-256:1024}; TP_OUTLEN=${TP_OUTLEN:-64:256}
HEAD=${HEAD:-}; [ -n "$HEAD" ] && [ -z "$SUCCESSOR" ] && { echo "HEAD needs SUCCESSOR=1" >&2; exit 2; }
SUCC=${SUCCESSOR:+-successor}${HEAD:+-eagle3-d$HEAD}  # successor checkpoints get their own names (checkpoint, artifact, call)
NAME=$(shape_name "$PRESET" "$LAYERS" "$DTYPE" "$QUANT")$SUCC${DRAFT:+-draft-$DRAFT}
CK=$CKPT_WORK/ckpt-$(shape_name "$PRESET" "$LAYERS" "$DTYPE" "")$SUCC; ART=$WORK/art-$NAME
PROMPT_ARGS=${SUCCESSOR:+--prompt-kind cycle}  # before each variant's words, which may override it
ACCURACY=${ACCURACY:-0}; ACC_SEQLEN=${ACC_SEQLEN:-512}; REF=$WORK/art-$NAME-accuracy-ref
call_begin "e2e_$NAME" "$1"
HERE=$PWD

if [ -n "$GPU_TESTS" ]; then
  # shellcheck disable=SC2086  # paths, split on purpose
  gpu_tests tests.log 300 $GPU_TESTS
  stamp tests
fi

free_work "$CK" "$ART" "$REF"
make_checkpoint "$PRESET" "$LAYERS" "$DTYPE" "$CK" ${SUCCESSOR:+--successor} \
  ${HEAD:+--eagle3-head "$CK.part/eagle3-head" --decoy "$HEAD"} || { call_end e2e.sh PRESET LAYERS SUCCESSOR HEAD; exit 1; }
stamp checkpoint
if [ -n "$HEAD" ]; then  # the head, compiled into the artifact
  COMPILE_ARGS="--eagle3 $CK/eagle3-head $COMPILE_ARGS"
  [[ "$COMPILE_ARGS" == *--verify-lengths* ]] || COMPILE_ARGS="$COMPILE_ARGS --verify-lengths 4,6"
fi
if [ -n "$DRAFT" ]; then  # the draft's checkpoint, compiled into the artifact
  DCK=$CKPT_WORK/ckpt-$(shape_name "$DRAFT" "" "$DTYPE" "")
  make_checkpoint "$DRAFT" "" "$DTYPE" "$DCK" || { call_end e2e.sh PRESET DRAFT; exit 1; }
  COMPILE_ARGS="--draft-model $DCK $COMPILE_ARGS"
  [[ "$COMPILE_ARGS" == *--verify-lengths* ]] || COMPILE_ARGS="$COMPILE_ARGS --verify-lengths 4,8"
  stamp draft_checkpoint
fi
if [ -n "$REUSE" ] && [ -f "$ART/manifest.json" ]; then
  echo "artifact $ART: kept from an earlier call (REUSE=1)"
else
  # shellcheck disable=SC2086
  compile_in "$HERE" compile.log "$CK" "$ART" --dtype "$DTYPE" ${QUANT:+--quant "$QUANT"} $COMPILE_ARGS
  stamp compile
fi

hf=${HF:+--compare-hf $CK}
for ((r = 1; r <= ROUNDS; r++)); do
  IFS=';' read -ra vs <<< "$VARIANTS"
  for v in "${vs[@]}"; do
    [ -z "$v" ] && continue
    # shellcheck disable=SC2086  # WORDS and flags, split on purpose
    latency_in "$HERE" "$NAME" "${v%%:*}" "$r" "$ART" $PROMPT_ARGS ${v#*:} $LAT_ARGS $hf
    hf=
  done
done
stamp latency
latency_table

if [ "$NPROMPTS" -gt 0 ]; then
  hf=${TP_HF:+--compare-hf $CK --hf-num-prompts $TP_HF}
  IFS=';' read -ra vs <<< "${TP_VARIANTS:-default:}"
  for v in "${vs[@]}"; do
    [ -z "$v" ] && continue
    t=${v%%:*}; words=(); flags=()  # VAR=VALUE words go to the environment, the rest are flags
    for w in ${v#*:}; do if [[ $w == *=* && $w != -* ]]; then words+=("$w"); else flags+=("$w"); fi; done
    # shellcheck disable=SC2086  # flags, split on purpose
    step "throughput_$t.log" 400 env "${words[@]}" python -m kiln bench throughput "$ART" --num-prompts "$NPROMPTS" \
      --input-len "$TP_INLEN" --output-len "$TP_OUTLEN" --kv-memory "$KV" "${flags[@]}" $hf \
      --json "$RAW/throughput_$t.json"
    show "throughput_$t.log" "prompts in|HF transformers|step kind|^(prefill|decode|mixed|all|outside) " 8; stamp "throughput $t"
    hf=
  done
fi
if [ "$STARTUP" -gt 0 ]; then
  # shellcheck disable=SC2086  # flags, split on purpose
  step startup.log 200 python -m kiln bench startup "$ART" --runs "$STARTUP" $STARTUP_ARGS --json "$RAW/startup.json"
  show startup.log "ready|first token|phases" 4; stamp startup
fi
if [ -n "$PROFILE" ]; then
  # shellcheck disable=SC2086  # flags, split on purpose
  step profile.log 200 python bench/gpu/profile_decode.py "$ART" --batch-sizes "$PROFILE" --json "$RAW/profile.json" \
    $PROFILE_ARGS
  show profile.log "." 30; stamp profile
fi
if [ -n "$TIMELINE" ]; then
  step timeline.log 120 python bench/gpu/replay_timeline.py "$ART" --batch "$TIMELINE" --json "$RAW/timeline.json"
  show timeline.log "." 24; stamp timeline
fi
if [ "$ACCURACY" -gt 0 ]; then
  if [ -n "$REUSE" ] && [ -f "$REF/manifest.json" ]; then
    echo "reference artifact $REF: kept from an earlier call (REUSE=1)"
  else
    # shellcheck disable=SC2086  # flags, split on purpose
    compile_in "$HERE" compile_ref.log "$CK" "$REF" --dtype "$DTYPE" $ACC_REF_ARGS
    stamp "accuracy reference compile"
  fi
  step accuracy.log 300 python -m kiln bench accuracy "$ART" --reference "$REF" --num-seqs "$ACCURACY" \
    --seq-len "$ACC_SEQLEN" --json "$RAW/accuracy.json"
  show accuracy.log "." 12; stamp accuracy
fi
IFS=';' read -ra alts <<< "${ALT_COMPILE:-}"
for a in "${alts[@]}"; do
  [ -z "$a" ] && continue
  an=${a%%:*}
  [ -n "$DRY" ] || rm -rf "$ART"
  ART=$WORK/art-$NAME-$an
  # shellcheck disable=SC2086  # flags, split on purpose
  compile_in "$HERE" "compile_$an.log" "$CK" "$ART" --dtype "$DTYPE" ${QUANT:+--quant "$QUANT"} $COMPILE_ARGS ${a#*:} \
    || continue
  stamp "compile $an"
  IFS=';' read -ra vs <<< "$VARIANTS"
  for v in "${vs[@]}"; do
    [ -z "$v" ] && continue
    # shellcheck disable=SC2086  # WORDS and flags, split on purpose
    latency_in "$HERE" "$NAME" "$an-${v%%:*}" 1 "$ART" $PROMPT_ARGS ${v#*:} $LAT_ARGS
  done
  stamp "latency $an"
done
[ -n "${ALT_COMPILE:-}" ] && latency_table
call_end e2e.sh PRESET LAYERS CKPT_WORK DTYPE QUANT SUCCESSOR HEAD DRAFT COMPILE_ARGS REUSE ALT_COMPILE BATCHES INLEN OUTLEN KV LAT_ARGS HF VARIANTS ROUNDS \
  NPROMPTS TP_INLEN TP_OUTLEN TP_VARIANTS TP_HF STARTUP STARTUP_ARGS PROFILE PROFILE_ARGS TIMELINE ACCURACY ACC_SEQLEN ACC_REF_ARGS GPU_TESTS BUDGET
