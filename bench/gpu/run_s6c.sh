#!/bin/bash
# Sixth session, GPU call 3 (issue 4): the CUTLASS FP8 GEMM backend of fp8_linear, end to end.
#   (1) GPU tests: tests/ops/test_fp8_cutlass.py (every instantiation against the reference, bias and
#       scales, auto + CUDA graph), fp8_linear's and fp8_gemm's GPU tests, the FP8 compile / loader
#       tests of tests/compiler/test_compile_cutlass.py, tests/runtime/test_gpu_e2e.py's FP8 tests;
#   (2) bench/test_bench_fp8_linear.py::test_fp8_linear at M = 256, 1024, 4096 (fp8 = auto with the
#       library loaded, fp8_cutlass, fp8_triton, bf16), report JSON;
#   (3) Llama-3.1-8B-shaped --quant fp8 (library in the artifact): decode latency b1/8/64/256 with
#       KILN_FP8_GEMM=auto (CUTLASS at M 65..1024) and =cublas, same artifact.
# The library is the default build of ops/cutlass/sm90_fp8_gemm.cu made on the CPU machine
# (bench/cutlass_probe/out/kiln/cutlass_fp8_sm90.so, git-ignored, carried).
# Usage (repo root, carry bench/cutlass_probe/out): bash bench/gpu/run_s6c.sh OUT   (6 files)
source bench/gpu/s6_env.sh "$1"
timeout 200 python -m pytest -q -m gpu tests/ops/test_fp8_cutlass.py tests/ops/test_fp8_linear.py \
  tests/ops/test_fp8_gemm.py tests/compiler/test_compile_cutlass.py tests/runtime/test_gpu_e2e.py \
  -k "fp8" -p no:cacheprovider -rf > "$OUT/tests.log" 2>&1
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests.log" | tail -8
timeout 150 python -m pytest -q bench/test_bench_fp8_linear.py -k "test_fp8_linear and (256 or 1024 or 4096) and not ref_" \
  -p no:cacheprovider --benchmark-json="$OUT/raw.json" > "$OUT/bench.log" 2>&1
tail -1 "$OUT/bench.log"
python bench/report.py "$OUT/raw.json" "$OUT/fp8_linear_cutlass.json" --command \
  "KILN_CUTLASS_FP8_LIB=LIB pytest bench/test_bench_fp8_linear.py -k 'test_fp8_linear and (256 or 1024 or 4096) and not ref_'" > /dev/null 2>&1
rm -f "$OUT/raw.json"
fp8_compile 150
python -c "import json,sys; print('manifest fp8:', json.load(open('$ART/manifest.json'))['kernel_choices'].get('fp8'))"
for be in auto cublas; do
  KILN_FP8_GEMM=$be timeout 100 python -m kiln bench latency $ART --batch-sizes 1,8,64,128,256 --input-len 512 \
    --output-len 64 --kv-memory 40 --json "$OUT/fp8_latency_$be.json" 2>&1 | grep -v "it/s\]" | tail -6
done
python - "$OUT/fp8_linear_cutlass.json" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["results"] if r.get("impl", "").startswith("fp8")]
print(f"{'m':>5} {'n':>6} {'k':>6} {'impl':12} {'backend':8} {'us':>7} {'x bf16':>6}")
for r in sorted(rows, key=lambda r: (r["m"], r["n"], r["k"], r["impl"])):
    print(f"{r['m']:>5} {r['n']:>6} {r['k']:>6} {r['impl']:12} {str(r.get('backend', '')):8} "
          f"{r['ms'] * 1e3:7.1f} {r.get('speedup_vs_bf16', 0):6.2f}")
PY
