"""The `cutlass` extra of pyproject.toml installs what compiler/cutlass_build.py uses: the
distribution it names is cutlass_build.CUTLASS_DISTRIBUTION, and where that distribution is
installed it provides the module the build looks the headers up in (CUTLASS_MODULE)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from kiln.compiler import cutlass_build as cb

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_the_extra_names_the_distribution_the_build_uses():
    extra = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]["cutlass"]
    reqs = [Requirement(r) for r in extra]
    assert [canonicalize_name(r.name) for r in reqs] == [canonicalize_name(cb.CUTLASS_DISTRIBUTION)]
    assert reqs[0].specifier.contains(cb.CUTLASS_VERSION)


def test_the_installed_distribution_provides_the_module_the_build_imports():
    try:
        files = importlib.metadata.files(cb.CUTLASS_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{cb.CUTLASS_DISTRIBUTION} is not installed here (pip install 'kiln[cutlass]')")
    names = {f.as_posix() for f in files}
    assert f"{cb.CUTLASS_MODULE}/__init__.py" in names
    assert f"{cb.CUTLASS_MODULE}/source/include/cutlass/cutlass.h" in names  # the headers cutlass_dir uses
    dist = importlib.metadata.distribution(cb.CUTLASS_DISTRIBUTION)
    spec = importlib.util.find_spec(cb.CUTLASS_MODULE)  # what cutlass_dir finds: this distribution's
    assert (
        spec is not None
        and Path(spec.origin).resolve()
        == Path(dist.locate_file(f"{cb.CUTLASS_MODULE}/__init__.py")).resolve()
    )
