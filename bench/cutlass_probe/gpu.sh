#!/bin/bash
# GPU side (run from the repo root, carry bench/cutlass_probe/whl and bench/cutlass_probe/out).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  bench/cutlass_probe/whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
source bench/gpu/env.sh  # kiln from this tree, for the Triton rows
nvidia-smi -L; python3 -m pip show cuda-bindings 2>/dev/null | head -2; nvcc --version | tail -1
P=bench/cutlass_probe; REUSE=--reuse
# binaries built on the CPU image may not load here (other system libraries): then build here (~80 s)
python3 -c "import ctypes,glob; [ctypes.CDLL(f) for f in glob.glob('$P/out/*/*.so')]" || REUSE=
for w in w13 w2; do
  python3 $P/probe.py --out $P/out --which $w $REUSE 2>&1 | tee ${OUT:-/tmp}/probe_$w.log
done
cp $P/out/meta_*.json ${OUT:-/tmp}/ 2>/dev/null
