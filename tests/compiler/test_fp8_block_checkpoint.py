"""`kiln compile` of a checkpoint in the block-FP8 format of DeepSeek-V3 and Hugging Face's ``fp8``
quantization (Qwen3-*-FP8): e4m3 linear weights with ``weight_scale_inv`` per 128 x 128 block and
``quantization_config`` in config.json. Without ``--quant`` the artifact is ``quant: fp8-block``: the
pack holds the checkpoint's FP8 blocks as they are, and the graphs' linears call
``kiln::fp8_block_linear``, which quantizes activations per token and 128-column group.

Tiny random Llama (every dim a multiple of 128), Qwen3 (hidden 320: ragged K and N blocks) and
DeepSeek-V3 (MLA, a dense first layer, a shared expert; routed experts block FP8 too, ``w13``/``w2``
e4m3 with the checkpoint's per-expert blocks, run by ``kiln::fused_moe``'s block-scaled grouped GEMM)
checkpoints, quantized per block by the test, compiled in float32 on CPU, compared with transformers
on the float32 model the FP8 checkpoint means (its dequantized weights):

* against that model with each quantized linear (and each routed expert's two GEMMs) quantizing its
  input as the ops do (the "simulated" reference): the prefill logits of 8 short prompts agree within
  1e-5 max relative error (measured: 0 or 7e-7, on 96 prompts of each architecture; DeepSeek-V3 with
  block-FP8 experts at most 7.7e-7 on 48); allowed: two prompts beyond, within 5e-2 (one was
  allowed until a fresh install took numpy 2.4.6 / transformers 5.25 / triton 3.9: Qwen3's ragged
  blocks then had two rows at 1.7e-2 and 2.3e-2). float32 summation order differs between the two, which now and then moves an
  activation across an e4m3 rounding boundary (a 2**-3 step of one element): in decode steps,
  where it happens more often, measured on 1-3 of 240 logits rows per architecture, up to 2e-2. So
  the pack and the graph compute what the checkpoint means, to the bit where no boundary intervenes;
* against the plain dequantized model, where FP8 activations add their rounding (2**-4 relative per
  element): logits max relative error <= 0.15 (measured 0.049 Llama, 0.066 Qwen3, 0.092
  DeepSeek-V3), and greedy agreement: transformers' 32 greedy tokens of 4 prompts fed to kiln one by
  one, kiln's argmax equal to transformers' next token at 124/128 (Llama), 119/128 (Qwen3) and
  112/128 (DeepSeek-V3; 110/128 with its experts up-cast) positions; asserted >= 75%. (Left to run free, the two diverge at the first
  such flip, on these random models within a few tokens: near ties are common.)
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import transformers
from fp8_block_checkpoints import QUANT_CONFIG, write_block_fp8
from safetensors.torch import load_file
from tiny_models import check_against_hf, hf_greedy, make_checkpoint, randomize, rel_err

from kiln.compiler.build import CompileOptions, compile_model
from kiln.compiler.cli_inspect import format_report, inspect_report
from kiln.compiler.config import ConfigError, load_config, resolve_quant
from kiln.compiler.mappings import all_rank_specs
from kiln.compiler.parallel import ParallelConfig
from kiln.manifest import Manifest
from kiln.ops.linear.fp8_block import fp8_block_linear_ref
from kiln.runtime.direct import DirectRunner
from kiln.weights import load_pack
from kiln.weights.pack import pack_checkpoint

OPTS = dict(device="cpu", dtype="float32", max_batch_size=4, max_seq_len=128, chunk_size=64)
NEW = 32


def deepseek_v3(path: Path) -> None:
    """A tiny DeepSeek-V3 whose fused gate_up and qkv_a tensors keep 128-row blocks (intermediate
    128; q LoRA rank 128, so kv_a's rows start on the grid, as V3's 1536 does)."""
    cfg = transformers.DeepseekV3Config(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=128, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, vocab_size=300, max_position_embeddings=512, rms_norm_eps=1e-6,
        first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, eos_token_id=None,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager", dtype=torch.float32
    )
    randomize(model, 4)
    model.save_pretrained(path, max_shard_size="200KB")


ARCHS = {
    # head_dim 128 (2 heads, 1 KV head), intermediate 384: every block whole
    "llama": lambda p: make_checkpoint(
        p, "llama-untied", seed=3, hf_init=True, hidden_size=256, intermediate_size=384,
        num_attention_heads=2, num_key_value_heads=1, head_dim=128,
    ),
    # hidden 320: the last K block of qkv/gate_up and the last N block of o/down are ragged
    "qwen3": lambda p: make_checkpoint(
        p, "qwen3-qknorm", seed=3, hf_init=True, hidden_size=320, intermediate_size=384,
        num_attention_heads=2, num_key_value_heads=1, head_dim=128,
    ),
    "deepseek-v3": deepseek_v3,
}  # fmt: skip


def block_experts(ckpt: dict[str, torch.Tensor], layer: int, num_experts: int) -> tuple[torch.Tensor, ...]:
    """Layer ``layer``'s routed experts of a block-FP8 checkpoint stacked as kiln packs them:
    ``w13 [E, 2I, H]`` (gate rows, then up rows), ``w13_scale``, ``w2 [E, H, I]``, ``w2_scale``."""
    p = f"model.layers.{layer}.mlp.experts."

    def stack(part: str, suffix: str) -> torch.Tensor:
        return torch.stack([ckpt[f"{p}{e}.{part}_proj.{suffix}"] for e in range(num_experts)])

    w13 = torch.cat([stack("gate", "weight"), stack("up", "weight")], dim=1)
    s13 = torch.cat([stack("gate", "weight_scale_inv"), stack("up", "weight_scale_inv")], dim=1)
    return w13, s13, stack("down", "weight"), stack("down", "weight_scale_inv")


def simulated(hf: torch.nn.Module, fp8_dir: Path) -> torch.nn.Module:
    """A copy of ``hf`` whose block-FP8 linears run ``kiln::fp8_block_linear``'s reference on the
    checkpoint's FP8 weights (activations quantized per token and group), and whose routed experts
    run each expert's gate_up and down GEMMs the same way (the SiLU-and-mul output quantized per
    token and group before down), as ``kiln::fused_moe`` with block scales does. MLA's ``kv_b_proj``
    stays a float32 linear: kiln uses it dequantized, as the absorbed ``w_kc``/``w_vc``."""
    ckpt: dict[str, torch.Tensor] = {}
    for f in sorted(fp8_dir.glob("*.safetensors")):
        ckpt.update(load_file(f))
    sim = copy.deepcopy(hf)
    for name, mod in sim.named_modules():
        if name.endswith("mlp.experts") and hasattr(mod, "gate_up_proj"):  # transformers' stacked experts
            layer = int(name.split(".")[2])
            w13, s13, w2, s2 = block_experts(ckpt, layer, mod.num_experts)

            def experts(x, ids, weights, w13=w13, s13=s13, w2=w2, s2=s2, act=mod.act_fn):
                out = torch.zeros_like(x)  # x: [T, H]; ids, weights: [T, k]
                for e in torch.unique(ids).tolist():
                    tok, j = torch.where(ids == e)
                    gate, up = fp8_block_linear_ref(x[tok], w13[e], s13[e], None).chunk(2, dim=-1)
                    y = fp8_block_linear_ref(act(gate) * up, w2[e], s2[e], None)
                    out.index_add_(0, tok, (y * weights[tok, j, None]).to(out.dtype))
                return out

            mod.forward = experts
            continue
        scale = ckpt.get(f"{name}.weight_scale_inv")
        if scale is None or name.endswith("kv_b_proj"):
            continue
        w = ckpt[f"{name}.weight"]

        def forward(x: torch.Tensor, w: torch.Tensor = w, s: torch.Tensor = scale) -> torch.Tensor:
            y = fp8_block_linear_ref(x.reshape(-1, x.shape[-1]), w, s, None)
            return y.reshape(*x.shape[:-1], w.shape[0])

        mod.forward = forward
    return sim


@pytest.fixture(scope="module")
def hf_quiet():
    old = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(old)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def compiled(request, tmp_path_factory, hf_quiet):
    root = tmp_path_factory.mktemp(request.param)
    ARCHS[request.param](root / "hf")
    ref = write_block_fp8(root / "hf", root / "fp8")
    compile_model(root / "fp8", root / "art", CompileOptions(**OPTS), verbose=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        ref, dtype=torch.float32, attn_implementation="eager"
    )
    return hf.eval(), root


def prompts_of(seed: int, sizes) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in sizes]


def test_logits_match_the_simulated_fp8_model(compiled):
    hf, root = compiled
    runner = DirectRunner(str(root / "art"), device="cpu", num_slots=512)
    sim = simulated(hf, root / "fp8")
    errs = []
    for seed in (1, 2):  # 2 batches of 4 (the artifact's largest batch)
        prompts = prompts_of(seed, (6, 9, 7, 12))
        logits = runner.prefill(prompts)
        with torch.no_grad():
            errs += [rel_err(logits[i], sim(torch.tensor([p])).logits[0, -1]) for i, p in enumerate(prompts)]
    assert sum(e <= 1e-5 for e in errs) >= 6 and max(errs) <= 5e-2, errs


def test_close_to_the_dequantized_model(compiled):
    hf, root = compiled
    runner = DirectRunner(str(root / "art"), device="cpu", num_slots=512)
    check_against_hf(runner, hf, prompts_of(1, (32, 20)), decode_steps=4, tol=0.15)
    prompts = prompts_of(7, (5, 23, 40, 12))
    want = hf_greedy(hf, prompts, NEW)
    runner = DirectRunner(str(root / "art"), device="cpu", num_slots=1024)
    logits, same = runner.prefill(prompts), 0
    for step in range(NEW):  # kiln's greedy choice after transformers' greedy prefix
        same += sum(t == w[step] for t, w in zip(logits.argmax(-1).tolist(), want))
        logits = runner.decode([w[step] for w in want])
    assert same >= 0.75 * NEW * len(prompts), f"{same}/{NEW * len(prompts)} greedy tokens equal"


def test_artifact_keeps_the_checkpoint_blocks(compiled):
    _, root = compiled
    manifest = Manifest.load(root / "art")
    assert manifest.quant == "fp8-block"
    pack = load_pack(root / "art" / "weights", 0)
    info = json.loads((root / "art" / "weights" / "pack.json").read_text())["model"]
    blocks = sum(t.dtype == torch.float8_e4m3fn for t in pack.values())
    assert blocks >= 8 and info["fp8_block_kept"] == blocks and info["fp8_block_quantized"] == 0
    ckpt: dict[str, torch.Tensor] = {}
    for f in sorted((root / "fp8").glob("*.safetensors")):
        ckpt.update(load_file(f))
    o = "layers.1.attn.o.weight"
    assert pack[o].dtype == torch.float8_e4m3fn
    assert torch.equal(
        pack[o].view(torch.uint8), ckpt["model.layers.1.self_attn.o_proj.weight"].view(torch.uint8)
    )
    assert torch.equal(pack[o + "_scale"], ckpt["model.layers.1.self_attn.o_proj.weight_scale_inv"])
    # embeddings, norms and the LM head as the checkpoint has them (float32)
    assert torch.equal(pack["embed.weight"], ckpt["model.embed_tokens.weight"])
    assert torch.equal(pack["norm.weight"], ckpt["model.norm.weight"])
    graph = (root / "art" / "graphs" / "model.py").read_text()
    assert "kiln.fp8_block_linear" in graph and "kiln.fp8_linear" not in graph
    if "layers.1.moe.w13" in pack:  # DeepSeek-V3: the routed experts keep the checkpoint's blocks too
        w13, s13, w2, s2 = block_experts(ckpt, 1, pack["layers.1.moe.w13"].shape[0])
        for name, want in (("w13", w13), ("w13_scale", s13), ("w2", w2), ("w2_scale", s2)):
            got = pack[f"layers.1.moe.{name}"]
            assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (
                name
            )
        assert info["fp8_block_experts"] is True
        assert "kiln.fused_moe" in graph
    else:
        assert info["fp8_block_experts"] is False


def test_inspect_shows_the_checkpoint_format(compiled):
    _, root = compiled
    report = json.loads(json.dumps(inspect_report(load_config(root / "fp8"))))  # as `--json` prints it
    assert report["compile_quant"] == "fp8-block"
    assert report["checkpoint_quant"]["weight_block_size"] == [128, 128]
    text = format_report(report)
    assert "fp8 e4m3 weights, 128x128 block scales; kiln compile keeps it as quant fp8-block" in text
    moe = report["moe"] is not None
    assert ("routed experts (fp8-block)" in text) == moe and report.get("compile_experts") == (
        "block FP8" if moe else None
    )


def _pack(src: Path, out: Path, dtype: str, tp: int = 1) -> dict[str, torch.Tensor]:
    cfg = load_config(src)
    specs = all_rank_specs(cfg, ParallelConfig(tp=tp), "fp8-block")
    pack_checkpoint(src, out, specs, tp, dtype=dtype, quant="fp8-block", progress=False)
    return load_pack(out, 0)


@pytest.fixture(scope="module")
def deepseek_fp8(tmp_path_factory, hf_quiet) -> Path:
    root = tmp_path_factory.mktemp("ds-pack")
    deepseek_v3(root / "hf")
    write_block_fp8(root / "hf", root / "fp8")
    return root / "fp8"


def test_correction_bias_stays_float32_in_a_bf16_pack(deepseek_fp8, tmp_path):
    """DeepSeek-V3's ``e_score_correction_bias`` is float32 in Hugging Face's model whatever its
    dtype; a bf16 pack keeps it so (the bias moves near-tied experts), bit for bit."""
    pack = _pack(deepseek_fp8, tmp_path / "pack", "bfloat16")
    ckpt = load_file(next(deepseek_fp8.glob("*00001-*.safetensors")))
    bias = pack["layers.1.moe.router.bias"]
    assert bias.dtype == torch.float32
    assert torch.equal(bias, ckpt["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert pack["layers.1.moe.w13"].dtype == torch.float8_e4m3fn  # the experts: block FP8 in bf16 too


def test_experts_off_the_block_grid_are_up_cast_with_a_note(deepseek_fp8, tmp_path, capsys, monkeypatch):
    """tp 2 splits each expert's 128 intermediate rows into 64: gate and up cannot each start a
    128-row block, so the pack and the model keep the routed experts in the activation dtype (the
    checkpoint's blocks dequantized) and the compile says why on stderr."""
    from kiln.compiler import moe_layer

    pack = _pack(deepseek_fp8, tmp_path / "pack", "float32", tp=2)
    assert pack["layers.1.moe.w13"].dtype == torch.float32 and "layers.1.moe.w13_scale" not in pack
    assert pack["layers.1.attn.o.weight"].dtype == torch.float8_e4m3fn  # the linears stay block FP8
    info = json.loads((tmp_path / "pack" / "pack.json").read_text())["model"]
    assert info["fp8_block_experts"] is False
    monkeypatch.setattr(moe_layer, "_NOTED", set())
    with torch.device("meta"):
        layer = moe_layer.FusedMoE(
            load_config(deepseek_fp8), torch.float32, tp=2, quant="fp8-block", float_router=True
        )
    assert layer.w13.dtype == torch.float32 and layer.w13_scale is None
    err = capsys.readouterr().err
    assert "routed experts up-cast to torch.float32" in err and "128 split over 2 ranks (tp / ep) = 64" in err


@pytest.mark.parametrize(
    "block,quant,error",
    [
        ([64, 64], None, r"'quantization_config\.weight_block_size' is \[64, 64\]; kiln serves block-scaled"),
        ([128, 128], "fp8", r"--quant fp8 on a checkpoint already in FP8 with 128 x 128 block scales"),
        ([128, 64], "fp8-block", r"weight_block_size' is \[128, 64\]"),
    ],
)
def test_combinations_that_make_no_sense_are_one_line_errors(tmp_path, block, quant, error):
    make_checkpoint(tmp_path / "hf", "llama-tied", hidden_size=128, intermediate_size=128)
    write_block_fp8(
        tmp_path / "hf", tmp_path / "fp8", quant_config=QUANT_CONFIG | {"weight_block_size": block}
    )
    with pytest.raises(ConfigError, match=error) as err:
        compile_model(tmp_path / "fp8", tmp_path / "art", CompileOptions(**OPTS, quant=quant), verbose=False)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "art").exists()  # refused before any work


def test_resolve_quant():
    cfg = load_config(Path(__file__).parents[2] / "compiler" / "configs" / "deepseek-v3.json")
    assert resolve_quant(None, cfg) == "fp8-block" and resolve_quant("fp8-block", cfg) == "fp8-block"
    assert resolve_quant("none", cfg) is None
    plain = load_config(Path(__file__).parents[2] / "compiler" / "configs" / "llama-3.1-8b.json")
    assert resolve_quant(None, plain) is None and resolve_quant("fp8", plain) == "fp8"
    assert resolve_quant("fp8-block", plain) == "fp8-block"  # a bf16 checkpoint quantized per block
    with pytest.raises(ConfigError, match="--quant must be one of fp8, fp8-block, none or absent"):
        resolve_quant("int4", plain)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "deepseek-v3"])  # V3: one block-FP8 qkv_a, MLA, MoE
def test_gpu_bf16_artifact_matches_the_simulated_model(compiled_gpu, tmp_path, hf_quiet, arch):
    ARCHS[arch](tmp_path / "hf")
    ref = write_block_fp8(tmp_path / "hf", tmp_path / "fp8")
    opts = CompileOptions(**(OPTS | {"device": "cuda", "dtype": "bfloat16"}))
    compile_model(tmp_path / "fp8", tmp_path / "art", opts, verbose=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        ref, dtype=torch.float32, attn_implementation="eager"
    )
    runner = DirectRunner(str(tmp_path / "art"), device="cuda", num_slots=512)
    prompts = prompts_of(1, (32, 20))
    logits = runner.prefill(prompts)
    sim = simulated(hf.eval(), tmp_path / "fp8")
    # The yardstick: the same simulation in bf16 on the CPU. bf16 between the FP8 GEMMs flips the FP8
    # rounding of some activations, which moves these logits as far as quantizing the activations at
    # all does (4-6% here, measured on the CPU).
    sim_bf16 = simulated(copy.deepcopy(hf).to(torch.bfloat16), tmp_path / "fp8")
    with torch.no_grad():
        for i, p in enumerate(prompts):
            want = sim(torch.tensor([p])).logits[0, -1]
            bf16_move = rel_err(sim_bf16(torch.tensor([p])).logits[0, -1].float(), want)
            err = rel_err(logits[i].float().cpu(), want)
            assert err < 1.5 * bf16_move, (err, bf16_move)
