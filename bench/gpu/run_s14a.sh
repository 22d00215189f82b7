#!/bin/bash
# Written in the thirteenth session for the next one (not yet run): KILN_GRAPH_GREEDY=1 (the decode
# graph takes the greedy argmax itself and leaves the ids in its input row; runtime/model_runner.py).
# GPU tests (the e2e file, whose 130 s cut-off in s13d left most of it unrun, now with 300 s), then
# `kiln bench latency` on one MoE artifact off / on / off / on, and the replay timeline both ways
# (between-replay time: 35 us in ..._s13b_*). Usage: bash bench/gpu/run_s14a.sh OUTDIR
set -o pipefail
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
call_start s14a "$1"
gpu_tests tests.log 250 tests/runtime/test_gpu_e2e.py tests/ops/test_prewait.py
stamp tests
moe_checkpoint; stamp checkpoint
moe_compile; stamp compile
{ moe_latency default ""; moe_latency graph_greedy "" KILN_GRAPH_GREEDY=1; moe_latency default_again "";
  moe_latency graph_greedy_again "" KILN_GRAPH_GREEDY=1; } | tee "$OUT/latency_summary.txt"
stamp latency
for v in 0 1; do
  KILN_GRAPH_GREEDY=$v timeout 60 python bench/gpu/replay_timeline.py $MART --json "$OUT/timeline_gg$v.json" 2>&1 | tail -14
done | tee "$OUT/timeline_summary.txt"
stamp timeline
call_end
