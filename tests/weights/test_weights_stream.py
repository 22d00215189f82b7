"""Stage 2: stable order, mmap and read-ahead agree, the read-ahead memory bound measured, and
.bin files only through torch.load(weights_only=True)."""

from __future__ import annotations

import collections

import memory_probe
import pytest
import torch
from weights_helpers import hf_tensors

from kiln.weights import CheckpointError, CheckpointStream, discover_weights
from kiln.weights.st_format import read_header, write_tensor_file

MIB = 1024 * 1024


def test_order_is_stable_and_sequential(checkpoint):
    d = checkpoint("qwen3")
    wf = discover_weights(d)
    first = [n for n, _ in CheckpointStream(wf)]
    assert first == [n for n, _ in CheckpointStream(wf)]
    expected = [n for f in wf.files for n in read_header(f).tensors]  # files in order, offsets in file
    assert first == expected and sorted(first) == sorted(hf_tensors(d))


def test_readahead_yields_the_same_tensors(checkpoint):
    d = checkpoint("qwen3")
    wf = discover_weights(d)
    a = list(CheckpointStream(wf))
    b = list(CheckpointStream(wf, readahead=3))
    assert [n for n, _ in a] == [n for n, _ in b]
    for (_, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.fixture(scope="module")
def big_shards(tmp_path_factory):
    """5 shards of 40 MiB (past glibc's largest mmap threshold, so freed buffers leave the RSS)."""
    d = tmp_path_factory.mktemp("big")
    g = torch.Generator().manual_seed(0)
    for s in range(5):
        tensors = {f"s{s}.t{i}": torch.randn(MIB, generator=g) for i in range(10)}  # 10 x 4 MiB
        write_tensor_file(d / f"model-{s + 1:05d}-of-00005.safetensors", tensors)
    return d


def test_readahead_peak_memory_is_bounded_by_the_window(big_shards):
    shard = max(f.stat().st_size for f in discover_weights(big_shards).files)
    k = 2
    got = memory_probe.measure("stream", big_shards, k)
    bound = (k + 1) * shard  # documented in kiln.weights.stream
    assert got["peak_buffered_bytes"] == bound
    assert got["growth"] <= bound + 16 * MIB, (got["growth"] / MIB, bound / MIB)
    assert got["growth"] >= 2 * shard, "read-ahead should really hold shards in memory"


def test_mmap_stream_holds_no_anonymous_memory(big_shards):
    shard = max(f.stat().st_size for f in discover_weights(big_shards).files)
    got = memory_probe.measure("stream", big_shards, 0)
    assert got["bytes"] == 5 * 40 * MIB
    assert got["growth"] < shard // 2, got["growth"] / MIB


class NotATensor:
    def __init__(self) -> None:
        self.payload = "arbitrary object"


def test_pickled_objects_are_refused(tmp_path):
    torch.save({"w": torch.ones(2), "evil": NotATensor()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="weights_only=True"):
        list(CheckpointStream(discover_weights(tmp_path)))


def test_bin_stream_sorted_by_name(tmp_path):
    sd = collections.OrderedDict((n, torch.full((2,), float(i))) for i, n in enumerate(["z", "a", "m"]))
    torch.save(sd, tmp_path / "pytorch_model.bin")
    got = list(CheckpointStream(discover_weights(tmp_path)))
    assert [n for n, _ in got] == ["a", "m", "z"]
    assert torch.equal(got[0][1], sd["a"])
