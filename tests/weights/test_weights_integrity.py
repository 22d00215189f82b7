"""Integrity on by default (issue 25): pack.json records xxh3 hashes of each file's header and data
blocks; ``load_pack`` checks every block as it reads it (staged path: in the reader threads;
CPU / direct: a threaded pass first) and refuses a flipped byte naming the file, the byte range and
the tensor; ``verify=False`` skips the check. Packs are byte-identical across runs and directories;
a pack of the previous format version is refused with the re-pack command."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import zlib
from pathlib import Path

import pytest
import torch
import xxhash
from weights_helpers import pack

import kiln.weights.integrity as integrity
from kiln.weights import LoadOptions, PackError, PackIndex, load_pack, verify_pack
from kiln.weights.index import PackTensor

BLOCK = 4096  # small blocks: the tiny pack has several per file, each overlapping few tensors
# The staged pipeline on a CPU device (the path CUDA loads take) and the CPU direct path.
PATHS = {
    "staged": LoadOptions("pinned", threads=3, chunk_bytes=3 * BLOCK + 100, buffers_per_thread=2),
    "cpu": LoadOptions("direct", threads=3),
}


@pytest.fixture
def packed(checkpoint, tmp_path):
    out = tmp_path / "pack"
    index, _ = pack(checkpoint("llama"), out, tp=2, max_file_bytes=60_000, block_bytes=BLOCK)
    return out, index


def flip(path: Path, pos: int, mask: int = 0x40) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ mask]))


def block_of(t: PackTensor, index: PackIndex, pos: int) -> tuple[int, int]:
    f = next(f for r in index.ranks for f in r.files if f.name == t.file)
    begin = f.data_start + (pos - f.data_start) // BLOCK * BLOCK
    return begin, min(begin + BLOCK, f.bytes)


def test_pack_json_records_block_hashes(packed):
    out, _ = packed
    doc = json.loads((out / "pack.json").read_text())
    assert doc["version"] == 2 and doc["block_bytes"] == BLOCK
    for rank in doc["ranks"]:
        for f in rank["files"]:
            data = (out / f["name"]).read_bytes()
            ds = f["data_start"]
            assert ds == 8 + int.from_bytes(data[:8], "little")
            assert f["header_xxh3"] == xxhash.xxh3_64_hexdigest(data[:ds])
            assert f["blocks_xxh3"] == [
                xxhash.xxh3_64_hexdigest(data[b : b + BLOCK]) for b in range(ds, len(data), BLOCK)
            ]
            assert len(f["blocks_xxh3"]) > 2 and f["sha256"] == hashlib.sha256(data).hexdigest()
        # Each rank's own crc32 of each tensor (both ranks have the same names, sharded differently).
        for name, t in rank["tensors"].items():
            data = (out / t["file"]).read_bytes()[t["offset"] : t["offset"] + t["nbytes"]]
            assert t["crc32"] == f"{zlib.crc32(data):08x}", (rank["rank"], name)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_flipped_data_byte_is_refused_by_default(packed, path):
    out, index = packed
    t = index.ranks[1].tensors["layers.1.mlp.down.weight"]
    pos = t.offset + t.nbytes // 2
    good = load_pack(out, 1, options=PATHS[path])[t.name].clone()
    flip(out / t.file, pos)
    with pytest.raises(PackError) as e:
        load_pack(out, 1, options=PATHS[path])
    msg = str(e.value)
    begin, end = block_of(t, index, pos)
    assert str(out / t.file) in msg and f"bytes [{begin}, {end})" in msg, msg
    assert f"changed: {t.name}" in msg and "corrupt" in msg and "kiln pack" in msg, msg
    # The check is what refuses it: without it the altered tensor loads.
    bad = load_pack(out, 1, verify=False, options=PATHS[path])[t.name]
    assert bad.shape == good.shape and not torch.equal(bad, good)
    load_pack(out, 0, options=PATHS[path])  # the other rank is intact
    with pytest.raises(PackError, match=rf"bytes \[{begin}, {end}\).*{t.name}"):
        verify_pack(out)


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


def test_staged_load_checks_every_block_once(packed, monkeypatch):
    """Chunks of 3 blocks (chunk_bytes rounded down to whole blocks), cut on each file's block grid:
    every block of the rank is hashed exactly once, by the reader threads."""
    out, index = packed
    calls: list[tuple[int, str]] = []
    lock = threading.Lock()
    real = integrity.xxh3

    def counting(buf):
        with lock:
            calls.append((len(buf), threading.current_thread().name))
        return real(buf)

    monkeypatch.setattr(integrity, "xxh3", counting)
    load_pack(out, 0, options=PATHS["staged"])
    files = index.ranks[0].files
    data = [len(f.blocks_xxh3) for f in files]
    headers = len(files)  # one header hash per file, on the calling thread
    assert len(calls) == sum(data) + headers
    readers = [n for _, n in calls if n.startswith("kiln-load-")]
    assert len(readers) == sum(data)
    sizes = sorted(n for n, name in calls if name.startswith("kiln-load-"))
    want = sorted(
        min(BLOCK, f.bytes - f.data_start - k * BLOCK) for f in files for k in range(len(f.blocks_xxh3))
    )
    assert sizes == want


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
    """A version-1 pack.json (no block hashes; created and source.dir recorded) over intact files."""
    out, _ = packed
    doc = json.loads((out / "pack.json").read_text())
    doc["version"] = 1
    doc["created"] = "2026-01-01T00:00:00+00:00"
    doc["source"]["dir"] = "/somewhere"
    doc.pop("block_bytes", None)
    for rank in doc["ranks"]:
        for f in rank["files"]:
            for k in ("data_start", "header_xxh3", "blocks_xxh3"):
                f.pop(k, None)
    (out / "pack.json").write_text(json.dumps(doc, indent=1))
    with pytest.raises(
        PackError, match=r"pack format version 1 but this kiln reads version 2; re-pack.*`kiln pack`"
    ):
        load_pack(out, 0)


def test_malformed_block_list_is_refused(packed):
    out, _ = packed
    doc = json.loads((out / "pack.json").read_text())
    doc["ranks"][0]["files"][0]["blocks_xxh3"].pop()
    (out / "pack.json").write_text(json.dumps(doc, indent=1))
    with pytest.raises(PackError, match=r"block hash\(es\), expected"):
        load_pack(out, 0)
