#!/bin/bash
# Fourteenth session: KILN_GRAPH_GREEDY on by default. GPU tests (test_gpu_e2e.py), then `kiln bench
# latency` on one MoE artifact: the new default beside HF, graph greedy off, the early w2 slabs
# (KILN_MOE_EARLY_W2=1, off since the eighth session; retried on top of the pre-wait slabs), each
# twice, alternating. Usage: KILN_COMMIT=<hash> bash bench/gpu/run_s14b.sh OUTDIR
set -o pipefail
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
call_start s14b "$1"
gpu_tests tests.log 150 tests/runtime/test_gpu_e2e.py
stamp tests
moe_checkpoint; stamp checkpoint
moe_compile; stamp compile
{ moe_latency default_hf "--compare-hf $MCK"; moe_latency graph_greedy_off "" KILN_GRAPH_GREEDY=0;
  moe_latency early_w2 "" KILN_MOE_EARLY_W2=1; moe_latency default ""; moe_latency graph_greedy_off_again "" KILN_GRAPH_GREEDY=0;
  moe_latency early_w2_again "" KILN_MOE_EARLY_W2=1; } | tee "$OUT/latency_summary.txt"
stamp latency
call_end
