"""ModelConfig: a Hugging Face ``config.json`` normalized into the facts serving needs.

The config is serving's type system: from it alone we know the attention kind (MHA, GQA, MQA,
MLA), the per-rank shapes, the weight bytes, the KV bytes per token, and whether a requested
parallel layout can work at all. Nothing here touches a GPU or a weight file.

Both spellings of rotary settings are accepted: the classic ``rope_theta`` + ``rope_scaling``
(``type`` or ``rope_type``) and transformers 5's ``rope_parameters``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from kiln.errors import KilnError

AttentionKind = Literal["MHA", "GQA", "MQA", "MLA"]

DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "fp8": 1,
    "float8_e4m3fn": 1,
}


class ConfigError(KilnError, ValueError):
    """A config.json that kiln cannot serve, or a parallel layout that cannot work.

    The message always names the offending field and says how to fix it.
    """


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling. ``type`` is one of default, linear, dynamic, llama3, yarn."""

    type: str = "default"
    factor: float = 1.0
    original_max_position: int | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None  # yarn
    mscale: float | None = None  # yarn (DeepSeek)
    mscale_all_dim: float | None = None  # yarn (DeepSeek)
    attention_factor: float | None = None  # yarn


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts fields, normalized across Qwen3-MoE, Mixtral and DeepSeek."""

    num_experts: int
    top_k: int
    intermediate_size: int
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0  # per shared expert
    norm_topk_prob: bool = True
    scoring_func: Literal["softmax", "sigmoid"] = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    # group-limited routing (num_groups > 1), a group's score: the sum of its two best experts'
    # (DeepSeek-V3 noaux_tc) or its best (DeepSeek-V2 group_limited_greedy); ops/moe/topk.py
    group_score: Literal["top2_sum", "max"] = "top2_sum"
    routed_scaling_factor: float = 1.0
    has_correction_bias: bool = False  # DeepSeek-V3 noaux_tc e_score_correction_bias
    first_dense_layers: int = 0  # first_k_dense_replace
    layer_freq: int = 1  # moe_layer_freq / decoder_sparse_step
    dense_layers: tuple[int, ...] = ()  # mlp_only_layers


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class FP8Checkpoint:
    """A checkpoint whose config.json says its linear weights are FP8 (``quantization_config`` with
    ``quant_method: "fp8"``: DeepSeek-V3, Qwen3-*-FP8, transformers' fine-grained FP8). With
    ``weight_block_size`` each quantized ``W [N, K]`` is float8_e4m3fn with ``weight_scale_inv``
    ``[ceil(N/bn), ceil(K/bk)]`` float32 (or bf16, or UE8M0 ``scale_fmt``) beside it; without, one
    scale per tensor. Modules matching ``modules_to_not_convert`` (transformers' rules:
    :func:`should_convert`) keep the activation dtype, as do embeddings, norms, LM head and routers."""

    weight_block_size: tuple[int, int] | None
    activation_scheme: str = "dynamic"
    modules_to_not_convert: tuple[str, ...] = ()
    scale_fmt: str = "float"

    @property
    def block_128(self) -> bool:
        """128 x 128 blocks: what ``--quant fp8-block`` serves as is."""
        return self.weight_block_size == (128, 128)

    def describe(self) -> str:
        blocks = (
            f"{self.weight_block_size[0]}x{self.weight_block_size[1]} block scales"
            if self.weight_block_size
            else "per-tensor scales"
        )
        return f"fp8 e4m3 weights, {blocks}, {self.activation_scheme} activations"


# `kiln compile --quant`: None is "as the checkpoint is" (resolve_quant); "none" up-casts an FP8 checkpoint
QUANTS = ("fp8", "fp8-block", "none")


def should_convert(module: str, patterns: tuple[str, ...]) -> bool:
    """Whether checkpoint module ``module`` (a weight's name without ``.weight``) is quantized, given
    ``modules_to_not_convert``: not when a pattern matches it from the start up to a module boundary
    (also as a regex: ``model.layers.1`` matches ``model.layers.1.mlp`` but not ``model.layers.11``;
    ``mlp.gate`` does not match ``mlp.gate_proj``) or is a suffix of it, as transformers decides."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return not any(re.match(rf"(?:{p}){boundary}", module) or module.endswith(p) for p in patterns)


def resolve_quant(requested: str | None, cfg: ModelConfig) -> str | None:
    """The weight quantization a compile of ``cfg``'s checkpoint builds: ``requested`` is ``kiln
    compile --quant`` (None: not given).

    * not given: ``"fp8-block"`` for a checkpoint with 128 x 128 FP8 blocks (kept as they are), else
      None (the activation dtype; an FP8 checkpoint of another layout is up-cast);
    * ``"fp8-block"``: 128 x 128 blocks, a block-FP8 checkpoint's as they are, other weights
      quantized per block at pack time;
    * ``"fp8"``: per output channel; refused for a 128 x 128 block checkpoint (a second, coarser
      rounding of weights already in FP8);
    * ``"none"``: None (an FP8 checkpoint up-cast to the activation dtype).

    Block sizes other than 128 x 128 cannot be served as blocks: without ``--quant`` or with
    ``fp8-block`` that is an error naming the field and the choices.
    """
    if requested is not None and requested not in QUANTS:
        raise ConfigError(f"--quant must be one of {', '.join(QUANTS)} or absent, got {requested!r}.")
    q = cfg.fp8_checkpoint
    if requested == "none":
        return None
    if (
        q is not None
        and q.weight_block_size is not None
        and not q.block_128
        and requested in (None, "fp8-block")
    ):
        block = list(q.weight_block_size or ())
        raise ConfigError(
            f"config.json field 'quantization_config.weight_block_size' is {block}; "
            "kiln serves block-scaled FP8 with 128 x 128 blocks only. Compile with --quant fp8 (re-quantized "
            "per channel) or --quant none (up-cast to --dtype)."
        )
    if requested == "fp8" and q is not None and q.block_128:
        raise ConfigError(
            "--quant fp8 on a checkpoint already in FP8 with 128 x 128 block scales (config.json "
            "'quantization_config') would round its weights a second time, per channel; compile without "
            "--quant to serve its blocks as they are (quant fp8-block), or with --quant none to up-cast."
        )
    if requested is None:
        return "fp8-block" if q is not None and q.block_128 else None
    return requested


@dataclass(frozen=True)
class ModelConfig:
    """A normalized model config. Derived values are properties."""

    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    rotary_dim: int
    rope_theta: float
    rope_scaling: RopeScaling
    rope_is_neox: bool
    vocab_size: int
    max_position_embeddings: int
    intermediate_size: int
    rms_norm_eps: float
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    num_nextn_layers: int = 0
    fp8_checkpoint: FP8Checkpoint | None = None  # config.json's quantization_config (quant_method "fp8")

    # ----------------------------------------------------------------- derived facts
    @property
    def attention(self) -> AttentionKind:
        if self.mla is not None:
            return "MLA"
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        if self.num_kv_heads == 1:
            return "MQA"
        return "GQA"

    def is_moe_layer(self, layer: int) -> bool:
        m = self.moe
        if m is None or layer < m.first_dense_layers or layer in m.dense_layers:
            return False
        return (layer + 1) % m.layer_freq == 0 if m.layer_freq > 1 else True

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def attention_params(self) -> int:
        """Parameters of one attention block (norms inside the block included)."""
        h = self.hidden_size
        if self.mla is not None:
            m = self.mla
            if m.q_lora_rank:
                q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * self.num_heads * m.qk_head_dim
            else:
                q = h * self.num_heads * m.qk_head_dim
            kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
            kv += m.kv_lora_rank * self.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
            return q + kv + self.num_heads * m.v_head_dim * h
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        n = h * qkv_out + self.num_heads * self.head_dim * h
        if self.qkv_bias:
            n += qkv_out
        if self.qk_norm:
            n += 2 * self.head_dim
        return n

    def mlp_params(self, layer: int) -> tuple[int, int]:
        """(total, activated per token) parameters of one layer's MLP or MoE block."""
        h = self.hidden_size
        if not self.is_moe_layer(layer):
            n = 3 * h * self.intermediate_size
            return n, n
        m = self.moe
        assert m is not None
        expert = 3 * h * m.intermediate_size
        shared = m.num_shared_experts * 3 * h * m.shared_intermediate_size
        router = m.num_experts * h + (m.num_experts if m.has_correction_bias else 0)
        total = m.num_experts * expert + shared + router
        return total, m.top_k * expert + shared + router

    def _count(self, activated: bool) -> int:
        h = self.hidden_size
        n = self.vocab_size * h  # embedding
        if not self.tie_word_embeddings:
            n += self.vocab_size * h
        n += h  # final norm
        for i in range(self.num_layers):
            n += self.attention_params() + 2 * h + self.mlp_params(i)[1 if activated else 0]
        return n

    @property
    def num_params(self) -> int:
        """Parameters of the model as served (next-token-prediction layers excluded)."""
        return self._count(activated=False)

    @property
    def num_activated_params(self) -> int:
        """Parameters one token touches (MoE: top-k routed experts plus shared parts)."""
        return self._count(activated=True)

    def weight_bytes(self, dtype: str = "bfloat16", tp: int = 1) -> int:
        """Weight bytes per rank. FP8 counts one byte per GEMM weight, norms and embeddings in bf16;
        ``fp8-block`` (``--quant fp8-block``) adds a float32 scale per 128 x 128 block, the routed
        experts included where each rank's slice ``I / tp`` is a multiple of 128 (else they stay in
        bf16: compiler/moe_layer.py ``block_fp8_experts``).

        Embedding, LM head and attention/MLP weights are divided by ``tp``; norms and routers are
        replicated. Padding of uneven splits is ignored (a few rows at most).
        """
        h = self.hidden_size
        block = dtype == "fp8-block"
        b = 1 + 4 / 128**2 if block else DTYPE_BYTES[dtype]
        emb_b = 2 if dtype in ("fp8", "fp8-block") else b  # embeddings stay in the activation dtype
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        norms = h + self.num_layers * 2 * h
        gemm = 0
        experts = 0  # routed experts' weights, when they are not in ``b`` bytes
        replicated = 0
        for i in range(self.num_layers):
            gemm += self.attention_params()
            total, _ = self.mlp_params(i)
            if self.is_moe_layer(i):
                m = self.moe
                assert m is not None
                router = m.num_experts * h
                replicated += router
                upcast = block and -(-m.intermediate_size // tp) % 128 != 0  # experts off the block grid
                routed = m.num_experts * 3 * h * m.intermediate_size if upcast else 0
                experts += routed
                gemm += total - router - routed
            else:
                gemm += total
        return math.ceil(
            embed * emb_b / tp + (gemm * b + experts * emb_b) / tp + (norms + replicated) * emb_b
        )

    def kv_heads_per_rank(self, tp: int = 1) -> int:
        """KV heads stored on one rank; with kv_heads < tp each KV head is replicated."""
        return max(1, self.num_kv_heads // tp)

    def kv_bytes_per_token(self, kv_dtype: str = "bfloat16", tp: int = 1) -> int:
        """KV-cache bytes one token costs on one rank, all layers.

        MHA/GQA/MQA: 2 x kv_heads_per_rank x head_dim x bytes per layer (V may be narrower); FP8
        adds a float32 scale per head row of K and of V (runtime/kv_pool.py).
        MLA: (kv_lora_rank + qk_rope_head_dim) x bytes per layer, the latent is not sharded.
        """
        b = DTYPE_BYTES[kv_dtype]
        if self.mla is not None:
            per_layer = (self.mla.kv_lora_rank + self.mla.qk_rope_head_dim) * b
        else:
            per_layer = self.kv_heads_per_rank(tp) * (self.head_dim + self.v_head_dim) * b
            if b == 1:  # fp8: the two scales
                per_layer += self.kv_heads_per_rank(tp) * 2 * 4
        return int(per_layer * self.num_layers)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["attention"] = self.attention
        return d


# --------------------------------------------------------------------------- parsing
def _get(raw: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if n in raw and raw[n] is not None:
            return raw[n]
    return default


def _require(raw: Mapping[str, Any], name: str, arch: str) -> Any:
    if raw.get(name) is None:
        raise ConfigError(f"config.json field '{name}' is missing; {arch} needs it. Add it to config.json.")
    return raw[name]


def _positive(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config.json field '{name}' must be a positive integer, got {value!r}.")
    return value


def _parse_rope(raw: Mapping[str, Any]) -> tuple[float, RopeScaling]:
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    src: dict[str, Any] = {}
    if isinstance(params, Mapping):
        src.update(params)
    if isinstance(scaling, Mapping):
        src.update(scaling)
    theta = float(_get(src, "rope_theta", default=_get(raw, "rope_theta", default=10000.0)))
    kind = str(_get(src, "rope_type", "type", default="default"))
    if kind not in ("default", "linear", "dynamic", "llama3", "yarn"):
        raise ConfigError(
            f"config.json field 'rope_scaling.rope_type' is {kind!r}; kiln supports default, linear, "
            "dynamic, llama3 and yarn."
        )
    factor = float(_get(src, "factor", default=1.0))
    if kind != "default" and factor <= 0:
        raise ConfigError(f"config.json field 'rope_scaling.factor' must be > 0, got {factor}.")
    orig = _get(src, "original_max_position_embeddings")
    if kind in ("llama3",) and orig is None:
        raise ConfigError(
            "config.json field 'rope_scaling.original_max_position_embeddings' is required by llama3 scaling."
        )
    rs = RopeScaling(
        type=kind,
        factor=factor,
        original_max_position=int(orig) if orig is not None else None,
        low_freq_factor=_get(src, "low_freq_factor"),
        high_freq_factor=_get(src, "high_freq_factor"),
        beta_fast=_get(src, "beta_fast"),
        beta_slow=_get(src, "beta_slow"),
        mscale=_get(src, "mscale"),
        mscale_all_dim=_get(src, "mscale_all_dim"),
        attention_factor=_get(src, "attention_factor"),
    )
    return theta, rs


def _eos(raw: Mapping[str, Any]) -> tuple[int, ...]:
    e = raw.get("eos_token_id")
    if e is None:
        return ()
    return tuple(int(x) for x in (e if isinstance(e, list | tuple) else [e]))


_DEFAULT_TOPK_METHOD = {"DeepseekV2ForCausalLM": "greedy", "DeepseekV3ForCausalLM": "noaux_tc"}


def _parse_moe(raw: Mapping[str, Any], arch: str) -> MoEConfig | None:
    n = _get(raw, "num_experts", "num_local_experts", "n_routed_experts")
    if not n:
        return None
    top_k = _positive("num_experts_per_tok", _require(raw, "num_experts_per_tok", arch))
    inter = _get(raw, "moe_intermediate_size", default=raw.get("intermediate_size"))
    n_shared = int(_get(raw, "n_shared_experts", default=0) or 0)
    shared_inter = int(_get(raw, "moe_intermediate_size", default=0) or 0)
    always_norm = arch.startswith("Mixtral")  # Mixtral renormalizes its top-k without a flag
    # DeepSeek's routing method; transformers' config classes leave it out for V3, whose model
    # always routes noaux_tc (sigmoid, correction bias, groups scored by their two best)
    method = raw.get("topk_method") or _DEFAULT_TOPK_METHOD.get(arch)
    if method not in (None, "greedy", "group_limited_greedy", "noaux_tc"):
        raise ConfigError(
            f"config.json field 'topk_method' is {method!r}; kiln supports greedy, group_limited_greedy "
            "and noaux_tc."
        )
    grouped = method in (None, "group_limited_greedy", "noaux_tc")  # greedy ignores n_group
    moe = MoEConfig(
        num_experts=_positive("num_experts", n),
        top_k=top_k,
        intermediate_size=_positive("moe_intermediate_size", inter),
        num_shared_experts=n_shared,
        shared_intermediate_size=shared_inter,
        norm_topk_prob=always_norm or bool(raw.get("norm_topk_prob", False)),
        scoring_func=_get(raw, "scoring_func", default="sigmoid" if method == "noaux_tc" else "softmax"),
        num_groups=int(_get(raw, "n_group", default=1) or 1) if grouped else 1,
        topk_groups=int(_get(raw, "topk_group", default=1) or 1) if grouped else 1,
        group_score="max" if method == "group_limited_greedy" else "top2_sum",
        routed_scaling_factor=float(_get(raw, "routed_scaling_factor", default=1.0)),
        has_correction_bias=method == "noaux_tc",
        first_dense_layers=int(_get(raw, "first_k_dense_replace", default=0) or 0),
        layer_freq=int(_get(raw, "moe_layer_freq", "decoder_sparse_step", default=1) or 1),
        dense_layers=tuple(raw.get("mlp_only_layers") or ()),
    )
    if moe.top_k > moe.num_experts:
        raise ConfigError(
            f"config.json field 'num_experts_per_tok' ({moe.top_k}) exceeds the number of experts "
            f"({moe.num_experts})."
        )
    if moe.scoring_func not in ("softmax", "sigmoid"):
        raise ConfigError(
            f"config.json field 'scoring_func' is {moe.scoring_func!r}; kiln supports softmax and sigmoid."
        )
    if moe.num_experts % moe.num_groups:
        raise ConfigError(
            f"config.json field 'n_group' ({moe.num_groups}) must divide the number of experts "
            f"({moe.num_experts})."
        )
    return moe


def _parse_mla(raw: Mapping[str, Any], arch: str) -> MLAConfig | None:
    if raw.get("kv_lora_rank") is None:
        return None
    return MLAConfig(
        q_lora_rank=raw.get("q_lora_rank") or None,
        kv_lora_rank=_positive("kv_lora_rank", raw["kv_lora_rank"]),
        qk_nope_head_dim=_positive("qk_nope_head_dim", _require(raw, "qk_nope_head_dim", arch)),
        qk_rope_head_dim=_positive("qk_rope_head_dim", _require(raw, "qk_rope_head_dim", arch)),
        v_head_dim=_positive("v_head_dim", _require(raw, "v_head_dim", arch)),
    )


def _parse_fp8(raw: Mapping[str, Any]) -> FP8Checkpoint | None:
    """``quantization_config`` of an FP8 checkpoint (:class:`FP8Checkpoint`), else None (no
    quantization_config, or another method, which the weights' names then decide)."""
    qc = raw.get("quantization_config")
    if not isinstance(qc, Mapping) or qc.get("quant_method") != "fp8":
        return None
    block = qc.get("weight_block_size")
    if block is not None:
        if (
            not isinstance(block, list | tuple)
            or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
        ):
            raise ConfigError(
                "config.json field 'quantization_config.weight_block_size' must be two positive integers "
                f"[rows, columns], got {block!r}."
            )
        block = (int(block[0]), int(block[1]))
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(
            f"config.json field 'quantization_config.fmt' is {fmt!r}; kiln reads FP8 checkpoints in e4m3."
        )
    skip = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()
    if isinstance(skip, str) or not all(isinstance(p, str) for p in skip):
        raise ConfigError(
            f"config.json field 'quantization_config.modules_to_not_convert' must be a list of module names, "
            f"got {skip!r}."
        )
    return FP8Checkpoint(
        weight_block_size=block,
        activation_scheme=str(qc.get("activation_scheme", "dynamic")),
        modules_to_not_convert=tuple(skip),
        scale_fmt=str(qc.get("scale_fmt", "float")),
    )


def _sliding_window(raw: Mapping[str, Any], arch: str) -> int | None:
    sw = raw.get("sliding_window")
    if sw is None:
        return None
    # Qwen2/Qwen3 carry a sliding_window value but only apply it when use_sliding_window is set.
    if arch.startswith("Qwen") and not raw.get("use_sliding_window", False):
        return None
    return _positive("sliding_window", sw)


def normalize_config(raw: Mapping[str, Any]) -> ModelConfig:
    """Normalize a parsed config.json into a :class:`ModelConfig`.

    Raises :class:`ConfigError` naming the field for anything kiln cannot serve.
    """
    from kiln.compiler.registry import resolve_architecture

    archs = raw.get("architectures")
    if not archs or not isinstance(archs, list):
        raise ConfigError(
            "config.json field 'architectures' is missing or not a list: a non-empty list naming the "
            f'model class, for example ["LlamaForCausalLM"]; got {archs!r}.'
        )
    arch = str(archs[0])
    spec = resolve_architecture(arch)
    if raw.get("text_config"):
        raise ConfigError("config.json has a 'text_config': multimodal checkpoints are not supported.")

    hidden = _positive("hidden_size", _require(raw, "hidden_size", arch))
    layers = _positive("num_hidden_layers", _require(raw, "num_hidden_layers", arch))
    heads = _positive("num_attention_heads", _require(raw, "num_attention_heads", arch))
    kv_heads = _positive("num_key_value_heads", _get(raw, "num_key_value_heads", default=heads))
    if heads % kv_heads:
        raise ConfigError(
            f"config.json field 'num_key_value_heads' ({kv_heads}) must divide 'num_attention_heads' "
            f"({heads})."
        )
    vocab = _positive("vocab_size", _require(raw, "vocab_size", arch))
    mla = _parse_mla(raw, arch) if spec.family == "mla" else None
    if mla is not None:
        head_dim = mla.qk_head_dim
        v_head_dim = mla.v_head_dim
        rotary_dim = mla.qk_rope_head_dim
        kv_heads = heads  # MLA expands the latent to every head
    else:
        explicit = raw.get("head_dim")
        if explicit is None and hidden % heads:
            raise ConfigError(
                f"config.json field 'hidden_size' ({hidden}) is not divisible by 'num_attention_heads' "
                f"({heads}) and no 'head_dim' is given; add 'head_dim'."
            )
        head_dim = _positive("head_dim", explicit) if explicit is not None else hidden // heads
        v_head_dim = head_dim
        partial = float(_get(raw, "partial_rotary_factor", default=1.0))
        if not 0 < partial <= 1:
            raise ConfigError(f"config.json field 'partial_rotary_factor' must be in (0, 1], got {partial}.")
        rotary_dim = int(head_dim * partial)
        if rotary_dim % 2:
            raise ConfigError(
                f"config.json field 'partial_rotary_factor' gives an odd rotary_dim ({rotary_dim})."
            )
    theta, scaling = _parse_rope(raw)
    act = str(_get(raw, "hidden_act", "hidden_activation", default="silu"))
    if act not in ("silu", "swish"):
        raise ConfigError(f"config.json field 'hidden_act' is {act!r}; kiln supports silu.")
    inter = _get(raw, "intermediate_size")
    moe = _parse_moe(raw, arch) if spec.family in ("moe", "mla") else None
    if inter is None and moe is None:
        raise ConfigError(f"config.json field 'intermediate_size' is missing; {arch} needs it.")
    qkv_bias = bool(_get(raw, "attention_bias", "qkv_bias", default=spec.qkv_bias))
    return ModelConfig(
        architecture=arch,
        model_type=str(raw.get("model_type", "")),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        rotary_dim=rotary_dim,
        rope_theta=theta,
        rope_scaling=scaling,
        rope_is_neox=not (mla is not None and raw.get("rope_interleave", True)),
        vocab_size=vocab,
        max_position_embeddings=int(_get(raw, "max_position_embeddings", default=4096)),
        intermediate_size=int(inter or 0),
        rms_norm_eps=float(_get(raw, "rms_norm_eps", default=1e-6)),
        hidden_act="silu",
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=spec.qk_norm,
        sliding_window=_sliding_window(raw, arch),
        torch_dtype=str(_get(raw, "torch_dtype", "dtype", default="bfloat16")),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos(raw),
        moe=moe,
        mla=mla,
        num_nextn_layers=int(raw.get("num_nextn_predict_layers") or 0),
        fp8_checkpoint=_parse_fp8(raw),
    )


def load_config(path: str | Path) -> ModelConfig:
    """Read ``config.json`` from a model directory (or the file itself) and normalize it."""
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if not f.exists():
        raise ConfigError(
            f"no config.json at {f}; pass a Hugging Face checkpoint directory (kiln inspect also takes "
            "a config.json path)."
        )
    try:
        raw = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{f} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{f} must hold a JSON object.")
    return normalize_config(raw)


__all__ = [
    "DTYPE_BYTES",
    "QUANTS",
    "ConfigError",
    "FP8Checkpoint",
    "MLAConfig",
    "MoEConfig",
    "ModelConfig",
    "RopeScaling",
    "load_config",
    "normalize_config",
    "resolve_quant",
    "should_convert",
]
