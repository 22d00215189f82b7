"""``kiln cache ls`` / ``kiln cache rm``: the compiled artifacts :mod:`kiln.compile_cache` keeps."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from kiln.compile_cache import (
    ALL,
    MIN_PREFIX,
    default_cache_dir,
    list_entries,
    non_default,
    partial_builds,
    remove,
)

SHORT_KEY = 12  # key characters the table shows (rm takes any unique prefix of MIN_PREFIX or more)


def _cache_dir_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--cache-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="The compile cache [default: $KILN_CACHE, else ~/.cache/kiln/artifacts].",
    )(f)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t else "-"


def _flags(options: dict[str, Any]) -> str:
    out = []
    for name, v in non_default(options).items():
        flag = "--" + name.replace("_", "-")
        out.append(flag if v is True else f"--no-{flag[2:]}" if v is False else f"{flag} {v}")
    return " ".join(out) or "(defaults)"


@click.group("cache", context_settings={"help_option_names": ["-h", "--help"]})
def cache_cmd() -> None:
    """The compile cache: `kiln serve CHECKPOINT` (and generate, bench, LLM) compiles a Hugging Face
    checkpoint once into it, keyed by the checkpoint's content, the compile options, the device kind
    and the kiln / torch / triton versions; later starts load the artifact there and compile nothing.

    An interrupted or damaged entry is rebuilt on the next start. The cache lives in $KILN_CACHE,
    else ~/.cache/kiln/artifacts.
    """


@cache_cmd.command("ls")
@_cache_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print the entries as JSON (full keys and options).")
def ls_cmd(cache_dir: Path | None, as_json: bool) -> None:
    """List the cached artifacts: key, model, architecture, device, size, created, last used, and the
    compile options that differ from the defaults. An entry the next start would rebuild is marked
    UNUSABLE with the reason."""
    root = cache_dir or default_cache_dir()
    entries = list_entries(root)
    partial = partial_builds(root)
    if as_json:
        doc = {"cache_dir": str(root), "entries": [e.to_json() for e in entries]}
        doc["partial_builds"] = [str(p) for p in partial]
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
        return
    if not entries:
        click.echo(f"no compiled artifacts in {root}")
    else:
        head = ("KEY", "MODEL", "ARCHITECTURE", "DEVICE", "SIZE", "CREATED", "LAST USED", "OPTIONS")
        rows = [
            (
                e.key[:SHORT_KEY],
                e.model,
                e.architecture,
                e.device_kind,
                _size(e.size_bytes),
                _when(e.created),
                _when(e.last_used),
                _flags(e.options)
                if e.problem is None
                else f"UNUSABLE (rebuilt at the next start): {e.problem}",
            )
            for e in entries
        ]
        widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head) - 1)]
        for r in (head, *rows):
            click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
        total = sum(e.size_bytes for e in entries)
        click.echo(f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, {_size(total)} in {root}")
    if partial:
        click.echo(f"{len(partial)} partial build(s) (in progress or interrupted): `kiln cache rm --all`")


@cache_cmd.command(
    "rm",
    help=f"Remove the cached artifact KEY (as `kiln cache ls` shows it; a unique prefix of {MIN_PREFIX} "
    "characters or more will do), or every one with --all. The next start with that checkpoint and those "
    "options compiles again.",
)
@click.argument("key", required=False)
@click.option("--all", "rm_all", is_flag=True, help="Remove every entry and partial build.")
@_cache_dir_option
def rm_cmd(key: str | None, rm_all: bool, cache_dir: Path | None) -> None:
    if key is not None and rm_all:
        raise click.UsageError("give a KEY or --all, not both")
    if key is None and not rm_all:
        raise click.UsageError("give the KEY to remove (`kiln cache ls` lists them) or --all")
    root = cache_dir or default_cache_dir()
    removed = remove(root, ALL if rm_all else str(key))
    for k in removed:
        click.echo(f"removed {k}")
    if not removed:
        click.echo(f"nothing to remove in {root}")
