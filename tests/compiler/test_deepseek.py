"""`kiln compile` on tiny random DeepSeek-V2 and DeepSeek-V3 checkpoints reproduces Hugging Face
transformers (compiler/models/deepseek.py, compiler/mla_layer.py).

Four checkpoints cover the variants: q through a LoRA (``q_lora_rank``) or one projection (V2-Lite),
RoPE in interleaved pairs (V2, V3) or NeoX halves (V3 ``rope_interleave: false``), YaRN with
DeepSeek's mscale (the softmax scale), dense first layers (``first_k_dense_replace``), shared
experts, and the three routings: V3 ``noaux_tc`` (sigmoid, correction bias, groups scored by their
two best), V2 ``group_limited_greedy`` (softmax, groups scored by their best), V2-Lite ``greedy``.
Float32 on CPU, pages of 16 slots (the default):

* logits of a prefill of two prompts (32 and 20 tokens) and 4 greedy decode steps: max relative
  error (max |kiln - hf| / max |hf|) <= 1e-4 at every step;
* 32 greedy tokens of four prompts through ``kiln.LLM``, identical to HF ``generate``;
* on one artifact with pages of 1 slot: the radix cache serving a shared prefix, and prefill in
  chunks of 7 tokens, both identical to HF;
* the V3 artifact with the Triton kernels (interpreter) for a prefill and a decode step.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from tiny_models import check_against_hf, hf_greedy, randomize

from kiln import LLM, SamplingParams
from kiln.compiler.build import CompileOptions, compile_model
from kiln.compiler.config import ConfigError
from kiln.runtime.direct import DirectRunner
from kiln.weights import load_pack

OPTS = dict(device="cpu", dtype="float32", max_batch_size=4, max_seq_len=128, chunk_size=64)
NEW = 32
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)

TINY = dict(
    hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, vocab_size=300, max_position_embeddings=512, rms_norm_eps=1e-6, first_k_dense_replace=1,
)  # fmt: skip


def yarn(mscale: float, mscale_all_dim: float) -> dict:
    """DeepSeek's YaRN (its mscale_all_dim changes the softmax scale), as transformers 5 spells it."""
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "original_max_position_embeddings": 128, "mscale": mscale,
            "mscale_all_dim": mscale_all_dim}  # fmt: skip


V3, V2 = transformers.DeepseekV3Config, transformers.DeepseekV2Config
CONFIGS = {  # name: (config class, its fields beside TINY)
    # V3: q LoRA, interleaved RoPE, YaRN, noaux_tc over 4 groups (top 2), one shared expert
    "v3": (V3, dict(q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                    n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                    rope_parameters=yarn(1.0, 1.0))),
    # V3 with rope_interleave false (NeoX halves), no q LoRA, two dense layers, no groups, no renorm
    "v3-neox": (V3, dict(first_k_dense_replace=2, q_lora_rank=None, rope_interleave=False, n_routed_experts=8,
                         num_experts_per_tok=3, n_group=1, topk_group=1, n_shared_experts=2,
                         routed_scaling_factor=1.5, norm_topk_prob=False)),
    # V2-Lite: no q LoRA, greedy softmax top-2, two shared experts, YaRN with mscale 0.707
    "v2-lite": (V2, dict(q_lora_rank=None, topk_method="greedy", n_routed_experts=8, num_experts_per_tok=2,
                         n_shared_experts=2, routed_scaling_factor=1.0, rope_parameters=yarn(0.707, 0.707))),
    # V2: q LoRA, group_limited_greedy over 8 groups of 2 (top 3 groups), routed scaling 4
    "v2-group": (V2, dict(q_lora_rank=24, topk_method="group_limited_greedy", n_routed_experts=16,
                          num_experts_per_tok=3, n_group=8, topk_group=3, n_shared_experts=1,
                          routed_scaling_factor=4.0)),
}  # fmt: skip


def make_deepseek_checkpoint(path, name: str, seed: int = 0):
    """A tiny random checkpoint (tests/tiny_models.py's weights; V3's correction bias random too)."""
    cls, fields = CONFIGS[name]
    cfg = cls(**(TINY | fields))
    cfg.eos_token_id = None
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager", dtype=torch.float32
    )
    randomize(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(0.05 * torch.randn(bias.shape, generator=g))
    model.save_pretrained(path, max_shard_size="200KB")
    return model.eval()


@pytest.fixture(scope="module")
def hf_quiet():
    old = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # YaRN's notes on its factor
    yield
    transformers.logging.set_verbosity(old)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def compiled(request, tmp_path_factory, hf_quiet):
    root = tmp_path_factory.mktemp(request.param)
    hf = make_deepseek_checkpoint(root / "hf", request.param)
    compile_model(root / "hf", root / "art", CompileOptions(**OPTS), verbose=False)
    return hf, root


def prompts_of(seed: int, sizes) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in sizes]


def test_prefill_and_decode_match_hf(compiled):
    hf, root = compiled
    runner = DirectRunner(str(root / "art"), device="cpu", num_slots=512)
    check_against_hf(runner, hf, prompts_of(1, (32, 20)), decode_steps=4)


def test_greedy_tokens_match_hf_through_llm(compiled):
    hf, root = compiled
    prompts = prompts_of(7, (5, 23, 40, 12))
    llm = LLM(str(root / "art"), device="cpu")
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(hf, prompts, NEW)
    llm.engine.check_integrity()


def test_artifact_caches_the_latent_and_packs_deepseek_layers(compiled):
    """The KV spec is the latent (one head of kv_lora_rank + qk_rope_head_dim, no V); the pack
    holds the absorbed kv_b_proj halves, dense first layers, routed and shared experts; the graph
    writes the latent with the fused op and attends in latent space."""
    hf, root = compiled
    c = hf.config
    manifest = json.loads((root / "art" / "manifest.json").read_text())
    width = c.kv_lora_rank + c.qk_rope_head_dim
    assert {k: manifest["kv"][k] for k in ("num_kv_heads", "head_dim", "v_head_dim")} == {
        "num_kv_heads": 1,
        "head_dim": width,
        "v_head_dim": 0,
    }
    assert manifest["kv"]["bytes_per_token"] == c.num_hidden_layers * width * 4
    pack = load_pack(root / "art" / "weights", 0, "cpu")
    heads = c.num_attention_heads
    assert pack["layers.0.attn.w_kc"].shape == (heads, c.qk_nope_head_dim, c.kv_lora_rank)
    assert pack["layers.0.attn.w_vc"].shape == (heads, c.kv_lora_rank, c.v_head_dim)
    first = c.q_lora_rank or heads * c.qk_head_dim  # q_a's rows (or q's), then kv_a's
    assert pack["layers.0.attn.qkv_a.weight"].shape == (first + width, c.hidden_size)
    assert ("layers.0.attn.q_b.weight" in pack) == (c.q_lora_rank is not None)
    dense = c.first_k_dense_replace
    assert f"layers.{dense - 1}.mlp.gate_up.weight" in pack and f"layers.{dense - 1}.moe.w13" not in pack
    shared = c.n_shared_experts * c.moe_intermediate_size
    assert pack[f"layers.{dense}.moe.shared.gate_up.weight"].shape == (2 * shared, c.hidden_size)
    assert (f"layers.{dense}.moe.router.bias" in pack) == isinstance(c, transformers.DeepseekV3Config)
    src = (root / "art" / "graphs" / "model.py").read_text()
    layers, moe = c.num_hidden_layers, c.num_hidden_layers - dense
    assert src.count("torch.ops.kiln.mla_rope_kvwrite.default(") == layers
    assert src.count("torch.ops.kiln.mla_attention.default(") == layers
    assert src.count("torch.ops.kiln.moe_topk.default(") == moe and "qkv_rope_kvwrite" not in src
    # the float32 router gate on its op (the GEMV with float32 output at decode sizes), no casts
    assert src.count("torch.ops.kiln.router_linear.default(") == moe


@pytest.mark.slow
def test_triton_kernels_in_the_graph_match_hf(tmp_path, hf_quiet, monkeypatch):
    """The V3 artifact with every op on its Triton kernel (the interpreter, about 5 s): a prefill,
    then a decode step (the fused latent writer, the split-KV MLA decode, routing and experts)."""
    from kiln.ops.common.launch import interpreting

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
    hf = make_deepseek_checkpoint(tmp_path / "hf", "v3", seed=5)
    compile_model(tmp_path / "hf", tmp_path / "art", CompileOptions(**OPTS), verbose=False)
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "1")
    runner = DirectRunner(str(tmp_path / "art"), device="cpu", num_slots=128)
    check_against_hf(runner, hf, [[7, 3, 11, 5, 2, 9], [4, 8, 15]], decode_steps=1)


def test_latent_maps_on_their_kernel_match_hf(tmp_path, hf_quiet, monkeypatch):
    """``--gemv-plan ...,latent:16``: the graphs trace MLA's per-head latent maps as
    ``kiln::mla_head_matmul`` (ops/attention/mla_heads.py) instead of batched matmuls, and with the
    Triton kernels (the interpreter) the V2-Lite artifact (q from one projection: the kernel reads
    its nope slice in place) still gives HF's logits for a prefill of 9 tokens and a decode step;
    a chunk longer than the plan's 16 tokens takes the batched matmul in the same op."""
    from kiln.ops.common.launch import interpreting

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
    hf = make_deepseek_checkpoint(tmp_path / "hf", "v2-lite", seed=5)
    opts = CompileOptions(**OPTS, gemv_plan="attn:1,mlp:1,router:1,latent:16")
    compile_model(tmp_path / "hf", tmp_path / "art", opts, verbose=False)
    src = (tmp_path / "art" / "graphs" / "model.py").read_text()
    assert src.count("torch.ops.kiln.mla_head_matmul.default(") == 2 * hf.config.num_hidden_layers
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert manifest["kernel_choices"]["gemv_plan"]["latent"] == 16
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "1")
    runner = DirectRunner(str(tmp_path / "art"), device="cpu", num_slots=128)
    check_against_hf(runner, hf, [[7, 3, 11, 5, 2, 9], [4, 8, 15]], decode_steps=1)
    runner = DirectRunner(str(tmp_path / "art"), device="cpu", num_slots=128)
    check_against_hf(runner, hf, [list(range(3, 23))], decode_steps=0)  # 20 tokens: the bmm


def _graph_targets(art, graph: str) -> list[str]:
    ep = torch.export.load(art / "graphs" / f"{graph}.pt2")
    return [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("name", ["v2-lite", "v3"])
def test_folded_norms_run_batch_one_in_the_residual_stream(tmp_path, hf_quiet, name):
    """The norms fold (compiler/norm_folds.py) and batch 1's decode graph runs no norm kernel but
    the final one: the input norm inside ``qkv_a`` (V3: its ``q_a_norm`` inside ``q_b`` too), the
    post-attention norm inside the dense gate_up or the shared experts' gate_up; its logits and 32
    greedy tokens are HF's."""
    hf = make_deepseek_checkpoint(tmp_path / "hf", name, seed=2)
    manifest = compile_model(tmp_path / "hf", tmp_path / "art", CompileOptions(**OPTS), verbose=False)
    c, folds = hf.config, manifest.norm_folds
    layers, dense = c.num_hidden_layers, c.first_k_dense_replace
    for i in range(layers):
        attn = f"layers.{i}.attn"
        assert folds[f"layers.{i}.input_norm.weight"] == (f"{attn}.qkv_a.weight",)
        assert folds.get(f"{attn}.q_a_norm.weight") == ((f"{attn}.q_b.weight",) if c.q_lora_rank else None)
    moe = f"layers.{dense}.moe"
    expect = (f"{moe}.router.weight", f"{moe}.w13", f"{moe}.shared.gate_up.weight")
    assert folds[f"layers.{dense}.post_attn_norm.weight"] == expect
    assert manifest.graphs["decode_b1"].layout == "residual_stream"
    targets = _graph_targets(tmp_path / "art", "decode_b1")
    assert "kiln.fused_add_rmsnorm.default" not in targets and targets.count("kiln.rmsnorm.default") == 1
    assert targets.count("kiln.rmsnorm_linear.default") == (3 if c.q_lora_rank else 2) * layers
    runner = DirectRunner(str(tmp_path / "art"), device="cpu", num_slots=256)
    check_against_hf(runner, hf, prompts_of(3, (17,)), decode_steps=3)  # decode_b1
    prompt = prompts_of(4, (9,))
    out = LLM(str(tmp_path / "art"), device="cpu").generate(prompt, GREEDY)
    assert out[0].token_ids == hf_greedy(hf, prompt, NEW)[0]


def test_manifest_records_the_mla_split_plan(tmp_path, hf_quiet):
    """The manifest's decode split factors for an MLA model are the MLA op's (one latent KV head,
    read by every head block), not GQA's per-KV-head rule: at batch 64 over 8k tokens those differ."""
    from kiln.compiler.build import _decode_splits
    from kiln.compiler.config import load_config
    from kiln.ops.attention.decode import choose_num_splits
    from kiln.ops.attention.mla import mla_num_splits

    make_deepseek_checkpoint(tmp_path / "hf", "v2-lite")
    cfg = load_config(tmp_path / "hf")
    for tp in (1, 2):
        want = mla_num_splits(64, 8192, cfg.num_heads // tp)
        assert _decode_splits(cfg, 64, 8192, tp) == want
    assert want != choose_num_splits(64, 8192, cfg.kv_heads_per_rank(2))


def test_norm_folds_refuse_a_layer_with_any_fp8_linear(tmp_path, hf_quiet):
    """A block-FP8 checkpoint may leave some linears unquantized (``modules_to_not_convert``): a
    layer folds only when none of its linears is FP8 (the folds write into ``q_b``, the shared
    experts' gate_up, ...; ``o`` and the down projections take the residual adds)."""
    from kiln.compiler.config import load_config
    from kiln.compiler.norm_folds import norm_folds
    from kiln.compiler.registry import model_class

    make_deepseek_checkpoint(tmp_path / "hf", "v3")
    cfg = load_config(tmp_path / "hf")
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg, torch.float32)
        assert norm_folds(model)[0]
        model.layers[1].attn.q_b.quant = "fp8-block"  # qkv_a left unquantized, q_b not
        folds, why = norm_folds(model)
        assert not folds and "layer 1" in why and "FP8" in why


@pytest.mark.slow
def test_folded_norms_on_the_gemv_in_the_interpreter_match_hf(tmp_path, hf_quiet, monkeypatch):
    """V3 (q LoRA, sigmoid routing, a shared expert) with every GEMV role on: batch 1's decode step
    runs the GEMV with the norm inside (the interpreter; ``qkv_a`` one launch for q_a and kv_a),
    the o and shared down GEMVs and the routed
    experts' last kernel adding the stream, and still gives HF's logits."""
    from kiln.ops.common.launch import interpreting
    from kiln.ops.linear import gemv as G
    from kiln.ops.linear import norm_linear as NL

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
    hf = make_deepseek_checkpoint(tmp_path / "hf", "v3", seed=6)
    opts = CompileOptions(**OPTS, gemv_plan="1")
    compile_model(tmp_path / "hf", tmp_path / "art", opts, verbose=False)
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "1")
    calls: list[str] = []
    real = G.gemv

    def spy(*a, **kw):
        calls.append("norm" if kw.get("norm") else "res" if kw.get("residual") is not None else "plain")
        return real(*a, **kw)

    monkeypatch.setattr(G, "gemv", spy)
    monkeypatch.setattr(NL, "gemv", spy)
    runner = DirectRunner(str(tmp_path / "art"), device="cpu", num_slots=128)
    check_against_hf(runner, hf, [[7, 3, 11, 5, 2, 9]], decode_steps=1)
    layers = hf.config.num_hidden_layers
    decode = calls[calls.index("norm") :]  # the prefill (the shared graph) runs no norm inside a GEMV
    assert decode.count("norm") == 3 * layers  # qkv_a, q_b, gate_up (dense or shared)
    assert decode.count("res") == 2 * layers  # o, and the dense down or the shared down
    assert len(decode) == 5 * layers  # nothing else: kv_a is inside qkv_a


@pytest.fixture(scope="module")
def page1(tmp_path_factory, hf_quiet):
    """The V2 group_limited_greedy checkpoint compiled with pages of one slot."""
    root = tmp_path_factory.mktemp("v2-group-page1")
    hf = make_deepseek_checkpoint(root / "hf", "v2-group", seed=3)
    compile_model(root / "hf", root / "art", CompileOptions(**OPTS, page_size=1), verbose=False)
    return hf, root / "art"


def test_radix_cache_serves_a_shared_prefix(page1):
    hf, art = page1
    prefix = prompts_of(11, (24,))[0]
    prompts = [prefix + p for p in prompts_of(12, (3, 9, 5))]
    expect = hf_greedy(hf, prompts, 8)
    llm = LLM(str(art), device="cpu", radix_cache=True)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts[:1], params)
    rest = llm.generate(prompts[1:], params)
    assert [o.token_ids for o in first + rest] == expect
    assert all(o.num_cached_tokens >= 24 for o in rest)  # the prefix's latent rows, reused
    llm.engine.check_integrity()


def test_chunked_prefill_matches_hf(page1):
    hf, art = page1
    prompts = prompts_of(13, (40, 17, 3))
    llm = LLM(str(art), device="cpu", radix_cache=False, chunk_size=7)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy(hf, prompts, NEW)
    llm.engine.check_integrity()


def test_fp8_kv_cache_is_refused_for_mla(tmp_path, hf_quiet):
    make_deepseek_checkpoint(tmp_path / "hf", "v2-lite")
    with pytest.raises(ConfigError, match=r"^--kv-dtype fp8 is not supported for MLA models"):
        compile_model(
            tmp_path / "hf", tmp_path / "art", CompileOptions(**OPTS, kv_dtype="fp8"), verbose=False
        )
    assert not (tmp_path / "art").exists()  # refused before any work
