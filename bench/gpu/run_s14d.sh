#!/bin/bash
# Fourteenth session, after s14c's one failure (on an artifact copy no test had loaded, the
# workload's repeated prompts ran the extend graph at T == B, one token each, whose kernels the
# compile had not built): such steps now run on the decode graphs. The runtime's GPU tests again.
# Usage: KILN_COMMIT=<hash> bash bench/gpu/run_s14d.sh OUTDIR
set -o pipefail
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
call_start s14d "$1"
gpu_tests tests.log 240 tests/runtime tests/ops/test_prewait.py
stamp tests
call_end
