"""A whole decode step of a model definition, without a checkpoint or an artifact.

``kiln bench latency`` measures the real thing but needs a checkpoint and a compile (two minutes of a
GPU call for Qwen3-30B-A3B-shaped weights). Here the model definition (compiler/models) runs on
random weights made on the GPU, called as the exported graph calls it (``functional_call`` with the
weights dict and a ``ForwardContext``) and captured in one CUDA graph per case. The kernels and their
order are those of a decode step. Sampling, the host work and the aten glue are not included.
Settings (kiln/settings.py) are set per case: the compile's ``fold_norms`` while tracing, the
run-time ones (``pdl``, ``prewait``, ``gemv``, ...) as overrides around the capture, so step-level
A/B comparisons need no recompile. The model is built with the default GEMV plan. Chains of one op
do not predict these (docs/decode_budget.md). ``fold_norms`` (the residual-stream layout) is set as
the compiler traces it (batch 1, unless the case turns it off), on the same random weights: the
kernels are those of a folded artifact, the values are not.
(``bench/results/2026-11-30_h200_s9d_fold_step.json`` traced the layout at every batch.)

* ``test_decode_step[PRESET-B-VARIANT]``: Qwen3-30B-A3B- or Llama-3.1-8B-shaped with ``LAYERS``
  layers (16, as the MoE end-to-end runs), ``B`` requests each at ``CONTEXT`` tokens of KV.
  ``bytes`` is what the runtime's roofline counts (runtime/benchmark.py ``weight_bytes``: the
  experts a batch hits on average, lm_head, no embedding table) plus the KV read, so ``frac_bw``
  is comparable with ``kiln bench latency``'s ``frac_roofline``.

Smoke mode (CPU): a tiny config of the same architecture through the ops' torch paths.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from conftest import SMOKE, graphed, pick

from kiln import settings
from kiln.compiler.cli_inspect import bundled_configs
from kiln.compiler.config import normalize_config
from kiln.compiler.context import ForwardContext
from kiln.compiler.norm_folds import norm_folds
from kiln.compiler.registry import model_class
from kiln.ops.attention.decode import choose_num_splits
from kiln.ops.attention.rope import rope_cos_sin_cache
from kiln.runtime.benchmark import weight_bytes

DEV = "cpu" if SMOKE else "cuda"
LAYERS = pick(16, 2)
CONTEXT = pick(544, 24)  # the middle of `kiln bench latency --input-len 512 --output-len 64`
MAX_SEQ = pick(32768, 64)  # CompileOptions' default for this config: the decode bucket's split count
TINY = dict(hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, vocab_size=256,
            max_position_embeddings=512)  # fmt: skip
VARIANTS = {  # settings (kiln/settings.py) per case: fold_norms at trace, the others at capture
    "default": {},
    "unfolded": {"fold_norms": False},  # the add+norm kernels of the layout before folded norms
    "pdl_off": {"pdl": False},
    "gemv_off": {"gemv": False},
    # graph-constant loads before the PDL wait (ops/common/launch.py, the prewait setting; default: all parts)
    "prewait_off": {"prewait": "none"},
    "prewait_noslab": {"prewait": "gemv,attn,rope"},  # the default before the slab parts
    "prewait_gemv": {"prewait": "gemv"},
    "prewait_attn": {"prewait": "attn"},
    "prewait_rope": {"prewait": "rope"},
    "prewait_slab": {"prewait": "all"},  # plus the whole-slab first step, every one-row GEMV
    "slab_plain": {"prewait": "gemv,attn,rope,slab"},  # without a fused norm: o
    "slab_norm": {"prewait": "gemv,attn,rope,slab_norm"},  # with one: qkv, router, gate_up
}


MODELS = ("qwen3-30b-a3b", "llama-3.1-8b")  # bundled configs (compiler/configs)
FULL = pick(None, 2)  # speculative steps: every layer of the config (the computed tok/s need whole steps)


@functools.lru_cache(maxsize=len(MODELS))
def _model(preset: str, layers: int | None = LAYERS, vocab: int | None = None):
    """(config, model on the meta device, random weights on DEV) for ``preset``, ``layers`` layers
    (None: the config's), ``vocab`` rows of embedding and LM head (None: the config's)."""
    raw = json.loads(bundled_configs()[preset].read_text())
    raw |= {"num_hidden_layers": layers} if layers else {}
    raw |= {"vocab_size": vocab} if vocab else {}
    cfg = normalize_config(raw | TINY if SMOKE else raw)
    dtype = torch.float32 if SMOKE else torch.bfloat16
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg, dtype)
    g = torch.Generator(DEV).manual_seed(0)
    weights = {}
    for name, p in model.named_parameters():
        w = torch.randn(p.shape, generator=g, device=DEV, dtype=torch.float32)
        weights[name] = (1.0 + 0.1 * w if "norm" in name else 0.02 * w).to(p.dtype)
    return cfg, model, weights


def _context(cfg, batch: int, new: int = 1) -> tuple[torch.Tensor, ForwardContext]:
    """A decode step: ``batch`` requests with ``CONTEXT`` tokens cached, one new token each; with
    ``new > 1`` a speculative verify step: ``new`` tokens each (the newest and ``new - 1`` drafts),
    logits at every one."""
    per = CONTEXT + new
    slots = batch * per + 1  # slot 0: the padding sink
    dtype = torch.float32 if SMOKE else torch.bfloat16
    kv = (cfg.num_layers, slots, cfg.kv_heads_per_rank(1), cfg.head_dim)
    table = torch.zeros(batch, MAX_SEQ, dtype=torch.int32)
    for b in range(batch):
        table[b, :per] = torch.arange(1 + b * per, 1 + (b + 1) * per)
    t = batch * new
    ctx = ForwardContext(
        positions=(CONTEXT + torch.arange(new)).repeat(batch).to(DEV),
        out_slots=table[:, CONTEXT:per].reshape(-1).long().to(DEV),
        cos_sin=rope_cos_sin_cache(cfg.rotary_dim, per, cfg.rope_theta, None).to(DEV),
        k_cache=torch.randn(kv, device=DEV).to(dtype),
        v_cache=torch.randn(kv, device=DEV).to(dtype),
        block_table=table.to(DEV),
        req_rows=torch.arange(batch, dtype=torch.int32, device=DEV),
        seq_lens=torch.full((batch,), per, dtype=torch.int32, device=DEV),
        qo_indptr=torch.arange(batch + 1, dtype=torch.int32, device=DEV) * new,
        logits_indices=torch.arange(t, dtype=torch.int64, device=DEV),
        page_size=1,
        num_splits=choose_num_splits(batch, MAX_SEQ, cfg.kv_heads_per_rank(1)),
    )
    ids = torch.randint(0, cfg.vocab_size, (t,), device=DEV)
    return ids, ctx


def _bytes(cfg, weights, batch: int) -> float:
    """What ``kiln bench latency``'s roofline counts (runtime/benchmark.py ``weight_bytes``), plus
    the KV the step reads."""
    moe = cfg.moe
    kv_row = cfg.kv_heads_per_rank(1) * cfg.head_dim * 2 * weights["embed.weight"].element_size()
    kv = batch * (CONTEXT + 1) * kv_row * cfg.num_layers
    return weight_bytes(weights, (moe.top_k, moe.num_experts) if moe else None, batch) + kv


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("batch", pick([1, 8], [1]))
@pytest.mark.parametrize("preset", MODELS)
def test_decode_step(measure, monkeypatch, preset, batch, variant):
    run = dict(VARIANTS[variant])
    fold = run.pop("fold_norms", True)  # a compile setting: how the graph is traced
    cfg, model, weights = _model(preset)
    folded = batch == 1 and fold and bool(norm_folds(model)[0])  # as the compiler traces
    monkeypatch.setattr(model, "fold_norms", folded)
    ids, ctx = _context(cfg, batch)
    step = lambda: torch.func.functional_call(model, weights, (ids, ctx), strict=True)
    info = dict(
        model=preset,
        batch=batch,
        variant=variant,
        num_layers=LAYERS,
        context=CONTEXT,
        settings=VARIANTS[variant],
    )
    with settings.overridden(**run):  # the run-time ones, read at capture
        logits = step()
        assert logits.shape == (batch, cfg.vocab_size) and torch.isfinite(logits).all(), variant
        measure(graphed(step), bytes=_bytes(cfg, weights, batch), **info)


@pytest.mark.parametrize("plan", ["gemv", "cublas"])
@pytest.mark.parametrize("k", pick([0, 2, 4, 8], [0, 2]))
@pytest.mark.parametrize("batch", pick([1, 8, 32], [1]))
def test_verify_step(measure, monkeypatch, batch, k, plan):
    """A speculative verify step of ``k`` drafts per request (docs/speculative.md section 7.1)
    beside the decode step (``k`` 0), Llama-3.1-8B-shaped, unfolded norms (as the compiler traces
    verify graphs): ``gemv``, the linears on the GEMV up to ``batch * (k + 1)`` tokens when that is
    at most 16 (static verify graphs: 1.80x at batch 1 in the twenty-second session, which took them
    out of the compile; kept to measure GEMV kernels at M = 5..16), else the default plan (GEMV at
    one token, cuBLAS above); ``cublas``, the default plan at every size: what artifacts run. The
    issue's target: at batch 1 verify(4) and verify(8) within 1.10x of the decode step."""
    from kiln.compiler.layers import use_gemv_plan
    from kiln.ops.linear.gemv import DOT_M, gemv_plan

    cfg, model, weights = _model("llama-3.1-8b", FULL)
    t = batch * (k + 1)
    base = gemv_plan()
    on_gemv = plan == "gemv" and t <= DOT_M
    use_gemv_plan(model, {role: max(m, t) for role, m in base.items()} if on_gemv else base)
    try:
        monkeypatch.setattr(model, "fold_norms", False)
        ids, ctx = _context(cfg, batch, k + 1)
        step = lambda: torch.func.functional_call(model, weights, (ids, ctx), strict=True)
        logits = step()
        assert logits.shape == (t, cfg.vocab_size) and torch.isfinite(logits).all()
        info = dict(model="llama-3.1-8b", batch=batch, drafts=k, tokens=t, plan=plan, on_gemv=on_gemv)
        measure(
            graphed(step),
            bytes=_bytes(cfg, weights, batch),
            num_layers=cfg.num_layers,
            context=CONTEXT,
            **info,
        )
    finally:
        use_gemv_plan(model, base)


# A draft step per speculative draft source (docs/speculative.md section 7.2): a Llama-3.2-1B-shaped
# draft model's decode step, and an EAGLE-3-shaped head modeled as one Llama-3.1-8B layer with a 32k
# LM head, plus its fc [H, 3H] and the second H of its q/k/v input as one more [qkv rows, H] GEMV
# (EAGLE-3's q/k/v read cat(embed, hidden) [T, 2H]); both at the draft's own KV of CONTEXT tokens.
DRAFTS = {"llama-3.2-1b": ("llama-3.2-1b", FULL, None), "eagle3-8b": ("llama-3.1-8b", 1, 32000)}


@pytest.mark.parametrize("draft", list(DRAFTS))
@pytest.mark.parametrize("batch", pick([1, 8, 32], [1]))
def test_draft_step(measure, monkeypatch, batch, draft):
    """One draft step at ``batch`` (docs/speculative.md section 7.2); with test_verify_step's
    figures bench/report.py computes the tok/s of speculation at acceptance lengths 2, 3 and 4."""
    from kiln.ops.linear.gemv import gemv_plan

    preset, layers, vocab = DRAFTS[draft]
    cfg, model, weights = _model(preset, layers, vocab)
    monkeypatch.setattr(model, "fold_norms", False)
    ids, ctx = _context(cfg, batch)
    h = cfg.hidden_size
    extra: list[tuple[torch.Tensor, torch.Tensor]] = []
    if draft.startswith("eagle3"):  # fc over the target's three hidden states; the 2H q/k/v input
        g = torch.Generator(DEV).manual_seed(1)
        qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        for rows, cols in ((h, 3 * h), (qkv_rows, h)):
            w = (0.02 * torch.randn(rows, cols, generator=g, device=DEV)).to(weights["embed.weight"].dtype)
            extra.append((torch.randn(batch, cols, device=DEV).to(w.dtype), w))
    max_m = gemv_plan().get("mlp", 1)

    def step():
        for x, w in extra:
            torch.ops.kiln.linear(x, w, None, max_m)
        return torch.func.functional_call(model, weights, (ids, ctx), strict=True)

    logits = step()
    assert logits.shape == (batch, cfg.vocab_size) and torch.isfinite(logits).all()
    nbytes = _bytes(cfg, weights, batch) + sum(w.numel() * w.element_size() for _, w in extra)
    info = dict(draft=draft, batch=batch, num_layers=cfg.num_layers, vocab=cfg.vocab_size, context=CONTEXT)
    measure(graphed(step), bytes=nbytes, **info)
