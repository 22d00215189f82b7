"""Attention of a few new tokens per request split over the keys (``kiln::verify_attention``,
ops/attention/verify.py): the Triton kernels (interpreter on CPU, real on GPU) against extend
attention's reference on fresh random inputs, with one split (the outputs written directly) and with
several (partials and the merge), tiles of one request's tokens, padding rows, and the paged op
sending it a verify-shaped step. Tolerances as test_extend_attention.py's."""

import pytest
import test_decode_attention as decode_tests
import torch
from test_decode_attention import TOL, rel_err
from test_extend_attention import make_inputs

from kiln.ops.attention import verify as V
from kiln.ops.attention.paged import by_step
from kiln.ops.attention.reference import extend_attention_ref

seed, triton_on_cpu = decode_tests.seed, decode_tests.triton_on_cpu  # the fixtures, shared


@pytest.mark.parametrize(
    "ext, prefix, pad, hq, hkv, d, page_size, dtype, splits, cap",
    [
        ([5], [40], 0, 8, 2, 64, 16, torch.float32, 0, 0.0),  # a verify step at batch 1, auto splits
        ([5], [40], 0, 8, 2, 64, 16, torch.bfloat16, 3, 5.0),  # the same merged from 3 splits, capped
        ([1, 5, 9], [30, 0, 17], 4, 12, 3, 64, 1, torch.float32, 4, 0.0),  # mixed lengths, padding, page 1
        ([1, 20], [8, 33], 2, 4, 4, 32, 16, torch.float32, 2, 5.0),  # 20 tokens: two tiles of 16 (MHA)
        ([3, 0, 2], [9, 4, 50], 0, 16, 2, 128, 16, torch.bfloat16, 1, 0.0),  # a request with no new tokens
        ([24], [0], 0, 4, 1, 32, 16, torch.float32, 4, 0.0),  # early rows see none of split 1's keys
        ([7, 2], [3, 5], 1, 12, 2, 32, 16, torch.float32, 2, 5.0),  # GQA group 6: a tile of 10 tokens
        ([3, 2], [700, 40], 0, 4, 2, 32, 16, torch.float32, 40, 0.0),  # 22 splits: 2 merge passes
    ],
)
def test_verify_matches_reference(
    triton_on_cpu, seed, ext, prefix, pad, hq, hkv, d, page_size, dtype, splits, cap
):
    q, k, v, bt, rows, lens, indptr = make_inputs(ext, prefix, pad, hq, hkv, d, d, page_size, dtype)
    args = (q, k, v, bt, rows, lens, indptr, d**-0.5, page_size)
    out = torch.ops.kiln.verify_attention(*args, splits, cap)
    ref = extend_attention_ref(*args, -1, cap)
    assert out.shape == ref.shape and out.dtype == dtype and not out.isnan().any()
    if pad:
        assert torch.equal(out[-pad:], torch.zeros_like(out[-pad:])), "padding rows not zero"
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"seed {seed}: relative error {err:.2e}"
    out = V.verify_attention_triton(*args, splits, cap, min_chunk=40)  # splits of >= 64 keys (2 blocks)
    assert rel_err(out, ref) < TOL[dtype], f"seed {seed}: min_chunk"
    out = V.verify_attention_triton(*args, splits, cap, merge_tile=2)  # the merge in passes of 2 splits
    assert rel_err(out, ref) < TOL[dtype], f"seed {seed}: merge_tile"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_trees_match_reference(triton_on_cpu, seed, dtype):
    """Token trees (a node sees the prefix, its ancestors and itself): the kernels against extend
    attention's reference with the same ancestor masks, merged from 3 splits and written directly."""
    from test_tree_attention import make_tree_inputs

    gen = torch.Generator().manual_seed(seed)
    args, tree_mask, _ = make_tree_inputs([7, 12, 1], [5, 40, 9], 2, 8, 2, 32, 32, 16, dtype, gen)
    for splits in (3, 1):
        out = torch.ops.kiln.verify_attention(*args, 32**-0.5, 16, splits, 0.0, tree_mask)
        ref = extend_attention_ref(*args, 32**-0.5, 16, -1, 0.0, None, None, tree_mask)
        assert not out.isnan().any() and torch.equal(out[-2:], torch.zeros_like(out[-2:]))
        assert rel_err(out, ref) < TOL[dtype], f"seed {seed}, {splits} splits"


def test_paged_attention_sends_few_tokens_per_request_to_it(triton_on_cpu):
    """``paged_attention`` runs a step of at most ``FEW_TOKENS`` tokens per request on average (and
    no tree, window or FP8 cache) on the verify kernels, others on extend's (its routing, ``by_step``,
    checked with a spy per kernel: the two kernels may agree bit for bit under the interpreter, as
    they did with numpy 2.4 / triton 3.9 on CPU); the op gives the reference either way."""
    ran: list[str] = []

    def spy(name: str):
        return lambda *args: ran.append(name)

    route = by_step(spy("decode"), spy("extend"), spy("verify"))
    # (new tokens per request, sliding window, whether verify's kernels run): 16 a request on average
    # is the bound, a window goes to extend's kernel
    for ext, window, few in (([5, 5], -1, True), ([16, 16], -1, True), ([16, 17], -1, False), ([40], -1, False),
                             ([5, 5], 8, False)):  # fmt: skip
        q, k, v, bt, rows, lens, indptr = make_inputs(
            ext, [12] * len(ext), 0, 8, 2, 64, 64, 16, torch.float32
        )
        args = (q, k, v, bt, rows, lens, indptr, 0.125, 16)
        out = torch.ops.kiln.paged_attention(*args, 0, window, 0.0)
        assert rel_err(out, extend_attention_ref(*args, window, 0.0)) < TOL[torch.float32]
        ran.clear()
        route(*args, 0, window, 0.0)
        assert ran == ["verify" if few else "extend"], (ext, window, ran)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("batch, tokens", [(1, 5), (1, 9), (8, 5), (32, 5)])
def test_verify_gpu_llama_shapes(seed, page_size, batch, tokens):
    """Llama-3.1-8B heads, verify steps of k + 1 tokens over 512..4000-token contexts, bf16; a
    mixed step with a longer chunk (two tiles) and padding rows."""
    for ext, prefix, pad in (
        ([tokens] * batch, [512 + 97 * b for b in range(batch)], 0),
        ([tokens, 1, 30][: max(batch, 2)], [4000, 7, 300][: max(batch, 2)], 3),
    ):
        q, k, v, bt, rows, lens, indptr = make_inputs(
            ext, prefix, pad, 32, 8, 128, 128, page_size, torch.bfloat16, "cuda"
        )
        args = (q, k, v, bt, rows, lens, indptr, 128**-0.5, page_size)
        out = torch.ops.kiln.verify_attention(*args, 0, 0.0)
        ref = extend_attention_ref(*args, -1, 0.0)
        assert not out.isnan().any() and rel_err(out, ref) < TOL[torch.bfloat16], f"seed {seed}"


def test_the_compile_warm_up_reaches_every_tokens_per_program():
    """Verify attention runs in eager extend steps of any batch and length; its only varying launch
    parameter is the tokens per program (``qtile``), so the compile's extend warm-up must reach each
    value any step sent to it can take, for every GQA group, or the runtime would compile a kernel."""
    from kiln.compiler.build import EXTEND_WARMUP
    from kiln.ops.attention.verify import FEW_TOKENS, MAX_TOKENS, qtile

    def few(t: int, b: int) -> bool:  # what paged_attention sends to verify attention
        return b < t <= min(FEW_TOKENS * b, MAX_TOKENS)

    for group in (1, 2, 4, 8, 16):
        warm = {qtile(t, b, group) for t, b in EXTEND_WARMUP if few(t, b)}
        need = {qtile(t, b, group) for b in range(1, 70) for t in range(b + 1, 600) if few(t, b)}
        assert need <= warm, (group, sorted(need - warm))


def test_counts_that_vary_with_an_eager_step_do_not_specialize_the_kernels():
    """Eager extend steps of any batch and length run extend and verify attention: a request, token
    or split count that Triton specialized by value class (== 1, divisible by 16) would need a
    warm-up per class, and a class the warm-up missed compiles at load (what s28 shipped)."""
    from kiln.ops.attention.extend import _extend_kernel
    from kiln.ops.attention.verify import _verify_merge_kernel, _verify_split_kernel

    def unspecialized(kernel) -> set[str]:  # a JITFunction's, or the interpreter's wrapper's
        names = getattr(kernel, "do_not_specialize", None) or kernel.kwargs.get("do_not_specialize") or ()
        return {kernel.arg_names[n] if isinstance(n, int) else n for n in names}

    assert {"num_reqs", "num_tokens"} <= unspecialized(_extend_kernel)
    assert {"num_reqs", "num_tokens", "num_splits"} <= unspecialized(_verify_split_kernel)
    assert {"num_reqs", "num_splits"} <= unspecialized(_verify_merge_kernel)


@pytest.mark.parametrize("lengths", [(4, 8), (2,), (15, 32)])
def test_the_tree_warm_ups_reach_every_tokens_per_program(lengths):
    """Token-tree steps run verify attention eagerly at any size (the target's tree graph where no
    captured (B, k) graph holds a step; an EAGLE-3 head's tree steps always): the warm-ups of both
    tree graphs reach every tokens-per-program value such steps can take."""
    from kiln.compiler.build import _tree_shapes
    from kiln.compiler.eagle3 import _head_tree_shapes
    from kiln.manifest import VerifySpec
    from kiln.ops.attention.verify import FEW_TOKENS, MAX_TOKENS, qtile

    verify = VerifySpec(lengths=lengths, buckets=(1, 2, 4, 8))
    k = lengths[-1]
    for shapes, most in ((_tree_shapes(verify), k + 1), (_head_tree_shapes(verify), max(1, k - 1))):
        for group in (1, 4, 8):
            warm = {qtile(t, b, group) for b, t in shapes if t <= min(FEW_TOKENS * b, MAX_TOKENS)}
            need = {
                qtile(t, b, group)
                for b in range(1, 9)
                for t in range(b, b * most + 1)
                if t <= min(FEW_TOKENS * b, MAX_TOKENS)
            }
            assert need <= warm, (lengths, group, sorted(need - warm))


def test_one_split_launches_the_kernel_with_the_same_pointer_types(triton_on_cpu, monkeypatch):
    """A Triton kernel's identity includes its pointers' element types: with one split (a large
    eager batch) the partials must stay float32 like those of several splits, or that step compiles
    a kernel the warm-up never built."""
    q, k, v, bt, rows, lens, indptr = make_inputs([3, 2], [9, 40], 0, 8, 2, 32, 32, 16, torch.bfloat16)
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    real = V._verify_split_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append((args[8].dtype, args[9].dtype))  # mid_o_ptr, mid_lse_ptr
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(V, "_verify_split_kernel", Spy())
    args = (q, k, v, bt, rows, lens, indptr, 32**-0.5, 16)
    for splits in (1, 3):
        out = V.verify_attention_triton(*args, splits, 0.0)
        assert rel_err(out, extend_attention_ref(*args, -1, 0.0)) < TOL[torch.bfloat16]
    assert seen == [(torch.float32, torch.float32)] * 2
