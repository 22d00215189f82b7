"""Launch plumbing shared by every family: when to launch Triton, device properties, PDL and
pre-wait switches, arrival counters.

Every op (ops/common/op.py ``kiln_op``) picks its implementation at call time with
:func:`use_triton`:

* CUDA tensors: the launch (Triton kernels, or the backend it picks).
* CPU tensors: the plain-torch reference, unless the ``triton_on_cpu`` setting
  (``KILN_TRITON_ON_CPU=1``, kiln/settings.py) and ``TRITON_INTERPRET=1`` are both set, in which
  case the Triton kernels run in the interpreter (how the tests exercise the real kernels without a
  GPU).

Rules every kernel follows so that it can sit inside a CUDA graph: no host synchronisation, no
``.item()``, per-batch metadata read from device tensors, grids computed from tensor shapes only.

Programmatic dependent launch (PDL, sm_90+): the decode-path kernels are launched with
``launch_pdl`` (``pdl_args``) and start with ``pdl_trigger`` (the next kernel may be scheduled
now) then, after loading only what no earlier kernel writes (weights), ``pdl_wait`` (the previous
kernel has finished and its writes are visible). Two rules keep it safe: a PDL kernel waits before
it reads anything an earlier kernel wrote and before it writes anything (an earlier kernel may
still read it), and every program waits on every path, so a grid never completes before its
predecessor (a later kernel's wait then covers all earlier ones). Inside a CUDA graph the launch
becomes a programmatic edge, which lets kernel N+1 launch and stream its weights while kernel N
drains: 1.55 -> 1.05 us per one-row kernel and 11.9 -> 9.6 us per 4096 x 4096 GEMV in a chain on
the H200 (bench/results/2026-11-29_h200_pdl_probe.json). The ``pdl`` setting turns it off
(``--no-pdl``, ``EngineOptions.pdl``, ``KILN_PDL=0``: kiln/settings.py; read at call time, so at
capture time for CUDA graphs).

Pre-wait loads (the ``prewait`` setting: ``--prewait``, ``EngineOptions.prewait``,
``KILN_PREWAIT``; a comma list of ``gemv``, ``attn``, ``rope``, ``slab``, ``slab_norm``, or ``all``,
or ``none`` / ``0``; default all; read at call time, so at capture): the kernels named load, before
``pdl_wait``, what nothing in the running CUDA graph writes:

* ``gemv``: the GEMV its first weight step (peeled off the K loop, so no tile stays live across it);
* ``slab`` / ``slab_norm`` (with ``gemv``): a one-row GEMV whose whole ``[BLOCK_N, K]`` weight
  slab is at most ``SLAB_MAX_ELEMS`` elements a thread takes it as that first step, so each
  resident program loads all its weights before the wait (ops/linear/gemv.py ``slab_block_k``); ``slab``
  for GEMVs without a fused RMSNorm (the o projection, after the latency-bound attention kernels;
  only with a grid of at most ``SLAB_MAX_PER_SM`` programs a SM), ``slab_norm`` for those with one
  (qkv, router, gate_up);
* ``attn``: the decode split kernel its step inputs (length, request row, block-table pages) and the
  K/V rows of the keys earlier steps cached (the new key, written by the kernel before, is loaded
  after the wait), with 16-bit caches only (an FP8 cache's kernel spilled with them:
  ops/attention/decode.py); the merge kernel the request's length;
* ``rope``: the RoPE + KV-write kernel its position, cos/sin row and cache slot.

Step inputs are copied on the stream before the graph's replay, and a kernel launched early (its
predecessor triggered) starts only after every kernel before it has started, so these loads never
race a writer. On the H200 (``bench/results/2026-12-02_h200_s12c_prewait_default_hf.json``) it
took the Qwen3-30B-A3B-shaped batch-1 step from 1.010 to 0.926 ms (956.6 -> 1040.9 tok/s, ``kiln
bench latency``) and the Llama-3.1-8B-shaped step bench from 2183 to 2007 us; batch 8 within 0.3%.
The slab parts (default since ``..._s13d_*``) took the Qwen step from 1019-1027 to 1047-1053 tok/s
(``..._s13a_*``, ``..._s13b_*``).
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

import torch
import triton
import triton.language as tl

from kiln import settings


class CutlassUnavailable(RuntimeError):
    """A CUTLASS backend (ops/moe/cutlass.py, ops/linear/fp8_cutlass.py) was asked for without its library."""


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"  # Triton's own, process-level


def use_triton(t: torch.Tensor) -> bool:
    """Whether an op called on ``t`` should launch its Triton kernel (see the module docstring)."""
    if t.is_cuda:
        return True
    return interpreting() and settings.value("triton_on_cpu")


@functools.cache
def _props(index: int) -> Any:
    return torch.cuda.get_device_properties(index)


def _cuda_props(device: torch.device) -> Any:
    return _props(device.index if device.index is not None else torch.cuda.current_device())


def capability(device: torch.device) -> tuple[int, int]:
    """Compute capability ``(major, minor)`` of a CUDA ``device`` (cached; no index: the current one)."""
    props = _cuda_props(device)
    return props.major, props.minor


def sm_count(device: torch.device, off_gpu: int) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (cached); ``off_gpu`` for any other device."""
    return _cuda_props(device).multi_processor_count if device.type == "cuda" else off_gpu


def pdl_enabled(t: torch.Tensor) -> bool:
    """Whether kernels launched for ``t`` use programmatic dependent launch (module docstring)."""
    if not t.is_cuda or interpreting() or not settings.value("pdl"):
        return False
    return _cuda_props(t.device).major >= 9


def pdl_args(t: torch.Tensor) -> dict[str, bool]:
    """A launch's PDL keyword arguments for kernels of inputs like ``t``: the kernel's ``PDL``
    constexpr and, when on, ``launch_pdl`` (the interpreter takes no ``launch_pdl`` at all)."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(t) else {"PDL": False}


PREWAIT_PARTS = settings.SETTINGS["prewait"].choices  # ("gemv", "attn", "rope", "slab", "slab_norm")


def prewait(part: str) -> bool:
    """Whether kernel family ``part`` loads its graph-constant inputs before ``pdl_wait`` (the
    ``prewait`` setting, module docstring; parsed once per value: the GEMV asks on every eager
    launch). A bad value fails naming the variable."""
    return part in settings.value("prewait")


@triton.jit
def grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """The ``(m, n)`` output tile of program ``pid`` in a GEMM of ``num_m x num_n`` tiles, ordered
    in groups of ``GROUP_M`` tile rows (down a group's rows first, then across), so that programs
    running together share their A rows and B columns in L2."""
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


@triton.jit
def pdl_trigger(PDL: tl.constexpr):
    """Let the next kernel (if PDL-launched) be scheduled now; it still waits for this one."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the previous kernel has completed and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


class ArrivalCounters:
    """Zeroed int32 arrival counters for last-arrival reductions (the program that bumps a counter
    to its last value does the reduction and resets it to 0, so the buffer stays zero between
    calls and calls add no memset). One instance per kernel family: two families on one stream
    are ordered anyway, but separate buffers keep one family's bug out of the other.

    ``user`` names the family and ``fallback`` the path its callers take without counters, for the
    warning ``get`` gives when it returns None.

    The kernels' protocol (``tl.debug_barrier()``, then one scalar ``tl.atomic_add(cnt, 1,
    sem="acq_rel", scope="gpu")``; the program that reads ``arrivals - 1`` resets the counter with a
    relaxed ``atomic_xchg`` and loads the others' results with ``cache_modifier=".cg"``) is correct
    under the PTX memory model (sm_70+):

    * release: every thread's stores precede the barrier in program order; ``bar.sync`` orders them
      before the thread that performs the scalar atomic, and that atomic's acq_rel release at gpu
      scope is cumulative, so it publishes the whole CTA's stores, not just its own thread's;
    * acquire: the program that reads ``arrivals - 1`` comes after every other arrival's release in
      the counter's modification order, so its acquire makes their stores visible to the atomic's
      thread; Triton broadcasts a scalar atomic's result to the CTA through shared memory behind a
      ``bar.sync``, which carries that ordering to every thread, and ``.cg`` loads read L2, not a
      stale L1 line (L1 is not coherent across SMs);
    * no program waits for another (the last one reduces, the others exit), so the pattern needs no
      co-residency and cannot deadlock however CTAs are scheduled;
    * reset: every arrival of the launch has happened when the last one reads ``arrivals - 1``, so
      nothing touches the counter after its reset to 0; the next launch on the stream (or graph
      replay) starts after this one ends and sees 0. Launches that share a buffer must therefore not
      run concurrently (two streams, or two graphs replayed side by side)."""

    def __init__(
        self, min_size: int, user: str = "a kernel", fallback: str = "its path without arrival counters"
    ) -> None:
        self.min_size = min_size
        self.user, self.fallback = user, fallback
        self.buffers: dict[torch.device, torch.Tensor] = {}
        self.retired: list[torch.Tensor] = []  # outgrown buffers: a captured CUDA graph may use them

    def get(self, device: torch.device, n: int) -> torch.Tensor | None:
        """The device's buffer, at least ``n`` long: allocated once, grown (to a power of two) when
        a bigger ``n`` comes. None, with a warning, when it would have to be allocated during a
        CUDA-graph capture (the zeroing would only run at replay): the caller then takes its
        ``fallback`` path for that capture."""
        buf = self.buffers.get(device)
        if buf is not None and buf.numel() >= n:
            return buf
        if self._capturing(device):
            warnings.warn(
                f"{self.user}: first call at this size is inside a CUDA-graph capture; this capture "
                f"runs {self.fallback} (run the call once before capturing).",
                stacklevel=3,
            )
            return None
        new = torch.zeros(max(self.min_size, next_pow2(n)), dtype=torch.int32, device=device)
        if buf is not None:
            self.retired.append(buf)  # never freed: graphs captured with it stay valid
        self.buffers[device] = new
        return new

    @staticmethod
    def _capturing(device: torch.device) -> bool:
        if device.type != "cuda":
            return False
        with torch.cuda.device(device):
            return torch.cuda.is_current_stream_capturing()
