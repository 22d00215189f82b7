"""Stage 1: every discovery rule and every discovery error, on hand-made directories."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from weights_helpers import index_json

from kiln.weights import CheckpointError, CheckpointStream, discover_weights


def st(path, **tensors):
    save_file({k: v.contiguous() for k, v in tensors.items()} or {"x": torch.zeros(1)}, str(path))


def write_index(d, weight_map, name="model.safetensors.index.json"):
    (d / name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def names(wf):
    return [p.name for p in wf.files]


def test_hf_checkpoint_reads_exactly_the_index_shards(checkpoint):
    d = checkpoint("llama")
    wf = discover_weights(d)
    shards = sorted(set(index_json(d)["weight_map"].values()))
    assert wf.format == "safetensors" and wf.index is not None and len(shards) > 2
    assert sorted(names(wf)) == shards


def test_safetensors_preferred_over_bin(tmp_path):
    st(tmp_path / "model.safetensors", a=torch.ones(2))
    torch.save({"a": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    wf = discover_weights(tmp_path)
    assert wf.format == "safetensors" and names(wf) == ["model.safetensors"]


def test_index_names_exactly_its_shards_and_ignores_others(tmp_path):
    st(tmp_path / "a.safetensors", x=torch.ones(1))
    st(tmp_path / "b.safetensors", y=torch.ones(1))
    st(tmp_path / "stray.safetensors", z=torch.ones(1))
    write_index(tmp_path, {"x": "a.safetensors", "y": "b.safetensors"})
    wf = discover_weights(tmp_path)
    assert names(wf) == ["a.safetensors", "b.safetensors"]
    assert any("stray.safetensors" in s for s in wf.ignored)


def test_index_naming_missing_shards_lists_them(tmp_path):
    st(tmp_path / "model-00001-of-00003.safetensors", x=torch.ones(1))
    write_index(
        tmp_path,
        {
            "x": "model-00001-of-00003.safetensors",
            "y": "model-00002-of-00003.safetensors",
            "z": "model-00003-of-00003.safetensors",
        },
    )
    with pytest.raises(CheckpointError) as e:
        discover_weights(tmp_path)
    assert "model-00002-of-00003.safetensors" in str(e.value) and "model-00003-of-00003.safetensors" in str(
        e.value
    )


def test_invalid_index_is_an_error(tmp_path):
    st(tmp_path / "a.safetensors", x=torch.ones(1))
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="weight_map"):
        discover_weights(tmp_path)


def test_consolidated_beside_sharded_set_is_read_once(tmp_path):
    w = torch.arange(4.0)
    st(tmp_path / "model.safetensors", a=w, b=w.clone())
    st(tmp_path / "model-00001-of-00002.safetensors", a=w)
    st(tmp_path / "model-00002-of-00002.safetensors", b=w)
    wf = discover_weights(tmp_path)  # no index: the consolidated file alone
    assert names(wf) == ["model.safetensors"] and len(wf.ignored) == 2
    assert sorted(n for n, _ in CheckpointStream(wf)) == ["a", "b"]
    write_index(tmp_path, {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"})
    wf = discover_weights(tmp_path)  # with an index: exactly its shards
    assert names(wf) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert sorted(n for n, _ in CheckpointStream(wf)) == ["a", "b"]


def test_sharded_set_without_index_ignores_consolidated_mistral_file(tmp_path):
    st(tmp_path / "model-00001-of-00002.safetensors", a=torch.ones(1))
    st(tmp_path / "model-00002-of-00002.safetensors", b=torch.ones(1))
    st(tmp_path / "consolidated.safetensors", **{"layers.0.attention.wq.weight": torch.ones(1)})
    wf = discover_weights(tmp_path)
    assert names(wf) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_incomplete_sharded_set_without_index_lists_missing_numbers(tmp_path):
    st(tmp_path / "model-00001-of-00004.safetensors", a=torch.ones(1))
    st(tmp_path / "model-00003-of-00004.safetensors", b=torch.ones(1))
    with pytest.raises(CheckpointError, match=r"missing shard number\(s\) \[2, 4\]"):
        discover_weights(tmp_path)


def test_training_artifacts_never_read(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    for art in (
        "optimizer.pt",
        "scheduler.pt",
        "scaler.pt",
        "training_args.bin",
        "optimizer.bin",
        "rng_state_0.pth",
    ):
        (tmp_path / art).write_bytes(b"not a checkpoint at all")  # reading any of these would fail
    wf = discover_weights(tmp_path)
    assert wf.format == "pt" and names(wf) == ["pytorch_model.bin"]
    assert [n for n, _ in CheckpointStream(wf)] == ["w"]


def test_only_training_artifacts_fails_naming_patterns(tmp_path):
    (tmp_path / "optimizer.pt").write_bytes(b"x")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError) as e:
        discover_weights(tmp_path)
    msg = str(e.value)
    for pattern in ("*.safetensors", "*.bin", "*.pt", "model.safetensors.index.json"):
        assert pattern in msg
    assert "optimizer.pt" in msg


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        discover_weights(tmp_path / "nope")


def test_bin_index_and_pt_fallback(tmp_path):
    torch.save({"a": torch.ones(2)}, tmp_path / "pytorch_model-00001-of-00002.bin")
    torch.save({"b": torch.ones(3)}, tmp_path / "pytorch_model-00002-of-00002.bin")
    write_index(
        tmp_path,
        {"a": "pytorch_model-00001-of-00002.bin", "b": "pytorch_model-00002-of-00002.bin"},
        "pytorch_model.bin.index.json",
    )
    wf = discover_weights(tmp_path)
    assert wf.format == "pt" and wf.index is not None and len(wf.files) == 2
    got = dict(CheckpointStream(wf))
    assert torch.equal(got["a"], torch.ones(2)) and torch.equal(got["b"], torch.ones(3))


def test_same_tensor_in_two_files_is_an_error_naming_both(tmp_path):
    st(tmp_path / "first.safetensors", w=torch.ones(2))
    st(tmp_path / "second.safetensors", w=torch.ones(2))
    with pytest.raises(CheckpointError) as e:
        CheckpointStream(discover_weights(tmp_path))
    assert (
        "first.safetensors" in str(e.value) and "second.safetensors" in str(e.value) and "'w'" in str(e.value)
    )
