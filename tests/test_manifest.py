"""The typed manifest (kiln/manifest.py): the demo artifact's manifest.json is exactly what the
typed record writes back; ``from_json`` names the bad field (missing, wrong type, unknown, out of
range) in one line; ``save`` refuses a record it could not load; the derived values."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest

from kiln import artifact_format as fmt
from kiln.json_record import RecordError
from kiln.manifest import FileEntry, KVSpec, Manifest, MoEChoice


@pytest.fixture(scope="module")
def doc(demo_artifact) -> dict:
    return json.loads((demo_artifact / fmt.MANIFEST).read_text())


@pytest.fixture(scope="module")
def manifest(demo_artifact) -> Manifest:
    return Manifest.load(demo_artifact)


def test_the_file_on_disk_is_what_the_record_writes(doc, manifest, tmp_path):
    assert doc["schema_version"] == fmt.SCHEMA_VERSION
    assert manifest.document() == doc  # every key, the schema version and the self-hash
    manifest.save(tmp_path)
    assert (tmp_path / fmt.MANIFEST).read_text() == json.dumps(doc, indent=2, sort_keys=True) + "\n"
    assert Manifest.load(tmp_path) == manifest


def test_typed_fields(manifest):
    assert isinstance(manifest.kv, KVSpec) and manifest.kv.page_size == 16  # the default
    assert manifest.decode_buckets[-1] == manifest.max_batch_size
    assert all(isinstance(b, int) for b in manifest.kernel_choices.decode_num_splits)  # JSON keys are strings
    code = manifest.graphs["model"].python
    assert code is not None and code.file in manifest.files and isinstance(code.weight_keys, tuple)
    weights = [rel for rel in manifest.files if fmt.is_weight_data(rel)]
    assert weights and all(manifest.files[rel].checked_by == fmt.PACK_INDEX for rel in weights)
    assert manifest.routed_experts is None  # the demo model is dense


def body(doc: dict) -> dict:
    d = copy.deepcopy(doc)
    del d["schema_version"], d[fmt.MANIFEST_HASH_KEY]
    return d


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["rope"].pop("base"), "'rope.base' is missing"),
        (lambda d: d.update(tp="1"), "'tp' is a string, not an integer"),
        (lambda d: d.update(vocab_size=True), "'vocab_size' is a boolean, not an integer"),
        (lambda d: d["rope"].update(base=None), "'rope.base' is null, not a number"),
        (lambda d: d.update(eos_token_ids=[2, "3"]), r"'eos_token_ids\[1\]' is a string, not an integer"),
        (lambda d: d["kv"].update(P=16), "'kv.P' is not a field this kiln knows"),
        (lambda d: d["kernel_choices"]["decode_num_splits"].update(b8=1), "'kernel_choices.decode_num_splits' must have integer keys"),
        (lambda d: d.update(decode_buckets=[1, 4, 2, 8]), "'decode_buckets' must be a non-empty ascending list"),
        (lambda d: d.update(max_batch_size=16), r"ending at max_batch_size \(16\)"),
        (lambda d: d["files"]["weights/rank0.safetensors"].pop("checked_by"), r"'files\.weights/rank0\.safetensors\.checked_by' is missing"),
        (lambda d: d["graphs"].pop("model"), "'graphs.model' is missing"),
        (lambda d: d["kv"].update(page_size=-16), "'kv.page_size' is -16, not a positive integer"),
        (lambda d: d.update(ep=2), r"'ep' is 2, not a positive divisor of tp \(1\)"),
    ],
)  # fmt: skip
def test_from_json_names_the_bad_field(doc, edit, message):
    d = body(doc)
    edit(d)
    with pytest.raises(RecordError, match=message) as info:
        Manifest.from_json(d)
    assert "\n" not in str(info.value)


def test_optional_records_are_left_out_when_none(doc, manifest):
    # moe and fp8 are absent from a dense float32 artifact's kernel_choices; bos_token_id is written null
    assert set(doc["kernel_choices"]) == {"attention", "decode_graphs", "decode_num_splits", "gemv_plan"}
    table = {"64": {"w13": {"BLOCK_M": 16}, "w2": {"BLOCK_M": 16}, "backend": "cutlass"}}
    moe = MoEChoice("cutlass", "default", table, cutlass_min_tokens=64)
    with_moe = replace(manifest, kernel_choices=replace(manifest.kernel_choices, moe=moe))
    written = with_moe.to_json()["kernel_choices"]["moe"]
    assert written == {"backend": "cutlass", "method": "default", "table": table, "cutlass_min_tokens": 64}
    assert Manifest.from_json(with_moe.to_json()) == with_moe and moe.uses_cutlass
    assert not replace(moe, table={"64": {"w13": {}, "w2": {}}}).uses_cutlass


def test_save_refuses_what_load_would_refuse(manifest, tmp_path):
    bad = replace(manifest, decode_buckets=(1, 2))  # max_batch_size is 8
    with pytest.raises(RecordError, match="'decode_buckets' must be"):
        bad.save(tmp_path)
    unhashed = replace(manifest, files={"graphs/model.py": FileEntry(size=3)})
    with pytest.raises(RecordError, match=r"'files\.graphs/model\.py\.xxh3_128' is missing"):
        unhashed.save(tmp_path)
    assert not (tmp_path / fmt.MANIFEST).exists()


def test_derived_values(manifest):
    paged = replace(manifest, kv=replace(manifest.kv, page_size=16), max_seq_len=1000)
    assert paged.max_blocks == 63 and paged.kv.pages_for(16) == 1 and paged.kv.pages_for(17) == 2
    rows = replace(manifest, kv=replace(manifest.kv, page_size=1), max_seq_len=1000)
    assert rows.max_blocks == 1000 and rows.kv.pages_for(17) == 17
    moe = replace(manifest, model=manifest.model | {"moe": {"num_experts": 128, "top_k": 8}})
    assert moe.routed_experts == (8, 128)


def test_another_schema_version_is_refused_with_the_rebuild(demo_artifact, tmp_path, doc):
    old = dict(doc, schema_version=fmt.SCHEMA_VERSION - 1)
    old[fmt.MANIFEST_HASH_KEY] = fmt.manifest_digest(old)
    (tmp_path / fmt.MANIFEST).write_text(json.dumps(old))
    with pytest.raises(fmt.ArtifactError, match=r"'schema_version' is \d+; this kiln reads \d+: rebuild"):
        Manifest.load(tmp_path)
