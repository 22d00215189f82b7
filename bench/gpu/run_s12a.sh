#!/bin/bash
# Twelfth session, first GPU call (issue 9): KILN_PREWAIT (graph-constant loads before the PDL
# wait: the GEMV's first weight step, the decode split kernel's cached K/V, the RoPE kernel's
# tables). GPU tests, the step bench per part, then `kiln bench latency` on one artifact with the
# switch off / on / off / on (read at capture). Usage: bash bench/gpu/run_s12a.sh OUTDIR
# As recorded: KILN_PREWAIT was off by default then, and `all` had no `slab` part; rerun today,
# `default` is on and `all` adds the slab step (run_s12c.sh is the A/B against the current default).
set -o pipefail
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
call_start s12a "$1"
gpu_tests tests.log 100 tests/ops/test_prewait.py tests/ops/test_decode_attention.py -k "gpu or prewait"
stamp tests
step_bench 170 "a3b-1-default or a3b-1-prewait or llama-3.1-8b-1-default or (llama-3.1-8b-1-prewait and not prewait_)"
stamp step
moe_checkpoint; stamp checkpoint
moe_compile; stamp compile
{ moe_latency default ""; moe_latency prewait "" KILN_PREWAIT=all; moe_latency default_again "";
  moe_latency prewait_again "" KILN_PREWAIT=all; } | tee "$OUT/latency_summary.txt"
stamp latency
call_end
