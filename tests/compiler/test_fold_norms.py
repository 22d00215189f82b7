"""Folded norms (on by default; ``kiln compile --no-fold-norms`` turns them off): the RMSNorm weights folded
into the linears behind them (compiler/norm_folds.py, weights/fold.py) and the residual-stream
layout of the batch-1 decode graph (compiler/models/base.py).

float32 on CPU against Hugging Face transformers: a tiny Llama on the torch paths (the norm
kernel's unit weight, ``addmm``) and greedy tokens through ``kiln.LLM``; a tiny Qwen3-MoE with a
dense middle layer whose one-sequence decode steps run the Triton kernels in the interpreter (the
GEMV with the norm inside and without its weight, the o / down GEMVs and the experts' last kernel
adding the residual).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import check_against_hf, hf_greedy, make_checkpoint
from tiny_moe_models import make_moe_checkpoint

from kiln.compiler.build import CompileOptions, compile_model
from kiln.compiler.norm_folds import norm_folds
from kiln.compiler.registry import model_class
from kiln.ops.common.launch import interpreting
from kiln.ops.linear import gemv as G
from kiln.ops.linear import norm_linear as NL
from kiln.ops.moe import fused as moe
from kiln.runtime.direct import DirectRunner
from kiln.weights import load_pack
from kiln.weights.fold import FoldError, apply_norm_folds

OPTS = dict(device="cpu", dtype="float32", max_batch_size=2, max_seq_len=64, chunk_size=32)


def _targets(art, graph: str = "model") -> list[str]:
    ep = torch.export.load(art / "graphs" / f"{graph}.pt2")
    return [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("name", ["llama-tied", "qwen2-bias"])
def test_dense_folded_matches_hf_and_generates_its_greedy_tokens(tmp_path, name):
    """Tied embeddings (the final norm is not folded into the shared table) and a qkv bias."""
    from kiln import LLM, SamplingParams

    hf = make_checkpoint(tmp_path / "hf", name, eos=None)
    opts = CompileOptions(**OPTS, fold_norms=True)
    manifest = compile_model(tmp_path / "hf", tmp_path / "art", opts, verbose=False)
    layers = hf.config.num_hidden_layers
    assert manifest.norm_folds["layers.0.input_norm.weight"] == ("layers.0.attn.qkv.weight",)
    assert manifest.norm_folds["layers.0.post_attn_norm.weight"] == ("layers.0.mlp.gate_up.weight",)
    assert len(manifest.norm_folds) == 2 * layers
    # batch-1 decode: the residual-stream layout; the shared graph (prefill, batch 2..): add+norm
    assert manifest.graphs["decode_b1"].layout == "residual_stream"
    targets = _targets(tmp_path / "art", "decode_b1")
    assert "kiln.fused_add_rmsnorm.default" not in targets  # the producers add the residual
    assert targets.count("kiln.rmsnorm_linear.default") == 2 * layers
    shared = _targets(tmp_path / "art")
    assert shared.count("kiln.fused_add_rmsnorm.default") == 2 * layers  # all but layer 0's input, final
    assert "kiln.rmsnorm_linear.default" not in shared
    runner = DirectRunner(str(tmp_path / "art"), device="cpu", num_slots=256)
    # the loader folded the weights (the CPU fallbacks would match HF without it: they apply g)
    loaded, pack = runner.model.weights, load_pack(tmp_path / "art" / "weights", 0, "cpu")
    for i in range(layers):
        assert torch.equal(loaded[f"layers.{i}.input_norm.weight"], torch.ones(hf.config.hidden_size))
        g = pack[f"layers.{i}.post_attn_norm.weight"]
        assert torch.equal(
            loaded[f"layers.{i}.mlp.gate_up.weight"], pack[f"layers.{i}.mlp.gate_up.weight"] * g
        )
    check_against_hf(runner, hf, [[3, 4, 5, 6, 7, 8], [9, 10, 11]], decode_steps=3)  # shared graph
    check_against_hf(runner, hf, [[12, 13, 14, 15]], decode_steps=3)  # decode_b1
    prompt = [5, 17, 33, 2, 41]
    llm = LLM(str(tmp_path / "art"), device="cpu")
    out = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    assert out[0].token_ids == hf_greedy(hf, [prompt], 32)[0]


def test_moe_folded_decode_runs_the_fused_kernels_and_matches_hf(tmp_path, monkeypatch):
    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
    hf = make_moe_checkpoint(tmp_path / "hf", "qwen3-moe")
    opts = CompileOptions(**OPTS, fold_norms=True, gemv_plan="1")  # every role on the GEMV
    manifest = compile_model(tmp_path / "hf", tmp_path / "art", opts, verbose=False)
    folds = manifest.norm_folds
    moe_layer = next(i for i in range(hf.config.num_hidden_layers) if f"layers.{i}.moe.w13" in str(folds))
    assert folds[f"layers.{moe_layer}.post_attn_norm.weight"] == (
        f"layers.{moe_layer}.moe.router.weight",
        f"layers.{moe_layer}.moe.w13",
    )
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "1")
    calls: list[tuple[bool, bool]] = []  # (norm inside, without its weight) / (residual added)
    real_gemv, real_moe = G.gemv, moe.moe_gemv_launch

    def spy_gemv(*a, **kw):
        norm = kw.get("norm")
        calls.append(("norm", norm.weight is None) if norm else ("res", kw.get("residual") is not None))
        return real_gemv(*a, **kw)

    def spy_moe(*a, **kw):  # the decode GEMV's w2 launch (a_div 1) adds the residual
        if kw.get("a_div") == 1:
            calls.append(("moe", kw.get("residual") is not None))
        return real_moe(*a, **kw)

    monkeypatch.setattr(G, "gemv", spy_gemv)
    monkeypatch.setattr(NL, "gemv", spy_gemv)
    monkeypatch.setattr(moe, "moe_gemv_launch", spy_moe)
    runner = DirectRunner(str(tmp_path / "art"), device="cpu", num_slots=128)
    # one decode step (~12 s interpreted): the counts below are per step, a second runs the same calls
    check_against_hf(runner, hf, [[5, 6, 7, 8, 9, 10, 11]], decode_steps=1)
    layers, steps = hf.config.num_hidden_layers, 1
    moe_layers = sum(".moe." in str(c) for c in folds.values())
    assert calls.count(("norm", True)) == 2 * layers * steps  # decode: qkv, gate_up / router
    assert ("norm", False) not in calls
    # each decode step (the prefill runs the shared graph's add+norm kernels): o and the dense
    # down on the GEMV, the experts' last kernel, each adding the residual
    assert calls.count(("moe", True)) == moe_layers * steps
    assert calls.count(("res", True)) == (2 * layers - moe_layers) * steps


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_apply_norm_folds_scales_columns_and_sets_ones(device):
    g = torch.tensor([1.0, 2.0, 0.5], device=device)
    w = torch.arange(6.0, device=device).reshape(2, 3)
    experts = torch.ones(2, 2, 3, device=device)
    weights = {"n": g.clone(), "w": w.clone(), "e": experts.clone()}
    assert apply_norm_folds(weights, {"n": ["w", "e"]}) == 2
    assert torch.equal(weights["w"], w * g) and torch.equal(weights["e"], experts * g)
    assert torch.equal(weights["n"], torch.ones(3, device=device))
    assert apply_norm_folds(weights, None) == 0
    with pytest.raises(FoldError, match="names 'm', which the weight pack lacks"):
        apply_norm_folds(weights, {"m": ["w"]})
    with pytest.raises(FoldError, match="into 'x', which the weight pack lacks"):
        apply_norm_folds(weights, {"n": ["x"]})
    weights["bad"] = torch.ones(3, 4, device=device)
    with pytest.raises(FoldError, match="cannot take"):
        apply_norm_folds(weights, {"n": ["bad"]})


def test_norm_folds_refuses_what_it_cannot_fold(tmp_path):
    from kiln.compiler.config import load_config

    make_checkpoint(tmp_path / "hf", "llama-tied")
    cfg = load_config(tmp_path / "hf")
    with torch.device("meta"):
        cls = model_class(cfg.architecture)
        folds, why = norm_folds(cls(cfg, torch.float32, tp=2))
        assert not folds and "tp 1" in why
        folds, why = norm_folds(cls(cfg, torch.bfloat16, quant="fp8"))
        assert not folds and "FP8" in why
        folds, why = norm_folds(cls(cfg, torch.float32))
        assert len(folds) == 2 * cfg.num_layers and not why


@pytest.mark.parametrize("name", ["qwen3-moe", "mixtral"])
def test_norm_folds_of_moe_models(tmp_path, name):
    """A MoE layer folds its post-attention norm into the router and the stacked experts (dense
    layers into gate_up); FP8 experts keep their norms; a subclassed block is not folded."""
    from kiln.compiler.config import load_config
    from kiln.compiler.moe_layer import MoEDecoderLayer

    make_moe_checkpoint(tmp_path / "hf", name)
    cfg = load_config(tmp_path / "hf")
    with torch.device("meta"):
        cls = model_class(cfg.architecture)
        model = cls(cfg, torch.float32)
        folds, _ = norm_folds(model)
        for i, layer in enumerate(model.layers):
            moe = isinstance(layer, MoEDecoderLayer)
            expect = (
                [f"layers.{i}.moe.router.weight", f"layers.{i}.moe.w13"]
                if moe
                else [f"layers.{i}.mlp.gate_up.weight"]
            )
            assert folds[f"layers.{i}.post_attn_norm.weight"] == expect
            assert folds[f"layers.{i}.input_norm.weight"] == [f"layers.{i}.attn.qkv.weight"]
        folds, why = norm_folds(cls(cfg, torch.bfloat16, quant="fp8"))
        assert not folds and "FP8" in why
        layer = model.layers[0]
        layer.__class__ = type("Custom", (type(layer),), {})  # it may read the normed row elsewhere
        folds, why = norm_folds(model)
        assert not folds and "layer 0" in why


def test_switched_off_means_no_fold(tmp_path):
    make_checkpoint(tmp_path / "hf", "llama-tied")
    opts = CompileOptions(**OPTS, fold_norms=False)
    manifest = compile_model(tmp_path / "hf", tmp_path / "art", opts, verbose=False)
    assert manifest.norm_folds == {} and "decode_b1" not in manifest.graphs
    assert "kiln.fused_add_rmsnorm.default" in _targets(tmp_path / "art")
