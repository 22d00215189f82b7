"""Bundle one GPU call's outputs into a single JSON for ``bench/results/`` (one file per call).

``python bench/gpu/bundle.py DIR OUT.json "COMMAND"``: every ``*.json`` under DIR is parsed, every
``*.log`` / ``*.txt`` kept as its list of lines, all under ``results`` keyed by file stem, beside
``env`` (runtime/benchmark.py ``environment()``: date, GPU, versions) and ``command``. Run it on
the GPU machine so ``env`` names that machine.
"""

from __future__ import annotations

import json
import pathlib
import sys

from kiln.runtime.benchmark import environment


def bundle(src: pathlib.Path, command: str) -> dict:
    results: dict = {}
    for f in sorted(src.iterdir()):
        if f.suffix == ".json":
            try:
                results[f.stem] = json.loads(f.read_text())
            except json.JSONDecodeError as err:  # a run cut short: keep what it wrote
                results[f.stem] = {"unparsed": f.read_text()[-4000:], "error": str(err)}
        elif f.suffix in (".log", ".txt"):
            results[f.stem] = f.read_text(errors="replace").splitlines()[-400:]
    env = {k: v for k, v in environment().items() if k not in ("command", "host")}
    return {"env": env, "command": command, "results": results}


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: python bench/gpu/bundle.py DIR OUT.json COMMAND")
    out = bundle(pathlib.Path(sys.argv[1]), sys.argv[3])
    pathlib.Path(sys.argv[2]).write_text(json.dumps(out, indent=1))
    print(f"bundled {len(out['results'])} files into {sys.argv[2]}")
