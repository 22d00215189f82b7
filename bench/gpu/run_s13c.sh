#!/bin/bash
# Thirteenth session, third GPU call (issue 9): KILN_PREWAIT=...,slab_norm as the candidate default and
# the top-k inside the w13 GEMV by selection rounds (KILN_MOE_TOPK_IN_W13=1 when compiling,
# KILN_MOE_ROUTE_SELECT=rounds at capture). GPU tests under both, the step bench, `kiln bench
# latency` on two artifacts (the routed one compiled with KILN_MOE_TOPK_IN_W13=1), the candidate beside
# Hugging Face, then one replay timeline. Usage: bash bench/gpu/run_s13c.sh OUTDIR
# Since run (2026-12-02): every KILN_PREWAIT part is on by default; `default` here meant gemv,attn,rope.
set -o pipefail
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
call_start s13c "$1"
SN=gemv,attn,rope,slab_norm
KILN_PREWAIT=$SN KILN_MOE_ROUTE_SELECT=rounds gpu_tests tests.log 120 tests/ops/test_prewait.py \
  tests/ops/test_moe_routed.py tests/ops/test_gemv.py
stamp tests
step_bench 120 "(a3b-1 and (default or slab_norm or topk_w13 or rounds_slab_norm)) or (llama-3.1-8b-1 and (default or slab_norm))"
stamp step
moe_checkpoint; stamp checkpoint
moe_compile; stamp compile
RART=/tmp/art-qwen3moe-L16-routed
KILN_MOE_TOPK_IN_W13=1 timeout 150 python -m kiln compile $MCK -o $RART --force > "$OUT/compile_routed.log" 2>&1
tail -1 "$OUT/compile_routed.log"; stamp compile_routed
routed() {  # NAME [VAR=VALUE ...]: moe_latency on the routed artifact
  local name=$1; shift; MART=$RART moe_latency "$name" "" KILN_MOE_ROUTE_SELECT=rounds "$@"
}
{ moe_latency default ""; moe_latency slab_norm "" KILN_PREWAIT=$SN; routed routed_slab_norm KILN_PREWAIT=$SN;
  moe_latency default_again ""; moe_latency slab_norm_again "" KILN_PREWAIT=$SN;
  routed routed_slab_norm_again KILN_PREWAIT=$SN; routed routed_rank KILN_MOE_ROUTE_SELECT=rank KILN_PREWAIT=$SN;
  moe_latency slab_norm_hf "--compare-hf $MCK" KILN_PREWAIT=$SN; } | tee "$OUT/latency_summary.txt"
stamp latency
KILN_PREWAIT=$SN KILN_MOE_ROUTE_SELECT=rounds timeout 60 python bench/gpu/replay_timeline.py $RART \
  --json "$OUT/timeline_routed.json" 2>&1 | tail -14 | tee "$OUT/timeline_summary.txt"
stamp timeline
call_end
