"""The EAGLE-3 draft head (compiler/models/eagle3.py) against a reference built from Hugging Face
transformers' Llama pieces (attention with its q/k/v reading 2H, MLP, RMSNorms, RoPE), float32 on
CPU: a prefill from the target's hidden states (through ``fc``) and a decode step from the head's
own output, on kiln's paged KV cache."""

from __future__ import annotations

import torch
import transformers
from torch import nn
from transformers.models.llama import modeling_llama as hf

from kiln.compiler.config import normalize_config
from kiln.compiler.context import ForwardContext
from kiln.compiler.models.eagle3 import CHECKPOINT_NAMES, Eagle3Head
from kiln.ops.attention.rope import rope_cos_sin_cache

H, HT, VD, V, T = 64, 48, 40, 100, 7  # head hidden, target hidden, draft vocab, vocab, prompt length
RAW = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=H, intermediate_size=96,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=1, vocab_size=V,
    rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip


class Reference(nn.Module):
    """The head's forward over a whole sequence, from transformers' modules."""

    def __init__(self) -> None:
        super().__init__()
        cfg = transformers.LlamaConfig(**{k: v for k, v in RAW.items() if k != "architectures"})
        cfg._attn_implementation = "eager"
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(V, H)
        self.fc = nn.Linear(3 * HT, H, bias=False)
        self.input_layernorm = hf.LlamaRMSNorm(H, 1e-5)
        self.hidden_norm = hf.LlamaRMSNorm(H, 1e-5)
        self.self_attn = hf.LlamaAttention(cfg, 0)
        for p in "qkv":  # EAGLE-3's q/k/v read cat(embeds, hidden): 2H
            old = getattr(self.self_attn, f"{p}_proj")
            setattr(self.self_attn, f"{p}_proj", nn.Linear(2 * H, old.out_features, bias=False))
        self.post_attention_layernorm = hf.LlamaRMSNorm(H, 1e-5)
        self.mlp = hf.LlamaMLP(cfg)
        self.norm = hf.LlamaRMSNorm(H, 1e-5)
        self.lm_head = nn.Linear(H, VD, bias=False)
        self.rope = hf.LlamaRotaryEmbedding(cfg)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(
                    1 + 0.2 * torch.randn(p.shape, generator=g)
                    if "norm" in name
                    else 0.1 * torch.randn(p.shape, generator=g)
                )

    def forward(self, ids: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = ids.shape[0]
        x = torch.cat([self.input_layernorm(self.embed_tokens(ids)), self.hidden_norm(h)], -1)[None]
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        a, _ = self.self_attn(x, position_embeddings=self.rope(x, pos), attention_mask=mask)
        res = h + a[0]
        h_out = self.mlp(self.post_attention_layernorm(res)) + res
        return self.lm_head(self.norm(h_out)), h_out

    def kiln_weights(self) -> dict[str, torch.Tensor]:
        """The head's parameters by kiln name, from the checkpoint names (CHECKPOINT_NAMES)."""
        sd = {
            k.replace("input_layernorm", "midlayer.input_layernorm"): v for k, v in self.state_dict().items()
        }
        sd = {
            f"midlayer.{k}"
            if k.split(".")[0] in ("self_attn", "mlp", "hidden_norm", "post_attention_layernorm")
            else k: v
            for k, v in sd.items()
        }
        return {name: torch.cat([sd[s] for s in src]) for name, src in CHECKPOINT_NAMES.items()}


def _ctx(positions: list[int], slots: list[int], seq_len: int) -> ForwardContext:
    n = len(positions)
    table = torch.zeros(2, 16, dtype=torch.int32)
    table[0, :16] = torch.arange(1, 17)  # page size 1: position p in slot p + 1 (slot 0: the sink)
    return ForwardContext(
        positions=torch.tensor(positions),
        out_slots=torch.tensor(slots),
        cos_sin=rope_cos_sin_cache(16, 64, 10000.0, None),
        k_cache=KV[0],
        v_cache=KV[1],
        block_table=table,
        req_rows=torch.tensor([0], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        qo_indptr=torch.tensor([0, n], dtype=torch.int32),
        logits_indices=torch.arange(n),
        page_size=1,
    )


KV = (torch.zeros(1, 20, 2, 16), torch.zeros(1, 20, 2, 16))


def test_head_matches_the_reference_over_prefill_and_a_decode_step():
    ref = Reference()
    with torch.device("meta"):
        head = Eagle3Head(normalize_config(RAW), HT, VD, torch.float32)
    weights = ref.kiln_weights()
    assert set(weights) == {n for n, _ in head.named_parameters()}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (T + 1,), generator=g)
    aux = torch.randn(T, 3 * HT, generator=g)  # the target's three streams at the prompt's tokens
    with torch.no_grad():
        logits, h_out = torch.func.functional_call(
            head, weights, (ids[:T], aux, _ctx(list(range(T)), list(range(1, T + 1)), T)), strict=True
        )
        want_logits, want_h = ref(ids[:T], ref.fc(aux))
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(h_out, want_h, rtol=1e-4, atol=1e-4)
        # the next draft step: token T with the head's own last output as its hidden state
        own = h_out[-1:]
        step, step_h = torch.func.functional_call(
            head, weights, (ids[T:], own, _ctx([T], [T + 1], T + 1)), strict=True
        )
        full_logits, full_h = ref(ids, torch.cat([ref.fc(aux), own]))
        torch.testing.assert_close(step[0], full_logits[-1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(step_h[0], full_h[-1], rtol=1e-4, atol=1e-4)
