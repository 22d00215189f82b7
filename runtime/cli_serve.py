"""``kiln serve ART``: the OpenAI-compatible HTTP server (see :mod:`kiln.runtime.server`)."""

from __future__ import annotations

import click

from kiln import gc_paused
from kiln.runtime.cli_generate import engine_options, options_from


@click.command("serve")
@click.argument("artifact")
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0: every interface)."
)
@click.option(
    "--port",
    default=8000,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Port to bind (0: any free one).",
)
@click.option(
    "--api-key",
    envvar="KILN_API_KEY",
    default=None,
    help="Require 'Authorization: Bearer KEY' on /v1/* [env: KILN_API_KEY].",
)
@click.option(
    "--max-queue",
    type=click.IntRange(min=0),
    default=None,
    help="Sequences allowed to wait for a running slot; past it requests get 429 "
    "[default: 8 x the engine's --max-running].",
)
@click.option(
    "--max-sequences-per-request",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Most sequences (prompts x n) one request may ask for; past it a 400 naming n or prompt.",
)
@click.option(
    "--watchdog-seconds",
    type=click.FloatRange(min=0),
    default=60.0,
    show_default=True,
    help="If the engine makes no progress this long while it holds work (a hung device), fail its "
    "requests with an error, answer 503 on /health and take no more requests; 0 turns it off.",
)
@click.option(
    "--shutdown-timeout",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="On SIGTERM/SIGINT: stop admitting, give in-flight requests this many seconds to finish, "
    "end the rest with an error, exit 0.",
)
@click.option(
    "--served-model-name", default=None, help="Model id clients use [default: the artifact's directory name]."
)
@click.option("--max-body-mb", default=16.0, show_default=True, help="Largest request body (413 past it).")
@click.option(
    "--log-level", default="info", show_default=True, type=click.Choice(["debug", "info", "warning", "error"])
)
@click.option("--access-log", is_flag=True, help="Log every HTTP request.")
@engine_options
def serve_cmd(
    artifact: str,
    host: str,
    port: int,
    api_key: str | None,
    max_queue: int | None,
    max_sequences_per_request: int,
    watchdog_seconds: float,
    shutdown_timeout: float,
    served_model_name: str | None,
    max_body_mb: float,
    log_level: str,
    access_log: bool,
    **kw,
) -> None:
    """Serve ARTIFACT over HTTP with OpenAI's API: /v1/completions, /v1/chat/completions,
    /v1/models, /health, /metrics."""
    with gc_paused():  # torch, the kernels, the runtime and the server's modules (kiln.gc_paused)
        import torch

        from kiln.runtime.engine import Engine, EngineOptions
        from kiln.runtime.server import ServerOptions
        from kiln.runtime.server_run import check_bindable, serve
        from kiln.runtime.tensor_parallel import follow_launched

    opts = EngineOptions(**options_from(kw))
    if follow_launched(artifact, opts):
        return  # a launched rank other than 0 (torchrun): it followed rank 0's steps until the stop
    check_bindable(host, port)  # before the load, not after it
    if (opts.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu":
        torch.set_num_threads(1)  # small CPU models: OpenMP hand-offs cost more than the math
    engine = Engine(artifact, opts)
    server_opts = ServerOptions(
        model_name=served_model_name,
        api_key=api_key or None,
        max_queue=max_queue,
        max_sequences_per_request=max_sequences_per_request,
        max_body_bytes=int(max_body_mb * (1 << 20)),
        watchdog_seconds=watchdog_seconds,
        shutdown_timeout=shutdown_timeout,
    )
    serve(engine, host, port, server_opts, log_level=log_level, access_log=access_log)
