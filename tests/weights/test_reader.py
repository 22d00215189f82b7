"""The staged loader (``load_pack`` with ``staging="pinned"``): the arena plan (one copy per chunk
when tensors are 256-byte multiples, split runs where alignment padding falls inside a chunk,
every byte copied once), the per-thread rings on CPU with every option combination, with and
without the checksum check, errors raised from reader threads, and
(GPU-marked) the same on CUDA with several copy streams."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from weights_helpers import CONFIGS, pack

import kiln.weights.reader as reader
from kiln.compiler.synth import make_checkpoint
from kiln.weights import LoadOptions, PackError, load_pack
from kiln.weights.index import PackTensor
from kiln.weights.reader import DEVICE_ALIGN, plan_staging


def _tensors(sizes: list[tuple[str, int]], start: int = 64) -> list[PackTensor]:
    """Tensors tiling files without gaps, as in a pack: ``(file, nbytes)`` in file order."""
    out, pos = [], {}
    for i, (f, n) in enumerate(sizes):
        off = pos.get(f, start)
        out.append(PackTensor(f"t{i}", (n,), "uint8", f, off, n, "0"))
        pos[f] = off + n
    return out


def _check_plan(tensors: list[PackTensor], cb: int):
    plan = plan_staging(tensors, cb)
    chunks = list(plan.chunks())
    assert len(chunks) == plan.num_chunks()
    assert all(0 < end - begin <= plan.max_chunk_bytes() <= cb for _, begin, end, _ in chunks)
    assert all(o % DEVICE_ALIGN == 0 for o in plan.offsets)
    # Every tensor byte is copied exactly once, to the arena offset its tensor was given.
    want = {}
    for t, o in zip(tensors, plan.offsets):
        for j in range(t.nbytes):
            want[(t.file, t.offset + j)] = o + j
    got = {}
    for f, begin, end, runs in chunks:
        covered = 0
        for src, dst, n in runs:
            assert src == covered  # runs tile the chunk in order
            for j in range(n):
                assert (f, begin + src + j) not in got
                got[(f, begin + src + j)] = dst + j
            covered += n
        assert covered == end - begin
    assert got == want
    assert plan.arena_bytes >= max((o + t.nbytes for t, o in zip(tensors, plan.offsets)), default=0)
    return plan, chunks


def test_plan_aligned_tensors_one_copy_per_chunk():
    ts = _tensors([("a", 512), ("a", 1024), ("a", 256), ("b", 768), ("b", 256)])
    plan, chunks = _check_plan(ts, 600)
    assert all(len(runs) == 1 for *_, runs in chunks)  # chunks cross tensor boundaries freely
    assert [(f, e - b) for f, b, e, _ in chunks] == [
        ("a", 600),
        ("a", 600),
        ("a", 592),
        ("b", 600),
        ("b", 424),
    ]
    assert plan.offsets == [0, 512, 1536, 1792, 2560] and plan.arena_bytes == 2816


def test_plan_padding_splits_runs():
    ts = _tensors([("a", 100), ("a", 300), ("a", 0), ("a", 256), ("b", 7)])
    plan, chunks = _check_plan(ts, 1 << 20)
    assert plan.offsets == [0, 256, 768, 768, 1024]
    assert [len(runs) for *_, runs in chunks] == [3, 1]  # a: 100, 300 and 256 bytes, each padded apart


@pytest.mark.parametrize("cb", [1, 5, 64, 255, 256, 257, 4096])
def test_plan_odd_chunks(cb):
    _check_plan(_tensors([("a", 3), ("a", 300), ("a", 256), ("b", 1000), ("b", 2), ("c", 0)]), cb)


def test_plan_empty():
    plan = plan_staging(_tensors([("a", 0)]), 1024)
    assert plan.num_chunks() == 0 and list(plan.chunks()) == [] and plan.max_chunk_bytes() == 0


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    d = make_checkpoint(
        tmp_path_factory.mktemp("ck"),
        CONFIGS["llama"],
        with_tokenizer=False,
        max_shard_size="24KB",
        dtype="float32",
    )
    out = tmp_path_factory.mktemp("p") / "pack"
    pack(d, out, tp=2, max_file_bytes=60_000)
    return out


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize(
    "opts",
    [
        LoadOptions("pinned", 1, 1 << 30, 1),  # one thread, one chunk per file
        LoadOptions("pinned", 4, 4096, 1),  # depth 1
        LoadOptions("pinned", 3, 1000, 3, 2),  # chunk cuts tensors at odd places
        LoadOptions("pinned", 64, 512, 2),  # more threads than chunks of some files
        LoadOptions(),
    ],
)
def test_staged_cpu_equals_direct(packed, opts, verify):
    for r in range(2):
        want = load_pack(packed, r, verify=False)
        got = load_pack(packed, r, "cpu", verify=verify, options=dataclasses.replace(opts, staging="pinned"))
        assert list(got) == list(want)
        base = next(iter(got.values())).untyped_storage().data_ptr()
        for n, t in want.items():
            g = got[n]
            assert g.dtype == t.dtype and g.shape == t.shape and torch.equal(g, t), n
            assert g.untyped_storage().data_ptr() == base  # one arena
            assert (g.data_ptr() - base) % DEVICE_ALIGN == 0
        got.clear()


def test_reader_error_propagates(packed, monkeypatch):
    """A file that shrinks after the checks: the reader thread's PackError reaches the caller."""
    f = sorted(packed.glob("rank0-*.safetensors"))[-1]
    data = f.read_bytes()
    monkeypatch.setattr(reader, "check_rank_files", lambda *a: None)
    try:
        f.write_bytes(data[: len(data) - 100])
        with pytest.raises(PackError, match="unexpected end of file"):
            load_pack(packed, 0, "cpu", options=LoadOptions("pinned", 4, 512, 2))
    finally:
        f.write_bytes(data)
    load_pack(packed, 0, "cpu", options=LoadOptions("pinned", 4, 512, 2))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "opts",
    [LoadOptions(), LoadOptions("pinned", 3, 1000, 1, 1), LoadOptions("pinned", 8, 4096, 3, 4)],
)
def test_staged_cuda_equals_cpu(packed, opts):
    for r in range(2):
        want = load_pack(packed, r, verify=False)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # the caller's current stream is the one made to wait
            got = load_pack(packed, r, "cuda", options=opts)
            host = {n: g.to("cpu", non_blocking=False) for n, g in got.items()}
        for n, t in want.items():
            assert got[n].is_cuda and got[n].data_ptr() % DEVICE_ALIGN == 0, n
            assert torch.equal(host[n].view(torch.uint8), t.view(torch.uint8)), n


@pytest.mark.parametrize("staging", ["pinned", "direct"])
def test_placed_sees_the_returned_tensors_before_their_data(packed, staging):
    """``placed`` gets the very tensors load_pack returns (same dict, same memory) before any byte
    is read: a staged arena all zeros then, the weights after."""
    seen: list[tuple[dict, dict[str, int], bool]] = []

    def placed(ts: dict[str, torch.Tensor]) -> None:
        zeros = all(not t.view(torch.uint8).any() for t in ts.values())
        seen.append((ts, {n: t.data_ptr() for n, t in ts.items()}, zeros))

    want = load_pack(packed, 0, verify=False)
    got = load_pack(packed, 0, "cpu", options=LoadOptions(staging, 3, 1000, 2), placed=placed)
    assert len(seen) == 1
    ts, ptrs, zeros = seen[0]
    assert ts is got and ptrs == {n: t.data_ptr() for n, t in got.items()}
    assert zeros or staging == "direct"  # a CPU "direct" load allocates with torch.empty
    assert all(torch.equal(got[n], t) for n, t in want.items())
