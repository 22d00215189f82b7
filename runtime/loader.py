"""Loading an artifact onto a device: manifest checks, precompiled kernels, graphs, weights.

Start-up is loading files, nothing else: the Triton cache shipped in ``kernels/`` is used as is
(no JIT compilation), the exported graphs are deserialized, and the rank's weight pack is copied
to the device. Each phase is timed and reported.

Integrity (``verify``, on by default): the manifest checks every file but the weight data
(``kiln.runtime.artifact``), the pack loader checks the weight data while it streams it
(``kiln.weights.load_pack(verify=...)``); the graphs and CUTLASS libraries are checked as they are
read, verify or not (they are code). The runtime never writes into the artifact: Triton reads the
artifact's ``kernels/`` and compiles anything it lacks into a per-user cache (``kiln.kernel_cache``).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kiln import settings
from kiln.errors import KilnError
from kiln.kernel_cache import use_kernel_cache, user_cache_dir
from kiln.manifest import FileEntry
from kiln.runtime.artifact import (
    REBUILD,
    RECOPY,
    Artifact,
    ArtifactError,
    check_file,
    check_hashes,
    one_line,
    open_artifact,
)
from kiln.runtime.graph_code import load_graph_code

# The interpreter's switch interval while this thread runs Python beside the weight stream on a
# GPU (graphs, the tokenizer's tables). The stream's reader threads need the GIL for a moment
# between their reads and copies, and each such moment waits up to the switch interval (5 ms by
# default) while another thread runs Python. Measured on a 2-core CPU (preadv of 8 MiB chunks
# from the page cache beside a Python loop): the reader ran 4.0x slower than alone at 5 ms, 1.6x
# at 0.5 ms, 1.17x at 0.1 ms. Not on a CPU device, whose readers compete for the cores anyway
# (there it measured no faster). What Rust holds the GIL for (tokenizers' Tokenizer.from_file:
# all of its 0.45 s) stalls the readers whatever the interval.
OVERLAP_SWITCH_INTERVAL_S = 1e-4


@contextlib.contextmanager
def _switch_interval(seconds: float | None) -> Iterator[None]:
    """``sys.setswitchinterval(seconds)`` inside (None: unchanged), the previous value after."""
    old = sys.getswitchinterval()
    if seconds is not None:
        sys.setswitchinterval(min(old, seconds))
    try:
        yield
    finally:
        sys.setswitchinterval(old)


@dataclass
class LoadedModel:
    artifact: Artifact
    device: torch.device
    weights: dict[str, torch.Tensor]
    graphs: dict[str, Any]  # name -> callable module from torch.export
    cos_sin: torch.Tensor  # [max_seq_len, rotary_dim] f32
    phases: dict[str, float] = field(default_factory=dict)


def use_artifact_kernels(art: Artifact, kernel_cache_dir: str | Path | None = None) -> None:
    """Have Triton read the artifact's precompiled kernels and compile anything they lack into
    ``kernel_cache_dir`` (default ``~/.cache/kiln/triton``), never into the artifact."""
    use_kernel_cache(write=Path(kernel_cache_dir or user_cache_dir()), read=(art.root / "kernels",))


def _load_cutlass(
    art: Artifact, rel: str | None, field_name: str, what: str, load: Callable[[Any], None]
) -> str:
    """Check (size and hash, verify or not: it is executable code) and load one of the artifact's
    CUTLASS libraries."""
    info = art.manifest.files.get(rel or "")
    if not rel or info is None:
        raise ArtifactError(
            f"manifest field '{field_name}' must name a file listed in 'files' (it is {rel!r}): {REBUILD}."
        )
    check_file(art.root, rel, info)
    path = art.root / rel
    try:
        load(path)
    except (OSError, RuntimeError) as err:  # the ops' CutlassUnavailable are RuntimeErrors
        raise ArtifactError(
            f"artifact file {rel} (the {what} library) does not load here ({err}): {REBUILD}."
        ) from err
    return str(path)


def load_moe_library(art: Artifact, device: torch.device) -> str | None:
    """Load the CUTLASS grouped-GEMM library into this process (ops/moe/cutlass.py) when a rung of
    the artifact's MoE table runs CUTLASS (``manifest.kernel_choices.moe``) and the device is CUDA.
    Returns its path (None: not needed)."""
    moe = art.manifest.kernel_choices.moe
    if device.type != "cuda" or moe is None or not moe.uses_cutlass:
        return None
    from kiln.ops.moe import cutlass as moe_cutlass

    rel = moe.cutlass.library if moe.cutlass is not None else None
    field_name = "kernel_choices.moe.cutlass.library"
    return _load_cutlass(art, rel, field_name, "CUTLASS MoE", moe_cutlass.load_library)


def load_fp8_library(art: Artifact, device: torch.device) -> str | None:
    """Load the CUTLASS FP8 GEMM library (ops/linear/fp8_cutlass.py) when the artifact carries one
    (``manifest.kernel_choices.fp8.library``) and the device is CUDA; fp8_linear's ``auto`` backend
    then runs it where its table has the shape. Returns its path (None: none)."""
    fp8 = art.manifest.kernel_choices.fp8
    rel = fp8.library if fp8 is not None else None
    if device.type != "cuda" or rel is None:
        return None
    from kiln.ops.linear import fp8_cutlass

    return _load_cutlass(art, rel, "kernel_choices.fp8.library", "CUTLASS FP8 GEMM", fp8_cutlass.load_library)


class _CachedTyping(types.ModuleType):
    """``typing`` with a memoized ``get_type_hints``: torch.export's deserializer calls it for
    every node of the graph on the same few schema classes (about half of a load's time)."""

    def __init__(self) -> None:
        super().__init__("typing")
        self._hints: dict[tuple[Any, bool], Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(typing, name)

    def get_type_hints(
        self, obj: Any, globalns: Any = None, localns: Any = None, include_extras: bool = False
    ) -> Any:
        key = (obj, include_extras)
        if key not in self._hints:
            self._hints[key] = typing.get_type_hints(obj, globalns, localns, include_extras)
        return self._hints[key]


@contextlib.contextmanager
def _fast_deserialize() -> Iterator[None]:
    try:
        from torch._export.serde import serialize
    except ImportError:  # layout of a future torch: load normally
        yield
        return
    old = getattr(serialize, "typing", None)
    if old is not typing:
        yield
        return
    serialize.typing = _CachedTyping()  # type: ignore[assignment]
    try:
        yield
    finally:
        serialize.typing = old  # type: ignore[assignment]


def graph_format() -> str:
    """``python`` (default: the graphs' generated source, milliseconds) or ``pt2``
    (``torch.export.load``, seconds): the ``graph_format`` setting (``--graph-format``,
    ``EngineOptions.graph_format``, ``KILN_GRAPH_FORMAT``)."""
    return settings.value("graph_format")


def load_graphs(art: Artifact, fmt: str | None = None, device: torch.device | None = None) -> dict[str, Any]:
    """Load every graph of the artifact as a callable ``graph(weights, *inputs)``: its generated
    Python source when the artifact has one (and ``fmt``, default :func:`graph_format`, is
    python), else the ``.pt2``. ``device``: where the graphs run (the generated source's devices
    follow it; a ``.pt2`` keeps the device it was traced on, so it runs on GPU 0 only)."""
    fmt = fmt or graph_format()
    if fmt not in settings.SETTINGS["graph_format"].choices:
        raise settings.SettingError(f"graph format {fmt!r}: use one of python, pt2")
    graphs: dict[str, Any] = {}
    for name, g in art.manifest.graphs.items():
        code = g.python
        if fmt == "python" and code is not None:
            digest = _listed(art, code.file).xxh3_128
            graphs[name] = load_graph_code(art.root / code.file, code.to_json(), digest, device)
            continue
        if device is not None and device.type == "cuda" and device.index not in (None, 0):
            raise ArtifactError(
                f"graph {g.file} (graph format pt2) runs on cuda:0 only, not {device}: use the python graph "
                "format (--graph-format python, the default)."
            )
        check_file(art.root, g.file, _listed(art, g.file))  # it is code: checked verify or not
        try:
            with _fast_deserialize():
                graphs[name] = torch.export.load(art.root / g.file).module()
        except Exception as e:  # a file the hash check passed that this torch cannot read
            raise ArtifactError(f"graph file {g.file} does not load ({one_line(e)}); {RECOPY}.") from None
    return graphs


def _listed(art: Artifact, rel: str) -> FileEntry:
    info = art.manifest.files.get(rel)
    if info is None or info.xxh3_128 is None:
        raise ArtifactError(f"graph file {rel} named in the manifest is not in its file table; {RECOPY}.")
    return info


def check_vocab(art: Artifact, weights: dict[str, torch.Tensor]) -> None:
    """The manifest's ``vocab_size`` is the weights' vocabulary (rows of the LM head, or of the
    embedding when they are tied; a tensor-parallel rank holds ``ceil(vocab / tp)`` of them): the
    sampler and the graphs' logits are sized by each. An EAGLE-3 head's LM head holds its draft
    vocabulary only (its graphs place those logits among the target's ids): its embedding is checked."""
    head = "lm_head.weight" in weights and art.manifest.eagle3 is None
    name = "lm_head.weight" if head else "embed.weight"
    rows = weights[name].shape[0] if name in weights else None
    vocab, tp = art.manifest.vocab_size, art.manifest.tp
    if rows != -(-vocab // tp):
        per_rank = f" ({-(-vocab // tp)} per rank of {tp})" if tp > 1 else ""
        raise ArtifactError(
            f"manifest field 'vocab_size' is {vocab}{per_rank} but the weight pack's {name} has {rows} "
            f"rows (weights/pack.json): the manifest and the weights disagree; {RECOPY}."
        )


class _Background:
    """``fn(*args)`` on a daemon thread; :meth:`result` joins it and re-raises its error."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._error: BaseException | None = None

        def run() -> None:
            try:
                fn(*args)
            except BaseException as e:  # re-raised by result()
                self._error = e

        self._thread = threading.Thread(target=run, name=f"kiln-{fn.__name__}", daemon=True)
        self._thread.start()

    def result(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def _check_tp_layout(art: Artifact, rank: int) -> None:
    """A tensor-parallel artifact loads only in a process of a tensor-parallel group of its size
    (kiln.ops.common.collective.set_tp_group; the engine starts one: runtime/tensor_parallel.py), as
    that process's rank; a one-rank artifact has no collectives and loads anywhere, as rank 0."""
    from kiln.ops.common.collective import tp_world

    tp, ep = art.manifest.tp, art.manifest.ep
    group_rank, world = tp_world()
    if tp == 1 and rank == 0:
        return
    if world != tp:
        layout = f"--tp {tp}" + (f" --ep {ep}" if ep > 1 else "")
        raise ArtifactError(
            f"{art.root} is built for {tp} tensor-parallel ranks (kiln compile {layout}) but this "
            f"process runs {world}: load it through the engine (LLM, kiln serve, kiln generate start "
            "its ranks), or in each of its ranks' processes after set_tp_group."
        )
    if not 0 <= rank < tp or rank != group_rank:
        raise ArtifactError(
            f"{art.root}: rank {rank} asked for, but this process is rank {group_rank} of {tp}."
        )


def load_model(
    path: str,
    device: str | torch.device = "cpu",
    rank: int = 0,
    verify: bool = True,
    log: bool = False,
    while_weights_load: Callable[[Artifact], None] | None = None,
    kernel_cache_dir: str | Path | None = None,
    graph_format: str | None = None,
    weights_placed: Callable[[LoadedModel], None] | None = None,
) -> LoadedModel:
    """Load the artifact at ``path`` (module docstring). ``verify``: hash every file against the
    manifest (the weight data in the pack loader's threads as it streams); False: sizes only.
    ``while_weights_load(artifact)``: host work to run on this thread while the weights stream in
    (the engine loads its tokenizer there); timed as the ``tokenizer`` phase. ``kernel_cache_dir``:
    where Triton compiles kernels the artifact lacks (default ``~/.cache/kiln/triton``).
    ``graph_format``: ``python`` or ``pt2`` (None: the ``graph_format`` setting).
    ``weights_placed(model)``: work that needs the weights' addresses but not their values, run on
    this thread beside the stream, before ``while_weights_load``: the model returned, its weights
    allocated (zeroed on a device) and filling in on other threads and streams (the engine builds
    its KV pool and captures its CUDA graphs there; it must not read the weights' values, and every
    CUDA graph capture in it must use ``capture_error_mode="thread_local"``: the readers copy on
    their own threads meanwhile). It times its own phases; the weights are whole when this returns."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    phases: dict[str, float] = {}
    t = time.perf_counter()

    def mark(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        phases[name] = now - t
        t = now
        if log:
            print(f"[kiln] {name}: {phases[name]:.2f} s", flush=True)

    art = open_artifact(path, dev)  # sizes; the hashes on a thread below
    _check_tp_layout(art, rank)
    # The file hashes (kernels, tokenizer, graphs: all but the weight data, which load_pack checks)
    # are read beside the weight stream and joined before anything runs: the code files the load
    # executes (graph sources, CUTLASS libraries) are also checked by their own loaders first.
    hashes = _Background(check_hashes, art) if verify else None
    use_artifact_kernels(art, kernel_cache_dir)
    load_moe_library(art, dev)
    load_fp8_library(art, dev)
    import kiln.ops  # noqa: F401  (registers torch.ops.kiln.* before graphs deserialize)
    from kiln.ops.attention.rope import rope_cos_sin_cache
    from kiln.weights import load_pack
    from kiln.weights.checksum import load_kernel as load_checksum_kernel
    from kiln.weights.fold import apply_norm_folds

    mark("manifest")
    # Weights stream in on a worker thread (file reads and copies release the GIL) while this
    # thread deserializes the graphs.
    loaded: dict[str, Any] = {}
    placed = threading.Event()  # set once the weights have their memory (or the load failed)

    def on_placed(weights: dict[str, torch.Tensor]) -> None:
        loaded["placed"] = weights
        placed.set()

    def load_weights() -> None:
        try:
            weights = load_pack(
                art.root / "weights", rank, dev, verify=verify, placed=on_placed if weights_placed else None
            )
            folds = {norm: list(consumers) for norm, consumers in art.manifest.norm_folds.items()}
            apply_norm_folds(weights, folds)  # what the graphs expect (in place: the same addresses)
            loaded["weights"] = weights
            if dev.type == "cuda":  # this thread's stream follows the copies, folds and check; not a
                # device-wide sync, which would wait for (or fail on) a capture on the main thread
                torch.cuda.current_stream(dev).synchronize()
            loaded["seconds"] = time.perf_counter() - t_w
        except BaseException as e:  # re-raised below
            loaded["error"] = e
        finally:
            placed.set()

    if verify and dev.type == "cuda":
        load_checksum_kernel(dev)  # here, not first on the reader thread (load_kernel says why)
    t_w = time.perf_counter()
    worker = threading.Thread(target=load_weights, name="kiln-load-weights")
    worker.start()
    try:
        with _switch_interval(OVERLAP_SWITCH_INTERVAL_S if dev.type == "cuda" else None):
            graphs = load_graphs(art, graph_format, dev)
            mark("graphs")
            r = art.manifest.rope  # (no weights needed: beside the stream too; 0.11 s on the H200)
            cos_sin = rope_cos_sin_cache(
                r.rotary_dim, art.manifest.max_seq_len, r.base, r.scaling, device=dev
            )
            mark("rope")
            if weights_placed is not None:
                placed.wait()
                if "placed" in loaded:  # else the load failed: raised below
                    check_vocab(art, loaded["placed"])  # shapes only: before anything captures them
                    if hashes is not None:  # the build runs the artifact's kernels and graph code
                        hashes.result()
                    model = LoadedModel(art, dev, loaded["placed"], graphs, cos_sin, phases)
                    weights_placed(model)  # marks its own phases
                    t = time.perf_counter()
            if while_weights_load is not None:  # the tokenizer: it holds the GIL, so after the capture
                while_weights_load(art)
                mark("tokenizer")
    except BaseException as e:  # an altered file explains a failure (a file that does not parse, a
        # build on a bad kernel): say so if its hash does; a failed weight load explains a failed build
        worker.join()
        if hashes is not None:
            hashes.result()
        if "error" in loaded and not isinstance(e, KilnError):
            raise loaded["error"] from e
        raise
    finally:
        worker.join()  # an error above re-raises once the reader thread is done
    if hashes is not None:
        hashes.result()
    if "error" in loaded:
        raise loaded["error"]
    weights = loaded["weights"]
    check_vocab(art, weights)
    mark("weights (overlapped)")
    phases["weights_load"] = loaded["seconds"]
    if weights_placed is not None:  # the model weights_placed saw, now whole
        assert model.weights is weights
        return model
    return LoadedModel(art, dev, weights, graphs, cos_sin, phases)
