#!/bin/bash
# Fourteenth session, last call: a tiny Qwen3-MoE artifact loads and serves the loading test's
# workload without compiling a Triton kernel (new GPU test). Usage: bash bench/gpu/run_s14e.sh OUTDIR
set -o pipefail
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
call_start s14e "$1"
gpu_tests tests.log 130 tests/runtime/test_gpu_e2e.py -k moe_loading
stamp tests
call_end
