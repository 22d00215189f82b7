"""Block FP8 packs (``quant="fp8-block"``): a checkpoint in the DeepSeek-V3 / Hugging Face ``fp8``
format (e4m3 weights, ``weight_scale_inv`` per 128 x 128 block, ``quantization_config`` in
config.json) is packed with its blocks and scales unchanged wherever the fused and sharded tensors
keep the blocks whole; tensors off the block grid, and weights the checkpoint has in float, are
quantized per block at pack time within the e4m3 bound; weights that are not block FP8 in the pack
(MLA ``w_kc``/``w_vc``, MoE experts) get the dequantized values; ``modules_to_not_convert`` stay
as the checkpoint has them.

Each pack is compared with a plain pack (``quant=None``) of the float32 checkpoint holding what the
FP8 one means (its dequantized values), so every fused, sharded and padded tensor is checked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fp8_block_checkpoints import write_block_fp8
from weights_helpers import CONFIGS, hf_tensors, load_ranks, pack

from kiln.compiler.synth import make_checkpoint
from kiln.ops.common.quant import fp8_error_bound
from kiln.ops.linear.fp8_block import dequantize_fp8_block, expand_block_scale, quantize_fp8_block
from kiln.weights.st_format import write_tensor_file

# hidden 256 with 2 heads of 128 and one KV head, intermediate 256: every fused and tp-2 sharded
# tensor keeps 128 x 128 blocks whole
ALIGNED = dict(
    CONFIGS["llama"], hidden_size=256, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256
)


def float_checkpoint(tmp_path: Path, config: dict, seed: int = 0) -> Path:
    return make_checkpoint(
        tmp_path / "float", config, dtype="float32", seed=seed, with_tokenizer=False, max_shard_size="200KB"
    )


def dequantized_ranks(packs: list[dict[str, torch.Tensor]], specs) -> list[dict[str, torch.Tensor]]:
    """Each rank's tensors with its block-FP8 ones dequantized (float32)."""
    out = []
    for got, spec_list in zip(packs, specs):
        d = {s.name: got[s.name] for s in spec_list}
        for s in spec_list:
            if s.quant == "fp8-block":
                assert got[s.name].dtype == torch.float8_e4m3fn and got[s.scale_name].shape == s.scale_shape
                d[s.name] = dequantize_fp8_block(got[s.name], got[s.scale_name])
        out.append(d)
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_block_checkpoint_keeps_its_blocks(tmp_path, tp):
    # UE8M0 scales stored as float8_e8m0fnu: powers of two that a re-quantization would not give back
    ref_dir = write_block_fp8(
        float_checkpoint(tmp_path, ALIGNED), tmp_path / "fp8", pow2=True, scale_dtype=torch.float8_e8m0fnu
    )
    index, specs = pack(tmp_path / "fp8", tmp_path / "pack", tp=tp, quant="fp8-block")
    _, ref_specs = pack(ref_dir, tmp_path / "ref", tp=tp)
    packs = load_ranks(tmp_path / "pack", specs)
    block = [s for spec_list in specs for s in spec_list if s.quant == "fp8-block"]
    assert len(block) == 2 * 4 * tp and all(s.block_exact for s in block)  # qkv, o, gate_up, down
    assert index.model["fp8_block_kept"] == len(block) and index.model["fp8_block_quantized"] == 0
    assert index.quant == "fp8-block" and index.model["dequantized_fp8"] == 0
    for r, got in enumerate(packs):
        for s in specs[r]:
            if s.quant:
                scale = got[s.scale_name]
                assert torch.equal(scale, torch.exp2(torch.log2(scale).round())), f"{s.name}: scales re-made"
    refs = load_ranks(tmp_path / "ref", ref_specs)
    for got, ref in zip(dequantized_ranks(packs, specs), refs):
        assert got.keys() == ref.keys()
        for name in ref:
            assert torch.equal(got[name], ref[name]), name


def test_pieces_off_the_block_grid_are_quantized_again(tmp_path):
    # hidden 64, 4 heads of 16, intermediate 90 over 2 ranks: no piece keeps a block whole
    ref_dir = write_block_fp8(float_checkpoint(tmp_path, CONFIGS["llama"]), tmp_path / "fp8")
    index, specs = pack(tmp_path / "fp8", tmp_path / "pack", tp=2, quant="fp8-block")
    _, ref_specs = pack(ref_dir, tmp_path / "ref", tp=2)
    block = [s for spec_list in specs for s in spec_list if s.quant == "fp8-block"]
    assert block and not any(s.block_exact for s in block)
    assert index.model["fp8_block_kept"] == 0 and index.model["fp8_block_quantized"] == len(block)
    packs = load_ranks(tmp_path / "pack", specs)
    refs = load_ranks(tmp_path / "ref", ref_specs)
    for got, deq, ref, spec_list in zip(packs, dequantized_ranks(packs, specs), refs, specs):
        for s in spec_list:
            if s.quant is None:  # embeddings, norms, LM head: as the checkpoint has them
                assert torch.equal(got[s.name], ref[s.name]), s.name
                continue
            bound = fp8_error_bound(ref[s.name], expand_block_scale(got[s.scale_name], *s.shape))
            err = (deq[s.name] - ref[s.name]).abs()
            assert bool((err <= bound).all()), f"{s.name}: max err {err.max():.3g}"


def test_float_checkpoint_quantized_per_block(tmp_path):
    src = float_checkpoint(tmp_path, CONFIGS["qwen3"])
    index, specs = pack(src, tmp_path / "pack", quant="fp8-block")
    _, ref_specs = pack(src, tmp_path / "ref")
    assert index.model["fp8_block_kept"] == 0 and index.model["fp8_block_quantized"] == 4
    packs, refs = load_ranks(tmp_path / "pack", specs), load_ranks(tmp_path / "ref", ref_specs)
    for s in specs[0]:
        if s.quant is None:
            assert torch.equal(packs[0][s.name], refs[0][s.name]), s.name
            continue
        w, scale = packs[0][s.name], packs[0][s.scale_name]
        torch.testing.assert_close(scale, quantize_fp8_block(refs[0][s.name])[1], rtol=0, atol=0)
        err = (dequantize_fp8_block(w, scale) - refs[0][s.name]).abs()
        assert bool((err <= fp8_error_bound(refs[0][s.name], expand_block_scale(scale, *s.shape))).all())


def test_modules_to_not_convert_stay_as_the_checkpoint_has_them(tmp_path):
    keep = ("model.layers.0.mlp.down_proj", "layers.1.self_attn.o_proj")  # a full name and a suffix
    ref_dir = write_block_fp8(float_checkpoint(tmp_path, ALIGNED), tmp_path / "fp8", keep=keep)
    # the suffix is not a checkpoint module name: write_block_fp8 quantized layer 1's o_proj
    fp8 = hf_tensors(tmp_path / "fp8")
    assert fp8["model.layers.1.self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn
    fp8["model.layers.1.self_attn.o_proj.weight"] = hf_tensors(ref_dir)[
        "model.layers.1.self_attn.o_proj.weight"
    ]
    del fp8["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    for f in (tmp_path / "fp8").glob("*.safetensors"):
        f.unlink()
    (tmp_path / "fp8" / "model.safetensors.index.json").unlink()
    write_tensor_file(tmp_path / "fp8" / "model.safetensors", fp8)
    index, specs = pack(tmp_path / "fp8", tmp_path / "pack", quant="fp8-block")
    plain = {s.name for s in specs[0] if s.quant is None}
    assert {"layers.0.mlp.down.weight", "layers.1.attn.o.weight"} <= plain
    assert "layers.1.mlp.down.weight" not in plain and "layers.0.attn.o.weight" not in plain
    _, ref_specs = pack(ref_dir, tmp_path / "ref")
    got = dequantized_ranks(load_ranks(tmp_path / "pack", specs), specs)[0]
    ref = load_ranks(tmp_path / "ref", ref_specs)[0]
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
    assert index.model["fp8_block_kept"] == 6 and index.model["fp8_block_quantized"] == 0


def test_deepseek_v3_non_block_weights_are_dequantized(tmp_path):
    """kv_b_proj (MLA w_kc / w_vc, batched matmuls) and the routed experts (intermediate size 16: off
    the 128 grid, compiler/moe_layer.py ``block_fp8_experts``) are packed as the dequantized
    checkpoint; the router stays bf16."""
    ref_dir = write_block_fp8(float_checkpoint(tmp_path, CONFIGS["deepseek_v3"]), tmp_path / "fp8")
    index, specs = pack(tmp_path / "fp8", tmp_path / "pack", quant="fp8-block")
    _, ref_specs = pack(ref_dir, tmp_path / "ref")
    quantized = {s.name for s in specs[0] if s.quant}
    assert "layers.1.attn.qkv_a.weight" in quantized and "layers.1.moe.shared.gate_up.weight" in quantized
    assert not quantized & {"layers.1.attn.w_kc", "layers.1.attn.w_vc", "layers.1.moe.w13", "layers.1.moe.w2"}
    # kv_b of 2 layers, 4 experts x 3 of layer 1; and the gate and up of layer 0's MLP and of the
    # shared expert (96 and 16 rows: fused off the block grid, quantized again); q_a_proj and
    # kv_a_proj_with_mqa of both layers (qkv_a: kv_a's rows start at 24, off the grid)
    assert index.model["dequantized_fp8"] == 2 + 12 + 4 + 4 and index.model["fp8_block_quantized"] == 2 + 2
    got = load_ranks(tmp_path / "pack", specs)[0]
    ref = load_ranks(tmp_path / "ref", ref_specs)[0]
    for name in ("layers.0.attn.w_kc", "layers.1.attn.w_vc", "layers.1.moe.w13", "layers.1.moe.w2"):
        assert got[name].dtype == torch.float32 and torch.equal(got[name], ref[name]), name
    assert torch.equal(got["layers.1.moe.router.weight"], ref["layers.1.moe.router.weight"])
