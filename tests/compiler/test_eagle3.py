"""The EAGLE-3 draft head (compiler/models/eagle3.py) against a reference built from Hugging Face
transformers' Llama pieces (attention with its q/k/v reading 2H, MLP, RMSNorms, RoPE), float32 on
CPU: a prefill from the target's hidden states (through ``fc``) and a decode step from the head's
own output, on kiln's paged KV cache."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.models.llama import modeling_llama as hf

from kiln.compiler.build import CompileError, CompileOptions, compile_model
from kiln.compiler.config import normalize_config
from kiln.compiler.context import ForwardContext
from kiln.compiler.models.eagle3 import CHECKPOINT_NAMES, Eagle3Head
from kiln.compiler.synth import make_checkpoint
from kiln.manifest import Manifest
from kiln.ops.attention.rope import rope_cos_sin_cache
from kiln.runtime.direct import DirectRunner
from kiln.runtime.loader import load_model

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


# ---------------------------------------------------------------- kiln compile TARGET --eagle3 HEAD
TARGET = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=HT, intermediate_size=64,
    num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_hidden_layers=4, vocab_size=V,
    rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip
IDS = [0, 2, 1]  # eagle_aux_hidden_state_layer_ids: the streams at the inputs of layers 1, 2, 3
OPTS = dict(device="cpu", dtype="float32", max_batch_size=2, max_seq_len=64, chunk_size=16)


def write_head(path: Path, ref: Reference, **config: Any) -> torch.Tensor:
    """``ref`` as a published-layout checkpoint (its own embedding, ``d2t`` over a random subset
    of the vocabulary); returns the target ids of its draft ids."""
    inside = ("input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn", "mlp")
    w = {f"midlayer.{k}" if k.split(".")[0] in inside else k: v for k, v in ref.state_dict().items()}
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(5))[:VD].sort().values
    w["d2t"] = ids - torch.arange(VD)
    w["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill(0, ids, True)
    path.mkdir(parents=True)
    save_file(w, str(path / "model.safetensors"))
    raw = RAW | dict(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=VD, target_hidden_size=HT)
    raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": IDS}
    (path / "config.json").write_text(json.dumps(raw | config))
    return ids


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[Path, Reference, torch.Tensor]:
    root = tmp_path_factory.mktemp("eagle3c")
    make_checkpoint(root / "target", dict(TARGET), "float32", seed=2, with_tokenizer=False, engine="hf")
    ref = Reference()
    ids = write_head(root / "head", ref)
    compile_model(
        root / "target", root / "art", CompileOptions(**OPTS, eagle3=str(root / "head")), verbose=False
    )
    return root, ref, ids


def test_the_artifact_pins_the_head_and_the_target_hands_out_its_streams(compiled):
    root, _, _ = compiled
    m = Manifest.load(root / "art")
    assert m.draft is not None and m.draft.kind == "eagle3" and m.draft.path == "eagle3"
    assert m.aux_layers == (1, 2, 3) and m.aux_width == 3 * HT  # sorted ids, plus one
    assert m.verify is not None  # a draft verifies: the default lengths
    head = Manifest.load(root / "art" / "eagle3")
    assert head.eagle3 is not None and head.eagle3.draft_vocab_size == VD
    assert head.aux_width == 3 * HT and head.kv.num_layers == 1 and head.vocab_size == V
    assert head.max_seq_len == m.max_seq_len and head.max_blocks == m.max_blocks  # one block table
    assert {f"decode_b{b}" for b in m.decode_buckets} < set(head.graphs)


def test_the_compiled_head_matches_the_reference(compiled):
    """The head's graphs (the shared one from the target's streams through fc, a decode graph
    from its own output) against the reference from transformers' pieces, its logits placed at
    the target ids ``i + d2t[i]`` and -inf elsewhere."""
    root, ref, ids = compiled
    runner = DirectRunner("", model=load_model(str(root / "art" / "eagle3"), "cpu"))
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V, (T + 1,), generator=g)
    streams = torch.randn(T, 3 * HT, generator=g)
    (buf,) = runner.runner.aux_args = (torch.zeros(2 * T, 3 * HT),)
    buf[:T] = streams
    got = runner.prefill([tokens[:T].tolist()])[0]
    with torch.no_grad():
        want, want_h = ref(tokens[:T], ref.fc(streams))
    torch.testing.assert_close(got[ids], want[-1], rtol=1e-4, atol=1e-4)
    assert torch.isneginf(got[torch.ones(V, dtype=torch.bool).index_fill(0, ids, False)]).all()
    torch.testing.assert_close(buf[:T, :H], want_h, rtol=1e-4, atol=1e-4)  # its output, written back
    buf[0, :H] = want_h[-1]  # the chain: the last output fed back with the next token
    step = runner.decode([int(tokens[T])])[0]
    with torch.no_grad():
        full, _ = ref(tokens, torch.cat([ref.fc(streams), want_h[-1:]]))
    torch.testing.assert_close(step[ids], full[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "change, opts, message",
    [
        ({"vocab_size": V + 4}, {}, "'vocab_size' is 104, the target's 100"),
        ({"target_hidden_size": 2 * HT}, {}, "'target_hidden_size' is 96"),
        ({"num_hidden_layers": 2}, {}, "'num_hidden_layers' is 2"),
        ({"architectures": ["LlamaForCausalLM"]}, {}, "--draft-model"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 0, 1]}}, {}, "three distinct layers"),
        (
            {"eagle_config": {}},
            {},
            "default layers (2, L/2, L-3) do not name three distinct layers of the target's 4",
        ),
        ({}, {"draft_model": "x"}, "one draft source"),
    ],
)
def test_a_head_that_does_not_fit_is_refused_before_any_work(tmp_path, change, opts, message):
    make_checkpoint(tmp_path / "target", dict(TARGET), "float32", seed=2, with_tokenizer=False, engine="hf")
    write_head(tmp_path / "head", Reference(), **change)
    with pytest.raises(CompileError, match=re.escape(message)):
        compile_model(
            tmp_path / "target",
            tmp_path / "art",
            CompileOptions(**OPTS | opts, eagle3=str(tmp_path / "head")),
        )
    assert not (tmp_path / "art").exists()


def test_heads_in_other_formats_are_refused(tmp_path):
    make_checkpoint(tmp_path / "target", dict(TARGET), "float32", seed=2, with_tokenizer=False, engine="hf")
    write_head(tmp_path / "head", Reference())
    f = tmp_path / "head" / "model.safetensors"
    w = load_file(f)
    torch.save(w, tmp_path / "head" / "pytorch_model.bin")
    f.unlink()
    opts = CompileOptions(**OPTS, eagle3=str(tmp_path / "head"))
    with pytest.raises(CompileError, match="safetensors only"):
        compile_model(tmp_path / "target", tmp_path / "art", opts)
    w.pop("d2t")  # a draft vocabulary without its map to the target's ids
    save_file(w, str(f))
    with pytest.raises(CompileError, match="no d2t tensor"):
        compile_model(tmp_path / "target", tmp_path / "art", opts)
    with pytest.raises(CompileError, match="compiles into its target's artifact"):
        compile_model(tmp_path / "head", tmp_path / "art", CompileOptions(**OPTS))


def test_the_command_line_takes_a_head_and_refuses_two_draft_sources(tmp_path):
    make_checkpoint(tmp_path / "target", dict(TARGET), "float32", seed=2, with_tokenizer=False, engine="hf")
    write_head(tmp_path / "head", Reference())
    head, target = str(tmp_path / "head"), str(tmp_path / "target")
    args = ["compile", target, "-o", str(tmp_path / "art"), "--device", "cpu", "--dtype", "float32"]
    kiln = [sys.executable, "-m", "kiln"]
    p = subprocess.run(
        [*kiln, *args, "--eagle3", head, "--draft-model", target], capture_output=True, text=True
    )
    assert p.returncode != 0 and "one draft source" in p.stderr and "Traceback" not in p.stderr
    assert (
        "--eagle3 HEAD" in subprocess.run([*kiln, "compile", "--help"], capture_output=True, text=True).stdout
    )
