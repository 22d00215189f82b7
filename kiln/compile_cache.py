"""The compile cache: a checkpoint plus ``kiln compile`` options -> an artifact built once per machine.

``kiln serve CHECKPOINT`` (and generate, bench, ``LLM``) call :func:`find_or_build`: the first start
compiles into the cache, every later start with the same checkpoint, options, device kind and
versions loads what is there and compiles nothing.

Layout of a cache directory (:func:`default_cache_dir`)::

    <key>/artifact/       the artifact, as `kiln compile -o` writes it
    <key>/entry.json      the marker: written after the compile finished and its artifact checked,
                          before the entry is published (what it was built from, options, versions)
    <key>/last-used       touched at every hit (its mtime is the "last used" time)
    .tmp-<key>-<pid>/     a build in progress; renamed to <key> when complete (atomic)
    .locks/<key>.lock     fcntl.flock'ed while a process checks or builds <key> (never deleted)

The key (:func:`cache_key`) hashes the checkpoint's content identity (config.json, the tokenizer
files and the weight index by their bytes; per weight file its name, size, safetensors header and a
few sampled bytes of every tensor, so a retrained checkpoint saved over the old one gets a new key
without reading gigabytes), the normalized compile options (defaults filled, order-independent),
the device kind (``cpu``, or the GPU's name and compute capability), the versions the manifest
records (kiln, torch, triton, CUDA, Python, the kernel sources hash the runtime checks), the
artifact schema version and a hash of the compiler's and weight packer's sources.

This module never imports ``kiln.compiler``: the default build runs ``python -m kiln compile`` in a
subprocess (its output goes to the terminal), so a runtime caller stays on its side of the boundary.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kiln import artifact_format as fmt
from kiln import settings
from kiln.errors import KilnError
from kiln.manifest import Manifest, Versions

CACHE_FORMAT = 1  # bump when the key's material or the entry layout changes
KEY_CHARS = 32  # hex characters of a key (128 bits of sha256)
ARTIFACT, MARKER, LAST_USED, LOCKS, TMP_PREFIX = "artifact", "entry.json", "last-used", ".locks", ".tmp-"
ALL = "all"  # remove()'s "every entry" (never a key: keys are hex)
MIN_PREFIX = 4  # a key may be given by a unique prefix of at least this many characters
KEY_RE = re.compile(rf"[0-9a-f]{{{KEY_CHARS}}}")
SAMPLE_BYTES = 64  # read from the middle of each tensor (bytes)
MAX_SAMPLES = 4096  # per weight file; evenly spread over its tensors beyond that
BLOCK_SAMPLES = 64  # .bin / .pt weight files (no header): evenly spaced blocks of SAMPLE_BYTES


# `kiln compile`'s artifact-shaping flags: name -> (kind, default), kinds "str" (a choice or text),
# "int", "flag" (--x only) and "bool" (--x/--no-x); None: not given. The compiler owns them
# (compiler/cli_compile.py, CompileOptions); tests/test_compile_cache.py checks this table against
# both. The compile settings' flags (--gemv-plan, --fold-norms) come from kiln/settings.py.
_FLAGS: dict[str, tuple[str, Any]] = {
    "dtype": ("str", "bfloat16"),
    "quant": ("str", None),
    "tp": ("int", 1),
    "ep": ("int", 1),
    "max_batch_size": ("int", 256),
    "max_seq_len": ("int", None),
    "chunk_size": ("int", 4096),
    "page_size": ("int", 16),
    "kv_dtype": ("str", "auto"),
    "decode_graphs": ("str", "shared"),
    "moe_tune": ("flag", False),
    "moe_backend": ("str", "triton"),
    "moe_cutlass_min_tokens": ("int", 2048),
    "fp8_cutlass": ("bool", True),
}
# Flags of `kiln compile` the cache sets itself.
_NOT_TAKEN = {
    "device": "the cache keys on the device: pass --device to the command itself (generate, serve, bench)",
    "output": "the cache chooses the output directory",
    "o": "the cache chooses the output directory",
    "force": "the cache replaces only entries it finds incomplete",
    "draft_model": "the cache keys on one checkpoint: compile a draft model into an artifact with "
    "`kiln compile MODEL --draft-model DRAFT -o ART` and serve ART",
    "eagle3": "the cache keys on one checkpoint: compile an EAGLE-3 head into an artifact with "
    "`kiln compile MODEL --eagle3 HEAD -o ART` and serve ART",
    "mtp": "the cache builds no draft sources: compile a DeepSeek-V3 checkpoint's MTP layer into an "
    "artifact with `kiln compile MODEL --mtp -o ART` and serve ART",
}

Build = Callable[[Path, Path, list[str], str], None]
"""``build(checkpoint, out, args, device)``: write a complete artifact at ``out`` (which does not
exist yet) compiled from ``checkpoint`` with the ``kiln compile`` flags ``args`` for ``device``,
or raise. :func:`compile_in_subprocess` is the default."""


class CacheError(KilnError):
    """A cache directory, entry or compile option that cannot be used (the message says which)."""


def default_cache_dir() -> Path:
    """The ``cache_dir`` setting (``KILN_CACHE``; default ``~/.cache/kiln/artifacts``)."""
    return Path(settings.value("cache_dir")).expanduser()


def _notice(msg: str) -> None:
    print(f"[kiln cache] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- compile options
def compile_flags() -> dict[str, tuple[str, Any]]:
    """Every artifact-shaping flag of ``kiln compile``: name -> (kind, default) (see ``_FLAGS``)."""
    flags = dict(_FLAGS)
    for s in settings.of_stage("compile"):
        if s.flag:
            flags[s.name] = ("bool" if s.kind == "bool" else "str", s.parse(s.default))
    return flags


def _coerce(name: str, kind: str, v: Any) -> Any:
    if v is None:
        return None
    if kind in ("flag", "bool"):
        if isinstance(v, bool):
            return v
    elif kind == "int":
        with contextlib.suppress(TypeError, ValueError):
            if not isinstance(v, bool) and str(int(v)) == str(v).strip():
                return int(v)
    elif isinstance(v, str | int) and not isinstance(v, bool):
        return str(v)
    want = {"flag": "true or false", "bool": "true or false", "int": "an integer"}.get(kind, "text")
    raise CacheError(f"compile option {name!r} is {v!r}; it takes {want}")


def _parse_argv(args: Sequence[str], flags: Mapping[str, tuple[str, Any]]) -> dict[str, Any]:
    given: dict[str, Any] = {}
    it = iter(args)
    for tok in it:
        if not tok.startswith("-") or tok in ("-", "--"):
            raise CacheError(f"compile argument {tok!r} is not an option (the checkpoint is passed apart)")
        opt, eq, val = tok.lstrip("-").partition("=")
        name = opt.replace("-", "_")
        if name in _NOT_TAKEN:
            raise CacheError(f"compile option {tok.split('=')[0]} is not taken here: {_NOT_TAKEN[name]}")
        if name not in flags and name.startswith("no_") and flags.get(name[3:], ("",))[0] == "bool":
            if eq:
                raise CacheError(f"compile option {tok.split('=')[0]} takes no value")
            given[name[3:]] = False
            continue
        if name not in flags:
            known = ", ".join("--" + n.replace("_", "-") for n in flags)
            raise CacheError(f"{tok.split('=')[0]} is not a `kiln compile` option the cache knows ({known})")
        kind = flags[name][0]
        if kind in ("flag", "bool"):
            if eq:
                raise CacheError(f"compile option {tok.split('=')[0]} takes no value")
            given[name] = True
            continue
        value = val if eq else next(it, None)
        if value is None:
            raise CacheError(f"compile option {tok} needs a value")
        given[name] = value
    return given


def normalize_options(compile_args: Sequence[str] | Mapping[str, Any]) -> dict[str, Any]:
    """Every flag of :func:`compile_flags` with its value (defaults filled, typed), from ``kiln
    compile`` flags (``["--dtype", "float32", "--max-batch-size=8", "--no-fold-norms"]``) or a
    mapping of option names (``{"dtype": "float32", "max_batch_size": 8}``). The checkpoint,
    ``--device``, ``-o`` and ``--force`` are not options here (:class:`CacheError`)."""
    flags = compile_flags()
    if isinstance(compile_args, Mapping):
        given = dict(compile_args)
        for name in given:
            if name in _NOT_TAKEN:
                raise CacheError(f"compile option {name!r} is not taken here: {_NOT_TAKEN[name]}")
            if name not in flags:
                raise CacheError(
                    f"{name!r} is not a `kiln compile` option the cache knows ({', '.join(flags)})"
                )
    elif isinstance(compile_args, str):
        raise CacheError("compile options must be a list of flags or a mapping, not one string")
    else:
        given = _parse_argv(compile_args, flags)
    out = {}
    for name, (kind, default) in flags.items():
        v = _coerce(name, kind, given.get(name, default))
        out[name] = default if v is None and default is not None else v
    return out


def render_args(options: Mapping[str, Any]) -> list[str]:
    """``kiln compile`` flags for normalized ``options``, every value explicit (None: left out)."""
    flags = compile_flags()
    argv: list[str] = []
    for name, v in options.items():
        flag = "--" + name.replace("_", "-")
        kind = flags[name][0]
        if kind == "flag":
            argv += [flag] if v else []
        elif kind == "bool":
            argv.append(flag if v else "--no-" + flag[2:])
        elif v is not None:
            argv += [flag, str(v)]
    return argv


def non_default(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options that differ from ``kiln compile``'s defaults (what ``kiln cache ls`` shows)."""
    flags = compile_flags()
    return {k: v for k, v in options.items() if k not in flags or flags[k][1] != v}


# ---------------------------------------------------------------------------------- the key
def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sample(path: Path, offsets: Sequence[int]) -> str:
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        for off in offsets:
            h.update(os.pread(fd, SAMPLE_BYTES, off))
    finally:
        os.close(fd)
    return h.hexdigest()


def _spread(items: Sequence[int], most: int) -> list[int]:
    return list(items) if len(items) <= most else [items[i * len(items) // most] for i in range(most)]


def _weight_identity(path: Path, safetensors: bool) -> dict[str, Any]:
    size = path.stat().st_size
    if not safetensors:  # .bin / .pt: no header to read
        offsets = [max(0, size - SAMPLE_BYTES) * i // max(1, BLOCK_SAMPLES - 1) for i in range(BLOCK_SAMPLES)]
        return {"size": size, "sample": _sample(path, offsets)}
    from kiln.weights.st_format import read_header  # lazy: kiln.weights imports torch

    header = read_header(path)  # a malformed or truncated file: a one-line SafetensorsError
    mids = [t.begin + max(0, t.nbytes - SAMPLE_BYTES) // 2 for t in header.tensors.values() if t.nbytes]
    return {"size": size, "header": _sha(header.raw), "sample": _sample(path, _spread(mids, MAX_SAMPLES))}


def checkpoint_identity(checkpoint: Path) -> dict[str, Any]:
    """What identifies a checkpoint's content (module docstring), cheap to compute at every start:
    the bytes' hashes of config.json, the tokenizer files and the weight index, and per weight file
    the compiler reads (``kiln.weights.discover``) its size, header hash and sampled bytes."""
    from kiln.weights.discover import discover_weights  # lazy: kiln.weights imports torch

    if not (checkpoint / "config.json").is_file():
        raise CacheError(
            f"{checkpoint} has no config.json: pass a Hugging Face checkpoint directory (or an artifact "
            "directory, which is used as it is)"
        )
    files = {
        name: _sha((checkpoint / name).read_bytes())
        for name in ("config.json", *fmt.TOKENIZER_FILES)
        if (checkpoint / name).is_file()
    }
    found = discover_weights(checkpoint)
    if found.index is not None:
        files[found.index.name] = _sha(found.index.read_bytes())
    safetensors = found.format == "safetensors"
    weights = {p.name: _weight_identity(p, safetensors) for p in found.files}
    return {"files": files, "weights": weights}


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)  # imports the parent package only, never ``name`` itself
    locations = spec.submodule_search_locations if spec else None
    return Path(next(iter(locations))) if locations else None


_build_sources: str | None = None


def build_sources_hash() -> str:
    """sha256 over :func:`kiln.artifact_format.sources_hash` of the ``kiln`` package and of
    ``kiln.compiler`` and ``kiln.weights`` (found without importing them): a changed compiler in a
    source checkout, whose kiln version stays the same, gets new keys. Computed once per process."""
    global _build_sources
    if _build_sources is None:
        dirs = [_package_dir(n) for n in ("kiln", "kiln.compiler", "kiln.weights")]
        _build_sources = _sha(" ".join(fmt.sources_hash(d) if d else "-" for d in dirs).encode())
    return _build_sources


def device_kind(device: str) -> str:
    """``cpu``, or for a CUDA device its name and compute capability (``NVIDIA H200 sm_90``)."""
    import torch

    dev = torch.device(device)
    if dev.type == "cpu":
        return "cpu"
    if dev.type != "cuda":
        raise CacheError(f"device {device!r}: kiln compiles for cpu or cuda")
    if not torch.cuda.is_available():
        raise CacheError(f"device {device!r} was asked for but no CUDA device is visible; use cpu")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise CacheError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    major, minor = torch.cuda.get_device_capability(index)
    return f"{torch.cuda.get_device_name(index)} sm_{major}{minor}"


def _key_material(
    checkpoint: Path, compile_args: Sequence[str] | Mapping[str, Any], kind: str
) -> dict[str, Any]:
    return {
        "cache_format": CACHE_FORMAT,
        "checkpoint": checkpoint_identity(checkpoint),
        "options": normalize_options(compile_args),
        "device_kind": kind,
        "versions": Versions.current().to_json(),
        "schema_version": fmt.SCHEMA_VERSION,
        "build_sources": build_sources_hash(),
    }


def cache_key(checkpoint: Path, compile_args: Sequence[str] | Mapping[str, Any], device_kind: str) -> str:
    """The entry name (:data:`KEY_CHARS` hex characters) of ``checkpoint`` compiled with
    ``compile_args`` (flags or a mapping: :func:`normalize_options`) for ``device_kind``
    (:func:`device_kind`) by this kiln, torch and triton (module docstring)."""
    material = _key_material(Path(checkpoint), compile_args, device_kind)
    return _sha(fmt.canonical_json(material))[:KEY_CHARS]


# ---------------------------------------------------------------------------------- entries
@dataclass(frozen=True)
class Entry:
    """One cache entry as :func:`list_entries` finds it."""

    key: str
    path: Path  # cache_dir/key; the artifact is path/artifact
    model: str  # the checkpoint's name (a Hugging Face hub cache path gives "org/name")
    architecture: str  # the manifest's model.architecture
    checkpoint: str  # where it was compiled from
    options: dict[str, Any]  # normalized compile options
    device_kind: str
    size_bytes: int
    created: float | None  # seconds since the epoch
    last_used: float | None
    problem: str | None  # None: complete; else why find_or_build would rebuild it

    @property
    def artifact(self) -> Path:
        return self.path / ARTIFACT

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "path": str(self.path), "artifact": str(self.artifact)}


def _read_marker(entry: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads((entry / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("key") == entry.name else None


def entry_problem(entry: Path) -> str | None:
    """None when ``entry`` is complete: its marker names it, its manifest loads (schema, self-hash,
    fields) and every file the manifest lists has its recorded size; else what is wrong. File
    hashes are not read here (the loader checks them)."""
    if not (entry / MARKER).is_file():
        return f"no {MARKER}: its compile did not finish"
    if _read_marker(entry) is None:
        return f"{MARKER} is damaged"
    return artifact_problem(entry / ARTIFACT)


def artifact_problem(art: Path) -> str | None:
    """None when the artifact at ``art`` has a valid manifest and every listed file its size."""
    try:
        files = Manifest.load(art).files
    except KilnError as e:  # without the advice to copy or rebuild: the cache rebuilds
        return str(e).removesuffix(f"; {fmt.RECOPY}.").removesuffix(f": {fmt.REBUILD}.")
    for rel, info in files.items():
        p = art / rel
        if not p.is_file():
            return f"artifact file {rel} is missing"
        if p.stat().st_size != info.size:
            return f"artifact file {rel} has {p.stat().st_size} bytes, the manifest says {info.size}"
    return None


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _entry(path: Path) -> Entry:
    doc = _read_marker(path) or {}
    return Entry(
        key=path.name,
        path=path,
        model=str(doc.get("model", "?")),
        architecture=str(doc.get("architecture", "?")),
        checkpoint=str(doc.get("checkpoint", "?")),
        options=dict(doc.get("options") or {}),
        device_kind=str(doc.get("device_kind", "?")),
        size_bytes=_tree_bytes(path),
        created=doc.get("created"),
        last_used=_mtime(path / LAST_USED),
        problem=entry_problem(path),
    )


def _entry_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and KEY_RE.fullmatch(p.name))


def list_entries(cache_dir: Path | None = None) -> list[Entry]:
    """Every entry of ``cache_dir`` (default :func:`default_cache_dir`), complete or not, by key."""
    return [_entry(p) for p in _entry_dirs(Path(cache_dir) if cache_dir else default_cache_dir())]


def partial_builds(cache_dir: Path) -> list[Path]:
    """Temporary build directories: builds in progress or interrupted ones."""
    root = Path(cache_dir)
    return sorted(root.glob(f"{TMP_PREFIX}*")) if root.is_dir() else []


class _Busy(Exception):
    pass


@contextlib.contextmanager
def _locked(root: Path, key: str, wait: bool = True) -> Iterator[None]:
    """Hold ``root/.locks/<key>.lock`` exclusively (closing the file releases it, a killed process
    included); without ``wait`` raise :class:`_Busy` when another process holds it. In a read-only
    cache (no lock file can be made) nothing is built or removed, so nothing is locked."""
    fd = None
    try:
        (root / LOCKS).mkdir(exist_ok=True)
        fd = os.open(root / LOCKS / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
    if fd is None:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                raise _Busy from None
            _notice(f"another process is compiling or checking cache entry {key}; waiting for it")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _rmtree(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _model_name(checkpoint: Path) -> str:
    parts = checkpoint.absolute().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/")
    return parts[-1] if parts else str(checkpoint)


def _write_marker(path: Path, doc: dict[str, Any]) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------------- building
def compile_in_subprocess(checkpoint: Path, out: Path, args: list[str], device: str) -> None:
    """The default :data:`Build`: ``python -m kiln compile CHECKPOINT -o OUT --device D ARGS``, its
    output on this process's stdout and stderr (progress visible). ``cuda:N`` compiles on GPU N
    (through CUDA_VISIBLE_DEVICES)."""
    kind, _, index = device.partition(":")
    env = dict(os.environ)
    if index:
        visible = [s.strip() for s in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if s.strip()]
        if not index.isdigit() or (visible and int(index) >= len(visible)):
            raise CacheError(f"device {device!r} is not one of the visible CUDA devices")
        env["CUDA_VISIBLE_DEVICES"] = visible[int(index)] if visible else index
    cmd = [sys.executable, "-m", "kiln", "compile", str(checkpoint), "-o", str(out), "--device", kind, *args]
    _notice(f"running {shlex.join(cmd)}")
    rc = subprocess.call(cmd, env=env)
    if rc != 0:
        raise CacheError(
            f"`kiln compile` of {checkpoint} failed (exit status {rc}, its output is above); nothing "
            "was cached"
        )


def find_or_build(
    checkpoint: str | Path,
    compile_args: Sequence[str] | Mapping[str, Any],
    device: str,
    cache_dir: str | Path | None = None,
    build: Build | None = None,
) -> Path:
    """The artifact of ``checkpoint`` compiled with ``compile_args`` (:func:`normalize_options`)
    for ``device`` (``cpu``, ``cuda`` or ``cuda:N``): ``cache_dir/<key>/artifact``.

    Protocol: under the entry's lock (a second process waits, then uses what the first built), a
    complete entry (:func:`entry_problem`) is returned as it is; an incomplete or damaged one is
    removed with a one-line notice; then ``build`` (default :func:`compile_in_subprocess`) writes
    the artifact into ``cache_dir/.tmp-<key>-<pid>/artifact``, the artifact is checked, the marker
    written, and the directory renamed to ``cache_dir/<key>`` (atomic). A build that fails leaves
    nothing behind and raises."""
    ckpt = Path(checkpoint)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    kind = device_kind(device)
    options = normalize_options(compile_args)
    material = _key_material(ckpt, options, kind)
    key = _sha(fmt.canonical_json(material))[:KEY_CHARS]
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CacheError(f"cannot create the compile cache {root} ({e.strerror}); pass another cache directory "
                         "(--cache-dir, or KILN_CACHE)") from None  # fmt: skip
    entry = root / key
    with _locked(root, key):
        problem = entry_problem(entry) if entry.exists() else "absent"
        if problem is None:
            with contextlib.suppress(OSError):  # a read-only cache still serves
                (entry / LAST_USED).touch()
            _notice(f"using {entry / ARTIFACT} (compiled from {ckpt} earlier)")
            return entry / ARTIFACT
        if entry.exists() or entry.is_symlink():
            _notice(f"cache entry {key} is unusable ({problem}); removing it and compiling again")
            _rmtree(entry)
        for stale in root.glob(f"{TMP_PREFIX}{key}-*"):  # interrupted builds (we hold the lock)
            _rmtree(stale)
        tmp = root / f"{TMP_PREFIX}{key}-{os.getpid()}"
        try:
            tmp.mkdir()
        except OSError as e:
            raise CacheError(f"cannot compile into the cache {root} ({e.strerror}); pass a writable cache "
                             "directory (--cache-dir, or KILN_CACHE)") from None  # fmt: skip
        try:
            _notice(f"compiling {ckpt} for {kind} into {entry} (once: later starts load it)")
            (build or compile_in_subprocess)(ckpt, tmp / ARTIFACT, render_args(options), device)
            built = _check_built(ckpt, tmp / ARTIFACT, material["versions"])
            _write_marker(tmp / MARKER, {
                "key": key, "cache_format": CACHE_FORMAT, "model": _model_name(ckpt),
                "architecture": built.model.get("architecture", "?"), "checkpoint": str(ckpt.absolute()),
                "options": options, "device": device, "device_kind": kind, "versions": material["versions"],
                "created": time.time(),
            })  # fmt: skip
            (tmp / LAST_USED).touch()
            os.rename(tmp, entry)
        except BaseException:
            _rmtree(tmp)
            raise
    return entry / ARTIFACT


def _check_built(ckpt: Path, art: Path, versions: dict[str, Any]) -> Manifest:
    """The manifest of a build's artifact, which must be complete and record the versions the key was
    made with (else a later start would find an entry the runtime refuses)."""
    bad = artifact_problem(art)
    if bad is not None:
        raise CacheError(
            f"the compile of {ckpt} did not leave a complete artifact ({bad}); nothing was cached"
        )
    m = Manifest.load(art)
    for field, here in versions.items():
        if getattr(m.versions, field) != here:
            raise CacheError(
                f"the compile of {ckpt} recorded versions.{field} {getattr(m.versions, field)!r} but this process "
                f"has {here!r} (kiln's sources changed during the compile, or `{sys.executable} -m kiln` is "
                "another kiln); nothing was cached"
            )
    return m


def resolve_artifact(
    path: str | Path,
    compile_args: Sequence[str] | Mapping[str, Any],
    device: str,
    cache_dir: str | Path | None = None,
    revision: str | None = None,
) -> Path:
    """``path`` itself when it is an artifact (it has manifest.json), else :func:`find_or_build`
    of the checkpoint it names (a directory, or a Hugging Face Hub id at ``revision``:
    kiln/hub.py): what serve / generate / bench / LLM call with their argument."""
    p = Path(path)
    if (p / fmt.MANIFEST).is_file():
        if revision is not None:
            raise CacheError(f"{path} is a compiled artifact: --revision applies to Hub model ids only")
        return p
    from kiln.hub import resolve_checkpoint

    return find_or_build(resolve_checkpoint(str(path), revision), compile_args, device, cache_dir)


# ---------------------------------------------------------------------------------- removing
def _match(root: Path, key: str) -> str:
    keys = [p.name for p in _entry_dirs(root)]
    if key in keys:
        return key
    found = [k for k in keys if len(key) >= MIN_PREFIX and k.startswith(key)]
    if len(found) == 1:
        return found[0]
    if found:
        raise CacheError(
            f"key prefix {key!r} matches {len(found)} entries ({', '.join(found)}); give more of it"
        )
    listing = "; ".join(f"{e.key[:12]} ({e.model})" for e in list_entries(root)) or "it is empty"
    hint = f" (a key prefix needs {MIN_PREFIX} characters or more)" if len(key) < MIN_PREFIX else ""
    raise CacheError(f"no cache entry {key!r} in {root}{hint}; `kiln cache ls` lists them: {listing}")


def remove(cache_dir: str | Path | None, key_or_all: str) -> list[str]:
    """Remove the entry ``key_or_all`` (a key or a unique prefix of :data:`MIN_PREFIX`+ characters)
    or, with :data:`ALL`, every entry and partial build; returns the keys removed. Raises
    :class:`CacheError` for an unknown key and for entries another process is compiling or
    checking (the others are removed first). Running servers are not tracked: removing the
    artifact of one does not stop it."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if key_or_all == ALL:
        targets = [p.name for p in _entry_dirs(root)]
    else:
        targets = [_match(root, key_or_all)]
    removed, busy = [], []
    for key in targets:
        try:
            with _locked(root, key, wait=False):
                _rmtree(root / key)
                removed.append(key)
        except _Busy:
            busy.append(key)
        except OSError as e:
            raise CacheError(f"cannot remove {root / key} ({e.strerror})") from None
    if key_or_all == ALL:
        for tmp in partial_builds(root):
            key = tmp.name[len(TMP_PREFIX) :].split("-")[0]
            try:
                with _locked(root, key, wait=False):
                    _rmtree(tmp)
            except _Busy:
                busy.append(f"{key} (being compiled)")
    if busy:
        raise CacheError(
            f"removed {len(removed)}; {', '.join(busy)} in {root} is in use by another process (compiling or "
            "checking it); run this again when it is done"
        )
    return removed
