"""The wheel holds every file of the package trees, at the import path the code opens it by.

The installed ``kiln`` maps the repository's top-level folders onto subpackages (``ops/`` is
``kiln.ops``, ...) through an explicit ``packages`` list and ``package-data`` patterns in
pyproject.toml, so a new subpackage or data file (a bundled config, a CUTLASS source) is easy to
leave out of the wheel while every test run from the source tree still passes. This test builds
the wheel (no build isolation: setuptools from the dev venv, about 2 s) from a copy of the sources
and compares. .ci/wheel_check.sh goes further: `python -m build`, a fresh venv, `kiln demo`.
"""

from __future__ import annotations

import email.parser
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# source folder -> the folder it becomes in the wheel (pyproject.toml [tool.setuptools] package-dir)
TREES = {
    "kiln": "kiln",
    "ops": "kiln/ops",
    "weights": "kiln/weights",
    "compiler": "kiln/compiler",
    "runtime": "kiln/runtime",
}
SKIP = ("__pycache__", "*.pyc", "*.egg-info")


def _source_files() -> set[str]:
    """Every file under the package trees, as its path inside the wheel."""
    out = set()
    for src, dst in TREES.items():
        for p in (REPO / src).rglob("*"):
            rel = p.relative_to(REPO / src)
            if p.is_file() and "__pycache__" not in rel.parts and p.suffix != ".pyc":
                out.add(f"{dst}/{rel.as_posix()}")
    return out


def _build_wheel(tmp: Path) -> tuple[Path, str]:
    """Build the wheel from a copy of the sources; returns it and the build's log."""
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for tree in TREES:
        shutil.copytree(REPO / tree, src / tree, ignore=shutil.ignore_patterns(*SKIP))
    pip = [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation"]
    p = subprocess.run([*pip, "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("kiln-*.whl")
    return wheel, p.stdout + p.stderr


def _setuptools_major() -> int:
    try:
        return int(metadata.version("setuptools").split(".")[0])
    except metadata.PackageNotFoundError:
        return 0


@pytest.mark.skipif(
    _setuptools_major() < 77, reason="builds without isolation: needs setuptools>=77 (pyproject build-system)"
)
def test_wheel_holds_every_package_file(tmp_path):
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wheel, log = _build_wheel(tmp_path)
    # setuptools warns of data folders it sees as undeclared packages (configs/, cutlass/): data
    # that a later setuptools may leave out. include-package-data = false keeps data explicit.
    assert "absent from the `packages` configuration" not in log, log[-3000:]
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        dist_info = f"kiln-{project['version']}.dist-info"
        meta = email.parser.Parser().parsestr(z.read(f"{dist_info}/METADATA").decode())
        entry_points = z.read(f"{dist_info}/entry_points.txt").decode()

    missing = sorted(_source_files() - names)
    assert not missing, (
        f"{len(missing)} source files are not in the wheel (add their package to [tool.setuptools] "
        f"packages or their pattern to package-data in pyproject.toml): {missing[:20]}"
    )
    stray = sorted(n for n in names if not n.startswith(("kiln/", f"{dist_info}/")))
    assert not stray, f"the wheel installs files outside the kiln package: {stray[:20]}"
    # the data files the code opens by path (compiler/cli_inspect.py, compiler/cutlass_build.py)
    assert any(n.startswith("kiln/compiler/configs/") and n.endswith(".json") for n in names)
    assert any(n.startswith("kiln/ops/cutlass/") and n.endswith(".cu") for n in names)
    assert meta["Name"] == "kiln" and meta["Version"] == project["version"]
    assert "kiln = kiln.cli:main" in entry_points
