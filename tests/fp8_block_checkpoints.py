"""Block-FP8 checkpoints in the official layout, made from float ones: what the weights tests
(tests/weights/test_weights_fp8_block.py) and the compiler tests (tests/compiler/
test_fp8_block_checkpoint.py) read."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from kiln.ops.linear.fp8_block import dequantize_fp8_block, expand_block_scale, quantize_fp8_block
from kiln.weights.st_format import write_tensor_file

# the linear weights DeepSeek-V3's and transformers' FP8 checkpoints store in e4m3 (routers, norms,
# embeddings and the LM head stay in bf16)
GEMM = re.compile(
    r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|"
    r"kv_b_proj)\.weight$"
)
QUANT_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


def pow2_block_quant(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block quantization with power-of-two scales (DeepSeek's UE8M0 ``scale_fmt``): unlike amax / 448
    scales, re-quantizing the dequantized weight would give other scales and values."""
    _, amax_scale = quantize_fp8_block(w)
    scale = torch.exp2(torch.ceil(torch.log2(amax_scale)))
    q = (w / expand_block_scale(scale, *w.shape)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale


def write_block_fp8(
    src: Path,
    dst: Path,
    *,
    keep: tuple[str, ...] = (),
    pow2: bool = False,
    scale_dtype: torch.dtype = torch.float32,
    quant_config: dict | None = None,
) -> Path:
    """``src`` rewritten as a block-FP8 checkpoint in ``dst``: its linear weights (:data:`GEMM`) in
    e4m3 with a ``weight_scale_inv`` per 128 x 128 block, over two shards with an index (weights
    alternate between them, every scale in the second: some beside their weight, some not);
    ``keep``: modules left in float and listed in ``modules_to_not_convert``; ``pow2``: power-of-two
    scales; config.json with ``quant_config`` (default :data:`QUANT_CONFIG`). Returns a float32
    checkpoint beside it holding what the FP8 one means: the dequantized weights
    (``dst.with_name(dst.name + "-meaning")``)."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    meaning: dict[str, torch.Tensor] = {}
    for i, (name, w) in enumerate(sorted(tensors.items())):
        module = name.removesuffix(".weight")
        if GEMM.search(name) and module not in keep:
            q, s = pow2_block_quant(w) if pow2 else quantize_fp8_block(w)
            s = s.to(scale_dtype)
            shards[i % 2][name], shards[1][f"{module}.weight_scale_inv"] = q, s
            meaning[name] = dequantize_fp8_block(q, s.float())
        else:
            shards[0][name] = meaning[name] = w
    dst.mkdir(parents=True)
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for fname, part in zip(names, shards):
        write_tensor_file(dst / fname, part)
    wmap = {n: fname for fname, part in zip(names, shards) for n in part}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    cfg = json.loads((src / "config.json").read_text())
    quant = (quant_config or QUANT_CONFIG) | ({"modules_to_not_convert": list(keep)} if keep else {})
    (dst / "config.json").write_text(json.dumps(cfg | {"quantization_config": quant}))
    ref = dst.with_name(dst.name + "-meaning")
    ref.mkdir()
    write_tensor_file(ref / "model.safetensors", meaning)
    (ref / "config.json").write_text(json.dumps(cfg))
    return ref
