"""Tampered artifacts (a copy of the demo artifact per test): a flipped byte in a weight, graph or
tokenizer file, a truncated file, an edited manifest, another kiln or other kernel sources, a
manifest that does not parse or lacks a field, a vocab_size the weights contradict. Each is refused
by default with one line naming the file or field and the fix; with verify off (``--no-verify``)
every corrupt file still ends in one line, never a traceback. Kernel files are covered by
tests/runtime/test_artifact_kernel_cache.py (the same file-table check)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln import artifact_format as fmt
from kiln.errors import KilnError
from kiln.runtime.artifact import ArtifactError, open_artifact
from kiln.runtime.llm import LLM
from kiln.runtime.loader import load_model
from kiln.runtime.sampling_params import SamplingParams


@pytest.fixture
def art(demo_artifact, tmp_path) -> Path:
    return Path(shutil.copytree(demo_artifact, tmp_path / "art"))


def flip_byte(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if at is None else at
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def rehash_manifest(art: Path, edit) -> None:
    """Edit the manifest and record its new hash, as a compiler that wrote those values would."""
    m = json.loads((art / "manifest.json").read_text())
    edit(m)
    m[fmt.MANIFEST_HASH_KEY] = fmt.manifest_digest(m)
    (art / "manifest.json").write_text(json.dumps(m, indent=2, sort_keys=True))


def refused(art: Path, match: str, verify: bool = True, **env) -> str:
    """Load ``art`` (weights, graphs, tokenizer: what the engine does) and return the one-line error."""
    with pytest.raises(KilnError, match=match) as info:
        LLM(str(art), device="cpu", verify=verify)
    msg = str(info.value)
    assert "\n" not in msg and ("copy it again" in msg or "kiln compile" in msg), msg
    return msg


def test_the_intact_copy_loads_verified(art):
    out = LLM(str(art), device="cpu").generate(
        "Once upon a time", SamplingParams(max_tokens=4, temperature=0)
    )
    assert len(out[0].token_ids) == 4


def test_flipped_weight_byte_is_refused_by_the_pack_loader(art):
    flip_byte(art / "weights" / "rank0.safetensors")  # in the tensor data (the header is a few KB)
    msg = refused(art, "rank0.safetensors")
    assert "pack" in msg or "weights/" in msg


@pytest.mark.parametrize(
    "rel", ["graphs/model.py", "graphs/model.pt2", "tokenizer/tokenizer.json", "weights/pack.json"]
)
def test_flipped_byte_in_a_hashed_file_is_refused_naming_it(art, rel):
    flip_byte(art / rel)
    # the file check beside the weight stream, or (code) the graph loader's own check, first
    refused(art, f"{rel} (fails its hash check|does not match its hash)")


def test_truncated_file_is_refused_with_and_without_verify(art):
    tok = art / "tokenizer" / "tokenizer.json"
    tok.write_bytes(tok.read_bytes()[:-100])
    for verify in (True, False):
        refused(art, r"artifact file tokenizer/tokenizer.json has \d+ bytes, the manifest says", verify)


@pytest.mark.parametrize("graph_format", ["python", "pt2"])
def test_flipped_graph_byte_without_verify_is_one_line(art, graph_format, monkeypatch):
    monkeypatch.setenv("KILN_GRAPH_FORMAT", graph_format)
    rel = "graphs/model.py" if graph_format == "python" else "graphs/model.pt2"
    flip_byte(art / rel)
    open_artifact(art, "cpu", verify=False)  # sizes only: the manifest check lets it through ...
    refused(art, rel.split("/")[1], verify=False)  # ... the graph loader does not (it is code)


def test_garbage_tokenizer_files_without_verify_are_one_line(art):
    tok = art / "tokenizer" / "tokenizer.json"
    tok.write_bytes(b"\xff" * tok.stat().st_size)  # same size: only parsing tells
    refused(art, r"tokenizer file .*tokenizer\.json does not load", verify=False)


def test_garbage_tokenizer_config_without_verify_is_one_line(art):
    cfg = art / "tokenizer" / "tokenizer_config.json"
    cfg.write_bytes(b"{" * cfg.stat().st_size)
    refused(art, r"tokenizer file .*tokenizer_config\.json does not load", verify=False)


def test_broken_chat_template_is_one_line_naming_its_file(art):
    cfg = art / "tokenizer" / "tokenizer_config.json"
    text = cfg.read_text()
    cfg.write_text(text.replace("{% endfor %}", "{% endfxr %}"))  # same size, still JSON
    llm = LLM(str(art), device="cpu", verify=False)
    with pytest.raises(KilnError, match=r"tokenizer file .*tokenizer_config\.json does not load"):
        llm.chat([{"role": "user", "content": "Hi"}])


def test_edited_manifest_is_refused_with_or_without_verify(art):
    m = json.loads((art / "manifest.json").read_text())
    m["vocab_size"] += 1
    (art / "manifest.json").write_text(json.dumps(m, indent=2, sort_keys=True))
    for verify in (True, False):
        refused(art, "manifest.json was altered after `kiln compile`", verify)


def test_manifest_that_is_not_json_is_one_line(art):
    (art / "manifest.json").write_text('{"schema_version": 4, "files": ')
    refused(art, "manifest.json is not valid JSON")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda m: m["kv"].pop("page_size"), r"field 'kv\.page_size' is missing"),
        (lambda m: m.update(max_seq_len="1024"), r"field 'max_seq_len' is a string, not an integer"),
        (
            lambda m: m["files"]["graphs/model.py"].pop("xxh3_128"),
            r"field 'files\.graphs/model\.py\.xxh3_128'",
        ),
        (lambda m: m.update(decode_buckets=[]), "'decode_buckets' must be a non-empty ascending list"),
        (lambda m: m["kv"].update(page_size=0), r"field 'kv\.page_size' is 0, not a positive integer"),
        (lambda m: m.update(dtype="int8"), r"field 'dtype' is 'int8', not one of float32"),
        (
            lambda m: m["kernel_choices"].update(page_size=1),
            r"field 'kernel_choices\.page_size' is not a field",
        ),
        (
            lambda m: m["graphs"]["model"]["python"]["weight_keys"].append(7),
            r"field 'graphs\.model\.python\.weight_keys\[\d+\]' is an integer, not a string",
        ),
    ],
)
def test_missing_or_wrong_typed_field_is_named(art, edit, match):
    rehash_manifest(art, edit)
    refused(art, match, verify=False)


def test_vocab_size_the_weights_contradict_says_which_is_which(art):
    rehash_manifest(art, lambda m: m.update(vocab_size=m["vocab_size"] + 8))
    msg = refused(
        art, r"manifest field 'vocab_size' is 4104 but the weight pack's lm_head\.weight has 4096 rows"
    )
    assert "disagree" in msg


@pytest.mark.parametrize(
    ("name", "field"), [("kiln_version", "versions.kiln"), ("kernel_source_hash", "versions.kernel_sources")]
)
def test_another_kiln_or_other_kernel_sources_are_refused(art, monkeypatch, name, field):
    built = json.loads((art / "manifest.json").read_text())["versions"][field.split(".")[1]]
    monkeypatch.setattr(fmt, name, lambda: "other")  # what this process computes
    msg = refused(art, rf"manifest field '{field}' is '{built}' but .* 'other'")
    assert "kiln compile" in msg


def test_kernel_source_hash_follows_every_source_byte(tmp_path):
    import kiln.ops

    ops = Path(shutil.copytree(Path(kiln.ops.__file__).parent, tmp_path / "ops"))
    assert fmt.sources_hash(ops) == fmt.kernel_source_hash()
    (ops / "__pycache__").mkdir(exist_ok=True)
    (ops / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"compiled")
    (ops / "notes.txt").write_text("not a source")
    assert fmt.sources_hash(ops) == fmt.kernel_source_hash()
    cu = next(ops.rglob("*.cu"))
    flip_byte(cu)
    assert fmt.sources_hash(ops) != fmt.kernel_source_hash()


def test_verify_off_checks_sizes_only(art):
    flip_byte(art / "weights" / "rank0.safetensors")
    flip_byte(art / "tokenizer" / "special_tokens_map.json", at=0)  # read by nothing on this path
    assert load_model(str(art), "cpu", verify=False).artifact.manifest.vocab_size == 4096
    with pytest.raises(ArtifactError, match=r"special_tokens_map\.json fails its hash check"):
        open_artifact(art, "cpu", verify=True)


@pytest.mark.parametrize("flags", [[], ["--no-verify"]])
def test_cli_prints_one_line_and_no_traceback(art, flags):
    flip_byte(art / "graphs" / "model.py")
    env = dict(os.environ, KILN_GRAPH_FORMAT="python")
    cmd = [sys.executable, "-m", "kiln", "generate", str(art), "Hello", "--device", "cpu", *flags]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    errors = [line for line in p.stderr.splitlines() if not line.startswith("[kiln]")]
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert len(errors) == 1 and errors[0].startswith("error: ") and "graphs/model.py" in errors[0], p.stderr
