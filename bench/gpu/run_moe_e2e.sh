#!/bin/bash
# GPU run: Qwen3-30B-A3B-shaped end to end (issue 9). Random bf16 weights with 16 of the 48 layers,
# so that checkpoint and artifact fit a 64 GB disk (~21 GB each; every other shape is the real
# model's: E=128, top-8, H=2048, I=768, 32/4 heads, vocab 151936): the MoE GPU tests, make the
# checkpoint, kiln compile, decode latency at batch 1/8/64 beside Hugging Face transformers,
# offline throughput, then a table of the runtime's roofline (which counts only the weights a
# decode step reads: attention, routers, the experts the batch hits, final norm, lm_head; see
# runtime/benchmark.py weight_bytes_per_step) beside one that counts all 128 experts of every layer.
#
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_moe_e2e.sh OUTDIR
# Every stage is skipped when its output exists (a second call resumes; FORCE=1 redoes them).
# Env: LAYERS (16), BATCHES (1,8,64), INLEN (512), OUTLEN (64), NO_HF=1 (skip transformers),
#      NPROMPTS (400; 0 skips the throughput run), MAXBS (256, compile --max-batch-size),
#      KV (40, --kv-memory GiB), NO_TESTS=1, PROFILE=1 (per-kernel decode profile at batch 1 and 64).
# Kernel stages instead of / before the end to end (bench/test_bench_moe.py):
#      SWEEP=1,4,8,16,4096 (token counts, any subset): the launch-config sweeps at those sizes, best
#      3 per case printed; KERNELS=1: the fused-op rows (KILN_MOE_TUNING=table.json to try a
#      retuned table); E2E=0: stop after those.
# Writes into OUTDIR: gpu_tests.log, compile.log, latency.json, throughput.json, roofline_active.json
# (and profile.json, moe_sweep_<sizes>.json/.txt, moe_kernels.json/.txt); prints the table last.
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
moe_bench() {  # NAME -k-EXPRESSION TIMEOUT: one run of the MoE kernel bench into $OUT/NAME.{json,txt}
  timeout $3 python -m pytest -q bench/test_bench_moe.py -k "$2" -p no:cacheprovider \
    --benchmark-json="$OUT/$1_raw.json" 2>&1 | tail -2
  python bench/report.py "$OUT/$1_raw.json" "$OUT/$1.json" --command "pytest bench/test_bench_moe.py -k '$2'" \
    > "$OUT/$1.txt" 2>&1
}
best() {  # the 3 best configs of every sweep case in $OUT/$1.json
  python - "$OUT/$1.json" <<'PY'
import collections, json, sys
best = collections.defaultdict(list)
for r in json.load(open(sys.argv[1]))["results"]:
    if "ms" in r:
        key = (r["name"].split("[")[0].replace("test_", ""), r.get("gemm", "op"), r["t"])
        best[key].append((round(r.get("frac_bw", r.get("frac_mm", 0)), 3), round(r["ms"] * 1e3, 1), r["config"]))
for k, v in sorted(best.items(), key=str):
    print(k, "frac, us, config:", sorted(v, key=lambda t: -t[0])[:3])
PY
}
if [ -n "$SWEEP" ]; then
  tag=$(echo "$SWEEP" | tr ',' '_'); expr=$(echo "$SWEEP" | sed 's/\([0-9]*\)/\1tok/g; s/,/ or /g')
  moe_bench "moe_sweep_$tag" "sweep and ($expr)" ${SWEEP_TIMEOUT:-560}; best "moe_sweep_$tag"
fi
if [ -n "$KERNELS" ]; then
  moe_bench moe_kernels "test_fused_moe and not sweep" ${KTIMEOUT:-300}
  grep -E "ceilings|triton\]|align\]" "$OUT/moe_kernels.txt"
fi
[ "${E2E:-1}" = 0 ] && exit 0
L=${LAYERS:-16}
CK=/tmp/ckpt-qwen3moe-L$L; ART=/tmp/art-qwen3moe-L$L
[ -n "$FORCE" ] && rm -rf "$ART" "$CK" "$OUT/latency.json" "$OUT/throughput.json"
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
T0=$(date +%s)
if [ -z "$NO_TESTS" ] && [ ! -f "$OUT/gpu_tests.log" ]; then  # the decode GEMV compiles for the GPU here first
  timeout 200 python -m pytest -q -m gpu tests/ops/test_moe_gemm.py tests/ops/test_moe_align.py \
    -p no:cacheprovider -rf 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|Error" | tail -8
  stamp "gpu tests"
fi
if [ ! -f $CK/config.json ]; then
  python bench/make_checkpoint.py --preset qwen3-30b-a3b --num-layers $L -o $CK 2>&1 | tail -1
  stamp "checkpoint"; df -h /tmp | tail -1
fi
if [ ! -f $ART/manifest.json ]; then
  timeout 450 python -m kiln compile $CK -o $ART --force --max-batch-size ${MAXBS:-256} 2>&1 \
    | grep -v "it/s\]" | tee "$OUT/compile.log" | tail -3
  stamp "compile"; df -h /tmp | tail -1
fi
[ -f $ART/manifest.json ] || { echo "no artifact at $ART (see $OUT/compile.log)"; exit 1; }
HF="--compare-hf $CK"; [ -n "$NO_HF" ] && HF=""
if [ ! -f "$OUT/latency.json" ]; then
  timeout ${LAT_TIMEOUT:-420} python -m kiln bench latency $ART --batch-sizes ${BATCHES:-1,8,64} \
    --input-len ${INLEN:-512} --output-len ${OUTLEN:-64} --kv-memory ${KV:-40} $HF --json "$OUT/latency.json" 2>&1 \
    | grep -v "it/s\]" | tail -6
  stamp "latency"
fi
if [ "${NPROMPTS:-400}" != 0 ] && [ ! -f "$OUT/throughput.json" ]; then
  timeout ${TPUT_TIMEOUT:-300} python -m kiln bench throughput $ART --num-prompts ${NPROMPTS:-400} \
    --input-len 256:1024 --output-len 64:256 --kv-memory ${KV:-40} --json "$OUT/throughput.json" 2>&1 \
    | grep -v "it/s\]" | tail -1
  stamp "throughput"
fi
if [ -n "$PROFILE" ]; then
  timeout 150 python bench/gpu/profile_decode.py $ART --batch-sizes 1,64 --json "$OUT/profile.json" 2>&1 | tail -30
fi
echo "== Qwen3-30B-A3B-shaped, $L layers: decode vs HF and the roofline (active weights only)"
python - "$ART" "$OUT" <<'PY'
import json, re, sys
from pathlib import Path

art, out = Path(sys.argv[1]), Path(sys.argv[2])
moe = json.loads((art / "manifest.json").read_text())["model"]["moe"]
e, k = moe["num_experts"], moe["top_k"]
tensors = json.loads((art / "weights" / "pack.json").read_text())["ranks"][0]["tensors"]
# what runtime/benchmark.py weight_bytes_per_step counts: every tensor but an untied embedding table
counted = {n: t["nbytes"] for n, t in tensors.items() if n != "embed.weight" or "lm_head.weight" not in tensors}
experts = sum(b for n, b in counted.items() if re.search(r"\.moe\.w(13|2)(_scale)?$", n))
dense = sum(counted.values()) - experts


def active(batch):  # weights a decode step of `batch` tokens reads: E * (1 - (1 - k/E)^B) experts hit
    return dense + experts * (1 - (1 - k / e) ** batch)


lat = json.loads((out / "latency.json").read_text()) if (out / "latency.json").exists() else None
rows = []
if lat:
    bw = lat["read_gbps"] * 1e9
    print(f"read {lat['read_gbps']:.0f} GB/s; weights counted by the runtime {sum(counted.values()) / 1e9:.2f} GB "
          f"(experts {experts / 1e9:.2f} GB); active at batch 1: {active(1) / 1e9:.2f} GB")
    print(f"{'batch':>5} {'tok/s':>9} {'HF tok/s':>9} {'kiln/HF':>7} {'ITL ms':>7} {'TTFT s':>7} "
          f"{'roof(all)':>9} {'roof(active)':>12} {'GB/step':>8}")
    for r in lat["kiln"]:
        b = r["batch"]
        nbytes = r["bytes_per_step"]  # the runtime's count: active weights + KV read
        kv = nbytes - active(b)  # B * mean context * KV bytes per token
        roof_all = b / ((sum(counted.values()) + kv) / bw)
        hf = (lat.get("hf") or {}).get(str(b), {}).get("decode_tok_s")
        row = dict(batch=b, decode_tok_s=r["decode_tok_s"], hf_tok_s=hf, itl_ms=r["itl_ms"], ttft_s=r["ttft_s"],
                   frac_roofline_all_experts=r["decode_tok_s"] / roof_all, active_bytes_per_step=nbytes,
                   roofline_active_tok_s=r["roofline_tok_s"], frac_roofline_active=r["frac_roofline"])
        rows.append(row)
        print(f"{b:>5} {r['decode_tok_s']:>9.1f} {hf or float('nan'):>9.1f} "
              f"{r['decode_tok_s'] / hf if hf else float('nan'):>7.2f} {r['itl_ms']:>7.2f} {r['ttft_s']:>7.3f} "
              f"{row['frac_roofline_all_experts']:>9.1%} {row['frac_roofline_active']:>12.1%} {nbytes / 1e9:>8.2f}")
tp = out / "throughput.json"
if tp.exists():
    t = json.loads(tp.read_text())["kiln"]
    print(f"throughput: input {t['input_tok_s']:.0f} tok/s, output {t['output_tok_s']:.0f} tok/s, "
          f"{t['requests_s']:.2f} req/s, preemptions {t['preemptions']}")
(out / "roofline_active.json").write_text(json.dumps(dict(
    num_experts=e, top_k=k, dense_bytes=dense, expert_bytes=experts, runtime_counted_bytes=sum(counted.values()),
    formula="dense + expert_bytes * (1 - (1 - top_k / E) ** batch) + batch * mean_ctx * kv_bytes_per_token",
    rows=rows), indent=1))
PY
