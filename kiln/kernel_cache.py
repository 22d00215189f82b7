"""Triton's on-disk kernel cache for kiln: compile writes kernels into the artifact, the runtime
only reads them there and writes anything new elsewhere.

Triton finds compiled kernels (and its driver helper modules) through a cache manager class,
``triton.knobs.cache.manager_class`` (the ``TRITON_CACHE_MANAGER`` hook; same protocol on triton
3.6 and 3.9): ``cls(key, override=False, dump=False)`` per cache key (a directory name), then
``get_file(name) -> path | None``, ``put(data, name) -> path``, ``get_group(name) -> {child: path}
| None`` and ``put_group(name, {child: path})``. :class:`KilnCacheManager` implements it over
:class:`CacheDirs`: lookups search ``read`` then ``write``; every put goes to ``write``.

* ``kiln compile`` (``CacheDirs(write=ART/kernels)``): kernels land in the artifact, and group files
  (``__grp__*.json``) name their children relative to their own directory, where Triton's file
  manager writes absolute paths (which differ between two compiles and break a moved artifact).
* the runtime (``CacheDirs(read=(ART/kernels,), write=user_cache_dir())``): the artifact is never
  written; a kernel it lacks (another kiln or triton, a shape the compile did not warm up) compiles
  into the per-user cache. A group's children are looked up beside the group file, so a copied or
  moved artifact (or one built by Triton's own manager, absolute paths) still hits its cache.

The directories are process-wide (Triton's manager class is): :func:`use_kernel_cache` sets them
for the rest of the process, :func:`kernel_cache` for a ``with`` block.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from triton.runtime.cache import CacheManager, FileCacheManager


@dataclass(frozen=True)
class CacheDirs:
    write: Path  # every new cache entry goes here
    read: tuple[Path, ...] = ()  # searched first, in order; never written


_dirs: CacheDirs | None = None


def user_cache_dir() -> Path:
    """Where the runtime compiles kernels an artifact lacks: ``~/.cache/kiln/triton``."""
    return Path.home() / ".cache" / "kiln" / "triton"


class KilnCacheManager(CacheManager):
    """Triton cache manager over the process's :class:`CacheDirs` (module docstring). Triton's
    dump and override managers (``TRITON_KERNEL_DUMP``, ``TRITON_KERNEL_OVERRIDE``) stay Triton's."""

    def __init__(self, key: str, override: bool = False, dump: bool = False) -> None:
        self.key = key
        dirs = _dirs
        self._plain = (
            FileCacheManager(key, override=override, dump=dump) if override or dump or not dirs else None
        )
        self._read = [d / key for d in dirs.read] if dirs else []
        self._write = dirs.write / key if dirs else Path()

    def _find(self, filename: str) -> Path | None:
        for d in (*self._read, self._write):
            p = d / filename
            if p.is_file():
                return p
        return None

    def get_file(self, filename: str) -> str | None:
        if self._plain is not None:
            return self._plain.get_file(filename)
        p = self._find(filename)
        return None if p is None else str(p)

    def get_group(self, filename: str) -> dict[str, str] | None:
        if self._plain is not None:
            return self._plain.get_group(filename)
        grp = self._find(f"__grp__{filename}")
        if grp is None:
            return None
        try:
            children = json.loads(grp.read_text())["child_paths"]
            paths = {str(c): grp.parent / Path(p).name for c, p in children.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None  # unreadable group: a miss, recompiled into the write directory
        if not all(p.is_file() for p in paths.values()):
            return None
        return {c: str(p) for c, p in paths.items()}

    def put(self, data: object, filename: str, binary: bool = True) -> str:
        if self._plain is not None:
            return self._plain.put(data, filename, binary)
        self._write.mkdir(parents=True, exist_ok=True)
        path = self._write / filename
        tmp = self._write / f".{filename}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(str(data), encoding="utf-8")
        os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
        return str(path)

    def put_group(self, filename: str, group: dict[str, str]) -> str:
        if self._plain is not None:
            return self._plain.put_group(filename, group)
        children = {c: Path(p).name for c, p in sorted(group.items())}  # beside the group file
        return self.put(json.dumps({"child_paths": children}), f"__grp__{filename}", binary=False)


def _install(dirs: CacheDirs | None) -> None:
    import triton

    global _dirs
    _dirs = dirs
    if dirs is None:
        del triton.knobs.cache.manager_class  # back to TRITON_CACHE_MANAGER or Triton's default
    else:
        triton.knobs.cache.manager_class = KilnCacheManager


def active_dirs() -> CacheDirs | None:
    """The directories Triton's cache uses in this process (None: Triton's own default)."""
    import triton

    return _dirs if triton.knobs.cache.manager_class is KilnCacheManager else None


def use_kernel_cache(write: Path, read: tuple[Path, ...] = ()) -> None:
    """Route Triton's cache through :class:`KilnCacheManager` for the rest of the process."""
    _install(CacheDirs(Path(write).resolve(), tuple(Path(r).resolve() for r in read)))


def reset_kernel_cache() -> None:
    """Back to Triton's own cache manager (``TRITON_CACHE_MANAGER``, else its file cache)."""
    _install(None)


@contextlib.contextmanager
def kernel_cache(write: Path, read: tuple[Path, ...] = ()) -> Iterator[None]:
    """:func:`use_kernel_cache` inside the block; what was there before is restored after it."""
    before = active_dirs()
    use_kernel_cache(write, read)
    try:
        yield
    finally:
        _install(before)
