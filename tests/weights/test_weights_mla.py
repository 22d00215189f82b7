"""MLA post-processing (kv_b_proj -> w_kc / w_vc), the other MLA projections, and DeepSeek-V3
next-token-prediction layers (skipped unless asked)."""

from __future__ import annotations

import json

import pytest
import torch
from weights_helpers import hf_tensors, load_ranks, pack

from kiln.compiler.config import load_config
from kiln.weights.st_format import write_tensor_file


@pytest.mark.parametrize("name,tp", [("deepseek_v2", 1), ("deepseek_v2", 2), ("deepseek_v3", 4)])
def test_w_kc_w_vc_reconstruct_kv_b_proj(checkpoint, tmp_path, name, tp):
    d = checkpoint(name)
    hf, cfg = hf_tensors(d), load_config(d)
    m = cfg.mla
    hl = cfg.num_heads // tp
    _, specs = pack(d, tmp_path / "p", tp=tp)
    ranks = load_ranks(tmp_path / "p", specs)
    for i in range(cfg.num_layers):
        p, a = f"model.layers.{i}.self_attn.", f"layers.{i}.attn."
        kv_b = hf[p + "kv_b_proj.weight"]  # [H * (nope + v), kv_lora]
        blocks = []
        for w in ranks:
            w_kc, w_vc = w[a + "w_kc"], w[a + "w_vc"]
            assert w_kc.shape == (hl, m.qk_nope_head_dim, m.kv_lora_rank)
            assert w_vc.shape == (hl, m.kv_lora_rank, m.v_head_dim)
            blocks += [torch.cat([w_kc[j], w_vc[j].T]) for j in range(hl)]  # head j: nope rows, then v rows
        assert torch.equal(torch.cat(blocks), kv_b)
        # The absorbed form computes what the unabsorbed one does: q_nope . k_nope = (q_nope W_kc) . c_kv
        c = torch.randn(3, m.kv_lora_rank)
        q_nope = torch.randn(hl, m.qk_nope_head_dim)
        k_nope = (c @ kv_b.T).view(3, cfg.num_heads, -1)[:, :hl, : m.qk_nope_head_dim]  # rank 0's heads
        ref = torch.einsum("hd,thd->ht", q_nope, k_nope)
        absorbed = torch.einsum("hd,hdc,tc->ht", q_nope, ranks[0][a + "w_kc"], c)
        torch.testing.assert_close(absorbed, ref, rtol=1e-4, atol=1e-4)
        # qkv_a: q_a_proj (or the rank's q_proj heads), then kv_a_proj_with_mqa on every rank
        first = m.q_lora_rank or hl * m.qk_head_dim
        for w in ranks:
            assert torch.equal(w[a + "qkv_a.weight"][first:], hf[p + "kv_a_proj_with_mqa.weight"])
            assert torch.equal(w[a + "kv_a_norm.weight"], hf[p + "kv_a_layernorm.weight"])
        assert torch.equal(torch.cat([w[a + "o.weight"] for w in ranks], 1), hf[p + "o_proj.weight"])
        if m.q_lora_rank:
            assert torch.equal(torch.cat([w[a + "q_b.weight"] for w in ranks]), hf[p + "q_b_proj.weight"])
            for w in ranks:
                assert torch.equal(w[a + "qkv_a.weight"][:first], hf[p + "q_a_proj.weight"])
                assert torch.equal(w[a + "q_a_norm.weight"], hf[p + "q_a_layernorm.weight"])
        else:
            q = torch.cat([w[a + "qkv_a.weight"][:first] for w in ranks])
            assert torch.equal(q, hf[p + "q_proj.weight"])


def with_mtp_layer(src, dst):
    """A copy of a DeepSeek-V3 checkpoint plus a next-token-prediction layer 2, laid out as the
    published checkpoints do (a full decoder layer + enorm/hnorm/eh_proj/shared_head + copies of
    the embedding and LM head)."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    hf = hf_tensors(src)
    h = load_config(src).hidden_size
    mtp = {
        k.replace("model.layers.1.", "model.layers.2."): v.clone()
        for k, v in hf.items()
        if "model.layers.1." in k
    }
    mtp |= {
        "model.layers.2.embed_tokens.weight": hf["model.embed_tokens.weight"].clone(),
        "model.layers.2.shared_head.head.weight": hf["lm_head.weight"].clone(),
        "model.layers.2.shared_head.norm.weight": torch.randn(h),
        "model.layers.2.enorm.weight": torch.randn(h),
        "model.layers.2.hnorm.weight": torch.randn(h),
        "model.layers.2.eh_proj.weight": torch.randn(h, 2 * h),
    }
    write_tensor_file(dst / "mtp.safetensors", mtp)
    idx = json.loads((dst / "model.safetensors.index.json").read_text())
    idx["weight_map"].update(dict.fromkeys(mtp, "mtp.safetensors"))
    (dst / "model.safetensors.index.json").write_text(json.dumps(idx))
    return mtp


def test_nextn_layers_skipped_unless_asked(checkpoint, tmp_path):
    d = tmp_path / "ckpt"
    mtp = with_mtp_layer(checkpoint("deepseek_v3"), d)
    index, specs = pack(d, tmp_path / "main", tp=2)
    assert index.model["skipped_tensors"] == len(mtp)
    assert not any(n.startswith("layers.2.") for r in load_ranks(tmp_path / "main", specs) for n in r)
    index, specs = pack(d, tmp_path / "nextn", tp=2, nextn=True)
    assert index.model["skipped_tensors"] == 2  # its embed_tokens and shared_head.head copies
    for w in load_ranks(tmp_path / "nextn", specs):
        for n in ("enorm", "hnorm", "shared_head.norm", "eh_proj"):
            assert torch.equal(w[f"layers.2.{n}.weight"], mtp[f"model.layers.2.{n}.weight"])
        assert torch.equal(w["layers.2.moe.router.weight"], mtp["model.layers.2.mlp.gate.weight"])
        assert "layers.2.attn.w_kc" in w and "layers.2.moe.w13" in w
