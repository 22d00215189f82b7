"""MoE routing: router logits -> the top-k experts of every token and their weights.

Op ``torch.ops.kiln.moe_topk(logits, bias, top_k, renormalize, scoring, num_groups, topk_groups,
scale, round_to="", group_score="top2_sum") -> (weights [T, k] float32, ids [T, k] int32)``,
``logits: [T, E]`` bf16/fp16/fp32:

* ``scoring="softmax"`` (Qwen3-MoE, Mixtral, DeepSeek-V2): ``p = softmax(logits.f32)``; the ``k``
  largest ``p`` (among the chosen groups, below); with ``renormalize`` the chosen weights are
  divided by their sum (Mixtral always, Qwen3-MoE when ``norm_topk_prob``). ``bias`` must be None.
* ``scoring="sigmoid"`` (DeepSeek-V3 ``noaux_tc``): ``s = sigmoid(logits.f32)``; experts are *chosen*
  on ``c = s + bias`` (the ``e_score_correction_bias``, ``[E]`` float32, or zeros), the ``k``
  largest ``c`` (among the chosen groups) win. The weights are the chosen ``s`` (without the bias);
  with ``renormalize`` divided by ``sum + 1e-20``.
* Group-limited routing, either scoring, ``num_groups > 1``: the experts are ``num_groups`` equal
  groups, each scored on the choice scores (``p``, or ``c``) by ``group_score``: ``"top2_sum"``, the
  sum of its two largest (DeepSeek-V3 ``noaux_tc``), or ``"max"``, its largest (DeepSeek-V2
  ``group_limited_greedy``); only the ``topk_groups`` best groups compete for the ``k`` experts.

Both modes finally multiply the weights by ``scale`` (``routed_scaling_factor``; 1.0 for Qwen3-MoE
and Mixtral) and, with ``round_to`` ``"bfloat16"`` or ``"float16"``, round them to that dtype (still
stored as float32: Hugging Face's Qwen3-MoE casts its routing weights to the activation dtype;
here that is no extra kernel). ``ids`` of a row are always distinct, in descending order of the choice score; ties
go to the lower expert index and NaN scores count as -inf.

Kernel: one program per token, the ``E`` scores in registers; top-k by ``k`` rounds of
(max, lowest index achieving it, exclude), group selection likewise over the group scores.
Launched with PDL (ops/common/launch.py), waiting before every load: the logits come from the router
linear, and the graph casts the correction bias to float32 each step (compiler/moe_layer.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.common.launch import next_pow2, pdl_args, pdl_trigger, pdl_wait
from kiln.ops.common.op import kiln_op

SCORINGS = ("softmax", "sigmoid")
GROUP_SCORES = ("top2_sum", "max")  # a group's score for group-limited routing (module docstring)
ROUND_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_ROUND_CODE = {"": 0, "bfloat16": 1, "float16": 2}

# ---- torch reference ------------------------------------------------------------------------------


def moe_topk_ref(
    logits,
    bias,
    top_k,
    renormalize,
    scoring,
    num_groups,
    topk_groups,
    scale,
    round_to="",
    group_score="top2_sum",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, following Hugging Face's Qwen3-MoE / Mixtral routers and DeepSeek-V2's and
    DeepSeek-V3's gates (group-limited top-k; V3: sigmoid, correction bias). Returns ``(w f32, ids
    int32)``. The op's parameters, typed on ``moe_topk_triton``."""
    t, e = logits.shape
    x = logits.float()  # [T, E]
    if scoring == "softmax":
        p = c = torch.softmax(x, dim=-1)  # weights and choice scores
    else:
        p = torch.sigmoid(x)  # [T, E]
        c = p + (bias.float() if bias is not None else 0.0)
    if num_groups > 1:
        groups = c.view(t, num_groups, e // num_groups)
        if group_score == "max":
            gscore = groups.max(dim=-1).values  # [T, G]
        else:
            gscore = groups.topk(2, dim=-1)[0].sum(dim=-1)
        gidx = torch.topk(gscore, topk_groups, dim=-1)[1]  # [T, topk_groups]
        gmask = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, gidx, True)
        emask = gmask.unsqueeze(-1).expand(t, num_groups, e // num_groups).reshape(t, e)
        c = c.masked_fill(~emask, float("-inf"))
    ids = torch.topk(c, top_k, dim=-1)[1]  # [T, k]
    w = p.gather(1, ids)
    if renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + (1e-20 if scoring == "sigmoid" else 0.0))
    w = (w * scale).float()
    if round_to:
        w = w.to(ROUND_DTYPES[round_to]).float()
    return w, ids.to(torch.int32)


# ---- Triton kernel --------------------------------------------------------------------------------


@triton.jit
def _softmax(x, valid):
    """float32 softmax over the ``valid`` entries of ``x`` (0 elsewhere)."""
    m = tl.max(x, axis=0)
    ex = tl.where(valid, tl.exp(x - m), 0.0)
    return ex / tl.sum(ex, axis=0)


@triton.jit
def _scale_round(w, scale, ROUND: tl.constexpr):
    """Routing weights times ``scale``, then rounded: ``ROUND`` 1 to bf16 (nearest-even with bit
    arithmetic, as torch does, the same everywhere), 2 to fp16, 0 not; values stay float32."""
    w = w * scale
    if ROUND == 1:
        b = w.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        w = b.to(tl.float32, bitcast=True)
    elif ROUND == 2:
        w = w.to(tl.float16).to(tl.float32)
    return w


@triton.jit
def _pick(score, avail, offs, N_PAD: tl.constexpr):
    """Index of the largest available ``score`` (lowest index on ties) and its score."""
    cand = tl.where(avail, score, float("-inf"))
    best = tl.max(cand, axis=0)
    idx = tl.min(tl.where(avail & (cand == best), offs, N_PAD), axis=0)
    return idx, best


@triton.jit
def _topk_row(
    x, offs, valid, BIAS, W_OUT, ID_OUT, row, E, scale,
    K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
    TOPK_G: tl.constexpr, ROUND: tl.constexpr, GROUP_MAX: tl.constexpr,
):  # fmt: skip
    """One token's routing from its float32 logits ``x [E_PAD]`` (``valid``: ``offs < E``): stores
    its ``K`` weights and ids in row ``row`` of ``W_OUT`` / ``ID_OUT``."""
    if HAS_BIAS:
        bias = tl.load(BIAS + offs, mask=valid, other=0.0).to(tl.float32)
    x = tl.where(x == x, x, float("-inf"))  # NaN -> -inf: never preferred, ids stay distinct
    if SIGMOID:
        p = 1.0 / (1.0 + tl.exp(-x))  # weights: [E_PAD]
        choice = p
        if HAS_BIAS:
            choice = p + bias
    else:
        p = _softmax(x, valid)
        choice = p
    avail = valid
    if G > 1:  # group-limited: only the TOPK_G best groups compete
        gs = E // G
        grp = offs // gs
        goffs = tl.arange(0, G_PAD)
        gscore = tl.full([G_PAD], float("-inf"), tl.float32)
        for g in tl.static_range(G):
            in_g = valid & (grp == g)
            i1, m1 = _pick(choice, in_g, offs, E_PAD)
            if GROUP_MAX:
                gscore = tl.where(goffs == g, m1, gscore)
            else:  # the sum of its two best
                _, m2 = _pick(choice, in_g & (offs != i1), offs, E_PAD)
                gscore = tl.where(goffs == g, m1 + m2, gscore)
        gavail = goffs < G
        gsel = goffs < 0  # all False
        for _j in tl.static_range(TOPK_G):
            gi, _ = _pick(gscore, gavail, goffs, G_PAD)
            gsel = gsel | (goffs == gi)
            gavail = gavail & (goffs != gi)
        avail = offs < 0
        for g in tl.static_range(G):
            chosen = tl.sum(tl.where((goffs == g) & gsel, 1, 0), axis=0) > 0
            avail = avail | (valid & (grp == g) & chosen)
    choice = tl.where(choice == choice, choice, float("-inf"))  # an all-NaN row: p is NaN too
    koffs = tl.arange(0, K_PAD)
    w = tl.zeros([K_PAD], dtype=tl.float32)
    ids = tl.zeros([K_PAD], dtype=tl.int32)
    for j in tl.static_range(K):
        i, _ = _pick(choice, avail, offs, E_PAD)
        wj = tl.sum(tl.where(offs == i, p, 0.0), axis=0)
        w = tl.where(koffs == j, wj, w)
        ids = tl.where(koffs == j, i, ids)
        avail = avail & (offs != i)
    if RENORM:
        total = tl.sum(w, axis=0)
        if SIGMOID:
            total = total + 1e-20
        w = w / total
    kmask = koffs < K
    w = _scale_round(w, scale, ROUND)
    tl.store(W_OUT + row * K + koffs, w, mask=kmask)
    tl.store(ID_OUT + row * K + koffs, ids, mask=kmask)


@triton.jit
def _moe_topk_kernel(
    L,  # [T, E] router logits
    BIAS,  # [E] f32 correction bias (HAS_BIAS)
    W_OUT,  # [T, K] f32
    ID_OUT,  # [T, K] int32
    E,
    stride_l,
    scale,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr,
    G: tl.constexpr,  # expert groups (group-limited routing when > 1)
    G_PAD: tl.constexpr,
    TOPK_G: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (ops/common/launch.py)
    ROUND: tl.constexpr = 0,  # 0: none, 1: to bf16, 2: to fp16 (values stay float32)
    GROUP_MAX: tl.constexpr = False,  # a group's score: its best choice score, else its two best summed
):
    pdl_trigger(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_PAD)
    valid = offs < E
    pdl_wait(PDL)  # before the bias too: the graph casts it to float32 each step (moe_layer.py)
    x = tl.load(L + row * stride_l + offs, mask=valid, other=float("-inf")).to(tl.float32)
    _topk_row(
        x, offs, valid, BIAS, W_OUT, ID_OUT, row, E, scale,
        K, K_PAD, E_PAD, SIGMOID, HAS_BIAS, RENORM, G, G_PAD, TOPK_G, ROUND, GROUP_MAX,
    )  # fmt: skip


def routing_outputs(like: torch.Tensor, t: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized ``(weights [t, k] f32, ids [t, k] int32)`` on ``like``'s device."""
    return like.new_empty((t, top_k), dtype=torch.float32), like.new_empty((t, top_k), dtype=torch.int32)


# ---- custom op ------------------------------------------------------------------------------------


def check_routing(
    e: int,
    bias,
    top_k,
    renormalize,
    scoring,
    num_groups,
    topk_groups,
    scale,
    round_to="",
    group_score="top2_sum",
) -> None:
    """The routing arguments (``moe_topk``'s after ``logits``, which ``moe_route`` takes too, but for
    ``group_score``) for ``e`` experts."""
    if group_score not in GROUP_SCORES:
        raise ValueError(f"moe_topk: group_score must be one of {GROUP_SCORES}, got {group_score!r}")
    if round_to not in _ROUND_CODE:
        raise ValueError(f"moe_topk: round_to must be one of {sorted(_ROUND_CODE)}, got {round_to!r}")
    if not 1 <= top_k <= e:
        raise ValueError(f"moe_topk: top_k must be in 1..E={e}, got {top_k}")
    if scoring not in SCORINGS:
        raise ValueError(f"moe_topk: scoring must be one of {SCORINGS}, got {scoring!r}")
    if scoring == "softmax" and bias is not None:
        raise ValueError("moe_topk: softmax scoring takes no bias (a correction bias is sigmoid mode's)")
    if bias is not None and (bias.shape != (e,) or bias.dtype != torch.float32):
        raise ValueError(f"moe_topk: bias must be [E={e}] float32, got {tuple(bias.shape)} {bias.dtype}")
    if num_groups < 1 or e % num_groups or (num_groups > 1 and e // num_groups < 2):
        raise ValueError(
            f"moe_topk: num_groups ({num_groups}) must divide E={e} into groups of at least 2 experts"
        )
    if not 1 <= topk_groups <= num_groups or top_k > topk_groups * (e // num_groups):
        raise ValueError(
            f"moe_topk: topk_groups ({topk_groups}) must be in 1..num_groups ({num_groups}) and its "
            f"groups must hold top_k={top_k} experts"
        )


def _check(logits: torch.Tensor, *routing) -> None:
    if logits.dim() != 2 or logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(
            f"moe_topk: logits must be [T, E] bf16/fp16/fp32, got {tuple(logits.shape)} {logits.dtype}"
        )
    check_routing(logits.shape[1], *routing)


@kiln_op("moe_topk", ref=moe_topk_ref, check=_check)
def moe_topk_triton(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    renormalize: bool,
    scoring: str,
    num_groups: int,
    topk_groups: int,
    scale: float,
    round_to: str = "",
    group_score: str = "top2_sum",
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` -> ``(weights [T, k] f32, ids [T, k] int32)`` (see the module
    docstring), by the kernel; ``out``: preallocated ``(weights, ids)`` to write (tests)."""
    t, e = logits.shape
    w, ids = routing_outputs(logits, t, top_k) if out is None else out
    if t == 0:
        return w, ids
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    e_pad = next_pow2(e)
    _moe_topk_kernel[(t,)](
        logits, bias if bias is not None else logits, w, ids,
        e, logits.stride(0), float(scale),
        K=top_k, K_PAD=next_pow2(top_k), E_PAD=e_pad, SIGMOID=scoring == "sigmoid",
        HAS_BIAS=bias is not None, RENORM=renormalize, G=num_groups, G_PAD=next_pow2(num_groups),
        TOPK_G=topk_groups, ROUND=_ROUND_CODE[round_to], GROUP_MAX=group_score == "max",
        num_warps=1 if e_pad <= 256 else 4, **pdl_args(logits),
    )  # fmt: skip
    return w, ids
