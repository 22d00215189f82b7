#!/bin/bash
# CPU side: fetch the wheels to carry (whl/, 6.5 MB) and build the artifacts (out/, ~80 s, no GPU).
set -euo pipefail
cd "$(dirname "$0")"
python3 -m pip download -q --no-deps -d whl nvidia-cutlass==4.2.0.0 pydot==4.0.1 treelib==1.8.0
# here only (the GPU image has cuda-bindings 13 and pyparsing/six): the shim needs cuda.bindings
python3 -m pip download -q --no-deps -d /tmp/cutl/whl_here cuda-bindings==13.* cuda-pathfinder pyparsing six
python3 -m pip install -q --no-deps --no-compile --upgrade --target /tmp/cutl/site whl/*.whl /tmp/cutl/whl_here/*.whl
for w in w13 w2; do PYTHONPATH=/tmp/cutl/site python3 probe.py --out out --which "$w" --no-gpu --reuse; done
du -sh whl out
