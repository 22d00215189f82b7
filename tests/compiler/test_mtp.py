"""DeepSeek-V3's MTP layer as a draft head (``kiln compile --mtp``: compiler/mtp.py,
compiler/models/mtp.py) against a from-scratch reference, float32 on CPU.

The checkpoint is a tiny random DeepSeek-V3 (q LoRA, one dense layer then MoE, 4 routed experts)
with ``num_nextn_predict_layers: 1``, its MTP layer written by compiler/synth.py. The reference is
transformers' ``DeepseekV3DecoderLayer`` loaded with the MTP layer's weights (the checkpoint read by
``from_pretrained`` with one layer more) and ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head`` done
by hand, fed the target's hidden state as its LM head reads it (after ``model.norm``) and, in a
chain, its own ``shared_head.norm`` output (SGLang's ``deepseek_nextn``). Checked, each within 1e-4
relative error (``|kiln - ref| / |ref|``): the target artifact's aux stream (its last decoder layer
output, before the final norm), the head's catch-up graph from those streams (logits and the output
it writes back), and a chain step of its decode graph on its own output. Then the refusals, each a
one-line error before any work, the compile cache's and the command line's.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from click.testing import CliRunner
from mtp_checkpoints import V3, H, L, V, make_mtp_checkpoint
from safetensors import safe_open
from safetensors.torch import load_file

from kiln import compile_cache as cc
from kiln.compiler.build import CompileError, CompileOptions, compile_model
from kiln.compiler.cli_compile import compile_cmd
from kiln.compiler.synth import make_checkpoint
from kiln.manifest import Manifest
from kiln.runtime.direct import DirectRunner
from kiln.runtime.loader import load_model
from kiln.weights import load_pack

T = 9  # prompt length
OPTS = dict(device="cpu", dtype="float32", max_batch_size=2, max_seq_len=64, chunk_size=16)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mtp")
    make_mtp_checkpoint(root / "ckpt", seed=3)
    compile_model(root / "ckpt", root / "art", CompileOptions(**OPTS, mtp=True), verbose=False)
    return root


class Reference:
    """The target's last decoder layer output and the MTP layer, from transformers' modules."""

    def __init__(self, ckpt: Path):
        cfg = transformers.AutoConfig.from_pretrained(ckpt)
        cfg.num_hidden_layers = L + 1  # layer L: the MTP layer's decoder layer, as any layer's names
        old = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # its enorm, hnorm, ... are unexpected there
        try:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(
                ckpt, config=cfg, attn_implementation="eager", dtype=torch.float32
            ).eval()
        finally:
            transformers.logging.set_verbosity(old)
        self.eps = cfg.rms_norm_eps
        index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
        p = f"model.layers.{L}."
        self.w: dict[str, torch.Tensor] = {}
        for name, file in index.items():
            if name.startswith(p) and not name.startswith((p + "self_attn", p + "mlp")):
                with safe_open(str(ckpt / file), "pt") as st:
                    self.w[name.removeprefix(p)] = st.get_tensor(name)
        assert set(self.w) >= {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.head.weight"}

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.w[name]

    def streams(self, ids: list[int]) -> torch.Tensor:
        """The target's last decoder layer output at every token ``[T, H]`` (before the final norm)."""
        out: list[torch.Tensor] = []
        hook = self.model.model.layers[L - 1].register_forward_hook(lambda m, a, o: out.append(o))
        try:
            with torch.no_grad():
                self.model(torch.tensor([ids]))
        finally:
            hook.remove()
        return out[0][0]

    def mtp(self, ids: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [T, V], shared_head.norm(y) [T, H])`` of the MTP layer over positions
        ``0 .. T - 1`` with tokens ``ids`` (``t_{i+1}``) and hidden states ``h``."""
        n = ids.shape[0]
        with torch.no_grad():
            e = self.model.model.embed_tokens(ids)
            x = torch.cat([self.norm(e, "enorm.weight"), self.norm(h, "hnorm.weight")], -1)
            x = torch.nn.functional.linear(x, self.w["eh_proj.weight"])[None]
            pos = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            y = self.model.model.layers[L](
                x,
                attention_mask=mask,
                position_ids=pos,
                position_embeddings=self.model.model.rotary_emb(x, pos),
            )
            y = (y[0] if isinstance(y, tuple) else y)[0]
            y = self.norm(y, "shared_head.norm.weight")
            logits = torch.nn.functional.linear(y, self.w["shared_head.head.weight"])
        return logits, y


def test_the_artifact_pins_the_mtp_head(compiled):
    m = Manifest.load(compiled / "art")
    assert m.draft is not None and m.draft.kind == "mtp" and m.draft.path == "mtp"
    assert m.aux_layers == (L,) and m.aux_width == H and m.verify is not None
    head = Manifest.load(compiled / "art" / "mtp")
    assert head.mtp is not None and head.mtp.layer == L and head.eagle3 is None
    assert head.aux_width == H and head.kv.num_layers == 1 and head.vocab_size == V
    assert head.max_blocks == m.max_blocks and {f"decode_b{b}" for b in m.decode_buckets} < set(head.graphs)
    main = load_pack(compiled / "art" / "weights", 0, "cpu")
    assert not any(n.startswith(f"layers.{L}.") for n in main)  # the model's pack leaves it out
    own = load_pack(compiled / "art" / "mtp" / "weights", 0, "cpu")
    assert "layers.0.moe.w13" in own and "eh_proj.weight" in own and "layers.1.attn.w_kc" not in own
    assert "final_norm.weight" in own and "norm.weight" in own  # the target's, shared_head's


def test_the_compiled_head_matches_transformers(compiled):
    """The target's stream, the catch-up graph (from the target's streams) and a chain step (the
    head's own output fed back), each against the reference."""
    ref = Reference(compiled / "ckpt")
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, V, (T + 2,), generator=g)
    target = DirectRunner("", model=load_model(str(compiled / "art"), "cpu"))
    (streams,) = target.runner.aux_args = (torch.zeros(2 * T, H),)
    target.prefill([tokens[:T].tolist()])
    h = ref.streams(tokens[:T].tolist())
    assert rel_err(streams[:T], h) < 1e-4  # the target hands out its last layer's output
    with torch.no_grad():
        normed = ref.model.model.norm(h)  # what the target's LM head reads: the MTP layer's h
    head = DirectRunner("", model=load_model(str(compiled / "art" / "mtp"), "cpu"))
    (buf,) = head.runner.aux_args = (torch.zeros(2 * T, H),)
    buf[:T] = h  # as the target hands it out: the head applies the final norm
    got = head.prefill([tokens[1 : T + 1].tolist()])[0]  # position i reads t_{i+1} and h_i
    want, want_y = ref.mtp(tokens[1 : T + 1], normed)
    assert rel_err(got, want[-1]) < 1e-4
    assert rel_err(buf[:T], want_y) < 1e-4  # its output, written back for the chain
    buf[0] = want_y[-1]  # the chain: the last output fed back with the next token
    step = head.decode([int(tokens[T + 1])])[0]
    full, _ = ref.mtp(tokens[1:], torch.cat([normed, want_y[-1:]]))
    assert rel_err(step, full[-1]) < 1e-4


@pytest.fixture(scope="module")
def ckpt(compiled) -> Path:
    return compiled / "ckpt"


def _variant(src: Path, dst: Path, config: dict | None = None, drop_mtp: bool = False) -> Path:
    """``src`` linked into ``dst`` with config.json fields replaced (None: removed), or without the
    MTP layer's weights."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            (dst / f.name).symlink_to(f)
    raw = json.loads((src / "config.json").read_text())
    for k, v in (config or {}).items():
        raw.pop(k) if v is None else raw.__setitem__(k, v)
    (dst / "config.json").write_text(json.dumps(raw))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    if drop_mtp:  # as conversions that keep num_nextn_predict_layers but drop the layer do
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if f".layers.{L}." not in k}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


@pytest.mark.parametrize(
    "config, drop, opts, message",
    [
        ({"num_nextn_predict_layers": None}, False, {}, "config.json has no 'num_nextn_predict_layers'"),
        ({}, True, {}, f"lacks the layer (model.layers.{L}.enorm.weight)"),
        ({}, False, {"draft_model": "x"}, "--mtp and --draft-model: an artifact has one draft source"),
        ({}, False, {"eagle3": "x"}, "--mtp and --eagle3: an artifact has one draft source"),
    ],
)
def test_mtp_is_refused_where_it_cannot_compile(ckpt, tmp_path, config, drop, opts, message):
    src = _variant(ckpt, tmp_path / "ckpt", config, drop)
    with pytest.raises(CompileError, match=re.escape(message)) as err:
        compile_model(src, tmp_path / "art", CompileOptions(**OPTS | opts, mtp=True), verbose=False)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "art").exists()


def test_other_architectures_are_refused(tmp_path):
    llama = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=32, intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=1, vocab_size=V,
        max_position_embeddings=64, num_nextn_predict_layers=1,
    )  # fmt: skip
    make_checkpoint(tmp_path / "ckpt", llama, "float32", with_tokenizer=False, engine="hf")
    with pytest.raises(CompileError, match=r"^--mtp: config.json 'architectures' is LlamaForCausalLM; "):
        compile_model(tmp_path / "ckpt", tmp_path / "art", CompileOptions(**OPTS, mtp=True), verbose=False)


def test_the_cache_and_the_command_line(ckpt, tmp_path):
    for given in (["--mtp"], {"mtp": True}):
        with pytest.raises(
            cc.CacheError, match=r"is not taken here: .*kiln compile MODEL --mtp -o ART"
        ) as err:
            cc.normalize_options(given)
        assert "\n" not in str(err.value)
    kiln = [sys.executable, "-m", "kiln", "compile"]
    args = [str(ckpt), "-o", str(tmp_path / "art"), "--device", "cpu", "--mtp", "--eagle3", str(ckpt)]
    p = subprocess.run([*kiln, *args], capture_output=True, text=True)
    assert p.returncode != 0 and "one draft source" in p.stderr and "Traceback" not in p.stderr
    help_text = CliRunner().invoke(compile_cmd, ["--help"], terminal_width=200).output
    assert "--mtp " in help_text and "next-token-prediction layer" in help_text


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in ckpt.glob("*.safetensors"):
        out.update(load_file(f))
    return out


def test_synth_writes_the_mtp_layer_with_both_engines(ckpt, tmp_path):
    """Both engines of compiler/synth.py write the same names and shapes, the MTP layer's included,
    its embedding a copy of the model's; the hf engine's second shard is in the index."""
    fast = _tensors(
        make_checkpoint(tmp_path / "fast", dict(V3), "float32", seed=3, with_tokenizer=False, engine="fast")
    )
    hf = _tensors(ckpt)
    assert {n: t.shape for n, t in fast.items()} == {n: t.shape for n, t in hf.items()}
    p = f"model.layers.{L}."
    assert hf[p + "eh_proj.weight"].shape == (H, 2 * H) and hf[p + "shared_head.head.weight"].shape == (V, H)
    assert f"{p}mlp.experts.3.down_proj.weight" in hf and f"{p}mlp.gate.e_score_correction_bias" in hf
    for w in (fast, hf):
        assert torch.equal(w[p + "embed_tokens.weight"], w["model.embed_tokens.weight"])
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(hf)
