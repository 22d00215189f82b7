#!/bin/bash
# GPU call 4 of the third 2026-11-29 session: Qwen3-30B-A3B-shaped (16 of 48 layers) end to end
# beside Hugging Face (issue 9): checkpoint, compile, decode latency at batch 1/8/64, throughput,
# per-kernel decode profile, roofline over the weights a step activates. Frees the disk first.
# Usage: bash bench/gpu/run_s3d.sh OUTDIR
rm -rf /tmp/ckpt-llama8b /tmp/art-llama8b
NO_TESTS=1 NPROMPTS=${NPROMPTS:-200} PROFILE=1 LAT_TIMEOUT=240 TPUT_TIMEOUT=120 bash bench/gpu/run_moe_e2e.sh "$@"
