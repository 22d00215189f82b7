# shellcheck shell=bash
# Source on the GPU machine (from the repo root) to import kiln from this working tree without
# installing it (kiln/__init__.py maps the subpackages onto the top-level folders).
export PYTHONPATH="$PWD:$PWD/tests:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
python3 -c "import torch, triton, transformers, kiln.ops, kiln.runtime.engine, kiln.compiler.build; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
