"""Tiny random Hugging Face checkpoints of every dense architecture, shared by the tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from kiln.compiler.synth import make_checkpoint as synth_checkpoint
from kiln.compiler.synth import successor_next

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)

CONFIGS = {
    "llama-untied": lambda: transformers.LlamaConfig(
        **TINY,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama-tied": lambda: transformers.LlamaConfig(**TINY, tie_word_embeddings=True),
    "mistral-headdim": lambda: transformers.MistralConfig(**TINY, head_dim=32, sliding_window=None),
    "qwen2-bias": lambda: transformers.Qwen2Config(**TINY),
    "qwen3-qknorm": lambda: transformers.Qwen3Config(**TINY, head_dim=32),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))


def make_checkpoint(path, name: str, seed: int = 0, eos: int | None = 2, hf_init: bool = False, **overrides):
    """A tiny random checkpoint. Weights are redrawn wider than HF's init (std 0.08, norms
    1 +- 0.2) so float32 comparisons exercise every path; ``hf_init`` keeps transformers' init."""
    cfg = CONFIGS[name]()
    cfg.eos_token_id = eos
    for k, v in overrides.items():  # e.g. a wider hidden size
        setattr(cfg, k, v)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager", dtype=torch.float32
    )
    if hf_init:
        torch.manual_seed(seed)
        model.init_weights()
    else:
        randomize(model, seed)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(path, max_shard_size="200KB")
    return model.eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def hf_greedy(hf, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Hugging Face ``generate`` (greedy, no EOS stop), one prompt at a time: the new tokens."""
    with torch.no_grad():
        return [
            hf.generate(
                torch.tensor([p]),
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            for p in prompts
        ]


def check_against_hf(runner, hf, prompts: list[list[int]], decode_steps: int, tol: float = 1e-4) -> None:
    """Prefill ``prompts`` with a DirectRunner, then greedy decode steps; at every step each
    sequence's logits must match HF's full forward within ``tol`` (max relative error)."""
    logits = runner.prefill(prompts)
    seqs = [list(p) for p in prompts]
    for step in range(decode_steps + 1):
        with torch.no_grad():
            for i, s in enumerate(seqs):
                ref = hf(torch.tensor([s])).logits[0, -1]
                err = rel_err(logits[i], ref)
                assert err <= tol, f"step {step} seq {i}: max rel err {err:.2e}"
        if step == decode_steps:
            return
        nxt = logits.argmax(-1).tolist()
        for s, t in zip(seqs, nxt):
            s.append(t)
        logits = runner.decode(nxt)


# Successor checkpoints (kiln.compiler.synth, ``successor=True``): greedy decoding emits
# ``SUCCESSOR_NEXT[t]`` after ``t`` whatever came before, the workload the speculative tests need.
SUCCESSOR_SEED = 3


def successor_config(num_layers: int = 2) -> dict:
    """config.json of the tiny Llama (:data:`TINY`, untied) the speculative tests build successor
    checkpoints from."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **TINY} | {
        "num_hidden_layers": num_layers,
        "tie_word_embeddings": False,
    }


SUCCESSOR_NEXT = successor_next(TINY["vocab_size"], SUCCESSOR_SEED)


def walk(t: int, n: int) -> list[int]:
    """The ``n`` tokens that follow ``t`` along a successor checkpoint's cycle (:data:`SUCCESSOR_NEXT`):
    its greedy continuation of ``t``."""
    out = []
    for _ in range(n):
        t = SUCCESSOR_NEXT[t]
        out.append(t)
    return out


def make_successor(path, num_layers: int = 2, dtype: str = "float32", engine: str = "hf") -> Path:
    """A successor checkpoint of :func:`successor_config` in ``path`` (no tokenizer)."""
    return synth_checkpoint(
        path, successor_config(num_layers), dtype, seed=SUCCESSOR_SEED, with_tokenizer=False, engine=engine,
        successor=True,
    )  # fmt: skip
