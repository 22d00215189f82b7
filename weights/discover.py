"""Stage 1: which files of a model directory hold its weights.

Rules, in order:

1. ``*.safetensors`` win over ``*.bin`` and ``*.pt``; those are read only when no safetensors
   file exists, and only through ``torch.load(weights_only=True)``.
2. When an index (``model.safetensors.index.json``, else the single ``*.safetensors.index.json``;
   for ``.bin``: ``pytorch_model.bin.index.json``) exists, exactly the shards its ``weight_map``
   names are read. A shard it names that is not on disk fails with the list of missing files.
3. Without an index: a consolidated ``model.safetensors`` is read alone (a sharded set beside it
   is the same weights and is not read twice); else one complete ``NAME-0000i-of-0000n`` set
   (missing shard numbers fail, listed), ignoring ``consolidated*`` files beside it; else every
   remaining weight file.
4. Training artifacts (optimizer, scheduler, scaler, rng state, training_args) are never read.
5. Nothing found fails naming the directory and every pattern tried.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kiln.errors import KilnError

TRAINING_ARTIFACT = re.compile(
    r"^(optimizer|scheduler|scaler|training_args|rng_state|trainer_state)([._-].*)?$", re.IGNORECASE
)
SHARD_RE = re.compile(r"^(?P<stem>.+)-(?P<i>\d+)-of-(?P<n>\d+)\.(?P<ext>safetensors|bin|pt)$")
PATTERNS_TRIED = (
    "model.safetensors.index.json",
    "*.safetensors",
    "pytorch_model.bin.index.json",
    "*.bin",
    "*.pt",
)


class CheckpointError(KilnError, FileNotFoundError):
    """A model directory whose weights cannot be found or read as declared. Names the files."""


@dataclass(frozen=True)
class WeightFiles:
    """The weight files of one checkpoint, in the order they are streamed."""

    root: Path
    format: Literal["safetensors", "pt"]
    files: tuple[Path, ...]
    index: Path | None = None  # the index file that chose them, if any
    weight_map: dict[str, str] = field(default_factory=dict)  # tensor name -> file name (from the index)
    ignored: tuple[str, ...] = ()  # weight files present but deliberately not read, with why

    def describe(self) -> str:
        how = f"index {self.index.name}" if self.index else "directory listing"
        return f"{len(self.files)} {self.format} file(s) chosen by {how}"


def _natural_key(p: Path) -> list[object]:
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", p.name)]


def _is_artifact(p: Path) -> bool:
    return bool(TRAINING_ARTIFACT.match(p.name))


def _from_index(root: Path, index: Path, fmt: Literal["safetensors", "pt"]) -> WeightFiles:
    try:
        doc = json.loads(index.read_text())
        wmap = doc["weight_map"]
        assert isinstance(wmap, dict) and wmap
    except (json.JSONDecodeError, KeyError, AssertionError, TypeError) as e:
        raise CheckpointError(
            f"{index} is not a valid index: it needs a non-empty 'weight_map' object ({e!r}). "
            "Re-download it or delete it to read the shards without an index."
        ) from e
    names = sorted(set(wmap.values()), key=lambda n: _natural_key(Path(n)))
    missing = [n for n in names if not (root / n).is_file()]
    if missing:
        raise CheckpointError(
            f"{index.name} names {len(missing)} shard(s) that are not in {root}: {', '.join(missing)}. "
            "The download is incomplete; fetch the missing files."
        )
    files = tuple(root / n for n in names if not _is_artifact(root / n))
    present = {p.name for p in root.iterdir() if p.suffix in (".safetensors", ".bin", ".pt")}
    ignored = tuple(f"{n} (not in {index.name})" for n in sorted(present - set(names)))
    return WeightFiles(root, fmt, files, index, {str(k): str(v) for k, v in wmap.items()}, ignored)


def _choose_unindexed(root: Path, files: list[Path], fmt: Literal["safetensors", "pt"]) -> WeightFiles:
    consolidated = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
    by_name = {p.name: p for p in files}
    if consolidated in by_name and len(files) > 1:
        ignored = tuple(
            f"{p.name} (consolidated {consolidated} read instead)" for p in files if p.name != consolidated
        )
        return WeightFiles(root, fmt, (by_name[consolidated],), None, {}, ignored)
    sets: dict[tuple[str, int], dict[int, Path]] = {}
    for p in files:
        m = SHARD_RE.match(p.name)
        if m:
            sets.setdefault((m["stem"], int(m["n"])), {})[int(m["i"])] = p
    if len(sets) > 1:
        raise CheckpointError(
            f"{root} holds several sharded sets ({', '.join(f'{s}-*-of-{n:05d}' for s, n in sets)}) and no "
            "index; add the index file of the one to load or remove the others."
        )
    if sets:
        (stem, n), shards = next(iter(sets.items()))
        missing = [i for i in range(1, n + 1) if i not in shards]
        if missing:
            raise CheckpointError(
                f"{root}: sharded set {stem}-*-of-{n:05d} is incomplete, missing shard number(s) "
                f"{missing}. Fetch the missing files."
            )
        chosen = [shards[i] for i in range(1, n + 1)]
        others = [p for p in files if p not in chosen]
        ignored = tuple(f"{p.name} (beside the sharded set {stem}-*-of-{n:05d})" for p in others)
        return WeightFiles(root, fmt, tuple(chosen), None, {}, ignored)
    return WeightFiles(root, fmt, tuple(sorted(files, key=_natural_key)))


def discover_weights(model_dir: str | Path) -> WeightFiles:
    """Apply the module's rules to ``model_dir``; raise :class:`CheckpointError` on any violation."""
    root = Path(model_dir)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory; pass a Hugging Face model directory.")
    entries = [p for p in root.iterdir() if p.is_file()]

    def weights(suffix: str) -> list[Path]:
        return [p for p in entries if p.name.endswith(suffix) and not _is_artifact(p)]

    st = weights(".safetensors")
    if st:
        idx = root / "model.safetensors.index.json"
        if not idx.is_file():
            cands = [p for p in entries if p.name.endswith(".safetensors.index.json")]
            idx = cands[0] if len(cands) == 1 else idx
        if idx.is_file():
            return _from_index(root, idx, "safetensors")
        return _choose_unindexed(root, st, "safetensors")
    pt = weights(".bin") + weights(".pt")
    if pt:
        idx = root / "pytorch_model.bin.index.json"
        if idx.is_file():
            return _from_index(root, idx, "pt")
        return _choose_unindexed(root, pt, "pt")
    skipped = sorted(p.name for p in entries if _is_artifact(p))
    extra = f" (training artifacts not read: {', '.join(skipped)})" if skipped else ""
    raise CheckpointError(
        f"no model weights in {root}: tried {', '.join(PATTERNS_TRIED)}{extra}. "
        "Pass the directory that holds the checkpoint's weight files."
    )
