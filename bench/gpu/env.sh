# Source on the GPU machine (from the repo root) to import kiln from this working tree without
# installing it: the image has torch/triton/transformers, and no network for a pip build.
mkdir -p /tmp/kp/kiln
for f in kiln/*.py; do ln -sf "$PWD/$f" /tmp/kp/kiln/; done
for d in ops weights compiler runtime; do ln -sfn "$PWD/$d" "/tmp/kp/kiln/$d"; done
export PYTHONPATH="/tmp/kp:$PWD/tests:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
python3 -c "import torch, triton, transformers, kiln.ops; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
