"""KILN_PREWAIT (ops/common/launch.py): the GEMV, the decode split kernel and the RoPE kernel loading their
graph-constant inputs before the PDL wait compute exactly what they compute without it.

On CPU (interpreter) the wait is a no-op, so these tests check the restructured kernels' arithmetic
and masks (the first weight step taken from the pre-wait tile, the cached keys loaded apart from the
new one and patched in after the wait), bit for bit against the switch off and within tolerance
against the references. The GPU test replays a CUDA graph in which the kernel before the split
kernel writes the new key, which is what the pre-wait split must not read early.
"""

from __future__ import annotations

import pytest
import torch

from kiln.ops.attention import decode as dec
from kiln.ops.attention.qkv_rope import qkv_rope_kvwrite_ref, qkv_rope_kvwrite_triton
from kiln.ops.attention.reference import decode_attention_ref, random_block_table
from kiln.ops.attention.rope import rope_cos_sin_cache
from kiln.ops.common import launch as common
from kiln.ops.common.launch import next_pow2
from kiln.ops.linear import gemv as G


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    if not common.interpreting():
        pytest.skip("CPU kernel tests need TRITON_INTERPRET=1 (set by tests/conftest.py)")
    monkeypatch.setenv("KILN_TRITON_ON_CPU", "1")


def both(monkeypatch, part: str, fn):
    """``fn()`` with ``KILN_PREWAIT=none``, then with ``part`` on: the two results."""
    monkeypatch.setenv("KILN_PREWAIT", "none")
    off = fn()
    monkeypatch.setenv("KILN_PREWAIT", part)
    return off, fn()


@pytest.mark.parametrize(
    "raw, expect",
    [
        (None, {"gemv", "attn", "rope", "slab", "slab_norm"}),  # the default: all
        ("none", set()),
        ("0", set()),
        ("all", {"gemv", "attn", "rope", "slab", "slab_norm"}),
        ("gemv, rope", {"gemv", "rope"}),
    ],
)
def test_switch(monkeypatch, raw, expect):
    if raw is None:
        monkeypatch.delenv("KILN_PREWAIT", raising=False)
    else:
        monkeypatch.setenv("KILN_PREWAIT", raw)
    assert {p for p in common.PREWAIT_PARTS if common.prewait(p)} == expect


def test_bad_switch_names_the_variable(monkeypatch):
    monkeypatch.setenv("KILN_PREWAIT", "gemv,attention")
    with pytest.raises(ValueError, match="KILN_PREWAIT"):
        common.prewait("gemv")


@pytest.mark.parametrize(
    "m, n, k, kw",
    [
        (1, 40, 200, {}),  # K not a multiple of the block: masked first step
        (2, 24, 256, dict(block_n=4, block_k=64)),  # four K steps, the first from the pre-wait tile
        (1, 16, 256, dict(block_n=4, block_k=32, split_k=4)),  # each split's first step
        (1, 20, 96, dict(gate_up=True, block_n=2, block_k=32)),  # gate and up tiles
        (1, 32, 128, dict(residual=True, block_n=8, block_k=32)),
    ],
)
def test_gemv_first_step_before_the_wait(kernels_on_cpu, monkeypatch, m, n, k, kw):
    g = torch.Generator().manual_seed(n * k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
    kw = dict(kw)
    n_out = n // 2 if kw.get("gate_up") else n
    if kw.pop("residual", False):
        kw["residual"] = torch.randn(m, n_out, generator=g).to(torch.bfloat16)
    off, on = both(monkeypatch, "gemv", lambda: G.gemv(x, w, **kw))
    assert torch.equal(off, on)
    ref = G.gate_up_ref(x, w) if kw.get("gate_up") else G.gemv_ref(x, w)
    if "residual" in kw:
        ref = ref + kw["residual"]
    torch.testing.assert_close(on.float(), ref.float(), rtol=2**-6, atol=4e-3)


@pytest.mark.parametrize(
    "n, k, warps, norm, slab",
    [
        (40, 200, 1, False, True),  # 2 x 256 / 32 = 16 elements a thread: one masked step
        (16, 512, 2, True, True),  # the fused norm: its sum of squares in the one step
        (16, 4096, 1, False, False),  # 2 x 4096 / 32 = 256 elements: over the limit, K steps as before
    ],
)
def test_gemv_whole_slab_before_the_wait(kernels_on_cpu, monkeypatch, n, k, warps, norm, slab):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(torch.bfloat16) if norm else None
    cfg = G.GemvConfig(block_n=2, block_k=64, num_warps=warps, num_stages=1, split_k=1, use_dot=False)
    part, other = ("gemv,slab_norm", "gemv,slab") if norm else ("gemv,slab", "gemv,slab_norm")
    monkeypatch.setenv("KILN_PREWAIT", part)
    assert G.slab_block_k(cfg, 1, k, False, norm) == (next_pow2(k) if slab else 64)
    assert G.slab_block_k(cfg, 2, k, False, norm) == 64  # one x row only
    for unset in ("gemv", other):  # each part for its own kind of GEMV
        monkeypatch.setenv("KILN_PREWAIT", unset)
        assert G.slab_block_k(cfg, 1, k, False, norm) == 64
    if not norm:  # a plain GEMV slabs only a grid of at most SLAB_MAX_PER_SM programs a SM
        monkeypatch.setenv("KILN_PREWAIT", part)
        wide = 2 * (G.SLAB_MAX_PER_SM * 4 + 1)  # block_n 2, 4 SMs: one program over the limit
        assert G.slab_block_k(cfg, 1, k, False, False, wide - 2, sms=4) == (next_pow2(k) if slab else 64)
        assert G.slab_block_k(cfg, 1, k, False, False, wide, sms=4) == 64
    monkeypatch.setattr(G, "gemv_config", lambda *a, **kw: cfg)
    ns = G.NormIn(nw, 1e-6) if norm else None
    off, on = both(monkeypatch, part, lambda: G.gemv(x, w, norm=ns))
    # the one step sums K in another order: equal to the K-step result within a rounding or two
    torch.testing.assert_close(on.float(), off.float(), rtol=2**-6, atol=4e-3)
    if not norm:
        torch.testing.assert_close(on.float(), G.gemv_ref(x, w).float(), rtol=2**-6, atol=4e-3)
    if not slab:
        assert torch.equal(off, on)


def test_gemv_fused_norm_before_the_wait(kernels_on_cpu, monkeypatch):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 128, generator=g).to(torch.bfloat16)
    w = (torch.randn(32, 128, generator=g) / 128**0.5).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(128, generator=g)).to(torch.bfloat16)
    norm = G.NormIn(nw, 1e-6)
    off, on = both(monkeypatch, "gemv", lambda: G.gemv(x, w, norm=norm, block_n=4, block_k=32))
    assert torch.equal(off, on)


@pytest.mark.parametrize(
    "seq_lens, num_splits, page, window",
    [
        ([40], 2, 16, -1),  # two splits of 32 keys: the new key (39) in the last split's first block
        ([33, 1, 70], 3, 16, -1),  # a one-key request (only the new key), pages crossed
        ([100], 2, 4, -1),  # blocks past the first in each split (loaded after the wait)
        ([0, 20], 2, 16, -1),  # an empty request: its programs wait and write zeros
        ([90], 3, 16, 24),  # a sliding window: the first block masked below lo
    ],
)
def test_split_kernel_cached_keys_before_the_wait(
    kernels_on_cpu, monkeypatch, seq_lens, num_splits, page, window
):
    g = torch.Generator().manual_seed(sum(seq_lens))
    bt, rows, slots = random_block_table(seq_lens, page, "cpu")
    hq, hkv, d = 8, 2, 64
    q = torch.randn(len(seq_lens), hq, d, generator=g)
    k = torch.randn(slots, hkv, d, generator=g)
    v = torch.randn(slots, hkv, d, generator=g)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    cfg = dec.DecodeConfig(block_n=16, num_warps=1, num_stages=1)

    def run():
        return dec.decode_attention_triton(
            q, k, v, bt, rows, lens, d**-0.5, page, num_splits, window, 0.0, config=cfg
        )

    off, on = both(monkeypatch, "attn", run)
    assert torch.equal(off, on)
    ref = decode_attention_ref(q, k, v, bt, rows, lens, d**-0.5, page, num_splits, window, 0.0)
    torch.testing.assert_close(on, ref, rtol=1e-5, atol=1e-5)


def test_rope_inputs_before_the_wait(kernels_on_cpu, monkeypatch):
    g = torch.Generator().manual_seed(5)
    t, hq, hkv, d = 3, 4, 2, 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    pos = torch.tensor([7, 0, 300])
    cs = rope_cos_sin_cache(d, 512, 10000.0, None, device="cpu")
    slots = torch.tensor([3, 17, 40])
    qw, kw = 1 + 0.1 * torch.randn(d, generator=g), 1 + 0.1 * torch.randn(d, generator=g)

    def run():
        kc, vc = torch.zeros(64, hkv, d), torch.zeros(64, hkv, d)
        q = qkv_rope_kvwrite_triton(
            qkv, pos, cs, kc, vc, slots, hq, hkv, d, d, True, qw, kw, 1e-6, None, None
        )
        return torch.cat([q.flatten(), kc.flatten(), vc.flatten()])

    off, on = both(monkeypatch, "rope", run)
    assert torch.equal(off, on)
    kc, vc = torch.zeros(64, hkv, d), torch.zeros(64, hkv, d)
    q_ref = qkv_rope_kvwrite_ref(qkv, pos, cs, kc, vc, slots, hq, hkv, d, d, True, qw, kw, 1e-6, None, None)
    torch.testing.assert_close(
        on, torch.cat([q_ref.flatten(), kc.flatten(), vc.flatten()]), rtol=1e-5, atol=1e-5
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (PDL, CUDA graphs)")
def test_gpu_graph_new_key_written_by_the_kernel_before(monkeypatch):
    """In one CUDA graph, qkv_rope_kvwrite writes each request's new key and value, then the split
    kernel (PDL-launched behind it) reads them: with the pre-wait loads on, the result still equals
    the switch off and the reference over the rewritten cache, replay after replay."""
    dev = "cuda"
    g = torch.Generator().manual_seed(11)
    seq_lens = [545, 1, 130, 64]
    page, hq, hkv, d = 16, 32, 4, 128
    bt, rows, slots = random_block_table(seq_lens, page, dev)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    pos = (lens - 1).long()
    new_slot = torch.stack(
        [bt[rows[i], (n - 1) // page] * page + (n - 1) % page for i, n in enumerate(seq_lens)]
    )
    new_slot = new_slot.long().to(dev)
    k = torch.randn(slots, hkv, d, generator=g).to(dev, torch.bfloat16)
    v = torch.randn(slots, hkv, d, generator=g).to(dev, torch.bfloat16)
    qkv = torch.randn(len(seq_lens), (hq + 2 * hkv) * d, generator=g).to(dev, torch.bfloat16)
    cs = rope_cos_sin_cache(d, 4096, 1e6, None, device=dev)

    def step():
        q = qkv_rope_kvwrite_triton(
            qkv, pos, cs, k, v, new_slot, hq, hkv, d, d, True, None, None, 1e-6, None, None
        )
        return torch.ops.kiln.decode_attention(q, k, v, bt, rows, lens, d**-0.5, page, 0, -1, 0.0), q

    tokens = [torch.randn(qkv.shape, generator=g).to(dev, torch.bfloat16) for _ in range(3)]
    outs = {}
    for part in ("none", "all"):
        monkeypatch.setenv("KILN_PREWAIT", part)
        step()  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, q = step()
        for i, tok in enumerate(tokens):  # a new token each replay: new q, new key and value
            qkv.copy_(tok)
            graph.replay()
            torch.cuda.synchronize()
            ref = decode_attention_ref(q, k, v, bt, rows, lens, d**-0.5, page, 0, -1, 0.0)
            torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
            outs[part, i] = out.clone()
    for i in range(len(tokens)):
        assert torch.equal(outs["none", i], outs["all", i]), f"replay {i}: pre-wait loads changed the result"
