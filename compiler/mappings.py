"""Per-architecture weight declarations: which checkpoint regions make each packed tensor of a rank.

``param_specs(cfg, par, rank, quant)`` lists every tensor of rank ``rank``'s pack (names and
shapes of docs/internals.md) with its sources and its placement, frozen at construction:

* column-parallel (output rows split), row-parallel (input columns split), vocab-parallel
  (vocab rows split, padded with zero rows up to ``ceil(V / tp)`` per rank);
* fused QKV by heads: q heads, then k, then v; with ``kv_heads < tp`` rank ``r`` holds KV head
  ``r // (tp / kv_heads)`` (each KV head replicated ``tp / kv_heads`` times);
* gate_up: gate rows, then up rows; uneven intermediate splits are zero-padded (the zero rows of
  gate/up meet zero columns of down, so they contribute nothing);
* MoE: rank ``r`` owns experts ``[ep_r * E/ep, (ep_r + 1) * E/ep)`` with ``ep_r = r // etp``, and
  slice ``r % etp`` of each expert's intermediate dim (``etp = tp / ep``); per-expert checkpoint
  tensors (``experts.{e}.gate_proj``, Mixtral's ``w1/w3/w2``) and transformers-5 pre-stacked ones
  (``experts.gate_up_proj [E, 2I, H]``, gate rows first; ``experts.down_proj [E, H, I]``) are both
  accepted. Shared experts are either their own column/row-parallel MLP (``moe.shared.*``) or, with
  ``fuse_shared_experts``, extra experts appended to every rank's local experts (shared expert
  ``s`` is slice ``s`` of the shared MLP's intermediate dim);
* MLA: ``kv_b_proj [H*(nope+v), kv_lora]`` -> ``w_kc[h] = rows of head h's nope part`` and
  ``w_vc[h] = (rows of head h's v part)^T``; ``qkv_a = [q_a_proj | kv_a_proj_with_mqa]`` (without a
  q LoRA ``[the rank's q_proj heads | kv_a_proj_with_mqa]``: the latent's rows on every rank); the
  rest of MLA as column/row/replicated linears.
  With FP8, ``w_kc``/``w_vc`` stay in the activation dtype (batched matmuls, not linears).
* ``quant="fp8-block"`` (128 x 128 block FP8, compiler/config.py ``resolve_quant``): every 2-D GEMM
  weight but those whose every source module the checkpoint's ``modules_to_not_convert`` names
  (those stay in the activation dtype, as the checkpoint has them), and the routed experts'
  ``w13 [E, 2I, H]`` / ``w2 [E, H, I]`` with ``[E, ceil(N/128), ceil(K/128)]`` scales where each
  rank's ``I / etp`` is a multiple of 128 (compiler/moe_layer.py ``block_fp8_experts``; otherwise
  they stay in the activation dtype). DeepSeek-V3's ``router.bias`` (``e_score_correction_bias``)
  is float32.

Next-token-prediction layers (DeepSeek-V3 ``num_nextn_predict_layers``) are packed only with
``nextn=True``, as ``layers.{L + j}.*`` plus ``enorm``, ``hnorm``, ``eh_proj`` and
``shared_head.norm``; their copies of the embedding and LM head are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.compiler.config import ConfigError, ModelConfig, should_convert
from kiln.compiler.moe_layer import block_fp8_experts
from kiln.compiler.parallel import ParallelConfig, validate_parallel
from kiln.weights.spec import ParamSpec, Piece, Region, even_split


@dataclass
class _Rank:
    cfg: ModelConfig
    par: ParallelConfig
    rank: int
    quant: str | None
    specs: list[ParamSpec] = field(default_factory=list)

    @property
    def tp(self) -> int:
        return self.par.tp

    def add(
        self,
        name: str,
        shape: tuple[int, ...],
        pieces: list[Piece],
        placement: str,
        gemm: bool = False,
        dtype: str = "act",
    ) -> None:
        q = self.quant if gemm else None
        if q == "fp8-block" and (
            len(shape) != (3 if placement == "experts" else 2) or not self.converted(pieces)
        ):
            q = None
        self.specs.append(ParamSpec(name, tuple(shape), tuple(pieces), placement, dtype, q))  # type: ignore[arg-type]

    def converted(self, pieces: list[Piece]) -> bool:
        """Whether the checkpoint quantizes the modules of ``pieces`` (block FP8): not when its
        ``modules_to_not_convert`` names every one (then the pack keeps them unquantized)."""
        skip = self.cfg.fp8_checkpoint.modules_to_not_convert if self.cfg.fp8_checkpoint is not None else ()
        modules = [r.name.removesuffix(".weight") for p in pieces for r in p.sources]
        return not skip or not modules or any(should_convert(m, skip) for m in modules)

    def replicated(
        self, name: str, src: str | list[str], shape: tuple[int, ...], gemm: bool = False, dtype: str = "act"
    ) -> None:
        alts = [src] if isinstance(src, str) else src
        self.add(
            name, shape, [Piece(tuple(Region(s, tuple(shape)) for s in alts))], "replicated", gemm, dtype
        )

    def column(
        self, name: str, src: str, shape: tuple[int, ...], gemm: bool = True, vocab: bool = False
    ) -> None:
        """Split dim 0 (output rows) of ``src`` [N, ...] over tp ranks, zero-padded."""
        start, n, per = even_split(shape[0], self.tp, self.rank)
        pieces = [Piece((Region(src, shape, dim=0, start=start, length=n),))] if n else []
        self.add(name, (per, *shape[1:]), pieces, "vocab" if vocab else "column", gemm)

    def row(self, name: str, src: str, shape: tuple[int, int], unit: int = 1) -> None:
        """Split dim 1 (input columns) of ``src`` [N, K] over tp ranks in units of ``unit`` columns."""
        start, n, per = even_split(shape[1] // unit, self.tp, self.rank)
        pieces = (
            [Piece((Region(src, shape, dim=1, start=start * unit, length=n * unit),), dst_dim=1)] if n else []
        )
        self.add(name, (shape[0], per * unit), pieces, "row", gemm=True)

    def gate_up(self, name: str, gate: str, up: str, inter: int) -> None:
        h = self.cfg.hidden_size
        start, n, per = even_split(inter, self.tp, self.rank)
        pieces = []
        if n:
            for k, src in enumerate((gate, up)):
                pieces.append(Piece((Region(src, (inter, h), start=start, length=n),), dst_start=k * per))
        self.add(name, (2 * per, h), pieces, "column", gemm=True)


def _attention(b: _Rank, i: int, p: str) -> None:
    cfg, tp, r = b.cfg, b.tp, b.rank
    h, d = cfg.hidden_size, cfg.head_dim
    hq, hkv = cfg.num_heads, cfg.num_kv_heads
    hl, kvl = hq // tp, cfg.kv_heads_per_rank(tp)
    kv0 = r * kvl if hkv >= tp else r // (tp // hkv)  # first KV head of this rank
    a = f"layers.{i}.attn."
    for suffix, shapes in (("weight", lambda n: (n, h)), ("bias", lambda n: (n,))):
        if suffix == "bias" and not cfg.qkv_bias:
            continue
        pieces = [
            Piece(
                (Region(f"{p}self_attn.q_proj.{suffix}", shapes(hq * d), start=r * hl * d, length=hl * d),)
            ),
            Piece(
                (Region(f"{p}self_attn.k_proj.{suffix}", shapes(hkv * d), start=kv0 * d, length=kvl * d),),
                dst_start=hl * d,
            ),
            Piece(
                (Region(f"{p}self_attn.v_proj.{suffix}", shapes(hkv * d), start=kv0 * d, length=kvl * d),),
                dst_start=(hl + kvl) * d,
            ),
        ]
        how = "qkv-heads" + ("-kv-replicated" if hkv < tp else "")
        b.add(a + f"qkv.{suffix}", shapes((hl + 2 * kvl) * d), pieces, how, gemm=suffix == "weight")
    if cfg.qk_norm:
        b.replicated(a + "q_norm.weight", f"{p}self_attn.q_norm.weight", (d,))
        b.replicated(a + "k_norm.weight", f"{p}self_attn.k_norm.weight", (d,))
    b.row(a + "o.weight", f"{p}self_attn.o_proj.weight", (h, hq * d), unit=d)


def _mla(b: _Rank, i: int, p: str) -> None:
    cfg, tp, r = b.cfg, b.tp, b.rank
    m = cfg.mla
    assert m is not None
    h, hq = cfg.hidden_size, cfg.num_heads
    hl = hq // tp
    a, s = f"layers.{i}.attn.", f"{p}self_attn."
    # qkv_a: the projections of the layer's input, q_a_proj (or this rank's q_proj heads) then
    # kv_a_proj_with_mqa, one [first + r + dr, hidden] GEMM (compiler/mla_layer.py)
    if m.q_lora_rank:
        first, placement = m.q_lora_rank, "replicated"
        q = Piece((Region(s + "q_a_proj.weight", (first, h)),))
        b.replicated(a + "q_a_norm.weight", s + "q_a_layernorm.weight", (m.q_lora_rank,))
        b.column(a + "q_b.weight", s + "q_b_proj.weight", (hq * m.qk_head_dim, m.q_lora_rank))
    else:
        first, placement = hl * m.qk_head_dim, "mla-q-heads"  # the latent's rows on every rank
        q = Piece((Region(s + "q_proj.weight", (hq * m.qk_head_dim, h), start=r * first, length=first),))
    kv_rows = m.kv_lora_rank + m.qk_rope_head_dim
    kv_a = Piece((Region(s + "kv_a_proj_with_mqa.weight", (kv_rows, h)),), dst_start=first)
    b.add(a + "qkv_a.weight", (first + kv_rows, h), [q, kv_a], placement, gemm=True)
    b.replicated(a + "kv_a_norm.weight", s + "kv_a_layernorm.weight", (m.kv_lora_rank,))
    per = m.qk_nope_head_dim + m.v_head_dim
    kv_b = (s + "kv_b_proj.weight", (hq * per, m.kv_lora_rank))
    kc, vc = [], []
    for j in range(hl):
        g = r * hl + j  # global head
        kc.append(Piece((Region(*kv_b, dim=0, start=g * per, length=m.qk_nope_head_dim),), dst_index=(j,)))
        vc.append(
            Piece(
                (Region(*kv_b, dim=0, start=g * per + m.qk_nope_head_dim, length=m.v_head_dim),),
                dst_index=(j,),
                transpose=True,
            )
        )
    b.add(a + "w_kc", (hl, m.qk_nope_head_dim, m.kv_lora_rank), kc, "mla-heads")
    b.add(a + "w_vc", (hl, m.kv_lora_rank, m.v_head_dim), vc, "mla-heads")
    b.row(a + "o.weight", s + "o_proj.weight", (h, hq * m.v_head_dim), unit=m.v_head_dim)


def _expert_regions(cfg: ModelConfig, p: str, e: int, part: str, inter: int) -> list[tuple[Region, int]]:
    """Alternative spellings of expert ``e``'s ``part`` (gate/up/down) with the offset of its slice
    inside the region's split dim (non-zero for ``up`` inside pre-stacked gate_up)."""
    h, ne = cfg.hidden_size, cfg.moe.num_experts  # type: ignore[union-attr]
    shape = (h, inter) if part == "down" else (inter, h)
    out = [(Region(f"{p}mlp.experts.{e}.{part}_proj.weight", shape), 0)]
    if cfg.architecture.startswith("Mixtral"):
        w = {"gate": "w1", "up": "w3", "down": "w2"}[part]
        out.insert(0, (Region(f"{p}block_sparse_moe.experts.{e}.{w}.weight", shape), 0))
    if part == "down":
        out.append((Region(f"{p}mlp.experts.down_proj", (ne, h, inter), index=(e,)), 0))
    else:
        out.append(
            (
                Region(f"{p}mlp.experts.gate_up_proj", (ne, 2 * inter, h), index=(e,)),
                inter if part == "up" else 0,
            )
        )
    return out


def _moe(b: _Rank, i: int, p: str, fuse_shared: bool) -> None:
    cfg, par, r = b.cfg, b.par, b.rank
    m = cfg.moe
    assert m is not None
    h, im, ne = cfg.hidden_size, m.intermediate_size, m.num_experts
    etp = par.expert_tp
    e_loc, ep_r, etp_r = ne // par.ep, r // etp, r % etp
    mo = f"layers.{i}.moe."
    mix = cfg.architecture.startswith("Mixtral")
    routers = [f"{p}block_sparse_moe.gate.weight", f"{p}mlp.gate.weight"] if mix else [f"{p}mlp.gate.weight"]
    b.replicated(mo + "router.weight", routers, (ne, h))
    if m.has_correction_bias:
        # float32, as Hugging Face keeps it (compiler/moe_layer.py Router)
        b.replicated(mo + "router.bias", f"{p}mlp.gate.e_score_correction_bias", (ne,), dtype="float32")
    start, n, per = even_split(im, etp, etp_r)
    w13: list[Piece] = []
    w2: list[Piece] = []

    def expert(slot: int, alts: dict[str, list[tuple[Region, int]]]) -> None:
        for k, part in enumerate(("gate", "up")):
            regs = tuple(
                Region(rg.name, rg.shape, rg.index, dim=0, start=off + start + rg.start, length=n)
                for rg, off in alts[part]
            )
            w13.append(Piece(regs, dst_index=(slot,), dst_start=k * per))
        regs = tuple(
            Region(rg.name, rg.shape, rg.index, dim=1, start=off + start + rg.start, length=n)
            for rg, off in alts["down"]
        )
        w2.append(Piece(regs, dst_index=(slot,), dst_dim=1))

    n_shared = m.num_shared_experts
    is_ = n_shared * m.shared_intermediate_size
    if fuse_shared and n_shared and m.shared_intermediate_size != im:
        raise ConfigError(
            f"shared experts of intermediate size {m.shared_intermediate_size} cannot be fused as extra experts "
            f"of size {im}; pack without --fuse-shared-experts."
        )
    for j in range(e_loc if n else 0):  # n == 0: an expert-TP rank past an uneven split, all padding
        e = ep_r * e_loc + j
        expert(j, {part: _expert_regions(cfg, p, e, part, im) for part in ("gate", "up", "down")})
    sh = f"{p}mlp.shared_experts."
    for s in range(n_shared if fuse_shared and n else 0):
        base = s * m.shared_intermediate_size  # shared expert s = slice s of the shared MLP
        expert(
            e_loc + s,
            {
                "gate": [(Region(sh + "gate_proj.weight", (is_, h), start=base), 0)],
                "up": [(Region(sh + "up_proj.weight", (is_, h), start=base), 0)],
                "down": [(Region(sh + "down_proj.weight", (h, is_), start=base), 0)],
            },
        )
    slots = e_loc + (n_shared if fuse_shared else 0)
    # block FP8 only where gate and up each start a 128-row block (else up-cast, as the model does)
    quantized = b.quant != "fp8-block" or block_fp8_experts(cfg, etp) is None
    b.add(mo + "w13", (slots, 2 * per, h), w13, "experts", gemm=quantized)
    b.add(mo + "w2", (slots, h, per), w2, "experts", gemm=quantized)
    if n_shared and not fuse_shared:
        b.gate_up(mo + "shared.gate_up.weight", sh + "gate_proj.weight", sh + "up_proj.weight", is_)
        b.row(mo + "shared.down.weight", sh + "down_proj.weight", (h, is_))


def _nextn_extras(b: _Rank, i: int, p: str) -> None:
    h = b.cfg.hidden_size
    for n in ("enorm", "hnorm", "shared_head.norm"):
        b.replicated(f"layers.{i}.{n}.weight", f"{p}{n}.weight", (h,))
    b.replicated(f"layers.{i}.eh_proj.weight", f"{p}eh_proj.weight", (h, 2 * h), gemm=True)


def param_specs(
    cfg: ModelConfig,
    par: ParallelConfig,
    rank: int,
    quant: str | None = None,
    *,
    fuse_shared_experts: bool = False,
    nextn: bool = False,
) -> list[ParamSpec]:
    """Every packed tensor of rank ``rank`` (see the module docstring). ``quant``: None, "fp8" or
    "fp8-block" (the compile's, compiler/config.py ``resolve_quant``)."""
    validate_parallel(cfg, par)
    if not 0 <= rank < par.tp:
        raise ConfigError(f"rank {rank} is outside 0..{par.tp - 1} (tp={par.tp}).")
    if quant not in (None, "fp8", "fp8-block"):
        raise ConfigError(f"--quant must be fp8, fp8-block or absent, got {quant!r}.")
    if cfg.moe is not None and par.ep * par.expert_tp != par.tp:
        raise ConfigError(f"ep ({par.ep}) x expert tp ({par.expert_tp}) must equal tp ({par.tp}).")
    if nextn and not cfg.num_nextn_layers:
        raise ConfigError(
            "next-token-prediction layers were asked for but config.json has no num_nextn_predict_layers."
        )
    b = _Rank(cfg, par, rank, quant)
    h, v = cfg.hidden_size, cfg.vocab_size
    b.column("embed.weight", "model.embed_tokens.weight", (v, h), gemm=False, vocab=True)
    layers = cfg.num_layers + (cfg.num_nextn_layers if nextn else 0)
    for i in range(layers):
        p = f"model.layers.{i}."
        b.replicated(f"layers.{i}.input_norm.weight", p + "input_layernorm.weight", (h,))
        b.replicated(f"layers.{i}.post_attn_norm.weight", p + "post_attention_layernorm.weight", (h,))
        (_mla if cfg.mla is not None else _attention)(b, i, p)
        if cfg.is_moe_layer(i):
            _moe(b, i, p, fuse_shared_experts)
        else:
            b.gate_up(
                f"layers.{i}.mlp.gate_up.weight",
                p + "mlp.gate_proj.weight",
                p + "mlp.up_proj.weight",
                cfg.intermediate_size,
            )
            b.row(f"layers.{i}.mlp.down.weight", p + "mlp.down_proj.weight", (h, cfg.intermediate_size))
        if i >= cfg.num_layers:
            _nextn_extras(b, i, p)
    b.replicated("norm.weight", "model.norm.weight", (h,))
    if not cfg.tie_word_embeddings:
        b.column("lm_head.weight", "lm_head.weight", (v, h), gemm=False, vocab=True)
    return b.specs


def skip_patterns(cfg: ModelConfig, nextn: bool = False) -> tuple[str, ...]:
    """Checkpoint names this architecture never packs, beyond the generic rules of kiln.weights."""
    if nextn and cfg.num_nextn_layers:
        first = cfg.num_layers
        idx = "|".join(str(first + j) for j in range(cfg.num_nextn_layers))
        return (rf"^model\.layers\.({idx})\.(embed_tokens|shared_head\.head)\.weight$",)
    return ()


def all_rank_specs(
    cfg: ModelConfig, par: ParallelConfig, quant: str | None = None, **kw: bool
) -> list[list[ParamSpec]]:
    """``param_specs`` for every rank, index = rank."""
    return [param_specs(cfg, par, r, quant, **kw) for r in range(par.tp)]
