"""Running a tensor-parallel artifact (``kiln compile --tp N``): one process per rank, rank 0 leading.
An expert-parallel MoE artifact (``--tp N --ep M``) is the same world of N ranks: the experts a rank
holds are in its pack, and its graph finds its share from its rank (ops/moe/expert_map.py).

Protocol. The engine's process is rank 0: it schedules, samples and detokenizes as with one rank.
:func:`start_ranks` starts ranks ``1..N-1`` as processes (``torch.multiprocessing``, spawn), joins
a ``torch.distributed`` group with them (gloo on CPU, NCCL on GPU; a file rendezvous) and makes it
the graphs' tensor-parallel group (``kiln.ops.common.collective.set_tp_group``). Each follower
loads its rank's pack. Everything after is broadcast from rank 0, in order: each message first as a
step wire (runtime/step_wire.py: one int64 tensor over the graphs' group, NCCL on GPUs), which
holds a step whole or says that the message follows as a Python object over the control group
(gloo, on the host: with NCCL a second group):

1. ``("setup", num_slots, max_running, cuda_graph)``: the KV pool and block table sizes the engine
   chose; every rank builds the same pool, table and model runner (capturing its CUDA graphs, whose
   collectives meet the other ranks' captures in the same order).
2. ``("step", step, pending, argmax)`` per forward: the step's inputs (``model_runner.StepInputs``,
   host lists) and the block table's changes since the last step, flushed on rank 0 or not
   (``BlockTable.take_changes``, ``{flat index: page}``: a draft's steps on rank 0 flush too);
   each follower applies the changes and runs the same forward, whose collectives pair with rank
   0's. Only rank 0 reads the logits (every rank has them whole). With overlap, rank 0 launches a
   decode step before it has read the last one's ids: ``argmax`` says they are the decode graph's
   argmax, which every rank holds in place (``ModelRunner.argmax_ids``); sampled ids are read to
   the host and sent in the step (that step does not overlap).
3. ``("stop",)``: every rank meets at a barrier (no connection closes while a peer still uses it:
   gloo aborts the process then), and leaves the group.

A follower that fails reports its error on stderr and exits; rank 0's next collective then fails
(gloo and NCCL time out after ``timeout_s``) and the engine raises instead of hanging.

Launched ranks (``torchrun``, across machines or on one). When a launcher started the processes
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` in the environment: :func:`launched_rank`), nothing is
spawned: every process joins the group through ``env://``; rank 0 runs the engine
(:func:`join_launched` gives it a :class:`RankGroup` without processes) and every other rank runs
the follower loop (:func:`follow_launched`; ``kiln serve`` / ``kiln generate`` call it on their
own), each on GPU ``LOCAL_RANK`` of its machine. The protocol is the same.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kiln import settings
from kiln.errors import KilnError
from kiln.ops.common.collective import enable_symmetric_all_reduce, set_tp_group
from kiln.runtime import step_wire
from kiln.runtime.gc_pauses import freeze_startup
from kiln.runtime.kv_pool import BlockTable, KVPool
from kiln.runtime.loader import load_model
from kiln.runtime.model_runner import ModelRunner, StepInputs, with_drafts

if TYPE_CHECKING:
    from kiln.runtime.engine import EngineOptions


class TensorParallelError(KilnError, RuntimeError):
    """The ranks of a tensor-parallel run could not start or lost one another."""


_CONTROL: Any = None  # the protocol's group (module docstring): gloo over the ranks


def _backend(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def launched_rank() -> tuple[int, int, int] | None:
    """``(rank, world size, local rank)`` when a launcher (torchrun) started this process, else None.
    These are torch.distributed's launch variables, not kiln settings."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        return rank, world, int(env.get("LOCAL_RANK", rank))
    except ValueError:
        raise TensorParallelError(
            f"RANK={env['RANK']!r} WORLD_SIZE={env['WORLD_SIZE']!r} LOCAL_RANK={env.get('LOCAL_RANK')!r}: "
            "the launcher's variables must be integers"
        ) from None


def rank_device(device: str, local_rank: int) -> str:
    """The rank's device: its machine's GPU ``local_rank`` (CPU: the CPU)."""
    return f"cuda:{local_rank}" if torch.device(device).type == "cuda" else device


def _join(
    rank: int, tp: int, init: str | None, device: str, timeout_s: float, local_rank: int | None = None
) -> None:
    """Join the group as ``rank`` of ``tp``: a file rendezvous at ``init``, or ``env://`` (None)."""
    backend = _backend(device)
    if backend == "nccl":
        torch.cuda.set_device(rank if local_rank is None else local_rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{init}" if init is not None else "env://",
        rank=rank,
        world_size=tp,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    set_tp_group(dist.group.WORLD)
    if backend == "nccl" and settings.value("tp_all_reduce") == "auto":
        enable_symmetric_all_reduce(torch.device("cuda", torch.cuda.current_device()))
    global _CONTROL, _WIRE
    _CONTROL = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    _WIRE = _Wire()


class _Wire:
    """This rank's step wire (runtime/step_wire.py): a host tensor broadcast over the control group."""

    def __init__(self) -> None:
        self.host = torch.zeros(step_wire.WIRE_INTS, dtype=torch.int64)

    def send(
        self, step: StepInputs | None, pending: dict[int, int] | None = None, argmax: bool = False
    ) -> bool:
        """Rank 0: broadcast ``step`` (None: the object header); whether it went on the wire."""
        on_wire = step_wire.encode(self.host.numpy(), step, pending, argmax)
        dist.broadcast(self.host, src=0, group=_CONTROL)
        return on_wire

    def receive(self) -> tuple[StepInputs, dict[int, int], bool] | None:
        """A follower: the next step, its table changes and whether its ids are this rank's own
        argmax, or None (an object follows)."""
        dist.broadcast(self.host, src=0, group=_CONTROL)
        return step_wire.decode(self.host.numpy())


_WIRE: _Wire | None = None


def _receive() -> tuple[Any, ...]:
    assert _WIRE is not None
    got = _WIRE.receive()
    if got is not None:
        return ("step", *got)
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=_CONTROL)
    return box[0]


def _follower_main(
    rank: int,
    tp: int,
    init: str | None,
    artifact: str,
    device: str,
    timeout_s: float,
    verify: bool,
    run_settings: dict[str, Any],
    local_rank: int | None = None,
) -> None:
    """Rank ``rank``'s process (module docstring): load the rank's pack, then mirror rank 0's steps.
    ``run_settings``: the engine's run-time settings (kiln/settings.py), applied here as there."""
    settings.apply("run", run_settings)
    _join(rank, tp, init, device, timeout_s, local_rank)
    dev = rank_device(device, rank if local_rank is None else local_rank)
    try:
        model = load_model(artifact, dev, rank=rank, verify=verify)
        msg = _receive()
        assert msg[0] == "setup", msg[0]
        _, num_slots, max_running, cuda_graph, graph_greedy, num_draft_tokens, tree_graphs = msg
        m = model.artifact.manifest
        pool = KVPool.for_spec(m.kv, num_slots, model.device)
        bt = BlockTable(max_running, m.max_blocks, model.device, m.kv.page_size)
        runner = ModelRunner(
            model,
            pool,
            bt,
            cuda_graph=cuda_graph,
            graph_greedy=graph_greedy,
            num_draft_tokens=num_draft_tokens,
            tree_graphs=tree_graphs,
            prefill_graphs=False,  # as rank 0's (Engine): eager extend steps on every rank
        )
        freeze_startup(settings.value("gc_freeze"))  # this process's engine is for good (gc_pauses.py)
        while True:
            msg = _receive()
            if msg[0] == "stop":
                dist.barrier(
                    group=_CONTROL
                )  # with rank 0: no rank closes its connections while another uses them
                break
            if msg[0] == "move":  # after a token-tree step: rank 0's K/V moves, on this rank's pool
                runner.move_kv(
                    torch.tensor(msg[1], dtype=torch.int64), torch.tensor(msg[2], dtype=torch.int64)
                )
                continue
            _, step, pending, argmax = msg
            bt.queue_changes(pending)
            # argmax: the ids are this rank's argmax of the last step, in place
            runner.forward(step, (None, runner.argmax_ids(step.batch)) if argmax else None)
        runner.release_graphs()
    finally:
        dist.destroy_process_group()


class RankGroup:
    """Rank 0's side of a tensor-parallel run: the follower processes and the broadcasts."""

    def __init__(self, procs: list[Any], init: str | None):
        # procs: the spawned followers (none when a launcher started the ranks); init: the file
        # rendezvous to remove at close (None: env://)
        self.procs = procs
        self.init = init
        self.closed = False

    def setup(
        self,
        num_slots: int,
        max_running: int,
        cuda_graph: bool,
        graph_greedy: bool,
        num_draft_tokens: int,
        tree_graphs: bool = False,
    ) -> None:
        """Step 1 of the protocol, before rank 0 builds its model runner (``num_draft_tokens``,
        ``tree_graphs``: ``ModelRunner``'s; 0 and False with speculative decoding off)."""
        self.send(("setup", num_slots, max_running, cuda_graph, graph_greedy, num_draft_tokens, tree_graphs))

    def send(self, msg: tuple[Any, ...]) -> None:
        """Broadcast one protocol message to the followers; a dead follower or a failed collective
        raises :class:`TensorParallelError`."""
        dead = [i + 1 for i, p in enumerate(self.procs) if not p.is_alive()]
        if dead:
            raise TensorParallelError(f"tensor-parallel rank(s) {dead} exited; the run cannot go on.")
        assert _WIRE is not None
        try:
            on_wire = _WIRE.send(*msg[1:]) if msg[0] == "step" else _WIRE.send(None)
            if not on_wire:  # setup, stop, a step larger than the wire: the object follows
                dist.broadcast_object_list([msg], src=0, group=_CONTROL)
        except Exception as e:  # a rank died mid-collective, or the group timed out
            raise TensorParallelError(f"tensor-parallel broadcast failed: {e}") from None

    def close(self, release_graphs: Callable[[], None] | None = None) -> None:
        """Stop the followers and leave the group (idempotent; never raises for a group already
        broken: the followers left are killed after 30 s). ``release_graphs``: rank 0's
        ``ModelRunner.release_graphs``, called once every rank has stopped (no collective in flight)."""
        if self.closed:
            return
        self.closed = True
        try:
            if all(p.is_alive() for p in self.procs):
                self.send(("stop",))
                dist.barrier(group=_CONTROL)  # the followers' (protocol step 3): then every rank closes
                if release_graphs is not None:
                    release_graphs()
        except (TensorParallelError, RuntimeError):
            pass  # a rank is gone or hung: the joins below end the rest
        finally:
            for p in self.procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
            set_tp_group(None)
            if dist.is_initialized():
                dist.destroy_process_group()
            if self.init is not None and os.path.exists(self.init):
                os.remove(self.init)


def _in_step(fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """Rank 0's share of a step; a collective inside it (the graphs' all-reduces) that times out or
    loses a rank fails as :class:`TensorParallelError`, as the step's broadcast does (which of the
    two meets a hung rank first depends on the transport's buffering)."""
    try:
        return fn(*args)
    except RuntimeError as e:
        text = str(e)
        if isinstance(e, dist.DistError) or "gloo" in text or "NCCL" in text:
            raise TensorParallelError(f"tensor-parallel collective failed: {text.splitlines()[0]}") from None
        raise


class BroadcastRunner:
    """Rank 0's model runner for a tensor-parallel artifact: each forward is sent to the followers
    (step 2 of the protocol) before it runs here. Every other attribute is the runner's."""

    def __init__(self, runner: ModelRunner, ranks: RankGroup):
        self.runner = runner
        self.ranks = ranks
        # a draft on rank 0 (its catch-up, chain and mirror steps) flushes the shared block table
        # between broadcast steps: each step carries every change since the last one
        runner.bt.track_changes()

    def forward(self, step: StepInputs, subst: Any = None) -> torch.Tensor:
        """``subst``: the step's input ids still on the device (overlap, ``ModelRunner.decode``).
        Those of the decode graph's argmax travel as a flag (every rank has them in place); others
        (sampled ids) are read to the host first: that step does not overlap."""
        argmax = self.runner.uses_argmax_ids(subst, step.batch)
        if subst is not None and not argmax:
            rows, ids = subst
            host_ids = list(step.input_ids)
            for r, i in zip(range(len(ids)) if rows is None else rows.tolist(), ids.tolist(), strict=True):
                host_ids[r] = i
            step, subst = replace(step, input_ids=host_ids), None
        self.ranks.send(("step", step, self.runner.bt.take_changes(), argmax))
        return _in_step(self.runner.forward, step, subst)

    def verify(self, step: StepInputs, draft_ids: torch.Tensor | None = None) -> torch.Tensor:
        """A speculative verify step (``ModelRunner.verify``), run by every rank; a draft chain's
        ids on rank 0's device go to the followers on the host (``with_drafts``)."""
        step = with_drafts(step, draft_ids)
        self.ranks.send(("step", step, self.runner.bt.take_changes(), False))
        return _in_step(self.runner.verify, step)

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """A token-tree step's K/V moves (``ModelRunner.move_kv``) on every rank: the slots go to
        the followers on the host (this waits for the acceptance that computed them)."""
        self.ranks.send(("move", src.tolist(), dst.tolist()))
        self.runner.move_kv(src, dst)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


def start_ranks(
    artifact: str,
    tp: int,
    device: str,
    timeout_s: float = 120.0,
    verify: bool = True,
    run_settings: dict[str, Any] | None = None,
) -> RankGroup:
    """Start ranks ``1..tp-1`` following this process, and join the group as rank 0 (module
    docstring). The engine calls it before loading the artifact."""
    if dist.is_initialized():
        raise TensorParallelError("a torch.distributed group is already initialized in this process")
    if timeout_s < 1:
        raise TensorParallelError(
            f"tp_timeout (--tp-timeout, KILN_TP_TIMEOUT) is {timeout_s}; give at least 1 second."
        )
    if torch.device(device).type == "cuda" and torch.cuda.device_count() < tp:
        raise TensorParallelError(
            f"the artifact is built for {tp} tensor-parallel ranks; this machine shows "
            f"{torch.cuda.device_count()} GPU(s): compile with --tp {torch.cuda.device_count()} or run it elsewhere."
        )
    fd, init = tempfile.mkstemp(prefix="kiln-tp-")
    os.close(fd)
    os.remove(init)  # the file rendezvous creates it
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_follower_main,
            args=(r, tp, init, artifact, device, timeout_s, verify, run_settings or {}),
            daemon=True,
        )
        for r in range(1, tp)
    ]
    for p in procs:
        p.start()
    try:
        _join(0, tp, init, device, timeout_s)
    except Exception as e:
        for p in procs:
            p.kill()
        raise TensorParallelError(f"the tensor-parallel ranks did not meet: {e}") from None
    return RankGroup(procs, init)


def _check_launch(artifact: str, tp: int, launch: tuple[int, int, int]) -> None:
    world = launch[1]
    if world != tp:
        raise TensorParallelError(
            f"{artifact} is built for {tp} tensor-parallel rank(s) but the launcher started {world} "
            f"processes: launch {tp} (torchrun --nproc-per-node ... so that nnodes x nproc = {tp})."
        )


def join_launched(artifact: str, tp: int, device: str, timeout_s: float = 120.0) -> RankGroup:
    """Rank 0 of a launched world (module docstring): join the group; the other ranks follow."""
    launch = launched_rank()
    assert launch is not None and launch[0] == 0, launch
    _check_launch(artifact, tp, launch)
    try:
        _join(0, tp, None, device, timeout_s, launch[2])
    except Exception as e:
        raise TensorParallelError(f"the tensor-parallel ranks did not meet: {e}") from None
    return RankGroup([], None)


def follow_launched(artifact: str, opts: EngineOptions) -> bool:
    """In a launched rank other than 0, run the follower loop until rank 0 stops and return True;
    in rank 0 or an unlaunched process return False at once (the caller runs the engine). ``opts``:
    the engine options of the command every rank runs (device, verify, run-time settings)."""
    launch = launched_rank()
    if launch is None or launch[0] == 0:
        return False
    from kiln.manifest import Manifest

    rank, world, local = launch
    _check_launch(artifact, Manifest.load(Path(artifact)).tp, launch)
    values = opts.setting_values()
    timeout_s = settings.apply("run", values)["tp_timeout"]
    device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    _follower_main(rank, world, None, artifact, device, timeout_s, opts.verify, values, local)
    return True
