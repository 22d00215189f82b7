# Sourced (with the OUT argument) by bench/gpu/run_s6{c..f}.sh: OUT, kiln's environment, the CUTLASS
# FP8 library carried from the CPU machine (bench/cutlass_probe/out, git-ignored), and the
# Llama-3.1-8B-shaped checkpoint generated in the background; fp8_compile waits for it and compiles
# it with --quant fp8 into $ART.
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
export KILN_CUTLASS_FP8_LIB=$PWD/bench/cutlass_probe/out/kiln/cutlass_fp8_sm90.so
CK=/tmp/ckpt-llama8b; ART=/tmp/art-llama8b-fp8
python bench/make_checkpoint.py --preset llama-3.1-8b -o $CK > /dev/null 2>&1 &
PCK=$!
fp8_compile() {
  wait $PCK
  timeout "${1:-150}" python -m kiln compile $CK -o $ART --quant fp8 --force 2>&1 | tail -1
}
