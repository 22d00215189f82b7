"""FP8: packing with --quant fp8 (per output channel, dense and expert weights) round-trips within
the e4m3 bound; FP8 checkpoints (block ``weight_scale_inv`` or per-channel ``weight_scale``) are
dequantized while streaming, scale names normalized, activation scales dropped."""

from __future__ import annotations

import json
import math

import pytest
import torch
from weights_helpers import check_dense, hf_tensors, load_ranks, pack

from kiln.compiler.config import load_config
from kiln.ops.common.quant import dequantize_fp8, fp8_error_bound
from kiln.weights.st_format import write_tensor_file


@pytest.mark.parametrize("name,tp,ep", [("llama", 2, 1), ("qwen3_moe", 4, 2), ("deepseek_v3", 2, 1)])
def test_fp8_pack_round_trip_within_e4m3_bound(checkpoint, tmp_path, name, tp, ep):
    d = checkpoint(name)
    _, ref_specs = pack(d, tmp_path / "bf16", tp=tp, ep=ep, dtype="bfloat16")
    _, specs = pack(d, tmp_path / "fp8", tp=tp, ep=ep, dtype="bfloat16", quant="fp8")
    refs = load_ranks(tmp_path / "bf16", ref_specs, "bfloat16")
    packs = load_ranks(tmp_path / "fp8", specs, "bfloat16")
    quantized = 0
    for spec_list, ref, got in zip(specs, refs, packs):
        for spec in spec_list:
            if spec.quant is None:  # norms, embeddings, routers, MLA w_kc/w_vc: bf16 (correction bias f32)
                dtype = got[spec.name].dtype
                assert dtype == spec.storage_dtype("bfloat16") and torch.equal(got[spec.name], ref[spec.name])
                continue
            quantized += 1
            w, s, r = got[spec.name], got[spec.scale_name], ref[spec.name].float()
            assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == w.shape[:-1]
            torch.testing.assert_close(s, (r.abs().amax(-1) / 448.0).clamp(min=1e-12), rtol=0, atol=0)
            err = (dequantize_fp8(w, s) - r).abs()
            assert bool((err <= fp8_error_bound(r, s)).all()), f"{spec.name}: max err {err.max():.3g}"
    assert quantized > 0
    if name == "qwen3_moe":
        assert packs[0]["layers.0.moe.w13_scale"].shape == (4, 2 * 16)  # [E_local, 2I/etp]


def block_quant(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style 128x128 (here ``block``) quantization: w ~ w_fp8 * scale_inv[block]."""
    n, k = w.shape
    sn, sk = math.ceil(n / block), math.ceil(k / block)
    pad = torch.zeros(sn * block, sk * block)
    pad[:n, :k] = w
    blocks = pad.view(sn, block, sk, block)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)  # [sn, sk]
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    return (w / full).to(torch.float8_e4m3fn), scale


def test_fp8_checkpoint_is_dequantized(checkpoint, tmp_path):
    src = checkpoint("llama")
    hf = hf_tensors(src)
    d = tmp_path / "fp8ckpt"
    d.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    (d / "config.json").write_text(json.dumps(cfg))
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    expected = {}
    for name, w in hf.items():
        if "_proj" not in name:
            shards[0][name] = w
            expected[name] = w
            continue
        base = name.removesuffix(".weight")
        if "down_proj" in name:  # per-channel scales under the plain name
            s = (w.abs().amax(-1) / 448.0).clamp(min=1e-12)
            q = (w / s[:, None]).to(torch.float8_e4m3fn)
            shards[0][f"{base}.weight_scale"] = s
            expected[name] = q.float() * s[:, None]
        else:  # block scales named weight_scale_inv, stored in the *other* shard than the weight
            q, s = block_quant(w, 32)
            shards[1][f"{base}.weight_scale_inv"] = s
            expected[name] = (
                q.float() * s.repeat_interleave(32, 0).repeat_interleave(32, 1)[: w.shape[0], : w.shape[1]]
            )
        shards[0][name] = q
        shards[1][f"{base}.activation_scale" if "q_proj" in name else f"{base}.input_scale"] = torch.ones(())
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for fname, tensors in zip(names, shards):
        write_tensor_file(d / fname, tensors)
    wmap = {n: fname for fname, tensors in zip(names, shards) for n in tensors}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    index, specs = pack(d, tmp_path / "pack", tp=2)
    gemms = sum("_proj" in n for n in hf)
    assert index.model["dequantized_fp8"] == gemms and index.model["dropped_activation_scales"] == gemms
    check_dense(load_ranks(tmp_path / "pack", specs), expected, load_config(d), 2)
