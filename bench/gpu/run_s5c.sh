#!/bin/bash
# GPU call 4 of the fifth 2026-11-29 session.
# (A) issue 4: FP8 GPU tests (fp8_gemm + fp8_linear, now auto backend + fast accumulation); the
#     sweep at M = 256 / 512 with the flat-loop stream-K; fp8_linear (auto) vs bf16 at M = 256..4096.
# (B) issue 9: Qwen3-30B-A3B-shaped (16 layers) compiled with the default MoE table and with
#     --moe-tune (first GPU run of the tuner), decode at batch 1 / 8 for both.
# (C) the persistent-norm GPU tests after last session's stage cap.
# Usage: bash bench/gpu/run_s5c.sh OUTDIR   (8 files)
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
CK=/tmp/ckpt-qwen3moe-L16; ART=/tmp/art-qwen3moe-L16
python bench/make_checkpoint.py --preset qwen3-30b-a3b --num-layers 16 -o $CK > /dev/null 2>&1 &
PCK=$!
timeout 100 python -m pytest -q -m gpu tests/ops/test_fp8_gemm.py tests/ops/test_fp8_linear.py \
  -p no:cacheprovider -rf > "$OUT/tests.log" 2>&1
tail -1 "$OUT/tests.log"
KILN_FP8_SWEEP_CHAIN=128 KILN_SWEEP_M=256,512 timeout 150 python -m pytest -q bench/test_bench_fp8_linear.py \
  -k "fp8_gemm_sweep and p-" -p no:cacheprovider --benchmark-json="$OUT/raw.json" > /dev/null 2>&1
python bench/report.py "$OUT/raw.json" "$OUT/fp8_sweep_streamk_flat.json" --command \
  "KILN_FP8_SWEEP_CHAIN=128 KILN_SWEEP_M=256,512 pytest bench/test_bench_fp8_linear.py -k 'fp8_gemm_sweep and p-'" > /dev/null 2>&1
timeout 100 python -m pytest -q bench/test_bench_fp8_linear.py -k "test_fp8_linear and not ref_ and not fast_accum and not 1- and not 16-" \
  -p no:cacheprovider --benchmark-json="$OUT/raw.json" > /dev/null 2>&1
python bench/report.py "$OUT/raw.json" "$OUT/fp8_linear_auto.json" --command \
  "pytest bench/test_bench_fp8_linear.py -k 'test_fp8_linear and not ref_ and not fast_accum and not 1- and not 16-'" > /dev/null 2>&1
rm -f "$OUT/raw.json"
wait $PCK
timeout 120 python -m kiln compile $CK -o $ART --force 2>&1 | tail -1
timeout 50 python -m kiln bench latency $ART --batch-sizes 1,8 --input-len 512 --output-len 64 \
  --kv-memory 40 --json "$OUT/moe_latency_default.json" 2>&1 | grep -v "it/s\]" | tail -3
rm -rf $ART
timeout 200 python -m kiln compile $CK -o $ART-tuned --force --moe-tune > "$OUT/moe_tune_compile.log" 2>&1
tail -1 "$OUT/moe_tune_compile.log"
python -c "import json; m=json.load(open('$ART-tuned/manifest.json'))['kernel_choices']['moe']; print(json.dumps(m, indent=1))" > "$OUT/moe_tune_choices.json" 2>&1
timeout 50 python -m kiln bench latency $ART-tuned --batch-sizes 1,8 --input-len 512 --output-len 64 \
  --kv-memory 40 --json "$OUT/moe_latency_tuned.json" 2>&1 | grep -v "it/s\]" | tail -3
timeout 60 python -m pytest -q -m gpu tests/ops/test_norm.py -k persistent -p no:cacheprovider -rf > "$OUT/norm_tests.log" 2>&1
tail -1 "$OUT/norm_tests.log"
python - "$OUT" <<'PY'
import json, sys, os
o = sys.argv[1]
rows = [r for r in json.load(open(f"{o}/fp8_sweep_streamk_flat.json"))["results"] if "chain_ms" in r and r["accum"] == "fast"]
for r in sorted(rows, key=lambda r: (r["m"], r["n"], r["k"], r["chain_ms"]))[:40]:
    print(f"{r['m']:>4} {r['n']:>5} {r['k']:>5} {r['config']:24} chain {r['chain_ms']*1e3:6.1f} us x{r['chain_speedup_vs_bf16']:.2f}")
for r in json.load(open(f"{o}/fp8_linear_auto.json"))["results"]:
    if "speedup_vs_bf16" in r:
        print(f"{r['m']:>5} {r['n']:>5} {r['k']:>5} {r['impl']:12} {r['ms']*1e3:7.1f} us  x{r['speedup_vs_bf16']:.2f} vs bf16")
for name in ("default", "tuned"):
    f = f"{o}/moe_latency_{name}.json"
    if os.path.exists(f):
        for r in json.load(open(f))["kiln"]:
            print(name, r["batch"], f"{r['decode_tok_s']:.1f} tok/s", f"{r['frac_roofline']:.3f} of roofline")
PY
