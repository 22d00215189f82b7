"""Expert mapping and expert-parallel selection: per-expert and pre-stacked checkpoint layouts,
EP x expert-TP placement, routers, shared experts (separate or fused as extra experts)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from weights_helpers import hf_tensors, load_ranks, pack

from kiln.compiler.config import load_config


def expert_weights(hf, p, e, mixtral=False):
    if mixtral:
        return tuple(hf[f"{p}block_sparse_moe.experts.{e}.{w}.weight"] for w in ("w1", "w3", "w2"))
    return tuple(hf[f"{p}mlp.experts.{e}.{w}_proj.weight"] for w in ("gate", "up", "down"))


def check_experts(ranks, hf, cfg, tp, ep, mixtral=False):
    m = cfg.moe
    etp = tp // ep
    e_loc, per = m.num_experts // ep, m.intermediate_size // etp
    for i in range(cfg.num_layers):
        if not cfg.is_moe_layer(i):
            continue
        p, mo = f"model.layers.{i}.", f"layers.{i}.moe."
        router = hf[f"{p}block_sparse_moe.gate.weight"] if mixtral else hf[f"{p}mlp.gate.weight"]
        pieces: dict[int, list] = {}  # expert -> [(etp rank, gate, up, down)]
        for r, w in enumerate(ranks):
            assert torch.equal(w[mo + "router.weight"], router)
            assert w[mo + "w13"].shape[0] >= e_loc and w[mo + "w2"].shape[1:] == (cfg.hidden_size, per)
            ep_r, etp_r = r // etp, r % etp
            for j in range(e_loc):
                gate, up = w[mo + "w13"][j].split(per)
                pieces.setdefault(ep_r * e_loc + j, []).append((etp_r, gate, up, w[mo + "w2"][j]))
        assert sorted(pieces) == list(range(m.num_experts)), "every expert on exactly one EP group"
        for e, parts in pieces.items():
            parts.sort(key=lambda x: x[0])
            assert [x[0] for x in parts] == list(range(etp))
            gate, up, down = expert_weights(hf, p, e, mixtral)
            assert torch.equal(torch.cat([x[1] for x in parts]), gate)
            assert torch.equal(torch.cat([x[2] for x in parts]), up)
            assert torch.equal(torch.cat([x[3] for x in parts], 1), down)


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4)])
def test_qwen3_moe_expert_placement(checkpoint, tmp_path, tp, ep):
    d = checkpoint("qwen3_moe")
    _, specs = pack(d, tmp_path / "p", tp=tp, ep=ep)
    check_experts(load_ranks(tmp_path / "p", specs), hf_tensors(d), load_config(d), tp, ep)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_prestacked_experts_give_the_same_pack(checkpoint, tmp_path, name):
    """transformers 5 without save_original_format writes experts.gate_up_proj [E, 2I, H] and
    experts.down_proj [E, H, I] (Mixtral: under mlp.); the pack must not depend on the layout."""
    per_expert = checkpoint(name, seed=7)
    stacked = checkpoint(name, seed=7, original_format=False)  # same weights, other layout
    hs = hf_tensors(stacked)
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in hs) and not any(".experts.0." in k for k in hs)
    a, specs = pack(per_expert, tmp_path / "a", tp=4, ep=2)
    b, _ = pack(stacked, tmp_path / "b", tp=4, ep=2)
    check_experts(
        load_ranks(tmp_path / "a", specs),
        hf_tensors(per_expert),
        load_config(per_expert),
        4,
        2,
        name == "mixtral",
    )
    assert [f.sha256 for r in a.ranks for f in r.files] == [f.sha256 for r in b.ranks for f in r.files]


def test_mixtral_names(checkpoint, tmp_path):
    d = checkpoint("mixtral")
    assert any("block_sparse_moe.experts.0.w1.weight" in k for k in hf_tensors(d))
    _, specs = pack(d, tmp_path / "p", tp=2, ep=1)
    check_experts(load_ranks(tmp_path / "p", specs), hf_tensors(d), load_config(d), 2, 1, mixtral=True)


def mlp(x, gate, up, down):
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (2, 2)])
def test_deepseek_shared_experts_separate_and_fused(checkpoint, tmp_path, tp, ep):
    d = checkpoint("deepseek_v2")
    hf, cfg = hf_tensors(d), load_config(d)
    sh = "model.layers.1.mlp.shared_experts."
    x = torch.randn(5, cfg.hidden_size)
    want = mlp(x, hf[sh + "gate_proj.weight"], hf[sh + "up_proj.weight"], hf[sh + "down_proj.weight"])
    # Separate: a TP MLP; the ranks' partial outputs sum to the shared MLP's output.
    _, specs = pack(d, tmp_path / "sep", tp=tp, ep=ep)
    ranks = load_ranks(tmp_path / "sep", specs)
    check_experts(ranks, hf, cfg, tp, ep)
    got = sum(
        mlp(x, *w["layers.1.moe.shared.gate_up.weight"].chunk(2), w["layers.1.moe.shared.down.weight"])
        for w in ranks
    )
    torch.testing.assert_close(got, want)
    # Fused: n_shared extra expert slots on every rank; with EP each EP group holds a copy, and the
    # expert-TP ranks of one group sum to the shared MLP.
    _, specs = pack(d, tmp_path / "fused", tp=tp, ep=ep, fuse_shared_experts=True)
    ranks = load_ranks(tmp_path / "fused", specs)
    check_experts(ranks, hf, cfg, tp, ep)
    e_loc, n_sh, etp = cfg.moe.num_experts // ep, cfg.moe.num_shared_experts, tp // ep
    for group in range(ep):
        got = 0
        for w in ranks[group * etp : (group + 1) * etp]:
            w13, w2 = w["layers.1.moe.w13"], w["layers.1.moe.w2"]
            assert w13.shape[0] == e_loc + n_sh and "layers.1.moe.shared.gate_up.weight" not in w
            got = got + sum(mlp(x, *w13[e_loc + s].chunk(2), w2[e_loc + s]) for s in range(n_sh))
        torch.testing.assert_close(got, want)
    # The first layer is dense.
    for w in ranks:
        assert "layers.0.mlp.gate_up.weight" in w and "layers.0.moe.w13" not in w


def test_deepseek_v3_router_bias(checkpoint, tmp_path):
    d = checkpoint("deepseek_v3")
    hf = hf_tensors(d)
    _, specs = pack(d, tmp_path / "p", tp=2, ep=2)
    for w in load_ranks(tmp_path / "p", specs):
        assert torch.equal(
            w["layers.1.moe.router.bias"], hf["model.layers.1.mlp.gate.e_score_correction_bias"]
        )
        assert torch.equal(w["layers.1.moe.router.weight"], hf["model.layers.1.mlp.gate.weight"])
