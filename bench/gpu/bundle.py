"""Bundle one GPU call's outputs into a single JSON for ``bench/results/`` (one file per call).

``python bench/gpu/bundle.py DIR OUT.json "COMMAND"``: every ``*.json`` in DIR is parsed, every
``*.log`` / ``*.txt`` kept as its last 400 lines, all under ``results`` keyed by file stem (a text
file beside a JSON of the same stem by its full name: ``latency.log`` beside ``latency``), beside
``env`` (runtime/benchmark.py ``environment()``: date, GPU, versions) and ``command``. Run it on
the GPU machine so ``env`` names that machine. Where kiln does not import (a tree broken mid-change),
``env`` comes from the packages' metadata and torch alone, so a call's figures are still kept.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import platform
import sys
import time
from importlib import metadata


def environment() -> dict:
    try:
        from kiln.runtime.benchmark import environment as kiln_environment

        return kiln_environment()
    except Exception as err:  # kiln broken: the same keys without it
        env = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": platform.python_version()}
        for pkg in ("torch", "triton", "transformers"):
            with contextlib.suppress(metadata.PackageNotFoundError):
                env[pkg] = metadata.version(pkg)
        try:
            import torch

            if torch.cuda.is_available():
                env |= {"gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda}
        except ImportError:
            pass
        return env | {"kiln_import_error": repr(err)}


def bundle(src: pathlib.Path, command: str) -> dict:
    results: dict = {}
    for f in sorted(src.iterdir()):
        if f.suffix == ".json":
            try:
                results[f.stem] = json.loads(f.read_text())
            except json.JSONDecodeError as err:  # a run cut short: keep what it wrote
                results[f.stem] = {"unparsed": f.read_text()[-4000:], "error": str(err)}
        elif f.suffix in (".log", ".txt"):  # beside a JSON of the same stem: keyed by its full name
            key = f.name if f.stem in results else f.stem
            results[key] = f.read_text(errors="replace").splitlines()[-400:]
    env = {k: v for k, v in environment().items() if k not in ("command", "host")}
    return {"env": env, "command": command, "results": results}


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: python bench/gpu/bundle.py DIR OUT.json COMMAND")
    out = bundle(pathlib.Path(sys.argv[1]), sys.argv[3])
    pathlib.Path(sys.argv[2]).write_text(json.dumps(out, indent=1))
    print(f"bundled {len(out['results'])} files into {sys.argv[2]}")
