"""Running ``kiln serve`` as a process: uvicorn, the signals, the graceful drain.

    serve(engine, "127.0.0.1", 8000, ServerOptions())   # blocks until SIGTERM or SIGINT

On SIGTERM or SIGINT the server closes its listener and idle connections, admits nothing new (a
503 on a connection still open), gives the requests in flight ``shutdown_timeout`` seconds to
finish, ends the rest with an error (an error event in a stream, a 503 otherwise), stops the
engine thread and returns, so that the process exits 0. A second SIGINT during the drain makes
uvicorn exit at once. What uvicorn does alone (0.55): on a signal it waits for open connections
(streams included) up to ``timeout_graceful_shutdown``, then cancels their tasks, which cuts
streams mid-body; and it re-raises the signal once done, so SIGTERM would end the process with
status 143.
"""

from __future__ import annotations

import signal
from typing import Any

from fastapi import FastAPI

from kiln import gc_paused, settings
from kiln.errors import KilnError
from kiln.runtime.gc_pauses import freeze_startup
from kiln.runtime.server import OpenAIServer, ServerOptions, create_app

SHUTDOWN_GRACE_S = 5.0  # after shutdown_timeout: time for the error replies to go out


class BindError(KilnError, OSError):
    """``--host``/``--port`` cannot be bound (in use, or not an address of this machine)."""


def check_bindable(host: str, port: int) -> None:
    """Raise :class:`BindError` unless ``host:port`` can be bound now: called before the model
    loads, so that a port in use fails in a second instead of after the load (uvicorn binds it
    again when it starts; a server that takes the port in between still fails there)."""
    import socket

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            s.bind(addr)
    except OSError as e:
        raise BindError(
            f"--host {host} --port {port}: cannot bind ({e.strerror or e}); another server may hold the "
            "port: pick another --port, or stop that server"
        ) from None


def uvicorn_server(app: FastAPI, **config: Any) -> Any:
    """A ``uvicorn.Server`` for ``app`` (``config``: ``uvicorn.Config``'s keywords) whose shutdown
    drains: when it is told to exit (a signal, or ``should_exit``) it closes the listener, the app
    admits nothing new (503) and gives in-flight requests ``shutdown_timeout`` seconds, then ends
    the rest with an error; uvicorn waits ``SHUTDOWN_GRACE_S`` more for those replies to go out
    before it cancels what is left, then stops the engine thread."""
    import uvicorn

    st: OpenAIServer = app.state.kiln

    class Server(uvicorn.Server):
        async def shutdown(self, *args: Any, **kwargs: Any) -> None:
            st.begin_shutdown()
            await super().shutdown(*args, **kwargs)

    config.setdefault("timeout_graceful_shutdown", st.opts.shutdown_timeout + SHUTDOWN_GRACE_S)
    return Server(uvicorn.Config(app, **config))


def serve(
    engine: Any, host: str, port: int, opts: ServerOptions, log_level: str = "info", access_log: bool = False
) -> None:
    """Run the server until SIGTERM or SIGINT (blocking), then drain (:func:`uvicorn_server`) and
    return."""
    with gc_paused():  # the app's routes and models, uvicorn's modules (kiln.gc_paused)
        server = uvicorn_server(
            create_app(engine, opts), host=host, port=port, log_level=log_level, access_log=access_log
        )
        server.config.load()  # (what server.run() does first: its protocol modules, the app's wrappers)
    freeze_startup(settings.value("gc_freeze"))  # the server's start-up objects too (runtime/gc_pauses.py)
    # uvicorn (>= 0.29) installs its own handlers while it runs, and after shutting down re-raises
    # the signal it caught under the handlers it found: Python's defaults would then kill the
    # process by SIGTERM (status 143) or raise KeyboardInterrupt. With ours in place the re-raise
    # only asks the finished server to exit again; a second SIGINT during the drain still forces
    # uvicorn to exit at once.
    handled = [signal.SIGINT, signal.SIGTERM]
    previous = {sig: signal.signal(sig, server.handle_exit) for sig in handled}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
