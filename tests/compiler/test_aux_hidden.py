"""Graphs that hand the residual stream out (``CompileOptions.aux_layers``, ``manifest.aux_layers``):
the input of chosen layers, and the stream before the final norm, written by every graph into its
last input (kiln::save_hidden), the foundation of drafts that read the target's hidden states
(EAGLE-3, DeepSeek MTP; docs/speculative.md section 4). Oracle: Hugging Face transformers'
``output_hidden_states`` on the same checkpoint, float32 on CPU."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_checkpoint

from kiln import LLM, SamplingParams
from kiln.compiler.build import CompileError, CompileOptions, compile_model
from kiln.manifest import Manifest

LAYERS = 4
OPTS = dict(device="cpu", dtype="float32", max_batch_size=4, max_seq_len=128, chunk_size=64)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("aux")
    make_checkpoint(root / "hf", "llama-untied", seed=4, num_hidden_layers=LAYERS)
    compile_model(root / "hf", root / "art", CompileOptions(**OPTS, aux_layers=(0, 2, LAYERS)), verbose=False)
    return root


def _hf_streams(ckpt, ids: list[int]) -> list[torch.Tensor]:
    """HF's residual stream at the input of layers 0 and 2 and before the final norm: [T, H] each."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32)
    before_norm = []
    model.model.norm.register_forward_hook(lambda mod, args, out: before_norm.append(args[0]))
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return [out.hidden_states[0][0], out.hidden_states[2][0], before_norm[0][0]]


def test_every_step_writes_the_streams(setup):
    root = setup
    m = Manifest.load(root / "art")
    assert m.aux_layers == (0, 2, LAYERS) and m.graphs["model"].inputs[-1] == "aux_hidden"
    llm = LLM(str(root / "art"), device="cpu")
    eng = llm.engine
    (aux,) = eng.runner.aux_args
    h = m.model["hidden_size"]
    assert aux.shape[1] == 3 * h
    prompt = [5, 17, 33, 9, 120, 7, 250, 3]
    eng.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    eng.step()  # the prefill: every prompt token's streams
    want = _hf_streams(root / "hf", prompt)
    for j in range(3):
        torch.testing.assert_close(aux[: len(prompt), j * h : (j + 1) * h], want[j], rtol=1e-5, atol=1e-5)
    first = eng.requests[next(iter(eng.requests))].output_ids[-1]
    eng.step()  # a decode step: the first sampled token's streams in row 0
    want = _hf_streams(root / "hf", [*prompt, first])
    for j in range(3):
        torch.testing.assert_close(aux[0, j * h : (j + 1) * h], want[j][-1], rtol=1e-5, atol=1e-5)


def test_plain_artifacts_take_no_buffer(setup, tmp_path):
    root = setup
    compile_model(root / "hf", tmp_path / "plain", CompileOptions(**OPTS), verbose=False)
    assert Manifest.load(tmp_path / "plain").aux_layers is None
    assert LLM(str(tmp_path / "plain"), device="cpu").engine.runner.aux_args == ()


@pytest.mark.parametrize("layers", [(2, 0), (0, 0), (LAYERS + 1,)])
def test_bad_layers_are_refused(setup, tmp_path, layers):
    with pytest.raises(CompileError, match="aux_layers"):
        compile_model(setup / "hf", tmp_path / "x", CompileOptions(**OPTS, aux_layers=layers), verbose=False)
