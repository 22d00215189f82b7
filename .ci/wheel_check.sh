#!/usr/bin/env bash
# The published package, as a user gets it: `python -m build` (an sdist, then the wheel built from
# that sdist), the wheel installed into a fresh venv, and `kiln --version`, `kiln inspect` of a
# bundled config and `kiln demo` run from a directory outside the repository.
#
# Time budget (a 2-core CI machine): torch, triton and the other dependencies are not installed
# again. The fresh venv sees the dev venv's site-packages as a plain path entry (a .pth line), so
# torch & co. come from there; the dev venv's editable kiln is not active in it (its .pth hook is
# not run from a path entry) and kiln itself is installed from the wheel with --no-deps. The script
# then checks that every kiln module imported comes from the fresh venv, that the wheel's kernel
# sources hash like the repository's, and that `pip check` finds the wheel's declared
# requirements satisfied.
#
# Usage: bash .ci/wheel_check.sh        (after `make install`; VENV=.venv by default)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY="$REPO/${VENV:-.venv}/bin/python"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kiln-wheel.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
say() { echo "[wheel-check] $*"; }
t0=$SECONDS

"$PY" -c "import build" 2>/dev/null || "$PY" -m pip install -q "build>=1.2"
say "python -m build (sdist, then the wheel from it) -> $WORK/dist"
"$PY" -m build --outdir "$WORK/dist" . >"$WORK/build.log" 2>&1 || {
    tail -50 "$WORK/build.log"
    exit 1
}
WHEEL=$(ls "$WORK"/dist/kiln-*.whl)
say "built $(basename "$WHEEL") and $(basename "$(ls "$WORK"/dist/kiln-*.tar.gz)")"

VENV_DIR="$WORK/venv"
"$PY" -m venv --without-pip "$VENV_DIR"
SITE=$("$VENV_DIR/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
DEV_SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
echo "$DEV_SITE" >"$SITE/_kiln_wheel_check_deps.pth"
"$PY" -m pip --python "$VENV_DIR/bin/python" install -q --no-deps "$WHEEL"
"$PY" -m pip --python "$VENV_DIR/bin/python" check

# From outside the repository, without PYTHONPATH: the repository's sources cannot be imported.
mkdir "$WORK/run"
cd "$WORK/run"
unset PYTHONPATH
export PATH="$VENV_DIR/bin:$PATH"
python - "$VENV_DIR" "$REPO" <<'EOF'
import sys
from pathlib import Path

import kiln
import kiln.compiler
import kiln.ops
import kiln.runtime
import kiln.weights
from kiln.artifact_format import kernel_source_hash, sources_hash

venv, repo = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
for mod in (kiln, kiln.ops, kiln.weights, kiln.compiler, kiln.runtime):
    where = Path(mod.__file__).resolve()
    assert where.is_relative_to(venv), f"{mod.__name__} imported from {where}, not from the wheel in {venv}"
print(f"[wheel-check] kiln {kiln.__version__} imported from {Path(kiln.__file__).parent}")
assert kernel_source_hash() == sources_hash(repo / "ops"), (
    "the wheel's kiln.ops kernel sources (.py/.cu/...) differ from the repository's ops/: "
    "add the missing files to [tool.setuptools] packages or package-data in pyproject.toml"
)
EOF

want="kiln, version $("$PY" -c "import tomllib; print(tomllib.load(open('$REPO/pyproject.toml', 'rb'))['project']['version'])")"
got=$(kiln --version)
[ "$got" = "$want" ] || { say "kiln --version printed '$got', expected '$want'"; exit 1; }
say "kiln --version: $got"
kiln inspect llama-3.1-8b >"$WORK/inspect.txt"
grep -q "LlamaForCausalLM" "$WORK/inspect.txt" || { cat "$WORK/inspect.txt"; exit 1; }
say "kiln inspect of a bundled config: ok"
kiln demo --dir "$WORK/demo" --max-tokens 16 | tee "$WORK/demo.txt"
grep -q "generate 16 tokens" "$WORK/demo.txt" || { say "kiln demo did not generate 16 tokens"; exit 1; }
say "ok in $((SECONDS - t0)) s"
