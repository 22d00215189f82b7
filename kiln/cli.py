"""The ``kiln`` command line. Each subcommand lives beside the code it drives and is imported
only when it runs, so ``kiln --help`` stays fast and the runtime never pulls in the compiler."""

from __future__ import annotations

import atexit
import importlib
import os
import sys
import warnings
from typing import TextIO

import click

from kiln import __version__, gc_paused
from kiln.errors import KilnError

# name -> ("module:attribute", one-line help). Only commands that exist are listed.
COMMANDS: dict[str, tuple[str, str]] = {
    "inspect": (
        "kiln.compiler.cli_inspect:inspect_cmd",
        "Show what a checkpoint is: attention kind, per-rank shapes, weight and KV bytes.",
    ),
    "bench": (
        "kiln.runtime.cli_bench:bench_cmd",
        "Measure decode latency, throughput and start-up (optionally beside Hugging Face transformers).",
    ),
    "cache": (
        "kiln.cli_cache:cache_cmd",
        "List or remove the artifacts compiled for checkpoints (serve / generate CHECKPOINT build them once).",
    ),
    "compile": (
        "kiln.compiler.cli_compile:compile_cmd",
        "Compile a Hugging Face checkpoint into a servable artifact (graphs, kernels, weight packs).",
    ),
    "demo": (
        "kiln.demo:demo_cmd",
        "Build a small random-weight model with a real tokenizer, compile it here, and generate.",
    ),
    "generate": (
        "kiln.runtime.cli_generate:generate_cmd",
        "Load an artifact and stream a completion of a prompt to the terminal.",
    ),
    "serve": (
        "kiln.runtime.cli_serve:serve_cmd",
        "Serve an artifact over HTTP with OpenAI's API (completions, chat, streaming, metrics).",
    ),
    "pack": (
        "kiln.compiler.cli_pack:pack_cmd",
        "Shard, fuse and optionally FP8-quantize a checkpoint into per-rank weight packs.",
    ),
    "settings": (
        "kiln.settings:settings_cmd",
        "List every switch: its flag, environment variable, default, allowed values, when it is read.",
    ),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        target, _ = COMMANDS[name]
        module, attr = target.split(":")
        with gc_paused():  # (kiln.gc_paused: imports allocate long-lived objects)
            return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="kiln")
def cli() -> None:
    """kiln: compile a Hugging Face checkpoint once, then load and serve it in seconds.

    Run `kiln COMMAND --help` for the options of each command.
    """


_EXIT_CODE = [0]  # main's exit status, for _leave_if_launched


def main() -> None:
    # registered first, so it runs after every other exit handler (they run last-in first-out),
    # the engine's close (its stop message to the follower ranks) included
    atexit.register(_leave_if_launched)
    # torch's own pytree code trips its own deprecation (torch 2.13, each export and graph load):
    # nothing a kiln user can act on
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    warnings.showwarning = _show_warning
    try:
        _run()
    except SystemExit as e:
        _EXIT_CODE[0] = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        raise
    except BaseException:
        _EXIT_CODE[0] = 1
        raise


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """kiln's own warnings (their text starts with "kiln") as one line on stderr, without the
    source line Python shows beside them; any other package's as Python shows it."""
    text = str(message)
    out = file or sys.stderr
    if text.startswith("kiln"):
        out.write(f"warning: {text}\n")
    else:
        out.write(warnings.formatwarning(message, category, filename, lineno, line))
    out.flush()


def _leave_if_launched() -> None:
    """A launcher's rank (torchrun) that used torch.distributed, its exit handlers done: leave
    without the interpreter's teardown, in which gloo's threads can abort the process after a
    clean run ("terminate called without an active exception", exit -6)."""
    launched = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))
    if launched and "torch.distributed" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_CODE[0])


def _run() -> None:
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except KilnError as e:
        click.secho(f"error: {e}", fg="red", err=True)
        sys.exit(2)
