#!/bin/bash
# Eighth session, last GPU call (issue 9): the defaults at the end of the session beside Hugging
# Face: Qwen3-30B-A3B-shaped (16 layers) decode at batch 1 / 8 / 64 with --compare-hf, and the
# 200-prompt throughput run (bench/gpu/run_moe_e2e.sh with its table of both rooflines).
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s8e.sh OUTDIR
NO_TESTS=1 NPROMPTS=200 BATCHES=1,8,64 LAT_TIMEOUT=240 TPUT_TIMEOUT=100 bash bench/gpu/run_moe_e2e.sh "$@"
