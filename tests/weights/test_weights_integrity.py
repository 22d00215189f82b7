"""Integrity on by default (issue 25): pack.json records the xxh3 of each file's header and the
wsum64 of each tensor; ``load_pack`` checks the headers before reading and every tensor after it
has landed (on a GPU: one kernel over the arena; here: numpy, on the staged pipeline and the CPU
path) and refuses a flipped byte naming the tensor, its file and byte range; ``verify=False`` skips
the check. Packs are byte-identical across runs and directories; a pack of the previous format
version is refused with the re-pack command."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import xxhash
from weights_helpers import pack, wsum64_definition

import kiln.weights.reader as reader
from kiln.weights import LoadOptions, PackError, load_pack, verify_pack

# The staged pipeline on a CPU device (the path CUDA loads take) and the CPU direct path.
PATHS = {
    "staged": LoadOptions("pinned", threads=3, chunk_bytes=3 * 4096 + 100, buffers_per_thread=2),
    "cpu": LoadOptions("direct", threads=3),
}


@pytest.fixture
def packed(checkpoint, tmp_path):
    out = tmp_path / "pack"
    index, _ = pack(checkpoint("llama"), out, tp=2, max_file_bytes=60_000)
    return out, index


def flip(path: Path, pos: int, mask: int = 0x40) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ mask]))


def test_pack_json_records_header_hashes_and_tensor_checksums(packed):
    out, _ = packed
    doc = json.loads((out / "pack.json").read_text())
    assert doc["version"] == 3 and "block_bytes" not in doc
    for rank in doc["ranks"]:
        for f in rank["files"]:
            data = (out / f["name"]).read_bytes()
            ds = f["data_start"]
            assert ds == 8 + int.from_bytes(data[:8], "little")
            assert f["header_xxh3"] == xxhash.xxh3_64_hexdigest(data[:ds])
            assert f["sha256"] == hashlib.sha256(data).hexdigest()
            assert set(f) == {"name", "bytes", "sha256", "data_start", "header_xxh3"}
        # Each rank's own checksum of each tensor (both ranks have the same names, sharded differently).
        for name, t in rank["tensors"].items():
            data = (out / t["file"]).read_bytes()[t["offset"] : t["offset"] + t["nbytes"]]
            assert t["wsum64"] == f"{wsum64_definition(data):016x}", (rank["rank"], name)


def _refused(out: Path, rank: int, opts: LoadOptions, t) -> str:
    with pytest.raises(PackError) as e:
        load_pack(out, rank, options=opts)
    msg = str(e.value)
    assert f"tensor {t.name} ({out / t.file} bytes [{t.offset}, {t.offset + t.nbytes}))" in msg, msg
    assert "wsum64" in msg and "corrupt" in msg and "copy it again" in msg and "kiln pack" in msg, msg
    return msg


@pytest.mark.parametrize("path", sorted(PATHS))
def test_flipped_data_byte_is_refused_by_default(packed, path):
    out, index = packed
    t = index.ranks[1].tensors["layers.1.mlp.down.weight"]
    pos = t.offset + t.nbytes // 2
    good = load_pack(out, 1, options=PATHS[path])[t.name].clone()
    flip(out / t.file, pos)
    msg = _refused(out, 1, PATHS[path], t)
    assert msg.count("tensor ") == 1  # only the altered one
    # The check is what refuses it: without it the altered tensor loads.
    bad = load_pack(out, 1, verify=False, options=PATHS[path])[t.name]
    assert bad.shape == good.shape and not torch.equal(bad, good)
    load_pack(out, 0, options=PATHS[path])  # the other rank is intact
    with pytest.raises(PackError, match=rf"tensor {t.name} .*bytes \[{t.offset}, {t.offset + t.nbytes}\)"):
        verify_pack(out)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_flipped_byte_in_any_tensor_is_refused(packed, path):
    """Each tensor of a rank in turn, its first and its last byte (partial last words, which no
    tensor of a real pack has, are in test_weights_checksum.py)."""
    out, index = packed
    for t in index.ranks[0].tensors.values():
        for pos in (t.offset, t.offset + t.nbytes - 1):
            flip(out / t.file, pos, 0x01)
            _refused(out, 0, PATHS[path], t)
            flip(out / t.file, pos, 0x01)
    load_pack(out, 0, options=PATHS[path])


def test_the_check_covers_the_data_where_it_landed(packed, monkeypatch):
    """A byte altered after the file read (a bad host-to-device copy, memory): the check runs on the
    loaded arena, so it is refused too; a check of the file bytes alone would pass it."""
    out, index = packed
    t = index.ranks[0].tensors["layers.0.attn.qkv.weight"]
    clean = load_pack(out, 0, options=PATHS["staged"])[t.name]
    real = reader._load_staged

    def corrupting(pack_dir, tensors, dev, opts, placed=None):
        got, arena, offsets = real(pack_dir, tensors, dev, opts, placed)
        got[t.name].view(-1).view(torch.uint8)[5] ^= 0x10
        return got, arena, offsets

    monkeypatch.setattr(reader, "_load_staged", corrupting)
    _refused(out, 0, PATHS["staged"], t)
    assert not torch.equal(load_pack(out, 0, verify=False, options=PATHS["staged"])[t.name], clean)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_flipped_header_bytes_are_refused_naming_the_tensor(packed, path):
    out, index = packed
    t = index.ranks[0].tensors["layers.0.attn.o.weight"]
    raw = (out / t.file).read_bytes()
    # A byte of the tensor's name in the header: the header still parses, the entry is renamed.
    flip(out / t.file, raw.index(json.dumps(t.name).encode()) + 3, 0x01)
    with pytest.raises(PackError) as e:
        load_pack(out, 0, options=PATHS[path])
    msg = str(e.value)
    assert str(out / t.file) in msg and "header bytes [0, " in msg and "xxh3" in msg, msg
    assert t.name in msg and "corrupt" in msg, msg


@pytest.mark.parametrize("path", sorted(PATHS))
def test_flipped_metadata_byte_is_refused(packed, path):
    """A header byte no structural check sees (the rank in __metadata__): only the hash tells."""
    out, index = packed
    name = index.ranks[1].files[0].name
    raw = (out / name).read_bytes()
    flip(out / name, raw.index(b'"rank":"1"') + len(b'"rank":"'), 0x01)  # "1" -> "0"
    load_pack(out, 1, verify=False, options=PATHS[path])
    with pytest.raises(PackError, match=rf"{name}: header bytes \[0, \d+\).*__metadata__"):
        load_pack(out, 1, options=PATHS[path])


@pytest.mark.parametrize("path", sorted(PATHS))
def test_truncated_file_is_refused(packed, path):
    out, index = packed
    t = max(index.ranks[0].tensors.values(), key=lambda t: (t.file, t.offset))
    os.truncate(out / t.file, (out / t.file).stat().st_size - 1)
    with pytest.raises(
        PackError, match=rf"{t.file} is \d+ bytes but pack.json records \d+: truncated.*{t.name}"
    ):
        load_pack(out, 0, options=PATHS[path])


def test_packs_are_byte_identical(checkpoint, tmp_path):
    """Two packs of the same checkpoint, from two copies of it at different paths, into two output
    directories: every file is byte-identical (pack.json included); the run-specific facts are
    returned as provenance instead."""
    for name, kw in [
        ("llama", dict(tp=2, max_file_bytes=60_000)),
        ("qwen3_moe", dict(tp=2, ep=2, dtype="bfloat16", quant="fp8")),
    ]:
        src = checkpoint(name)
        copy = tmp_path / f"copy-{name}"
        shutil.copytree(src, copy)
        a, _ = pack(src, tmp_path / f"a-{name}", **kw)
        b, _ = pack(copy, tmp_path / "elsewhere" / f"b-{name}", **kw)
        files_a = sorted(p.name for p in (tmp_path / f"a-{name}").iterdir())
        files_b = sorted(p.name for p in (tmp_path / "elsewhere" / f"b-{name}").iterdir())
        assert files_a == files_b and "pack.json" in files_a and len(files_a) > 2
        for f in files_a:
            da = (tmp_path / f"a-{name}" / f).read_bytes()
            db = (tmp_path / "elsewhere" / f"b-{name}" / f).read_bytes()
            assert da == db, f"{name}: {f} differs between two packs"
        assert a.provenance.source_dir == str(src.resolve()) and b.provenance.source_dir == str(
            copy.resolve()
        )
        assert a.provenance.created and a.provenance.peak_write_queue_bytes > 0
        assert set(a.provenance.to_json()) >= {"created", "source_dir", "seconds"}


def test_previous_format_version_is_refused(packed):
    """A version-2 pack.json (xxh3 data blocks, crc32 per tensor) over intact files."""
    out, _ = packed
    doc = json.loads((out / "pack.json").read_text())
    doc["version"] = 2
    doc["block_bytes"] = 8 << 20
    for rank in doc["ranks"]:
        for f in rank["files"]:
            f["blocks_xxh3"] = ["0" * 16]
        for t in rank["tensors"].values():
            t["crc32"] = f"{int(t.pop('wsum64'), 16) & 0xFFFFFFFF:08x}"
    (out / "pack.json").write_text(json.dumps(doc, indent=1))
    with pytest.raises(
        PackError, match=r"pack format version 2 but this kiln reads version 3; re-pack.*`kiln pack`"
    ):
        load_pack(out, 0)


def test_malformed_checksum_is_refused(packed):
    out, _ = packed
    doc = json.loads((out / "pack.json").read_text())
    doc["ranks"][0]["tensors"]["norm.weight"]["wsum64"] = "12ab"
    (out / "pack.json").write_text(json.dumps(doc, indent=1))
    with pytest.raises(PackError, match=r"tensor norm\.weight of rank 0 records wsum64 '12ab', not 16 hex"):
        load_pack(out, 0)
