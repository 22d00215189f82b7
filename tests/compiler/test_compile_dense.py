"""`kiln compile` on tiny random dense checkpoints reproduces Hugging Face transformers.

float32 on CPU: a prefill of two prompts (32 and 20 tokens) and 8 greedy decode steps; logits
max relative error (max |kiln - hf| / max |hf|) <= 1e-4 at every step.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from kiln.compiler.build import CompileOptions, compile_model
from kiln.runtime.direct import DirectRunner

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


def make_checkpoint(path, name: str, seed: int = 0):
    cfg = CONFIGS[name]()
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager", dtype=torch.float32
    )
    randomize(model, seed)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model.save_pretrained(path, max_shard_size="200KB")
    return model.eval()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def compiled(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint(root / "hf", request.param)
    opts = CompileOptions(device="cpu", dtype="float32", max_batch_size=4, max_seq_len=128, chunk_size=64)
    compile_model(root / "hf", root / "art", opts, verbose=False)
    return hf, root


def test_prefill_and_decode_match_hf(compiled):
    hf, root = compiled
    runner = DirectRunner(str(root / "art"), device="cpu", num_slots=512)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (32, 20)]
    logits = runner.prefill(prompts)
    seqs = [list(p) for p in prompts]
    for step in range(9):
        with torch.no_grad():
            for i, s in enumerate(seqs):
                ref = hf(torch.tensor([s])).logits[0, -1]
                err = rel_err(logits[i], ref)
                assert err <= 1e-4, f"step {step} seq {i}: max rel err {err:.2e}"
        if step == 8:
            break
        nxt = logits.argmax(-1).tolist()
        for s, t in zip(seqs, nxt):
            s.append(t)
        logits = runner.decode(nxt)


def test_compile_is_deterministic(compiled, tmp_path):
    import json

    _, root = compiled
    opts = CompileOptions(device="cpu", dtype="float32", max_batch_size=4, max_seq_len=128, chunk_size=64)
    compile_model(root / "hf", tmp_path / "again", opts, verbose=False)
    a = json.loads((root / "art" / "manifest.json").read_text())["files"]
    b = json.loads((tmp_path / "again" / "manifest.json").read_text())["files"]
    graph_and_weights = [k for k in a if k.endswith((".pt2", ".safetensors"))]
    assert graph_and_weights and all(a[k]["sha256"] == b[k]["sha256"] for k in graph_and_weights)
