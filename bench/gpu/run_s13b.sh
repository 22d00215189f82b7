#!/bin/bash
# Thirteenth session, second GPU call (issue 9): KILN_PREWAIT's slab split in two parts (`slab`: GEMVs
# without a fused norm, the o projection; `slab_norm`: with one, qkv and router). The step bench for
# both presets, `kiln bench latency` on one MoE artifact (default / all / slab / again), then the
# critical path of a graph replay by kernel (bench/gpu/replay_timeline.py), default and all.
# Usage: bash bench/gpu/run_s13b.sh OUTDIR
# Since run (2026-12-02): the plain `slab` part takes only grids of at most 8 programs a SM and every
# part is on by default; `default` here meant gemv,attn,rope.
set -o pipefail
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
call_start s13b "$1"
step_bench 150 "(a3b-1 or llama-3.1-8b-1) and (default or prewait_slab or slab_plain or slab_norm)"
stamp step
moe_checkpoint; stamp checkpoint
moe_compile; stamp compile
{ moe_latency default ""; moe_latency all "" KILN_PREWAIT=all; moe_latency slab "" KILN_PREWAIT=gemv,attn,rope,slab;
  moe_latency default_again ""; moe_latency all_again "" KILN_PREWAIT=all;
  moe_latency slab_again "" KILN_PREWAIT=gemv,attn,rope,slab; } | tee "$OUT/latency_summary.txt"
stamp latency
for v in default all; do
  prewait=$([ $v = all ] && echo all || echo gemv,attn,rope)
  KILN_PREWAIT=$prewait timeout 90 python bench/gpu/replay_timeline.py $MART --json "$OUT/timeline_$v.json" \
    > "$OUT/timeline_${v}.txt" 2>&1
  tail -32 "$OUT/timeline_${v}.txt"
done | tee "$OUT/timeline_summary.txt"
stamp timeline
call_end
