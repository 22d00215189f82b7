"""Synthetic EAGLE-3 draft heads (random weights) in the published layout, for tests and benchmarks.

The layout is ``LlamaForCausalLMEagle3``'s: config.json with one layer, ``draft_vocab_size`` and
``eagle_config.eagle_aux_hidden_state_layer_ids``; one safetensors file named as SGLang's and
SpecForge's heads are (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``), no
embedding (the target's). It is what ``kiln compile --eagle3`` reads (compiler/eagle3.py).

:func:`successor_eagle3_head` makes a head that drafts right on a successor target
(kiln.compiler.synth, ``successor=True``): such a target's residual stream at token ``t`` is
``embed[t]`` in every layer, so with ``fc`` the identity on the first auxiliary hidden state and
near-zero ``o_proj`` / ``down_proj`` (small random matrices, so that every input of the head still
moves its logits; scaled down with the width, their outputs stay far below the residual) the head's final state at ``t`` is ``RMSNorm(embed[t])``, and
its LM head row ``next(next(t))`` is ``embed[t]``: from the stream of ``t`` (whose next token is
``next(t)``) it drafts ``next(next(t))``, the token after. With ``decoy`` > 1 that row becomes
``embed[t] + decoy * embed[t + 1]``, so from the stream of ``t`` the row of ``next(next(t - 1))``
scores ``decoy`` times higher: the head's best token is always wrong and its second always right
(what chains cannot use and token trees of width 2 can; docs/speculative.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kiln.compiler.synth import successor_next

_EMBED = "model.embed_tokens.weight"


def write_eagle3_head(
    path: Path,
    target: Path,
    aux_ids: list[int] | None = None,
    draft_vocab: int | None = None,
    seed: int = 0,
    embed: bool = False,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """A head for the checkpoint in ``target`` (its hidden size, heads and vocabulary) into
    ``path``; ``draft_vocab`` (default: the whole vocabulary) ids drafted, a random increasing
    subset of the target's when smaller (``d2t[i] = target_id - i``); ``aux_ids``: the config's
    layer ids (None: left out); ``embed``: the head carries its own ``embed_tokens.weight``;
    floating-point tensors written in ``dtype``. Returns the tensors written (float32)."""
    raw = json.loads((target / "config.json").read_text())
    h, v = raw["hidden_size"], raw["vocab_size"]
    heads, kv_heads = raw["num_attention_heads"], raw["num_key_value_heads"]
    d = raw.get("head_dim") or h // heads
    inter = raw["intermediate_size"]
    vd = draft_vocab or v
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": d,
        "num_hidden_layers": 1,
        "vocab_size": v,
        "draft_vocab_size": vd,
        "rms_norm_eps": raw.get("rms_norm_eps", 1e-5),
        "rope_theta": raw.get("rope_theta", 10000.0),
        "max_position_embeddings": raw["max_position_embeddings"],
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if aux_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True}
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return scale * torch.randn(shape, generator=g)

    def norm() -> torch.Tensor:
        return 1 + rand(h, scale=0.1)

    w = {
        "fc.weight": rand(h, 3 * h),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": rand(heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, heads * d),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter),
        "norm.weight": norm(),
        "lm_head.weight": rand(vd, h, scale=0.5),
    }
    ids = torch.randperm(v, generator=g)[:vd].sort().values if vd < v else torch.arange(v)
    w["d2t"] = ids - torch.arange(vd)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    w["t2d"] = t2d
    if embed:
        w["embed_tokens.weight"] = rand(v, h, scale=1.0)
    _save(path, cfg, w, dtype)
    return w


def successor_eagle3_head(
    path: Path,
    target: Path,
    target_seed: int,
    decoy: float = 0.0,
    aux_ids: list[int] | None = None,
    seed: int = 1,
    dtype: torch.dtype = torch.float32,
) -> None:
    """The head of the module docstring for the successor checkpoint in ``target`` (written with
    ``target_seed``), into ``path``; ``decoy`` > 1: its best draft wrong, its second right.
    ``aux_ids`` default to the target's first three layers (all carry ``embed[t]``)."""
    w = write_eagle3_head(path, target, aux_ids=aux_ids or [0, 1, 2], seed=seed)
    emb = _target_embedding(target)
    h = emb.shape[1]
    g = torch.Generator().manual_seed(11)
    fc = torch.zeros(h, 3 * h)
    fc[:, :h] = torch.eye(h)
    w["fc.weight"] = fc
    noise = 0.002 * min(1.0, 64 / h) ** 2  # attention and MLP outputs << the residual's 0.02 at any width
    for name in ("midlayer.self_attn.o_proj.weight", "midlayer.mlp.down_proj.weight"):
        w[name] = noise * torch.randn(w[name].shape, generator=g)
    nxt = successor_next(emb.shape[0], target_seed)
    head = torch.empty_like(emb)
    head[torch.tensor([nxt[nxt[t]] for t in range(len(nxt))])] = emb + decoy * emb.roll(-1, 0)
    w["lm_head.weight"] = head
    w["norm.weight"] = torch.ones(h)
    w.pop("d2t", None)
    _save(path, json.loads((path / "config.json").read_text()), w, dtype)


def _target_embedding(target: Path) -> torch.Tensor:
    """The target's ``model.embed_tokens.weight`` in float32, from whichever shard holds it."""
    for f in sorted(target.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            if _EMBED in st.keys():  # noqa: SIM118 (safe_open has no __contains__)
                return st.get_tensor(_EMBED).float()
    raise FileNotFoundError(f"no {_EMBED} in the safetensors files of {target}")


def _save(path: Path, cfg: dict, w: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    out = {k: (t.to(dtype) if t.is_floating_point() else t).contiguous() for k, t in w.items()}
    save_file(out, str(path / "model.safetensors"))
