"""Stages 3-4 on dense models: TP=1/2/4 shards reassemble exactly into the fused full tensors,
KV heads replicate when kv_heads < tp, uneven splits and the vocab are zero-padded, skip rules."""

from __future__ import annotations

import json

import pytest
import torch
from weights_helpers import CONFIGS, check_dense, hf_tensors, load_ranks, pack

from kiln.compiler.config import load_config
from kiln.compiler.mappings import param_specs
from kiln.compiler.parallel import ParallelConfig
from kiln.weights import MappingError
from kiln.weights.st_format import write_tensor_file


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_llama_shards_reassemble(checkpoint, tmp_path, tp):
    """kv_heads=2: tp=4 replicates each KV head twice; intermediate 90 and vocab 250 pad at tp=4."""
    d = checkpoint("llama")
    _, specs = pack(d, tmp_path / "pack", tp=tp)
    check_dense(load_ranks(tmp_path / "pack", specs), hf_tensors(d), load_config(d), tp)


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_qwen_bias_and_qk_norm(checkpoint, tmp_path, name):
    d = checkpoint(name)
    _, specs = pack(d, tmp_path / "pack", tp=2)
    check_dense(load_ranks(tmp_path / "pack", specs), hf_tensors(d), load_config(d), 2)


def test_kv_head_replication_shapes():
    cfg = load_config_dict(CONFIGS["llama"])
    for r in range(4):
        qkv = next(
            s for s in param_specs(cfg, ParallelConfig(tp=4), r) if s.name == "layers.0.attn.qkv.weight"
        )
        assert qkv.shape == ((1 + 2 * 1) * 16, 64) and "kv-replicated" in qkv.placement
        k_region = qkv.pieces[1].sources[0]
        assert (k_region.start, k_region.length) == ((r // 2) * 16, 16)


def load_config_dict(raw):
    from kiln.compiler.config import normalize_config

    return normalize_config(raw)


def test_bf16_conversion_and_readahead_pack_identical(checkpoint, tmp_path):
    d = checkpoint("llama")
    a, specs = pack(d, tmp_path / "a", tp=2, dtype="bfloat16")
    b, _ = pack(d, tmp_path / "b", tp=2, dtype="bfloat16", readahead=2)
    assert [f.sha256 for r in a.ranks for f in r.files] == [f.sha256 for r in b.ranks for f in r.files]
    ranks = load_ranks(tmp_path / "a", specs, "bfloat16")
    hf = {k: v.to(torch.bfloat16) for k, v in hf_tensors(d).items()}
    check_dense(ranks, hf, load_config(d), 2)


def test_skip_rules_tied_lm_head_inv_freq_and_extra_layers(checkpoint, tmp_path):
    """A tied checkpoint that still carries lm_head, rotary inv_freq and a layer past num_hidden_layers."""
    src = checkpoint("llama_tied")
    d = tmp_path / "ckpt"
    d.mkdir()
    for f in src.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    extra = {
        "lm_head.weight": torch.randn(250, 64),
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.randn(8),
        "model.layers.1.mlp.down_proj.weight": torch.randn(64, 64),  # config has one layer
    }
    write_tensor_file(d / "extra.safetensors", extra)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"].update(dict.fromkeys(extra, "extra.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    index, specs = pack(d, tmp_path / "pack", tp=2)
    assert index.model["skipped_tensors"] == 3
    ranks = load_ranks(tmp_path / "pack", specs)
    assert all("lm_head.weight" not in r for r in ranks)
    check_dense(ranks, hf_tensors(src), load_config(d), 2)


def test_unknown_tensor_and_shape_mismatch_are_named(checkpoint, tmp_path):
    src = checkpoint("qwen3")
    for extra, match in (
        ({"model.layers.0.mlp.mystery.weight": torch.ones(3)}, "model.layers.0.mlp.mystery.weight"),
        (
            {"model.layers.0.self_attn.o_proj.weight": torch.ones(64, 60)},
            r"o_proj.weight.*\[64, 60\].*\[64, 64\]",
        ),
    ):
        d = tmp_path / f"c{len(match)}"
        d.mkdir()
        hf = hf_tensors(src)
        hf.update(extra)
        write_tensor_file(d / "model.safetensors", hf)
        (d / "config.json").write_bytes((src / "config.json").read_bytes())
        with pytest.raises(MappingError, match=match):
            pack(d, tmp_path / "out", tp=2, force=True)


def test_bin_checkpoint_packs_like_safetensors(checkpoint, tmp_path):
    """pytorch_model.bin (read with torch.load(weights_only=True)) gives the same rank files; a
    missing tensor is reported after the stream, by name."""
    src = checkpoint("llama")
    hf = hf_tensors(src)
    d = tmp_path / "bin"
    d.mkdir()
    (d / "config.json").write_bytes((src / "config.json").read_bytes())
    torch.save(hf, d / "pytorch_model.bin")
    a, _ = pack(src, tmp_path / "a", tp=2)
    b, _ = pack(d, tmp_path / "b", tp=2)
    assert [f.sha256 for r in a.ranks for f in r.files] == [f.sha256 for r in b.ranks for f in r.files]
    del hf["model.layers.1.mlp.up_proj.weight"]
    torch.save(hf, d / "pytorch_model.bin")
    with pytest.raises(
        MappingError, match=r"layers\.1\.mlp\.gate_up\.weight.*model\.layers\.1\.mlp\.up_proj\.weight"
    ):
        pack(d, tmp_path / "c", tp=2)
