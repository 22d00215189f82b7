"""Synthetic checkpoints: the fast (meta-device) engine writes what transformers writes, and every
bundled preset's real names and shapes satisfy the architecture's weight declarations."""

from __future__ import annotations

import json

import pytest
import torch
from weights_helpers import CONFIGS, hf_tensors

from kiln.compiler.cli_inspect import bundled_configs
from kiln.compiler.config import normalize_config
from kiln.compiler.mappings import all_rank_specs, skip_patterns
from kiln.compiler.parallel import ParallelConfig
from kiln.compiler.synth import _meta_tensors, make_checkpoint, parse_size, resolve_config
from kiln.weights.mapping import Plan, precheck
from kiln.weights.stream import SourceInfo


@pytest.mark.parametrize("name", ["llama_tied", "qwen3_moe", "mixtral", "deepseek_v3"])
def test_fast_engine_writes_what_transformers_writes(checkpoint, tmp_path, name):
    hf_dir = checkpoint(name, dtype="bfloat16")
    fast_dir = make_checkpoint(
        tmp_path / "fast",
        CONFIGS[name],
        "bfloat16",
        max_shard_size="24KB",
        engine="fast",
        with_tokenizer=False,
    )
    hf, fast = hf_tensors(hf_dir), hf_tensors(fast_dir)
    assert {n: (t.shape, t.dtype) for n, t in fast.items()} == {n: (t.shape, t.dtype) for n, t in hf.items()}
    wmap = json.loads((fast_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(wmap) == sorted(hf) and len(set(wmap.values())) > 2
    assert normalize_config(json.loads((fast_dir / "config.json").read_text())) == normalize_config(
        json.loads((hf_dir / "config.json").read_text())
    )
    norms = torch.cat([t.float().flatten() for n, t in fast.items() if t.dim() == 1 and "norm" in n])
    rest = torch.cat([t.float().flatten() for n, t in fast.items() if t.dim() == 2])
    assert abs(norms.mean().item() - 1) < 0.01 and abs(rest.std().item() - 0.02) < 0.002
    assert not torch.equal(fast["model.embed_tokens.weight"][:10], fast["model.norm.weight"][:10] - 1)


def test_stacked_expert_format_on_request(tmp_path):
    d = make_checkpoint(
        tmp_path / "s",
        CONFIGS["qwen3_moe"],
        "bfloat16",
        engine="fast",
        original_format=False,
        with_tokenizer=False,
    )
    names = set(hf_tensors(d))
    assert (
        "model.layers.0.mlp.experts.gate_up_proj" in names and "model.layers.0.mlp.experts.down_proj" in names
    )


PRESET_LAYERS = {"deepseek-v3": 4, "deepseek-v2-lite": 2}  # past the dense first layers


@pytest.mark.parametrize("preset", sorted(bundled_configs()))
def test_preset_names_and_shapes_match_the_declarations(preset):
    """Without writing data: the names and shapes save_pretrained would write for each bundled
    config (at a few layers) are exactly what param_specs reads, at tp=1 and at the largest tp."""
    raw = resolve_config(preset, "bfloat16", PRESET_LAYERS.get(preset, 2))
    cfg = normalize_config(raw)
    infos = {n: SourceInfo(n, s, torch.bfloat16, "meta", 0) for n, s in _meta_tensors(raw, True)}
    for tp in (1, 8 if cfg.num_heads % 8 == 0 else 4):
        ep = tp if cfg.moe is not None else 1
        plan = Plan(all_rank_specs(cfg, ParallelConfig(tp=tp, ep=ep)), skip_patterns(cfg))
        precheck(plan, infos)  # raises on any missing, mis-shaped or unknown tensor


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("24KB") == 24000 and parse_size("2GiB") == 2 * 2**30
    assert parse_size(1234) == 1234
    with pytest.raises(ValueError):
        parse_size("lots")


def test_tokenizer_ids_written_into_the_configs(tmp_path):
    from transformers import AutoTokenizer

    cfg = dict(CONFIGS["qwen3"], vocab_size=512)
    d = make_checkpoint(tmp_path / "t", cfg, "bfloat16", engine="fast")
    tok = AutoTokenizer.from_pretrained(d)
    conf = json.loads((d / "config.json").read_text())
    gen = json.loads((d / "generation_config.json").read_text())
    assert len(tok) == 512 and conf["bos_token_id"] == tok.bos_token_id == gen["bos_token_id"]
    assert conf["eos_token_id"] == tok.eos_token_id and tok.eos_token_id in gen["eos_token_id"]
    assert normalize_config(conf).eos_token_ids == (tok.eos_token_id,)
