"""The compile cache (kiln/compile_cache.py) and `kiln cache ls/rm` (kiln/cli_cache.py).

Most tests inject a build that copies the session's demo artifact (a real one, built once by
conftest's ``demo_one_rank``) and counts its calls; one runs the real ``python -m kiln compile``
subprocess, and one races two processes for the same entry.
"""

import dataclasses
import errno
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

from kiln import artifact_format as fmt
from kiln import compile_cache as cc
from kiln.cli import cli
from kiln.manifest import Manifest, Versions
from kiln.runtime.artifact import open_artifact

# the demo artifact's options (kiln/demo.py, CPU)
DEMO_ARGS = ["--dtype", "float32", "--max-batch-size", "8", "--max-seq-len", "1024", "--chunk-size", "512"]


def stamp(art: Path) -> None:
    """Record this process's versions in an artifact's manifest, as a compile by it would."""
    m = Manifest.load(art)
    if m.versions != Versions.current():
        dataclasses.replace(m, versions=Versions.current()).save(art)


class CopyBuild:
    """A build that copies a real artifact into place (as this process's kiln would have built it:
    ``stamp``) and records each call."""

    def __init__(self, art: Path, stamp: bool = True):
        self.art, self.stamp, self.calls = art, stamp, []

    def __call__(self, checkpoint, out, args, device):
        self.calls.append((Path(checkpoint), list(args), device))
        shutil.copytree(self.art, out)
        if self.stamp:
            stamp(out)


@pytest.fixture
def ckpt(demo_one_rank):
    return Path(demo_one_rank).parent / "checkpoint"


@pytest.fixture
def build(demo_one_rank):
    return CopyBuild(Path(demo_one_rank))


def _no_build(*args):
    raise AssertionError("built again")


# ----------------------------------------------------------------------------- find or build
def test_second_start_builds_nothing(tmp_path, ckpt, build):
    first = cc.find_or_build(ckpt, DEMO_ARGS, "cpu", tmp_path, build)
    second = cc.find_or_build(ckpt, DEMO_ARGS, "cpu", tmp_path, build)
    assert first == second == tmp_path / cc.cache_key(ckpt, DEMO_ARGS, "cpu") / "artifact"
    assert len(build.calls) == 1
    # the build got every option explicitly, defaults filled
    _, args, device = build.calls[0]
    assert device == "cpu" and args == cc.render_args(cc.normalize_options(DEMO_ARGS))
    assert {"--max-batch-size", "--page-size", "--fold-norms"} <= set(args)
    assert open_artifact(second, "cpu").manifest.max_batch_size == 8
    assert not cc.partial_builds(tmp_path)


def test_real_compile_once_then_loaded(tmp_path, ckpt):
    """The default build: `python -m kiln compile` in a subprocess; the next start loads it."""
    art = cc.find_or_build(ckpt, DEMO_ARGS, "cpu", tmp_path)
    m = open_artifact(art, "cpu", verify=True).manifest
    assert (m.dtype, m.max_batch_size, m.max_seq_len, m.chunk_size) == ("float32", 8, 1024, 512)
    assert cc.find_or_build(ckpt, DEMO_ARGS, "cpu", tmp_path, _no_build) == art


def test_failed_real_compile_caches_nothing(tmp_path, ckpt):
    with pytest.raises(cc.CacheError, match=r"`kiln compile` of .* failed \(exit status 2"):
        cc.find_or_build(ckpt, ["--dtype", "float64"], "cpu", tmp_path)  # kiln compile refuses it
    assert not cc.list_entries(tmp_path) and not cc.partial_builds(tmp_path)


def test_options_in_any_spelling_give_one_key(ckpt):
    key = cc.cache_key(ckpt, DEMO_ARGS, "cpu")
    spelled = {"chunk_size": 512, "max_seq_len": "1024", "dtype": "float32", "max_batch_size": 8}
    assert cc.cache_key(ckpt, spelled, "cpu") == key
    reordered = ["--chunk-size=512", "--fold-norms", "--max-seq-len", "1024", "--page-size", "16"]
    assert cc.cache_key(ckpt, [*reordered, "--max-batch-size=8", "--dtype", "float32"], "cpu") == key
    assert cc.cache_key(ckpt, [], "cpu") == cc.cache_key(ckpt, ["--dtype", "bfloat16", "--tp", "1"], "cpu")
    # content, not place: a copy of the checkpoint has the same key
    copy = shutil.copytree(ckpt, Path(ckpt).parent.parent / f"copy-{os.getpid()}")
    try:
        assert cc.cache_key(copy, DEMO_ARGS, "cpu") == key
    finally:
        shutil.rmtree(copy)


@pytest.mark.parametrize("change", ["option", "kiln_version", "kernel_sources", "torch", "device_kind"])
def test_a_change_makes_a_new_entry(tmp_path, ckpt, build, monkeypatch, change):
    first = cc.find_or_build(ckpt, DEMO_ARGS, "cpu", tmp_path, build)
    args = DEMO_ARGS
    if change == "option":
        args = [*DEMO_ARGS, "--no-fold-norms"]
    elif change == "kiln_version":
        monkeypatch.setattr(fmt, "kiln_version", lambda: "99.0.0")
    elif change == "kernel_sources":
        monkeypatch.setattr(fmt, "kernel_source_hash", lambda: "0" * 64)
    elif change == "torch":
        monkeypatch.setattr(torch, "__version__", "9.9.9")
    else:
        monkeypatch.setattr(cc, "device_kind", lambda device: "NVIDIA H200 sm_90")
    second = cc.find_or_build(ckpt, args, "cpu", tmp_path, build)
    assert second != first and len(build.calls) == 2
    assert {e.key for e in cc.list_entries(tmp_path)} == {first.parent.name, second.parent.name}
    assert cc.find_or_build(ckpt, args, "cpu", tmp_path, _no_build) == second


def test_a_build_of_other_versions_is_refused(tmp_path, ckpt, demo_one_rank, monkeypatch):
    """A compile that records other versions than the key's (another kiln on the subprocess's path,
    sources edited meanwhile) is not cached: the runtime would refuse that entry at every start."""
    monkeypatch.setattr(fmt, "kiln_version", lambda: "99.0.0")
    with pytest.raises(cc.CacheError, match=r"recorded versions\.kiln '.*' but this process has '99\.0\.0'"):
        cc.find_or_build(ckpt, DEMO_ARGS, "cpu", tmp_path, CopyBuild(Path(demo_one_rank), stamp=False))
    assert not cc.list_entries(tmp_path) and not cc.partial_builds(tmp_path)


def _rewrite_weights(path: Path, names=None):
    """Save the weights again with new values (``names``: only those tensors), as a fine-tune saved
    over the checkpoint would: same names, dtypes, shapes and order, so the same header and size."""
    with safe_open(path, "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    for k in names or tensors:
        tensors[k] = tensors[k] + 0.01
    save_file(tensors, path, metadata=meta)


@pytest.mark.parametrize("change", ["weights", "one_tensor", "config", "tokenizer"])
def test_a_changed_checkpoint_gets_a_new_key(tmp_path, ckpt, change):
    copy = Path(shutil.copytree(ckpt, tmp_path / "ckpt"))
    key = cc.cache_key(copy, DEMO_ARGS, "cpu")
    st = copy / "model.safetensors"
    size = st.stat().st_size
    if change in ("weights", "one_tensor"):
        header = cc.checkpoint_identity(copy)["weights"]["model.safetensors"]["header"]
        _rewrite_weights(st, ["model.layers.2.self_attn.q_proj.weight"] if change == "one_tensor" else None)
        # the header and size did not change: only the sampled bytes tell the two apart
        assert cc.checkpoint_identity(copy)["weights"]["model.safetensors"]["header"] == header
        assert st.stat().st_size == size
    elif change == "config":
        cfg = json.loads((copy / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-6}))
    else:
        tok = copy / "tokenizer_config.json"
        tok.write_text(json.dumps({**json.loads(tok.read_text()), "model_max_length": 77}))
    assert cc.cache_key(copy, DEMO_ARGS, "cpu") != key


DAMAGE = {
    "marker": ("no entry.json: its compile did not finish", lambda art: (art.parent / cc.MARKER).unlink()),
    "file": ("tokenizer/tokenizer.json is missing", lambda art: (art / "tokenizer/tokenizer.json").unlink()),
    "truncated": (
        "weights/rank0.safetensors has",
        lambda art: os.truncate(art / "weights/rank0.safetensors", 1000),
    ),
    "manifest": (
        "was altered after `kiln compile`",
        lambda art: (art / "manifest.json").write_text(
            (art / "manifest.json").read_text().replace('"max_batch_size": 8', '"max_batch_size": 9')
        ),
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_entry_is_rebuilt(tmp_path, ckpt, build, capfd, damage):
    art = cc.find_or_build(ckpt, DEMO_ARGS, "cpu", tmp_path, build)
    reason, do = DAMAGE[damage]
    do(art)
    assert reason in (cc.entry_problem(art.parent) or "")
    capfd.readouterr()
    assert cc.find_or_build(ckpt, DEMO_ARGS, "cpu", tmp_path, build) == art
    assert len(build.calls) == 2 and cc.entry_problem(art.parent) is None
    notice = [line for line in capfd.readouterr().err.splitlines() if "unusable" in line]
    assert len(notice) == 1 and art.parent.name in notice[0] and reason in notice[0]


def test_interrupted_build_is_never_used(tmp_path, ckpt, build, demo_one_rank):
    key = cc.cache_key(ckpt, DEMO_ARGS, "cpu")
    # a build killed before it finished: its temporary directory, with a whole artifact but no marker
    stale = tmp_path / f"{cc.TMP_PREFIX}{key}-999999"
    shutil.copytree(demo_one_rank, stale / cc.ARTIFACT)
    assert cc.partial_builds(tmp_path) == [stale]

    def interrupted(checkpoint, out, args, device):
        shutil.copytree(demo_one_rank, out)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cc.find_or_build(ckpt, DEMO_ARGS, "cpu", tmp_path, interrupted)
    assert not cc.list_entries(tmp_path) and not cc.partial_builds(tmp_path)

    def incomplete(checkpoint, out, args, device):
        shutil.copytree(demo_one_rank, out)
        (out / "graphs" / "model.py").unlink()

    with pytest.raises(
        cc.CacheError, match=r"did not leave a complete artifact .*graphs/model\.py is missing"
    ):
        cc.find_or_build(ckpt, DEMO_ARGS, "cpu", tmp_path, incomplete)
    assert not cc.list_entries(tmp_path) and not cc.partial_builds(tmp_path)
    art = cc.find_or_build(ckpt, DEMO_ARGS, "cpu", tmp_path, build)
    assert len(build.calls) == 1 and cc.entry_problem(art.parent) is None


RACER = """
import dataclasses, shutil, sys, time
from pathlib import Path
from kiln import artifact_format as fmt, compile_cache as cc
from kiln.manifest import Manifest, Versions
ckpt, cache, art, gate = map(Path, sys.argv[1:5])
# the shared checkout's sources may change while the test runs: pin them, or two processes started
# a second apart could compute different keys
fmt.kernel_source_hash = lambda: "pinned"
cc.build_sources_hash = lambda: "pinned"

def build(checkpoint, out, args, device):
    with open(gate / "builds", "a") as f:
        f.write("build\\n")
    while not (gate / "release").exists():
        time.sleep(0.02)
    shutil.copytree(art, out)
    m = Manifest.load(out)
    dataclasses.replace(m, versions=Versions.current()).save(out)

path = cc.find_or_build(ckpt, sys.argv[5:], "cpu", cache, build)
assert "kiln.compiler" not in sys.modules, "the cache imported the compiler"
print(path)
"""


def _wait_for(what, cond, procs, limit=180.0):
    """Poll ``cond`` (a hang guard, not a timing check): fail if a process ends first or it never holds."""
    end = time.monotonic() + limit
    while not cond():
        for p in procs:
            if p.poll() is not None:
                pytest.fail(f"a racer exited ({p.returncode}) before {what}: {p.stderr.read()}")
        if time.monotonic() > end:
            pytest.fail(f"never saw {what}")
        time.sleep(0.05)


def test_two_processes_build_once(tmp_path, ckpt, demo_one_rank):
    gate, cache = tmp_path / "gate", tmp_path / "cache"
    gate.mkdir()
    cmd = [sys.executable, "-c", RACER, str(ckpt), str(cache), str(demo_one_rank), str(gate), *DEMO_ARGS]
    builds = gate / "builds"

    def start(name):
        err = open(gate / f"{name}.err", "w+")  # noqa: SIM115
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)

    a = start("a")
    _wait_for("the first build", builds.exists, [a])
    b = start("b")
    waiting = lambda: "waiting for it" in (gate / "b.err").read_text()
    _wait_for(
        "the second process wait", lambda: waiting() or len(builds.read_text().splitlines()) > 1, [a, b]
    )
    (gate / "release").touch()
    outs = [p.communicate(timeout=180)[0] for p in (a, b)]
    assert [a.returncode, b.returncode] == [0, 0], [(gate / f"{n}.err").read_text() for n in "ab"]
    assert builds.read_text().splitlines() == ["build"]
    assert outs[0] == outs[1] and Path(outs[0].strip()).is_dir()
    assert waiting() and f"using {outs[0].strip()}" in (gate / "b.err").read_text()


def test_resolve_artifact(tmp_path, ckpt, build, demo_one_rank):
    assert cc.resolve_artifact(demo_one_rank, [], "cpu", tmp_path / "c") == Path(demo_one_rank)
    assert not (tmp_path / "c").exists()  # an artifact is used as it is
    art = cc.find_or_build(ckpt, DEMO_ARGS, "cpu", tmp_path / "c", build)
    assert cc.resolve_artifact(ckpt, DEMO_ARGS, "cpu", tmp_path / "c") == art


def test_read_only_cache_still_serves(tmp_path, ckpt, build, monkeypatch):
    art = cc.find_or_build(ckpt, DEMO_ARGS, "cpu", tmp_path, build)
    real_open = os.open

    def read_only(path, flags, *args):
        if str(path).endswith(".lock"):  # a cache mounted read-only: no lock file can be made
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", read_only)
    assert cc.find_or_build(ckpt, DEMO_ARGS, "cpu", tmp_path, _no_build) == art


# ----------------------------------------------------------------------------- options and errors
@pytest.mark.parametrize(
    "args, says",
    [
        (["--device", "cuda"], "--device is not taken here"),
        (["-o", "out"], "-o is not taken here"),
        (["--force"], "--force is not taken here"),
        (["--max-batch-size"], "--max-batch-size needs a value"),
        (["--max-batch-size", "eight"], "'max_batch_size' is 'eight'; it takes an integer"),
        (["--no-such"], "--no-such is not a `kiln compile` option"),
        (["--moe-tune=1"], "--moe-tune takes no value"),
        (["model_dir"], "'model_dir' is not an option"),
        ({"dtype": "float32", "devic": "cpu"}, "'devic' is not a `kiln compile` option"),
        ({"fold_norms": "no"}, "'fold_norms' is 'no'; it takes true or false"),
        ("--dtype float32", "not one string"),
    ],
)
def test_bad_compile_args(args, says):
    with pytest.raises(cc.CacheError, match=re.escape(says)):
        cc.normalize_options(args)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(cc.CacheError, match=re.escape(f"{tmp_path} has no config.json")):
        cc.find_or_build(tmp_path, [], "cpu", tmp_path / "cache", _no_build)


def test_option_table_matches_kiln_compile(tmp_path):
    """kiln/ may not import the compiler, so the cache keeps its own table of `kiln compile`'s flags:
    it must stay the compiler's (names, defaults, flag kinds; the tokenizer files are one list,
    kiln.artifact_format.TOKENIZER_FILES)."""
    from kiln.compiler.build import CompileOptions
    from kiln.compiler.cli_compile import compile_cmd

    flags = cc.compile_flags()
    params = {p.name: p for p in compile_cmd.params}
    # (--revision picks the checkpoint, whose content is in the key: not an artifact option;
    # --draft-model, --eagle3 and --mtp are refused, cc._NOT_TAKEN)
    drafts = {"draft_model", "eagle3", "mtp"}
    assert set(flags) == set(params) - {"model_dir", "revision", "out", "device", "force", *drafts}
    assert drafts <= set(cc._NOT_TAKEN)
    for name, (kind, default) in flags.items():
        assert default == getattr(CompileOptions(), name), name
        p = params[name]
        assert (kind in ("flag", "bool")) == bool(getattr(p, "is_flag", False) or p.secondary_opts), name
        assert (kind == "bool") == bool(p.secondary_opts), name
    # what the cache passes, `kiln compile` parses back to the same values
    given = [*DEMO_ARGS, "--quant", "fp8", "--moe-tune", "--no-fp8-cutlass", "--no-fold-norms"]
    opts = cc.normalize_options(given)
    ctx = compile_cmd.make_context("compile", [str(tmp_path), "-o", "out", *cc.render_args(opts)])
    for name, v in opts.items():
        got = ctx.params[name]
        assert (str(got) if name == "page_size" else got) == (str(v) if name == "page_size" else v), name


def test_default_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "mine"))
    assert cc.default_cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("KILN_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cc.default_cache_dir() == tmp_path / ".cache" / "kiln" / "artifacts"


# ----------------------------------------------------------------------------- kiln cache ls / rm
def _kiln(*args):
    r = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r.output


def test_cache_ls_and_rm(tmp_path, ckpt, build):
    d = str(tmp_path)
    assert f"no compiled artifacts in {d}" in _kiln("cache", "ls", "--cache-dir", d)
    a = cc.find_or_build(ckpt, DEMO_ARGS, "cpu", tmp_path, build).parent.name
    b = cc.find_or_build(ckpt, [*DEMO_ARGS, "--no-fold-norms"], "cpu", tmp_path, build).parent.name
    rows = {line[:12]: line for line in _kiln("cache", "ls", "--cache-dir", d).splitlines()}
    assert rows["KEY         "].split()[:3] == ["KEY", "MODEL", "ARCHITECTURE"]
    assert (
        "checkpoint" in rows[a[:12]]
        and "LlamaForCausalLM" in rows[a[:12]]
        and "--max-batch-size 8" in rows[a[:12]]
    )
    assert "--no-fold-norms" in rows[b[:12]] and "--no-fold-norms" not in rows[a[:12]]
    doc = json.loads(_kiln("cache", "ls", "--json", "--cache-dir", d))
    by_key = {e["key"]: e for e in doc["entries"]}
    assert set(by_key) == {a, b} and doc["cache_dir"] == d
    assert by_key[b]["options"]["fold_norms"] is False and by_key[a]["options"]["max_batch_size"] == 8
    assert all(e["problem"] is None and e["size_bytes"] > 1_000_000 for e in by_key.values())
    (tmp_path / a / cc.MARKER).unlink()
    assert "UNUSABLE (rebuilt at the next start): no entry.json" in _kiln("cache", "ls", "--cache-dir", d)
    assert _kiln("cache", "rm", a[:6], "--cache-dir", d) == f"removed {a}\n"
    assert not (tmp_path / a).exists() and (tmp_path / b).exists()
    assert _kiln("cache", "rm", "--all", "--cache-dir", d) == f"removed {b}\n"
    assert f"no compiled artifacts in {d}" in _kiln("cache", "ls", "--cache-dir", d)


def test_cache_rm_errors(tmp_path, ckpt, build):
    key = cc.find_or_build(ckpt, DEMO_ARGS, "cpu", tmp_path, build).parent.name
    env = {**os.environ, "KILN_CACHE": str(tmp_path)}  # the default cache directory
    r = subprocess.run(
        [sys.executable, "-m", "kiln", "cache", "rm", "ffff"], capture_output=True, text=True, env=env
    )
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [
        f"error: no cache entry 'ffff' in {tmp_path}; `kiln cache ls` lists them: {key[:12]} (checkpoint)"
    ]
    with pytest.raises(cc.CacheError, match="needs 4 characters or more"):
        cc.remove(tmp_path, key[:2])
    r = CliRunner().invoke(cli, ["cache", "rm", "--cache-dir", str(tmp_path)])
    assert r.exit_code == 2 and "give the KEY to remove" in r.output
    busy = f"{key} in {tmp_path} is in use by another process"
    with cc._locked(tmp_path, key), pytest.raises(cc.CacheError, match=re.escape(busy)):
        cc.remove(tmp_path, cc.ALL)  # while another process builds or checks the entry
    assert cc.remove(tmp_path, key) == [key] and not cc.list_entries(tmp_path)


def test_llm_takes_a_checkpoint_through_the_cache(demo_one_rank, tmp_path):
    """``LLM(CHECKPOINT)`` (and so serve / generate / bench, which build the same engine) compiles
    into the cache once (the real subprocess compile), and a second engine of the same checkpoint
    loads the cached entry and answers the same; the engine keeps the checkpoint as its source
    (the server's default model name)."""
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    ckpt = demo_one_rank.parent / "checkpoint"
    cache = tmp_path / "cache"
    args = "--dtype float32 --max-batch-size 4 --max-seq-len 256"
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = LLM(str(ckpt), device="cpu", cache_dir=str(cache), compile_args=args)
    assert first.engine.artifact.root.parent.parent == cache and first.engine.source == str(ckpt)
    got = first.generate([[5, 6, 7]], sp)[0].token_ids
    [entry] = cc.list_entries(cache)
    again = LLM(str(ckpt), device="cpu", cache_dir=str(cache), compile_args=args)
    assert again.engine.artifact.root == first.engine.artifact.root and len(cc.list_entries(cache)) == 1
    assert again.generate([[5, 6, 7]], sp)[0].token_ids == got
    assert entry.key in str(again.engine.artifact.root)


def test_an_altered_entry_is_refused_with_the_command_that_rebuilds_it(ckpt, build, tmp_path):
    """A cached artifact whose bytes were altered (sizes intact) fails its load's hash check; the
    error names the entry's `kiln cache rm`, after which the next start builds it again."""
    from kiln.runtime.engine import Engine, EngineOptions
    from kiln.weights.index import PackError

    art = cc.find_or_build(ckpt, DEMO_ARGS, "cpu", tmp_path, build)
    f = art / "weights" / "rank0.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    assert cc.entry_problem(art.parent) is None  # sizes intact: the cache cannot see it
    opts = EngineOptions(device="cpu", log=False, cache_dir=str(tmp_path), compile_args=" ".join(DEMO_ARGS))
    with pytest.raises(PackError, match=rf"`kiln cache rm {art.parent.name}`"):
        Engine(str(ckpt), opts)
    assert cc.remove(tmp_path, art.parent.name) == [art.parent.name]
    assert cc.find_or_build(ckpt, DEMO_ARGS, "cpu", tmp_path, build) == art and len(build.calls) == 2
