"""CUTLASS grouped-GEMM backend of the fused MoE op: bf16 experts on sm90 (H100/H200).

``fused_moe_cutlass(x, w13, w2, topk_weights, topk_ids, expert_map, out=None) -> out [T, H]`` computes
what ``kiln.fused_moe`` does (ops/moe/fused.py; same arguments, bf16 only, no FP8 scales):

    moe_sort (ops/moe/permute.py)      dst [P], counts [E], starts [E]       P = T * k
    gather_rows                        a   [P, H]   token rows sorted by expert
    CUTLASS grouped GEMM with w13      gu  [P, 2I]  rows a[starts[e] : + counts[e]] @ w13[e]^T
    silu_and_mul (ops/activation/silu_and_mul.py)   h   [P, I]
    CUTLASS grouped GEMM with w2       y   [P, H]
    unsort_combine                     out [T, H]   sum_j round(y[dst[t * k + j]] * topk_weights[t, j])

with ops/moe/gemm.py's rounding (each GEMM result rounded to bf16, silu rounded, product rounded,
the down projection rounded before the float32 routing weight, the k terms summed in float32 and
rounded once). Pairs of other ranks' experts (``expert_map`` -1) contribute nothing. Rows of ``gu``,
``h`` and ``y`` past the local pairs are never written nor read.

The GEMM is ops/cutlass/sm90_grouped.cu compiled into a shared library (``kiln compile
--moe-backend cutlass|auto`` builds it into the artifact's ``kernels/``, compiler/cutlass_build.py).
``load_library(path)`` loads it once per process with ctypes (the runtime's artifact loader calls it
when the manifest records a CUTLASS rung); the op asked for the CUTLASS backend without a loaded
library raises ``CutlassUnavailable``. ``GroupedGemm`` holds, per (device, E, N, K), the device arrays
the library reads: ``sizes [E, 3]`` int32 (M_e, N, K) and ``ptrs [3, E]`` int64 (A_e, W_e, D_e)
and the library handle bound to them. Each launch first refreshes them with one Triton kernel (the
base pointers are kernel arguments, the per-expert offsets come from ``moe_sort`` on the device), so
nothing reads the routing on the host and the whole op can be captured in a CUDA graph. Creating a
``GroupedGemm`` allocates and synchronizes: it happens at the first call for a shape, which must be
outside a capture (the runtime's and the benchmarks' warm-up runs are).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

from kiln import settings
from kiln.ops.activation import silu_and_mul as activation
from kiln.ops.common.launch import (
    CutlassUnavailable,
    capability,
    interpreting,
    next_pow2,
    pdl_args,
    pdl_trigger,
    pdl_wait,
    sm_count,
)
from kiln.ops.moe.permute import gather_rows, moe_sort, unsort_combine

ABI = 1  # kg_abi() of the library this module drives
ALIGN = 8  # N and K must be multiples of 8 elements (16-byte TMA rows)
STATUS = ("kSuccess", "kErrorMisalignedOperand", "kErrorInvalidDataType", "kErrorInvalidLayout",
          "kErrorInvalidProblem", "kErrorNotSupported", "kErrorWorkspaceNull", "kErrorInternal",
          "kErrorArchMismatch", "kErrorInsufficientDriver", "kErrorMemoryAllocation", "kInvalid")  # fmt: skip


_LIB: ctypes.CDLL | None = None
_LIB_PATH: Path | None = None
_GEMMS: dict[tuple[int, int, int, int], GroupedGemm] = {}
_RETIRED: list[GroupedGemm] = []  # handles of a replaced library: a captured CUDA graph may use them


def load_library(path: str | Path) -> None:
    """Load the compiled ops/cutlass/sm90_grouped.cu for this process (again: no-op; another path:
    replaces it for new handles; the old handles are kept, never destroyed, as CUDA graphs
    captured with them hold their workspace and argument arrays)."""
    global _LIB, _LIB_PATH
    path = Path(path).resolve()
    if _LIB is not None and path == _LIB_PATH:
        return
    if not path.is_file():
        raise CutlassUnavailable(f"CUTLASS MoE library {path} does not exist; build it with `kiln compile "
                                 "--moe-backend cutlass` (compiler/cutlass_build.py)")  # fmt: skip
    lib = ctypes.CDLL(str(path))
    abi = lib.kg_abi() if hasattr(lib, "kg_abi") else None
    if abi != ABI:
        raise CutlassUnavailable(f"CUTLASS MoE library {path} has ABI {abi}, kiln drives ABI {ABI}: rebuild "
                                 "the artifact with `kiln compile ... --force`")  # fmt: skip
    vp, i32 = ctypes.c_void_p, ctypes.c_int
    lib.kg_create.restype = vp
    lib.kg_create.argtypes = [i32, i32, i32, i32, vp, vp, vp, vp, i32, vp, ctypes.POINTER(i32)]
    lib.kg_run.restype = i32
    lib.kg_run.argtypes = [vp, vp]
    lib.kg_destroy.restype = None
    lib.kg_destroy.argtypes = [vp]
    _RETIRED.extend(_GEMMS.values())
    _GEMMS.clear()
    _LIB, _LIB_PATH = lib, path


def library_path() -> Path | None:
    """The library loaded in this process, if any."""
    return _LIB_PATH


def _library() -> ctypes.CDLL:
    if _LIB is None:
        raise CutlassUnavailable(
            'fused_moe: the MoE tuning table asks for the CUTLASS backend (an entry with "backend": '
            '"cutlass") but no CUTLASS library is loaded in this process: load the artifact with '
            "kiln's loader (it loads manifest kernel_choices.moe.cutlass.library), call "
            "kiln.ops.moe.cutlass.load_library(path), or rebuild with `kiln compile --moe-backend triton`"
        )
    return _LIB


def supports(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the CUTLASS backend runs this call: bf16 activations and experts on an sm90 GPU
    (compiled kernels, not the interpreter), contiguous experts, H and I multiples of ``ALIGN``,
    and not switched off (the ``moe_cutlass`` setting: ``--no-moe-cutlass``, ``KILN_MOE_CUTLASS=0``;
    read at call time: the entry's Triton configs run)."""
    if not x.is_cuda or interpreting() or not settings.value("moe_cutlass"):
        return False
    if capability(x.device)[0] != 9:
        return False
    if not x.dtype == w13.dtype == w2.dtype == torch.bfloat16:
        return False
    h, i = w2.shape[1], w2.shape[2]
    return h % ALIGN == 0 and i % ALIGN == 0 and w13.is_contiguous() and w2.is_contiguous()


# ---- per-shape device arguments -------------------------------------------------------------------


@triton.jit
def _args_kernel(
    COUNTS, STARTS, SIZES, PTRS, E, N, K, a_base, w_base, d_base, a_row, w_expert, d_row,
    E_PAD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # SIZES: [E, 3] int32 (M_e, N, K); PTRS: [3, E] int64 byte addresses (A_e, W_e, D_e);
    # a_row / w_expert / d_row: bytes per row of A, per expert of W, per row of D
    pdl_trigger(PDL)
    pdl_wait(PDL)
    e = tl.arange(0, E_PAD)
    m = e < E
    start = tl.load(STARTS + e, mask=m, other=0).to(tl.int64)
    zero = tl.zeros([E_PAD], dtype=tl.int32)
    tl.store(SIZES + e * 3, tl.load(COUNTS + e, mask=m, other=0), mask=m)
    tl.store(SIZES + e * 3 + 1, zero + N, mask=m)
    tl.store(SIZES + e * 3 + 2, zero + K, mask=m)
    tl.store(PTRS + e, a_base + start * a_row, mask=m)
    tl.store(PTRS + E + e, w_base + e.to(tl.int64) * w_expert, mask=m)
    tl.store(PTRS + 2 * E + e, d_base + start * d_row, mask=m)


def grouped_args_ref(
    counts: torch.Tensor, starts: torch.Tensor, a: torch.Tensor, w: torch.Tensor, d: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``_args_kernel`` writes, in torch: ``(sizes [E, 3] int32, ptrs [3, E] int64)``."""
    e, n, k = w.shape
    s = starts.long()
    sizes = torch.stack([counts.int(), torch.full_like(counts.int(), n), torch.full_like(counts.int(), k)], 1)
    ptrs = torch.stack([
        a.data_ptr() + s * k * a.element_size(),
        w.data_ptr() + torch.arange(e, device=s.device) * n * k * w.element_size(),
        d.data_ptr() + s * n * d.element_size(),
    ])  # fmt: skip
    return sizes, ptrs


def fill_args(counts, starts, a, w, d, sizes: torch.Tensor, ptrs: torch.Tensor) -> None:
    """Write ``grouped_args_ref``'s values into ``sizes`` / ``ptrs`` (one Triton program)."""
    e, n, k = w.shape
    _args_kernel[(1,)](
        counts, starts, sizes, ptrs, e, n, k, a.data_ptr(), w.data_ptr(), d.data_ptr(),
        k * a.element_size(), n * k * w.element_size(), n * d.element_size(), E_PAD=next_pow2(e), **pdl_args(w),
    )  # fmt: skip


class GroupedGemm:
    """The library handle for ``W [E, N, K]`` bf16 on one device, bound to its argument arrays."""

    def __init__(self, device: torch.device, e: int, n: int, k: int):
        lib = _library()
        capturing = False
        if device.type == "cuda":
            with torch.cuda.device(device):  # the capture state of this device's current stream
                capturing = torch.cuda.is_current_stream_capturing()
        if capturing:
            raise RuntimeError(f"CUTLASS grouped GEMM (E={e}, N={n}, K={k}): the first call for a shape "
                               "allocates and synchronizes; run the op once before capturing a CUDA graph")  # fmt: skip
        self.e, self.n, self.k = e, n, k
        self.sizes = torch.zeros(e, 3, dtype=torch.int32, device=device)  # (M_e, N, K)
        self.sizes[:, 1], self.sizes[:, 2] = n, k
        self.ptrs = torch.zeros(3, e, dtype=torch.int64, device=device)  # A_e, W_e, D_e
        status = ctypes.c_int(-(1 << 30))
        stream = torch.cuda.current_stream(device).cuda_stream
        p = self.ptrs
        self.lib, self.handle = lib, lib.kg_create(
            device.index, e, n, k, self.sizes.data_ptr(), p[0].data_ptr(), p[1].data_ptr(), p[2].data_ptr(),
            sm_count(device, 0), stream, ctypes.byref(status),
        )  # fmt: skip
        if status.value != 0:
            lib.kg_destroy(self.handle)
            self.handle = None
            raise RuntimeError(
                f"CUTLASS grouped GEMM (E={e}, N={n}, K={k}) setup failed: {_status(status.value)}"
            )

    def run(
        self, a: torch.Tensor, w: torch.Tensor, d: torch.Tensor, counts: torch.Tensor, starts: torch.Tensor
    ):
        """``d[rows of e] = a[rows of e] @ w[e]^T`` for the row ranges ``starts[e] : + counts[e]``."""
        fill_args(counts, starts, a, w, d, self.sizes, self.ptrs)
        st = self.lib.kg_run(self.handle, torch.cuda.current_stream(a.device).cuda_stream)
        if st != 0:
            raise RuntimeError(f"CUTLASS grouped GEMM (E={self.e}, N={self.n}, K={self.k}): {_status(st)}")

    def __del__(self) -> None:
        if getattr(self, "handle", None) and not sys.is_finalizing():
            self.lib.kg_destroy(self.handle)


def _status(st: int) -> str:
    if st < 0:
        return f"CUDA error {-st}"
    return f"cutlass::Status::{STATUS[st] if st < len(STATUS) else st}"


def cutlass_grouped_gemm(a, w, d, counts, starts) -> None:
    """The CUTLASS launch for ``a [P, K]``, ``w [E, N, K]``, ``d [P, N]`` (rows sorted by expert)."""
    dev = a.device if a.device.index is not None else torch.device("cuda", torch.cuda.current_device())
    key = (dev.index, *w.shape)
    if key not in _GEMMS:
        _GEMMS[key] = GroupedGemm(dev, *w.shape)
    _GEMMS[key].run(a, w, d, counts, starts)


def grouped_gemm_ref(a, w, d, counts, starts) -> None:
    """The same grouped GEMM in torch (reads the counts on the host): bf16 products of float32 sums."""
    for e, (s, c) in enumerate(zip(starts.tolist(), counts.tolist())):
        if c:
            d[s : s + c] = (a[s : s + c].float() @ w[e].float().t()).to(d.dtype)


# ---- the op ---------------------------------------------------------------------------------------

GemmFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def fused_moe_cutlass(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    out: torch.Tensor | None = None,
    gemm: GemmFn | None = None,
) -> torch.Tensor:
    """The routed experts of a MoE layer, ``x [T, H] -> out [T, H]`` (module docstring). ``gemm``
    replaces the CUTLASS launch (tests: ``grouped_gemm_ref``)."""
    if gemm is None:
        _library()  # the clear error before any work
        gemm = cutlass_grouped_gemm
    t, h = x.shape
    e, i, k = w13.shape[0], w2.shape[2], topk_ids.shape[1]
    out = x.new_empty((t, h)) if out is None else out
    if t == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    p = t * k
    dst, counts, starts = moe_sort(topk_ids.contiguous(), expert_map, e)  # [P], [E], [E]
    a = x.new_empty((p, h))
    gather_rows(x, dst, k, a)  # a: [P, H] sorted by expert
    gu = x.new_empty((p, 2 * i))
    gemm(a, w13, gu, counts, starts)  # gu: [P, 2I]
    hid = x.new_empty((p, i))
    activation.silu_and_mul_launch(gu, None, activation.QUANT_NONE, hid, None)  # [P, I]
    y = x.new_empty((p, h))
    gemm(hid, w2, y, counts, starts)  # y: [P, H]
    unsort_combine(y, dst, topk_weights.contiguous(), out)
    return out
