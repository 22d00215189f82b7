"""Stages 6-7: pack.json contents, split files, the streaming writer's memory, and every reader
check: corrupted byte (refused by default; more in test_weights_integrity.py), truncated file,
header/index disagreement, shape mismatch, missing/unexpected parameters, non-empty output
directory."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import memory_probe
import pytest
import torch
from weights_helpers import hf_tensors, load_ranks, pack

from kiln.compiler.config import load_config
from kiln.compiler.mappings import param_specs
from kiln.compiler.parallel import ParallelConfig
from kiln.weights import (
    CheckpointStream,
    LoadOptions,
    PackError,
    PackIndex,
    discover_weights,
    expected_tensors,
    load_pack,
    verify_pack,
)


@pytest.fixture
def packed(checkpoint, tmp_path):
    d = checkpoint("llama")
    index, specs = pack(d, tmp_path / "pack", tp=2, max_file_bytes=60_000)
    return d, tmp_path / "pack", index, specs


def test_pack_json(packed, tmp_path):
    d, out, index, specs = packed
    doc = json.loads((out / "pack.json").read_text())
    assert (doc["format"], doc["version"], doc["tp"], doc["ep"], doc["dtype"], doc["quant"]) == (
        "kiln-pack",
        3,
        2,
        1,
        "float32",
        None,
    )
    assert len(doc["source"]["fingerprint"]) == 64 and {f["name"] for f in doc["source"]["files"]}
    assert "created" not in doc and "dir" not in doc["source"]  # reproducible: see index.provenance
    for r, rank in enumerate(doc["ranks"]):
        assert (
            len(rank["files"]) > 1
            and rank["files"][0]["name"] == f"rank{r}-00001-of-{len(rank['files']):05d}.safetensors"
        )
        for f in rank["files"]:
            assert hashlib.sha256((out / f["name"]).read_bytes()).hexdigest() == f["sha256"]
            assert (out / f["name"]).stat().st_size == f["bytes"]
        want = expected_tensors(specs[r], "float32")
        assert {n: (tuple(t["shape"]), t["dtype"]) for n, t in rank["tensors"].items()} == want
        assert rank["tensors"]["layers.0.attn.qkv.weight"]["placement"] == "qkv-heads"
    # The fingerprint follows the source: the same files give the same one, another config another.
    assert PackIndex.load(out).source["fingerprint"] == index.source["fingerprint"]
    copy = tmp_path / "copy"
    shutil.copytree(d, copy)
    same = CheckpointStream(discover_weights(copy)).fingerprint(copy)["fingerprint"]
    assert same == index.source["fingerprint"]
    (copy / "config.json").write_text(
        (d / "config.json").read_text().replace("{", '{"rms_norm_eps": 1e-5,', 1)
    )
    assert CheckpointStream(discover_weights(copy)).fingerprint(copy)["fingerprint"] != same


def test_corrupted_byte_is_refused_by_default_and_named(packed):
    _, out, index, _ = packed
    t = index.ranks[1].tensors["layers.1.mlp.down.weight"]
    with open(out / t.file, "r+b") as f:
        f.seek(t.offset + t.nbytes // 2)
        b = f.read(1)
        f.seek(t.offset + t.nbytes // 2)
        f.write(bytes([b[0] ^ 0x40]))
    load_pack(out, 1, verify=False)  # sizes and headers are intact: only the hash can tell
    with pytest.raises(PackError, match=r"wsum64.*tensor layers\.1\.mlp\.down\.weight .*corrupt"):
        load_pack(out, 1)
    with pytest.raises(PackError, match=r"layers\.1\.mlp\.down\.weight"):
        verify_pack(out)
    load_pack(out, 0)  # the other rank is fine


def test_truncated_file_names_the_tensors_past_the_end(packed):
    _, out, index, _ = packed
    t = max(index.ranks[0].tensors.values(), key=lambda t: (t.file, t.offset))
    path = out / t.file
    os.truncate(path, path.stat().st_size - 10)
    with pytest.raises(PackError, match=rf"truncated.*{t.name}"):
        load_pack(out, 0)


def test_expected_shape_mismatch_and_missing_unexpected_are_named(packed):
    d, out, _, specs = packed
    want = expected_tensors(specs[0], "float32")
    bad = dict(want)
    bad["layers.0.attn.o.weight"] = ((64, 99), "float32")
    with pytest.raises(PackError, match=r"layers\.0\.attn\.o\.weight.*\[64, 32\].*\[64, 99\]"):
        load_pack(out, 0, expected=bad)
    bad = dict(want)
    del bad["norm.weight"]
    bad["layers.9.attn.qkv.weight"] = ((1,), "float32")
    with pytest.raises(PackError) as e:
        load_pack(out, 0, expected=bad)
    assert "layers.9.attn.qkv.weight" in str(e.value) and "norm.weight" in str(e.value)
    # A pack made for tp=2 checked against the tp=1 model: every sharded tensor mismatches.
    tp1 = expected_tensors(param_specs(load_config(d), ParallelConfig(tp=1), 0), "float32")
    with pytest.raises(PackError, match=r"embed\.weight"):
        load_pack(out, 0, expected=tp1)


def test_header_disagreeing_with_pack_json(packed):
    _, out, _, _ = packed
    doc = json.loads((out / "pack.json").read_text())
    doc["ranks"][0]["tensors"]["layers.0.mlp.down.weight"]["shape"] = [32, 90]
    (out / "pack.json").write_text(json.dumps(doc))
    with pytest.raises(PackError, match=r"layers\.0\.mlp\.down\.weight"):
        load_pack(out, 0)


def test_missing_pack_json_file_and_rank(packed):
    _, out, index, _ = packed
    with pytest.raises(PackError, match="rank 2 is not in this pack"):
        load_pack(out, 2)
    (out / index.ranks[1].files[0].name).unlink()
    with pytest.raises(PackError, match="missing"):
        load_pack(out, 1)
    (out / "pack.json").unlink()
    with pytest.raises(PackError, match=r"no pack\.json"):
        load_pack(out, 0)


def test_non_empty_output_needs_force(packed):
    d, out, _, _ = packed
    with pytest.raises(PackError, match="--force"):
        pack(d, out, tp=2)
    pack(d, out, tp=1, force=True)  # a tp=1 pack replaces the tp=2 files
    assert sorted(p.name for p in out.iterdir()) == ["pack.json", "rank0.safetensors"]


def test_cpu_load_matches_checkpoint(packed):
    d, out, _, specs = packed
    hf = hf_tensors(d)
    ranks = load_ranks(out, specs)
    assert torch.equal(
        torch.cat([r["layers.1.attn.o.weight"] for r in ranks], 1),
        hf["model.layers.1.self_attn.o_proj.weight"],
    )


def test_streaming_pack_memory_is_bounded(tmp_path):
    """Packing a 100 MB checkpoint holds far less than the model in anonymous memory: staging of the
    tensors in flight (about one layer) + the 8 MiB write queue + hashing buffers. Measured in a
    fresh process after a warm-up pack: 19-37 MiB from one run to the next (the reader and writer
    threads' heaps), so the bound is half the checkpoint; a pack that held it whole would fail."""
    from kiln.compiler.synth import make_checkpoint

    cfg = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=4096,
    )
    d = make_checkpoint(
        tmp_path / "ckpt", cfg, "float32", max_shard_size="16MB", engine="fast", with_tokenizer=False
    )
    size = sum(p.stat().st_size for p in d.glob("*.safetensors"))
    assert size > 90e6
    got = memory_probe.measure("pack", d, tmp_path / "p", 2, 8 << 20)
    assert got["peak_write_queue_bytes"] <= 8 << 20
    assert got["growth"] < size // 2, (
        f"{got['growth'] / 2**20:.1f} MiB for a {size / 2**20:.0f} MiB checkpoint"
    )


@pytest.mark.parametrize("chunk,threads", [(4096, 3), (1000, 1), (1 << 20, 8)])
def test_staged_pipeline_equals_direct_load(packed, chunk, threads):
    """The chunked read -> staging buffer -> copy pipeline (what CUDA loads use), run on CPU with
    chunks that cut tensors at odd places and a small ring of buffers."""
    _, out, _, _ = packed
    for r in range(2):
        want = load_pack(out, r)
        got = load_pack(out, r, "cpu", verify=False, options=LoadOptions("pinned", threads, chunk, 2))
        assert list(got) == list(want)
        for n in want:
            assert got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]), n
            assert (got[n].data_ptr() - got[n].untyped_storage().data_ptr()) % 256 == 0  # offset in the arena
