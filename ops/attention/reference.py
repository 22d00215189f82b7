"""Plain-torch references for paged decode and extend attention.

Both read K/V from the paged pool described in docs/internals.md: token position ``p`` of the
request in block-table row ``r`` lives at slot ``block_table[r, p // P] * P + p % P``. They loop over
requests on the host (``.tolist()``), gather that request's K/V rows, and run a masked softmax in
float32. They are the CPU implementation of the ops and the oracle of the kernel tests; they are
not meant to be fast.

Masks: key ``j`` is visible to query position ``i`` iff ``j <= i`` and, with a sliding window
``W > 0``, ``i - j < W``; with a token tree (``tree_mask``, extend only) a key of the request's
chunk only where the query's ancestor bitmask has its bit (:func:`tree_visible`). Soft-cap
``cap > 0``: ``s = cap * tanh(s / cap)`` on the scaled scores.

FP8 caches (``float8_e4m3fn``): each cached head row comes with a float32 scale, ``k_scale`` /
``v_scale`` ``[S, Hkv]`` (a layer's view of the pool's ``[L, S, Hkv]``), and stands for
``cache[slot, h, :].float() * scale[slot, h]``; the references dequantize the rows they gather.
Other caches take no scales (None).

The references take their ops' parameters (ops/common/op.py ``kiln_op``; the annotations are the
launches'): ``extend_attention_ref`` is ``kiln::extend_attention``'s, ``decode_attention_ref``
``kiln::decode_attention``'s (``num_splits`` only divides the kernel's work). Beside them, what
the attention ops share: ``check_attention`` (their common argument check) and
``empty_attention_out`` (their shape rule on fake tensors, where the references, which read
lengths on the host, cannot run); with qkv_rope.py, the FP8 format's ``check_kv_scales`` and
``kv_scale_args`` (a kernel launch's scale pointers and strides).
"""

from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn  # the FP8 KV-cache format (one float32 scale per head row)


def request_slots(block_table: torch.Tensor, row: int, length: int, page_size: int) -> torch.Tensor:
    """Slots of positions ``0..length-1`` of block-table row ``row``: ``[length]`` int64."""
    pos = torch.arange(length, device=block_table.device)
    pages = block_table[row, pos // page_size].long()
    return pages * page_size + pos % page_size


def gather_rows(cache: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
    """Rows ``slots`` of a K or V cache, ``[L, Hkv, D]``: as stored, or, with an FP8 cache's
    ``scale [S, Hkv]``, dequantized to float32 (``cache[slots].float() * scale[slots]``)."""
    if scale is None:
        return cache[slots]
    return cache[slots].float() * scale[slots].float()[..., None]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    sm_scale: float,
    sliding_window: int,
    logit_cap: float,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """One request: q ``[n, Hq, D]`` at positions ``q_pos [n]`` over keys ``k [L, Hkv, D]``,
    ``v [L, Hkv, Dv]`` at positions ``0..L-1``; ``allowed [n, L]`` bool, when given, masks further
    (token trees). Returns ``[n, Hq, Dv]`` float32."""
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    qf = q.float().transpose(0, 1)  # [Hq, n, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, Dv]
    s = torch.matmul(qf, kf.transpose(1, 2)) * sm_scale  # [Hq, n, L]
    if logit_cap > 0:
        s = logit_cap * torch.tanh(s / logit_cap)
    kpos = torch.arange(k.shape[0], device=q.device)
    visible = kpos[None, :] <= q_pos[:, None]  # [n, L]
    if sliding_window > 0:
        visible &= (q_pos[:, None] - kpos[None, :]) < sliding_window
    if allowed is not None:
        visible &= allowed
    s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no visible key -> zeros
    return torch.matmul(p, vf).transpose(0, 1)  # [n, Hq, Dv]


def tree_visible(tree_mask: torch.Tensor, prefix: int, length: int) -> torch.Tensor:
    """``[n, length]`` bool: which of keys ``0..length-1`` each of a chunk's ``n`` tokens may see
    under its ancestor bitmask ``tree_mask [n]`` int64 (the chunk starts at key ``prefix``): every
    prefix key, and chunk key ``prefix + j`` where bit ``j`` is set."""
    rel = torch.arange(length, device=tree_mask.device) - prefix  # [L]
    bits = (tree_mask.long()[:, None] >> rel.clamp(0, 63)[None, :]) & 1  # [n, L]
    return (rel < 0)[None, :] | (bits != 0)


def extend_attention_ref(q, k_cache, v_cache, block_table, req_rows, seq_lens, qo_indptr, sm_scale, page_size,
                         sliding_window, logit_cap, k_scale=None, v_scale=None, tree_mask=None):  # fmt: skip
    """Extend attention, reference.

    q ``[T, Hq, D]``; k_cache ``[S, Hkv, D]``; v_cache ``[S, Hkv, Dv]``; block_table ``[R, M]``
    int32; req_rows, seq_lens ``[B]`` int32; qo_indptr ``[B + 1]`` int32. Request ``b``'s new
    tokens are rows ``qo_indptr[b]:qo_indptr[b+1]`` of ``q`` at positions
    ``seq_lens[b] - n_b + j``. Returns ``[T, Hq, Dv]`` in q's dtype; rows of ``q`` that belong
    to no request (bucket padding) are zeros. FP8 caches: ``k_scale``/``v_scale`` ``[S, Hkv]``
    float32 (the module docstring). ``tree_mask`` ``[T]`` int64: token trees, each token's
    ancestor-or-self bitmask over its chunk (:func:`tree_visible`), or None (causal chunks).
    """
    t, hq = q.shape[0], q.shape[1]
    out = torch.zeros(t, hq, v_cache.shape[-1], dtype=torch.float32, device=q.device)
    indptr = qo_indptr.tolist()
    for b, (row, seq_len) in enumerate(zip(req_rows.tolist(), seq_lens.tolist())):
        lo, hi = indptr[b], indptr[b + 1]
        if hi <= lo:
            continue
        slots = request_slots(block_table, row, seq_len, page_size)  # [L]
        q_pos = torch.arange(seq_len - (hi - lo), seq_len, device=q.device)  # [n]
        k = gather_rows(k_cache, k_scale, slots)  # [L, Hkv, D]
        v = gather_rows(v_cache, v_scale, slots)  # [L, Hkv, Dv]
        allowed = None if tree_mask is None else tree_visible(tree_mask[lo:hi], seq_len - (hi - lo), seq_len)
        out[lo:hi] = _attend(q[lo:hi], k, v, q_pos, sm_scale, sliding_window, logit_cap, allowed)
    return out.to(q.dtype)


def decode_attention_ref(q, k_cache, v_cache, block_table, req_rows, seq_lens, sm_scale, page_size, num_splits,
                         sliding_window, logit_cap, k_scale=None, v_scale=None):  # fmt: skip
    """Decode attention, reference: one query per request at position ``seq_lens[b] - 1``.

    q ``[B, Hq, D]``; caches and metadata as in :func:`extend_attention_ref`; ``num_splits`` is
    unused. Returns ``[B, Hq, Dv]`` in q's dtype (zeros for a request with ``seq_lens[b] == 0``).
    """
    qo_indptr = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return extend_attention_ref(q, k_cache, v_cache, block_table, req_rows, seq_lens, qo_indptr, sm_scale,
                                page_size, sliding_window, logit_cap, k_scale, v_scale)  # fmt: skip


def kv_scale_args(
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, k_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int, int]]:
    """The KV kernels' scale arguments: ``(ks, vs, (ks slot stride, ks head stride, vs slot
    stride, vs head stride))``; without scales (not FP8) dummy pointers (``k_cache``, never read)
    and zero strides."""
    if k_scale is None or v_scale is None:
        return k_cache, k_cache, (0, 0, 0, 0)
    return k_scale, v_scale, (k_scale.stride(0), k_scale.stride(1), v_scale.stride(0), v_scale.stride(1))


def check_kv_scales(
    op: str,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """The KV-cache format rule of the ops that read or write the caches (``op`` names the op in
    the errors): ``float8_e4m3fn`` caches (both or neither) need ``k_scale``/``v_scale`` float32
    ``[S, Hkv]``, their cache's first two dims; other caches take None."""
    fp8 = (k_cache.dtype == FP8_KV_DTYPE, v_cache.dtype == FP8_KV_DTYPE)
    if fp8[0] != fp8[1]:
        raise ValueError(
            f"{op}: k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must both be {FP8_KV_DTYPE} "
            "or neither."
        )
    for name, cache, scale in (("k_scale", k_cache, k_scale), ("v_scale", v_cache, v_scale)):
        if not fp8[0]:
            if scale is not None:
                raise ValueError(
                    f"{op}: {name} is only for {FP8_KV_DTYPE} caches; pass None with a {cache.dtype} cache."
                )
            continue
        want = list(cache.shape[:2])
        if scale is None or scale.dtype != torch.float32 or list(scale.shape) != want:
            got = "None" if scale is None else f"{scale.dtype} {list(scale.shape)}"
            raise ValueError(
                f"{op}: {name} must be a float32 {want} tensor ([S, Hkv], one scale per cached head row) "
                f"with {FP8_KV_DTYPE} caches, got {got}."
            )


def check_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_size: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """The checks every attention op runs first: 3-D q and caches with agreeing heads and head dims,
    contiguous last dimensions, ``page_size >= 1``, and the scales of FP8 caches
    (:func:`check_kv_scales`)."""
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.dim() != 3:
        raise ValueError(
            f"attention: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)} and v_cache "
            f"{tuple(v_cache.shape)} must be 3-D ([tokens, heads, dim], [slots, kv_heads, dim])."
        )
    hq, hkv = q.shape[1], k_cache.shape[1]
    if hq % hkv or v_cache.shape[1] != hkv or q.shape[2] != k_cache.shape[2]:
        raise ValueError(
            f"attention: q heads ({hq}) must be a multiple of kv heads ({hkv}), v_cache must have "
            f"{hkv} heads (has {v_cache.shape[1]}) and q/k head dims must agree "
            f"({q.shape[2]} vs {k_cache.shape[2]})."
        )
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("attention: q, k_cache and v_cache need a contiguous last dimension.")
    if page_size < 1:
        raise ValueError(f"attention: page_size must be >= 1, got {page_size}.")
    check_kv_scales("attention", k_cache, v_cache, k_scale, v_scale)


def empty_attention_out(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *_: object
) -> torch.Tensor:
    """The attention ops' output for their arguments, uninitialized: ``[T, Hq, Dv]`` in q's dtype
    (their fake implementation)."""
    return q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])


def random_block_table(
    seq_lens: list[int], page_size: int, device: torch.device | str = "cpu", spare_pages: int = 3
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A random paged layout for tests and benchmarks: ``(block_table [R, M] int32, req_rows [B]
    int32, num_slots)``. Pages are scattered over a pool of ``num_slots`` slots (page 0, which
    holds the reserved sink slot 0, is never used); rows are shuffled and unused entries are 0."""
    p = page_size
    need = [max(1, -(-n // p)) for n in seq_lens]  # pages per request
    num_pages = 1 + sum(need) + spare_pages
    pages = (torch.randperm(num_pages - 1) + 1).tolist()
    rows = len(seq_lens) + 2
    table = torch.zeros(rows, max(need) + 1, dtype=torch.int32)
    req_rows = torch.randperm(rows)[: len(seq_lens)].to(torch.int32)
    for r, n in zip(req_rows.tolist(), need):
        table[r, :n] = torch.tensor(pages[:n], dtype=torch.int32)
        pages = pages[n:]
    return table.to(device), req_rows.to(device), num_pages * p
