"""The engine thread of ``kiln serve``, and the server's Prometheus metrics.

The engine is not thread-safe, so one thread owns it: :class:`EngineWorker` runs the step loop
and takes commands (submit, abort, call) from a thread-safe FIFO between steps. The asyncio side
never touches the engine. Each HTTP request is a :class:`Sink`: the engine requests (rids) it
owns and an ``asyncio.Queue`` of their :class:`RequestOutput`s. After each step the worker hands
that step's outputs to the event loop in one ``call_soon_threadsafe``; the loop fans them out to
the sinks and records latency metrics. Because commands are FIFO, an abort sent after a submit
always finds the requests it names.

Nothing accepted is lost: every sequence finishes (its last output has ``finished=True``), is
aborted by its sink, or its sink receives an :class:`EngineFailure`: the engine raised, the
watchdog found it stuck (:meth:`EngineWorker.watchdog`), or the server stopped (:meth:`fail`,
:meth:`stop`). After any of these the worker refuses new work and ``/health`` reports why.

Progress: the worker stamps a monotonic time each time ``engine.step()`` returns and each time
it takes a command, and marks itself idle while it waits for one. :meth:`stalled_for` is how long
it has been busy without such a stamp; the watchdog reads it from the event loop, so it works
while the engine thread is stuck inside a step (a hung device). Open sinks are kept in a registry
any thread can fail, for the same reason.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kiln.runtime import gc_pauses
from kiln.runtime.request import RequestOutput
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.step_stats import WALL_BUCKETS_MS

# (rid, prompt token ids, params, seed_index): one engine request
Seq = tuple[str, list[int], SamplingParams, int]


@dataclass
class EngineFailure:
    """Put on a sink's queue when the engine failed or the server stopped."""

    message: str


@dataclass
class Sink:
    """One HTTP request: its engine requests (rid -> choice index) and their outputs."""

    loop: asyncio.AbstractEventLoop
    rids: dict[str, int]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestOutput | EngineFailure
    arrival: float = field(default_factory=time.perf_counter)
    last_token: dict[str, float] = field(default_factory=dict)  # rid -> time of its latest token
    accepted: asyncio.Future | None = None  # resolves once the engine took its requests (submit)

    def fail(self, message: str) -> None:
        """On the event loop: end this request with ``message`` (its submit raises
        WorkerUnavailable, or its reader gets an EngineFailure)."""
        if self.accepted is not None and not self.accepted.done():
            self.accepted.set_exception(WorkerUnavailable(message))
        self.queue.put_nowait(EngineFailure(message))


class WorkerUnavailable(RuntimeError):
    """The worker failed or stopped; no new work is accepted."""


class EngineWorker:
    """Owns ``engine`` on its own thread. ``metrics`` (optional) is updated on the event loop."""

    def __init__(self, engine: Any, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.metrics = metrics
        self.error: str | None = None  # set once the worker stops taking work
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders "refuse new work" against enqueueing
        self._sinks: dict[str, Sink] = {}  # worker thread only: live rid -> its sink
        self._open_sinks: dict[int, Sink] = {}  # id -> sink submitted, not yet released (under _lock)
        self._beat: tuple[bool, float] = (True, time.monotonic())  # (idle, when last stamped)
        self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything in flight (sinks get an EngineFailure) and end the thread. If the
        thread does not end within ``timeout`` (stuck in a step), its sinks are failed from here."""
        self._put(("stop",), check=False)
        if self._thread.ident is not None:
            self._thread.join(timeout)
        if self._thread.is_alive():
            self.fail(f"the server stopped; the engine did not stop within {timeout:g} s")

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def fail(self, message: str) -> None:
        """Refuse new work (``message`` becomes :attr:`error` unless one is set) and end every open
        request now with an :class:`EngineFailure`, without waiting for the engine thread (which
        may be stuck); that thread aborts their engine requests and exits once it is free. Any
        thread may call this."""
        with self._lock:
            if self.error is None:
                self.error = message
            message = self.error
            sinks = list(self._open_sinks.values())
            self._cmds.put(("stop",))
        for s in sinks:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting
                s.loop.call_soon_threadsafe(s.fail, message)

    def stalled_for(self) -> float:
        """Seconds the worker has been busy (stepping or running a command) without progress:
        no step returned and no command was taken. 0 while it waits for work."""
        idle, since = self._beat
        if idle or not self._thread.is_alive():
            return 0.0
        return time.monotonic() - since

    def watchdog(self, limit_s: float) -> bool:
        """Fail everything (:meth:`fail`) if the worker made no progress for ``limit_s`` seconds
        while holding work; True if it fired. Call it periodically from another thread or the
        event loop."""
        stalled = self.stalled_for()
        if self.error is not None or stalled <= limit_s:
            return False
        self.fail(
            f"the engine made no progress for {stalled:.0f} s while holding work (a step that does "
            f"not return: a hung device?); watchdog limit {limit_s:g} s (--watchdog-seconds); "
            "the server takes no more requests"
        )
        return True

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the worker thread between steps (status, integrity checks in
        tests). Returns a concurrent future with its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._put(("call", fn, fut))
        return fut

    def _put(self, cmd: tuple, check: bool = True) -> None:
        with self._lock:
            if check and self.error is not None:
                raise WorkerUnavailable(self.error)
            self._cmds.put(cmd)

    # ------------------------------------------------------------------ event loop side
    def submit(self, sink: Sink, seqs: list[Seq]) -> asyncio.Future:
        """Queue ``seqs`` for ``sink``; the future resolves once the engine accepted them all (or
        raises what ``add_request`` raised: then none of them was kept)."""
        fut = sink.accepted = sink.loop.create_future()
        with self._lock:
            if self.error is not None:
                raise WorkerUnavailable(self.error)
            self._open_sinks[id(sink)] = sink
            self._cmds.put(("submit", sink, seqs, fut))
        return fut

    def release(self, sink: Sink, abort: bool) -> None:
        """``sink``'s HTTP request is over: forget it, and with ``abort`` abort its unfinished
        requests (its client went away or it failed); frees their KV."""
        with self._lock:
            self._open_sinks.pop(id(sink), None)
        if abort and self._thread.is_alive():
            self._put(("abort", sink), check=False)

    def abort(self, sink: Sink) -> None:
        """Abort every unfinished request of ``sink`` (its client went away); frees their KV."""
        self.release(sink, abort=True)

    def _dispatch(self, t: float, items: list[tuple[Sink, RequestOutput]]) -> None:
        """On the event loop: fan one step's outputs out to their sinks."""
        if self.metrics is not None:
            self.metrics.on_outputs(t, items)
        for sink, out in items:
            sink.queue.put_nowait(out)

    # ------------------------------------------------------------------ worker thread
    def _run(self) -> None:
        eng = self.engine
        try:
            idle = True  # the engine may have work of its own while it has no requests (Engine.idle)
            while True:
                if not self._drain(block=not eng.has_work() and not idle):
                    self._shutdown("the server is shutting down")
                    return
                if eng.has_work():
                    outs = eng.step()
                    self._beat = (False, time.monotonic())
                    if outs:
                        self._deliver(outs)
                    idle = True
                else:
                    idle = eng.idle()
                    if idle:  # progress (the watchdog counts from the last step or command)
                        self._beat = (False, time.monotonic())
        except BaseException as e:  # the engine raised: fail loudly, keep answering
            traceback.print_exc()
            self._shutdown(f"the engine failed: {type(e).__name__}: {e}")

    def _drain(self, block: bool) -> bool:
        """Run queued commands (waiting for one when ``block``); False once told to stop."""
        while True:
            try:
                if block:
                    self._beat = (True, time.monotonic())
                    cmd = self._cmds.get()
                else:
                    cmd = self._cmds.get_nowait()
            except queue.Empty:
                return True
            self._beat = (False, time.monotonic())
            block = False
            kind = cmd[0]
            if kind == "submit":
                self._add(*cmd[1:])
            elif kind == "abort":
                for rid in cmd[1].rids:
                    if self._sinks.pop(rid, None) is not None:
                        self.engine.abort(rid)
            elif kind == "call":
                fn, fut = cmd[1:]
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(self.engine))
                    except Exception as e:
                        fut.set_exception(e)
            elif kind == "stop":
                return False

    def _add(self, sink: Sink, seqs: list[Seq], fut: asyncio.Future) -> None:
        added: list[str] = []
        err: BaseException | None = None
        try:
            for rid, ids, params, seed_index in seqs:
                self.engine.add_request(ids, params, rid=rid, seed_index=seed_index)
                added.append(rid)
                self._sinks[rid] = sink
        except Exception as e:  # RequestError / InvalidSamplingParams: the handler answers 400
            err = e
            for rid in added:
                self._sinks.pop(rid, None)
                self.engine.abort(rid)
        self._resolve(sink.loop, fut, err)

    @staticmethod
    def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, err: BaseException | None) -> None:
        def done() -> None:
            if fut.done():  # the handler was cancelled meanwhile
                return
            if err is None:
                fut.set_result(None)
            else:
                fut.set_exception(err)

        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting
            loop.call_soon_threadsafe(done)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        t = time.perf_counter()
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Sink, RequestOutput]]] = {}
        for out in outs:
            sink = self._sinks.pop(out.rid, None) if out.finished else self._sinks.get(out.rid)
            if sink is not None:
                by_loop.setdefault(sink.loop, []).append((sink, out))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._dispatch, t, items)

    def _shutdown(self, message: str) -> None:
        """Refuse new work, then fail everything in flight and everything still queued."""
        with self._lock:
            if self.error is None:
                self.error = message
            message = self.error
        sinks = {id(s): s for s in self._sinks.values()}
        for rid in list(self._sinks):
            with contextlib.suppress(Exception):
                self.engine.abort(rid)
        self._sinks.clear()
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "submit":
                self._resolve(cmd[1].loop, cmd[3], WorkerUnavailable(message))
            elif cmd[0] == "call" and cmd[2].set_running_or_notify_cancel():
                cmd[2].set_exception(WorkerUnavailable(message))
        for s in sinks.values():
            with contextlib.suppress(RuntimeError):
                s.loop.call_soon_threadsafe(s.queue.put_nowait, EngineFailure(message))


# ------------------------------------------------------------------------------ metrics
_LATENCY_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15)
_LATENCY_BUCKETS += (0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    """Prometheus metrics of one server, in their own registry (several servers can share a
    process). Engine gauges come from ``engine.status()``, refreshed before each scrape."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        r = self.registry = CollectorRegistry()
        self.http = Counter(
            "kiln_http_requests", "HTTP requests answered.", ["endpoint", "status"], registry=r
        )
        self.finished = Counter(
            "kiln_request_finished", "Completions (sequences) finished.", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter(
            "kiln_prompt_tokens", "Prompt tokens of sequences that produced a token.", registry=r
        )
        self.generation_tokens = Counter("kiln_generation_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram(
            "kiln_time_to_first_token_seconds",
            "HTTP arrival to the first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "kiln_inter_token_latency_seconds",
            "Time between consecutive tokens of a sequence.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kiln_e2e_request_latency_seconds",
            "HTTP arrival to a sequence's last token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.status: dict[str, Any] = {}
        r.register(_EngineCollector(self))
        gc_pauses.install()  # the collector's pauses, process-wide (runtime/gc_pauses.py)

    def on_outputs(self, t: float, items: list[tuple[Sink, RequestOutput]]) -> None:
        ntok = 0
        for sink, out in items:
            ntok += len(out.new_token_ids)
            prev = sink.last_token.get(out.rid)
            if prev is None:
                self.ttft.observe(t - sink.arrival)
                self.prompt_tokens.inc(out.num_prompt_tokens)
            else:
                self.itl.observe(t - prev)
            if out.finished:
                sink.last_token.pop(out.rid, None)
                self.e2e.observe(t - sink.arrival)
                self.finished.labels(out.finish_reason or "unknown").inc()
            else:
                sink.last_token[out.rid] = t
        self.generation_tokens.inc(ntok)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# Per step kind (prefill, decode, mixed) sums: rates of these give a serving run's mean running
# batch (requests / steps) and mean step time (seconds / steps) by kind.
_STEP_KIND_COUNTERS = {
    "kiln_engine_steps": ("Engine steps (forwards), by kind.", "steps"),
    "kiln_engine_step_requests": ("Requests in each step, summed; / steps: the mean batch.", "requests"),
    "kiln_engine_step_seconds": ("Wall seconds the engine spent in steps, by kind.", "wall_s"),
    "kiln_engine_step_host_seconds": (
        "Of those, seconds the host worked (not waiting on the device).",
        "host_s",
    ),
    "kiln_engine_step_prefill_tokens": ("Prompt tokens fed to the model, by step kind.", "prefill_tokens"),
    "kiln_engine_step_decode_tokens": ("Decode rows fed to the model, by step kind.", "decode_tokens"),
}


def _step_kind_families(kinds: dict[str, dict[str, Any]]):
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    for name, (doc, key) in _STEP_KIND_COUNTERS.items():
        fam = CounterMetricFamily(name, doc, labels=["kind"])
        for kind, sums in kinds.items():
            fam.add_metric([kind], float(sums[key]))
        yield fam
    hist = HistogramMetricFamily(
        "kiln_engine_step_duration_seconds",
        "Wall time of the engine's step() calls, by step kind (the longest bound the inter-token gaps).",
        labels=["kind"],
    )
    walls = [b / 1e3 for b in WALL_BUCKETS_MS]  # as_dict's wall_hist: one count per bound, then "inf"
    for kind, sums in kinds.items():
        hist.add_metric([kind], _cumulative(walls, sums["wall_hist"].values()), float(sums["wall_s"]))
    yield hist


def _cumulative(bounds_s: Sequence[float], counts: Iterable[int]) -> list[tuple[str, int]]:
    """Prometheus histogram buckets ``(le, count at or below)`` from per-bucket counts: one per
    bound, then the open bucket (``+Inf``)."""
    les = [str(b) for b in bounds_s] + ["+Inf"]
    return list(zip(les, itertools.accumulate(counts), strict=True))


def _gc_pause_family():
    from prometheus_client.core import HistogramMetricFamily

    fam = HistogramMetricFamily(
        "kiln_python_gc_pause_seconds",
        "Pauses of Python's garbage collector, by generation (a collection stalls the engine's step).",
        labels=["generation"],
    )
    for gen, (counts, seconds) in gc_pauses.pauses().items():
        fam.add_metric([str(gen)], _cumulative(gc_pauses.PAUSE_BUCKETS_S, counts), seconds)
    return fam


class _EngineCollector:
    def __init__(self, m: ServerMetrics):
        self.m = m

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        s = self.m.status
        if not s:
            return
        cap = max(int(s["kv_capacity_tokens"]), 1)
        gauges = {
            "kiln_num_requests_running": ("Sequences holding KV and decoding.", s["running"]),
            "kiln_num_requests_waiting": ("Sequences queued for a running slot.", s["waiting"]),
            "kiln_kv_cache_usage_ratio": (
                "Fraction of KV slots in use (running sequences and the prefix cache).",
                1.0 - s["kv_free_tokens"] / cap,
            ),
            "kiln_kv_cache_capacity_tokens": ("KV slots in the pool.", s["kv_capacity_tokens"]),
            "kiln_prefix_cache_tokens": ("Tokens held by the radix prefix cache.", s["kv_cached_tokens"]),
            "kiln_prefix_cache_hit_rate": (
                "Prompt tokens served from the prefix cache / prompt tokens admitted.",
                s["cached_tokens"] / max(s["prompt_tokens"], 1),
            ),
            "kiln_engine_graph_captures_pending": (
                "CUDA graphs the idle engine may still capture (until 0, a new shape's first step may capture).",
                s["graph_captures_pending"],
            ),
        }
        for name, (doc, v) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=float(v))
        counters = {
            "kiln_prefix_cache_hit_tokens": ("Prompt tokens served from the prefix cache.", "cached_tokens"),
            "kiln_engine_prompt_tokens": ("Prompt tokens the engine admitted.", "prompt_tokens"),
            "kiln_preemptions": ("Running sequences preempted for KV memory.", "preemptions"),
            "kiln_engine_graph_captures": (
                "CUDA-graph capture runs (start-up's is one, then one per later decode bucket or "
                "prefill shape; each stalls the steps once).",
                "graph_captures",
            ),
            "kiln_engine_graph_capture_seconds": (
                "Wall seconds spent capturing CUDA graphs.",
                "graph_capture_seconds",
            ),
            # speculative decoding (the `speculative` setting; zeros when off)
            "kiln_spec_verify_requests": ("Request rows in speculative verify steps.", "spec_verified"),
            "kiln_spec_draft_tokens": ("Draft tokens proposed to verify steps.", "spec_proposed"),
            "kiln_spec_accepted_tokens": ("Draft tokens the target accepted.", "spec_accepted"),
            "kiln_spec_emitted_tokens": (
                "Tokens verify steps emitted (accepted + the target's own).",
                "spec_emitted",
            ),
            "kiln_spec_policy_switches": (
                "Times the measured speculative policy turned speculation on or off for a batch size.",
                "spec_policy_switches",
            ),
            "kiln_spec_policy_probes": (
                "Probes of the measured policy: runs of 3 steps in the mode a batch size is not using.",
                "spec_policy_probes",
            ),
        }
        for name, (doc, key) in counters.items():
            yield CounterMetricFamily(name, doc, value=float(s[key]))
        yield from _step_kind_families(s["step_kinds"])
        yield _gc_pause_family()
        yield GaugeMetricFamily(
            "kiln_spec_acceptance_rate",
            "Draft tokens accepted / proposed since the server started (0 before any).",
            value=s["spec_accepted"] / s["spec_proposed"] if s["spec_proposed"] else 0.0,
        )
        hist = s["spec_accepted_hist"]  # drafts accepted per verified request row: rows
        buckets, total = [], 0
        for accepted in range(max(hist, default=0) + 1):
            total += hist.get(accepted, 0)
            buckets.append((str(accepted), total))
        buckets.append(("+Inf", total))
        yield HistogramMetricFamily(
            "kiln_spec_accepted_drafts",
            "Draft tokens accepted per request row of a verify step.",
            buckets=buckets,
            sum_value=float(s["spec_accepted"]),  # the histogram's sum: every accepted draft
        )
