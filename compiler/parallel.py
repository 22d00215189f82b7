"""Parallel layouts: whether a tensor/expert-parallel split can shard a model (failing fast with
the field and the fix), the per-rank shapes it gives, and KV capacity per rank."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.compiler.config import ConfigError, ModelConfig


@dataclass(frozen=True)
class ParallelConfig:
    """A world of ``tp`` ranks (``--tp``); MoE experts split into ``ep`` groups (``--ep``) of
    ``expert_tp = tp / ep`` ranks each, every rank of a group holding the group's ``E / ep`` experts
    and slice ``rank % expert_tp`` of each one's intermediate dim."""

    tp: int = 1
    ep: int = 1
    moe_tp: int | None = None  # TP inside each expert; defaults to tp // ep

    @property
    def expert_tp(self) -> int:
        return self.moe_tp if self.moe_tp is not None else max(1, self.tp // self.ep)


def validate_parallel(cfg: ModelConfig, par: ParallelConfig) -> None:
    """Fail fast, naming the field and the fix, if ``par`` cannot shard ``cfg``."""
    tp = par.tp
    if tp < 1 or par.ep < 1:
        raise ConfigError(f"--tp and --ep must be >= 1, got tp={tp}, ep={par.ep}.")
    divisors = [d for d in range(1, cfg.num_heads + 1) if cfg.num_heads % d == 0]
    if cfg.num_heads % tp:
        raise ConfigError(
            f"num_attention_heads ({cfg.num_heads}) is not divisible by tp={tp}; "
            f"use a tp that divides it: {divisors}."
        )
    if cfg.mla is None:
        kv = cfg.num_kv_heads
        if kv >= tp and kv % tp:
            raise ConfigError(
                f"num_key_value_heads ({kv}) is not divisible by tp={tp}; with kv_heads >= tp the "
                f"KV heads must split evenly: use tp in {[d for d in divisors if kv % d == 0]}."
            )
        if kv < tp and tp % kv:
            raise ConfigError(
                f"tp={tp} is not a multiple of num_key_value_heads ({kv}); with kv_heads < tp each KV "
                f"head is replicated tp/kv_heads times, so tp must be a multiple of {kv}."
            )
    m = cfg.moe
    if m is None and par.ep > 1:
        raise ConfigError(
            f"--ep {par.ep}: {cfg.architecture} has no experts; expert parallelism is for MoE models, use --ep 1."
        )
    if m is not None:
        if m.num_experts % par.ep:
            raise ConfigError(
                f"num_experts ({m.num_experts}) is not divisible by ep={par.ep}; use an ep that divides it."
            )
        if par.ep > 1 and tp % par.ep:
            raise ConfigError(
                f"tp={tp} must be a multiple of ep={par.ep} (each of the ep expert groups spans tp/ep "
                "ranks); use an ep that divides tp."
            )
        etp = par.expert_tp
        if m.intermediate_size % etp:
            raise ConfigError(
                f"moe_intermediate_size ({m.intermediate_size}) is not divisible by the expert TP size "
                f"({etp} = tp / ep); pick tp and ep so that tp/ep divides it."
            )


def per_rank_shapes(cfg: ModelConfig, tp: int = 1, ep: int = 1) -> dict[str, list[int]]:
    """Shapes of one layer's main weights on one rank (TP/EP-sharded as the packs store them)."""
    h = cfg.hidden_size
    shapes: dict[str, list[int]] = {"embed": [math.ceil(cfg.vocab_size / tp), h]}
    if cfg.mla is not None:
        m = cfg.mla
        hr = cfg.num_heads // tp
        first = m.q_lora_rank or hr * m.qk_head_dim  # q_a's rows or the rank's q heads, then kv_a's
        shapes["attn.qkv_a"] = [first + m.kv_lora_rank + m.qk_rope_head_dim, h]
        if m.q_lora_rank:
            shapes["attn.q_b"] = [hr * m.qk_head_dim, m.q_lora_rank]
        shapes["attn.w_kc"] = [hr, m.qk_nope_head_dim, m.kv_lora_rank]
        shapes["attn.w_vc"] = [hr, m.kv_lora_rank, m.v_head_dim]
        shapes["attn.o"] = [h, hr * m.v_head_dim]
    else:
        hq = cfg.num_heads // tp
        hkv = cfg.kv_heads_per_rank(tp)
        shapes["attn.qkv"] = [(hq + 2 * hkv) * cfg.head_dim, h]
        shapes["attn.o"] = [h, hq * cfg.head_dim]
    if cfg.intermediate_size and (cfg.moe is None or cfg.num_moe_layers < cfg.num_layers):
        i = math.ceil(cfg.intermediate_size / tp)
        shapes["mlp.gate_up"] = [2 * i, h]
        shapes["mlp.down"] = [h, i]
    if cfg.moe is not None:
        i = math.ceil(cfg.moe.intermediate_size / ParallelConfig(tp, ep).expert_tp)
        e = cfg.moe.num_experts // ep
        shapes["moe.router"] = [cfg.moe.num_experts, h]
        shapes["moe.w13"] = [e, 2 * i, h]
        shapes["moe.w2"] = [e, h, i]
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = [math.ceil(cfg.vocab_size / tp), h]
    return shapes


def kv_capacity_tokens(
    cfg: ModelConfig, kv_memory_bytes: int, kv_dtype: str = "bfloat16", tp: int = 1
) -> int:
    """How many tokens of KV fit in ``kv_memory_bytes`` on one rank."""
    return int(kv_memory_bytes // cfg.kv_bytes_per_token(kv_dtype, tp))
