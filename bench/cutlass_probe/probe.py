"""CUTLASS grouped GEMM for the MoE expert GEMMs, from the nvidia-cutlass 4.2 wheel (no CuTe DSL).

Two kernels, both reading per-expert sizes and pointers from device arrays only:
  cppgen: cutlass_cppgen's GemmOperationGrouped = CUTLASS 2.x GemmGrouped, GroupScheduleMode::
          kDeviceOnly, Sm80 mma.sync + cp.async (cppgen has no sm90 grouped kernel), compiled
          for sm_90a; launched by cuda.bindings cuLaunchKernel with a Params blob built once.
  sm90:   sm90_grouped.cu = CUTLASS 3.x ptr-array grouped GEMM (wgmma + TMA, persistent
          cooperative), host problem shapes nullptr; a small C API launched via ctypes.
CPU part (nvcc, the wheel on PYTHONPATH; no GPU, no libcuda): emit + compile both, write meta.json
  (kernel, tile, compile times, Params layout found with sentinels, SASS instruction counts).
GPU part (torch.cuda.is_available()): UNTESTED, written from the APIs. Checks both vs torch,
  times them (CUDA graph of 20 launches, CUDA events) beside torch._grouped_mm, and checks that one
  captured graph (device-side routing update + launch) follows new routing on replay.

  PYTHONPATH=/tmp/cutl/site python bench/cutlass_probe/probe.py --out /tmp/cutlass_probe [--which w2]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import time

SHAPES = {"w13": (1536, 2048), "w2": (2048, 768)}  # Qwen3-30B-A3B: (N, K) of one expert's [N, K] weight
E, TOPK = 128, 8
HERE = os.path.dirname(os.path.abspath(__file__))


def shim_cuda_bindings() -> None:
    """cutlass_cppgen 4.2 imports cuda.cuda / cuda.cudart / cuda.nvrtc and reads cuda.__version__:
    cuda-bindings 13 removed those (now cuda.bindings.driver / runtime / nvrtc)."""
    import cuda  # a namespace package in cuda-bindings 13
    import cuda.bindings
    import cuda.bindings.driver as drv
    import cuda.bindings.nvrtc as nvrtc
    import cuda.bindings.runtime as rt

    if not hasattr(cuda, "__version__"):
        cuda.__version__ = cuda.bindings.__version__
    for name, mod in (("cuda", drv), ("cudart", rt), ("nvrtc", nvrtc)):
        sys.modules.setdefault("cuda." + name, mod)


def cuda_home() -> str:
    home = os.environ.get("CUDA_INSTALL_PATH") or os.path.dirname(
        os.path.dirname(os.path.realpath(shutil.which("nvcc")))
    )
    if not os.path.isdir(os.path.join(home, "include")):  # /usr/local/bin/nvcc may be a wrapper script
        home = "/usr/local/cuda"
    os.environ["CUDA_INSTALL_PATH"] = home  # cppgen would guess it from `which nvcc`
    return home


REUSE = False  # --reuse: keep artifacts already in --out (built on another machine)


def nvcc(cmd: list[str], cwd: str) -> float:
    if REUSE and os.path.exists(os.path.join(cwd, cmd[-1])):
        return 0.0
    t = time.time()
    subprocess.run(
        ["nvcc", "-std=c++17", "--expt-relaxed-constexpr", "-arch=sm_90a", *cmd], cwd=cwd, check=True
    )
    return round(time.time() - t, 1)


def build_cppgen(out: str, n: int, k: int, tile: tuple[int, int, int], stages: int):
    home = cuda_home()
    shim_cuda_bindings()
    os.makedirs(out, exist_ok=True)
    cwd = os.getcwd()
    os.chdir(out)  # cppgen opens ./compiled_cache.db (sqlite) at import
    try:
        import cutlass_cppgen as cg
    finally:
        os.chdir(cwd)
    from cutlass_cppgen import DataType as DT
    from cutlass_cppgen import LayoutType as LT
    from cutlass_cppgen.backend.gemm_operation import GemmOperationGrouped
    from cutlass_cppgen.backend.library import SchedulerMode, TensorDescription
    from cutlass_cppgen.library_defaults import OptionRegistry
    from cutlass_cppgen.utils.datatypes import td_from_profiler_op
    from cutlass_library import SubstituteTemplate

    t0 = time.time()
    cg.check_cuda_versions()  # sets cg._nvcc_version, which the registry needs; no GPU touched
    cg._option_registry = OptionRegistry(90)  # else get_option_registry() calls device_cc(): GPU
    t_reg = round(time.time() - t0, 1)
    plan = cg.GroupedGemm(
        element=DT.bf16,
        element_accumulator=DT.f32,
        layout_A=LT.RowMajor,
        layout_B=LT.ColumnMajor,
        layout_C=LT.RowMajor,
        cc=90,
    )  # -> kernel cc 80
    cands = plan.possible_operations.operations(8, 8, 8, plan._math_operation)
    pick = [
        o
        for o in cands
        if tuple(o.tile_description.threadblock_shape) == tile and o.tile_description.stages == stages
    ]
    if not pick:
        have = sorted(
            {(tuple(o.tile_description.threadblock_shape), o.tile_description.stages) for o in cands}
        )
        raise SystemExit(f"no sm{plan.current_cc} bf16 tile {tile} x{stages}; have {have}")
    td = td_from_profiler_op(pick[0])
    # GroupedGemm.construct() gives A the layout of B (4.2.0 bug), so build the operation here.
    op = GemmOperationGrouped(
        arch=plan.current_cc,
        tile_description=td,
        A=TensorDescription(DT.bf16, LT.RowMajor, 8),
        B=TensorDescription(DT.bf16, LT.ColumnMajor, 8),
        C=TensorDescription(DT.bf16, LT.RowMajor, 8),
        epilogue_functor=plan._reset_epilogue_functor_alignment(8, plan.epilogue_functor),
        precompute_mode=SchedulerMode.Device,
    )
    rt = op.rt_module
    name = rt.name()
    # what cppgen's compiler.emit_compile_ writes; its own path needs a GPU (cudaFree, device_cc,
    # cuModuleLoadData) and links the host .so with -lcuda, so compile here instead
    src = "".join(f'#include "{h}"\n' for h in rt.emitter.includes) + rt.emit()
    vals = {"operation_name": name, "operation_suffix": rt.emitter.operation_suffix}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "kernel.cu"), "w") as f:
        f.write(src + SubstituteTemplate(rt.KernelTemplate, vals))
    with open(os.path.join(out, "host.cu"), "w") as f:
        f.write("#include <cstddef>\n" + src + SubstituteTemplate(rt.HostTemplate, vals))
    inc = [
        f"-I{home}/include",
        f"-I{cg.CUTLASS_PATH}/include",
        f"-I{cg.CUTLASS_PATH}/tools/util/include",
        "-Xcudafe",
        "--diag_suppress=esa_on_defaulted_function_ignored",
    ]
    times = {
        "option_registry_s": t_reg,
        "cubin_s": nvcc([*inc, "-lineinfo", "-cubin", "kernel.cu", "-o", "kernel.cubin"], out),
        "host_so_s": nvcc([*inc, "-Xcompiler=-fPIC", "-shared", "host.cu", "-o", "host.so"], out),
    }
    meta = {
        "kernel": name,
        "n": n,
        "k": k,
        "kernel_cc": plan.current_cc,
        "target": "sm_90a",
        "threadblock": list(td.threadblock_shape),
        "warp_count": list(td.warp_count),
        "stages": td.stages,
        "instruction": list(td.math_instruction.instruction_shape),
        "threads": rt.threads,
        "sched": "kDeviceOnly",
        "compile": times,
        "cubin_bytes": os.path.getsize(os.path.join(out, "kernel.cubin")),
        "default_pick": cands[0].procedural_name(),
    }
    meta.update(param_layout(out, name, op))
    meta["sass"] = sass_counts(os.path.join(out, "kernel.cubin"))
    return meta, op


def host_lib(out: str, name: str, op):
    h = ctypes.CDLL(os.path.join(out, "host.so"))
    size = getattr(h, name + "_get_param_size")()
    get = getattr(h, name + "_get_params")
    get.argtypes = [ctypes.POINTER(op.argument_type), ctypes.c_int, ctypes.c_void_p]
    get.restype = ctypes.POINTER(ctypes.c_char * size)
    return h, size, get


def make_args(op, sizes, count, ctas, ptrs):
    """cppgen's ctypes mirror of GemmGrouped::Arguments (problem_sizes, count, threadblock_count,
    epilogue {alpha, beta, ...}, ptr_A/B/C/D, lda/ldb/ldc/ldd, host_problem_sizes=NULL)."""
    return op.argument_type(sizes, count, ctas, op.epilogue_type(1.0, 0.0), *ptrs, None)


def param_layout(out: str, name: str, op) -> dict:
    """Params byte offsets, found by passing sentinel values through the host helper (CPU only)."""
    h, size, get = host_lib(out, name, op)
    fields = ["problem_sizes", "ptr_A", "ptr_B", "ptr_C", "ptr_D", "lda", "ldb", "ldc", "ldd"]
    sent = {f: 0x1111_0000_0000 + (i << 16) for i, f in enumerate(fields)}
    args = make_args(op, sent["problem_sizes"], 0x7AB, 0x5CD, [sent[f] for f in fields[1:]])
    raw = bytes(get(ctypes.byref(args), 0x3EF, None).contents)
    q = [int.from_bytes(raw[i : i + 8], "little") for i in range(0, size - 7, 4)]
    d = [int.from_bytes(raw[i : i + 4], "little") for i in range(0, size - 3, 4)]
    lay = {f: 4 * q.index(v) for f, v in sent.items() if v in q}
    for f, v in (
        ("problem_count", 0x7AB),
        ("threadblock_count", 0x5CD),
        ("visitor_tile_count", 0x3EF),
        ("alpha_f32", 0x3F800000),
    ):
        if v in d:
            lay[f] = 4 * d.index(v)
    return {
        "param_bytes": size,
        "smem_bytes": getattr(h, name + "_shared_memory_size")(),
        "param_layout": lay,
    }


def sass_counts(binary: str) -> dict:
    tool = shutil.which("cuobjdump")
    if tool is None:
        try:
            import triton  # its wheel carries cuobjdump

            tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
        except ImportError:
            return {}
    if not os.path.exists(tool):
        return {}
    sass = subprocess.run([tool, "-sass", binary], capture_output=True, text=True).stdout
    return {m: sass.count(m) for m in ("HMMA", "HGMMA", "LDGSTS", "UTMALDG", "UTMASTG")}


def build_sm90(out: str) -> dict:
    cuda_home()
    import cutlass_library

    src = cutlass_library.source_path
    os.makedirs(out, exist_ok=True)
    t = nvcc(
        [
            "-O3",
            "-DNDEBUG",
            "-Xcompiler=-fPIC",
            "-shared",
            f"-I{src}/include",
            f"-I{src}/tools/util/include",
            os.path.join(HERE, "sm90_grouped.cu"),
            "-o",
            "libkg_sm90.so",
        ],
        out,
    )
    so = os.path.join(out, "libkg_sm90.so")
    h = ctypes.CDLL(so)  # static cudart: loads without a driver
    return {
        "so": so,
        "compile_s": t,
        "so_bytes": os.path.getsize(so),
        "tile": [128, 128, 64],
        "stages": h.kg_stages(),
        "smem_bytes": h.kg_smem_bytes(),
        "param_bytes": h.kg_params_bytes(),
        "sass": sass_counts(so),
    }


# ------------------------------------------------------------------ GPU part: UNTESTED
class Routing:
    """Persistent per-expert device arrays; set_counts() refreshes them with torch ops only (no
    host read, so capturable). Rows of A / D are sorted by expert; counts [E] int32 on the device."""

    def __init__(self, a, w, d):
        import torch

        self.a, self.w, self.d = a, w, d
        e, n, k = w.shape
        self.e, self.n, self.k = e, n, k
        i64 = dict(dtype=torch.int64, device=a.device)
        self.sizes = torch.zeros(
            e, 3, dtype=torch.int32, device=a.device
        )  # (M_e, N, K): GemmCoord / Shape<int,int,int>
        self.sizes[:, 1], self.sizes[:, 2] = n, k
        self.ptr_a = torch.zeros(e, **i64)
        self.ptr_b = w.data_ptr() + torch.arange(e, **i64) * (n * k * w.element_size())
        self.ptr_d = torch.zeros(e, **i64)
        self.lda, self.ldb, self.ldd = (
            torch.full((e,), v, **i64) for v in (k, k, n)
        )  # B = W[e]^T, K x N col-major

    def set_counts(self, counts):
        offs = (counts.cumsum(0) - counts).long()
        self.sizes[:, 0] = counts
        self.ptr_a.copy_(self.a.data_ptr() + offs * (self.k * self.a.element_size()))
        self.ptr_d.copy_(self.d.data_ptr() + offs * (self.n * self.d.element_size()))


def chk(res):
    err, *rest = res
    if getattr(err, "value", err) != 0:
        raise RuntimeError(f"CUDA driver error {err}")
    return rest[0] if len(rest) == 1 else rest


class CppgenLauncher:
    def __init__(self, r: Routing, out: str, meta: dict, op):
        import cuda.bindings.driver as drv
        import torch

        self.drv, self.torch = drv, torch
        with open(os.path.join(out, "kernel.cubin"), "rb") as f:
            self.module = chk(drv.cuModuleLoadData(f.read()))
        self.fn = chk(drv.cuModuleGetFunction(self.module, meta["kernel"].encode()))
        self.smem, self.threads = meta["smem_bytes"], meta["threads"]
        chk(
            drv.cuFuncSetAttribute(
                self.fn, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.smem
            )
        )
        per_sm = chk(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.fn, self.threads, self.smem))
        self.ctas = max(1, per_sm) * torch.cuda.get_device_properties(0).multi_processor_count
        _, size, get = host_lib(out, meta["kernel"], op)
        ptrs = [t.data_ptr() for t in (r.ptr_a, r.ptr_b, r.ptr_d, r.ptr_d, r.lda, r.ldb, r.ldd, r.ldd)]
        args = make_args(op, r.sizes.data_ptr(), r.e, self.ctas, ptrs)  # C = D, beta = 0: C never read
        self.params = (ctypes.c_char * size).from_buffer_copy(get(ctypes.byref(args), 0, None).contents)
        self.packed = (ctypes.c_void_p * 1)(ctypes.addressof(self.params))

    def launch(self):  # kDeviceOnly: any grid works, CTAs stride over all groups' tiles by gridDim.x
        stream = self.drv.CUstream(self.torch.cuda.current_stream().cuda_stream)
        chk(
            self.drv.cuLaunchKernel(
                self.fn, self.ctas, 1, 1, self.threads, 1, 1, self.smem, stream, self.packed, 0
            )
        )


class Sm90Launcher:
    def __init__(self, r: Routing, so: str):
        import torch

        self.torch = torch
        self.h = ctypes.CDLL(so)
        self.h.kg_create.restype = ctypes.c_void_p
        self.h.kg_create.argtypes = (
            [ctypes.c_int] * 3
            + [ctypes.c_void_p] * 4
            + [ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        )
        self.h.kg_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        st = ctypes.c_int(-9)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.handle = self.h.kg_create(
            r.e,
            r.n,
            r.k,
            r.sizes.data_ptr(),
            r.ptr_a.data_ptr(),
            r.ptr_b.data_ptr(),
            r.ptr_d.data_ptr(),
            sms,
            torch.cuda.current_stream().cuda_stream,
            ctypes.byref(st),
        )
        if st.value != 0:
            raise RuntimeError(f"kg_create: cutlass::Status {st.value}")

    def launch(self):
        st = self.h.kg_run(self.handle, self.torch.cuda.current_stream().cuda_stream)
        if st != 0:
            raise RuntimeError(f"kg_run: cutlass::Status {st}")


def gpu_run(which: str, cppgen, sm90) -> dict:
    import torch

    torch.manual_seed(0)
    n, k = SHAPES[which]
    max_rows = 4096 * TOPK
    w = torch.randn(E, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    a = torch.randn(max_rows, k, device="cuda", dtype=torch.bfloat16)
    d = torch.zeros(max_rows, n, device="cuda", dtype=torch.bfloat16)
    r = Routing(a, w, d)
    impls = {}
    if cppgen:
        impls["cppgen_sm80"] = CppgenLauncher(r, *cppgen)
    if sm90:
        impls["sm90_wgmma"] = Sm90Launcher(r, sm90["so"])
    res = {"runs": [], "graph_replay_rel_err": {}}

    def route(t):  # t tokens, top-8 of E uniformly at random
        return torch.bincount(route_ids(t).flatten(), minlength=E).int()

    def route_ids(t):
        return torch.rand(t, E, device="cuda").topk(TOPK, dim=1).indices.int()

    def kiln_triton(t):
        """kiln's Triton grouped GEMM (or decode GEMV) for the same product, no epilogue; its A is
        the token rows for w13 (a_div = top-k), the pair rows for w2, as fused_moe runs them."""
        from kiln.ops.moe.align import moe_align_run
        from kiln.ops.moe.gemm import moe_gemm_launch, moe_gemv_launch, pick_configs

        ids = route_ids(t)
        inter, hid = (n // 2, k) if which == "w13" else (k, n)
        c1, c2 = pick_configs("", E, inter, hid, t, TOPK)
        cfg = c1 if which == "w13" else c2
        a_in = a[:t] if which == "w13" else a[: t * TOPK]
        a_div = TOPK if which == "w13" else 1
        c = torch.empty(t * TOPK, n, device="cuda", dtype=torch.bfloat16)
        if cfg["BLOCK_M"] == 1:
            return cfg, lambda: moe_gemv_launch(a_in, None, w, None, c, None, ids, None, cfg, a_div)
        align = moe_align_run(ids, None, E, cfg["BLOCK_M"])
        return cfg, lambda: moe_gemm_launch(a_in, None, w, None, c, None, *align, cfg, a_div)

    def rel_err(counts):
        rows, offs = int(counts.sum()), (counts.cumsum(0) - counts).tolist()
        ref = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        for e, (o, c) in enumerate(zip(offs, counts.tolist())):
            ref[o : o + c] = a[o : o + c] @ w[e].T
        return ((d[:rows].float() - ref.float()).abs().max() / ref.float().abs().max()).item()

    def graph_us(fn, reps=20):
        fn()  # warm-up (and lazy init) outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                fn()
        g.replay()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(5):
            g.replay()
        e.record()
        torch.cuda.synchronize()
        return round(s.elapsed_time(e) * 1e3 / (5 * reps), 1)

    wt = w.transpose(1, 2)  # [E, K, N] view for torch._grouped_mm
    for t in (1, 8, 64, 256, 1024, 4096):
        counts = route(t)
        rows = int(counts.sum())
        r.set_counts(counts)
        row = {"tokens": t, "rows": rows}
        for name, impl in impls.items():
            d.zero_()
            impl.launch()
            torch.cuda.synchronize()
            row[name + "_rel_err"] = round(rel_err(counts), 5)
            us = graph_us(impl.launch)
            row[name + "_us"], row[name + "_tflops"] = us, round(2 * rows * n * k / us / 1e6, 1)
        try:
            cfg, fn = kiln_triton(t)
            row["kiln_triton_us"] = graph_us(fn)
            row["kiln_triton_tflops"] = round(2 * t * TOPK * n * k / row["kiln_triton_us"] / 1e6, 1)
            row["kiln_triton_cfg"] = cfg
        except Exception as ex:
            row["kiln_triton_us"] = repr(ex)[:160]
        if hasattr(torch, "_grouped_mm"):
            offs32 = counts.cumsum(0).int()
            try:
                row["grouped_mm_us"] = graph_us(
                    lambda rows=rows, offs32=offs32: torch._grouped_mm(a[:rows], wt, offs=offs32)
                )
            except Exception as ex:
                row["grouped_mm_us"] = repr(ex)[:160]
        res["runs"].append(row)
        print(row, flush=True)

    # capturability: one graph = device-side routing refresh + launch; new routing, replay, check
    counts_buf = route(64)
    for name, impl in impls.items():
        r.set_counts(counts_buf)
        impl.launch()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            r.set_counts(counts_buf)
            impl.launch()
        errs = []
        for t in (3, 200, 2000):
            counts_buf.copy_(route(t))
            d.zero_()
            g.replay()
            torch.cuda.synchronize()
            errs.append(round(rel_err(counts_buf), 5))
        res["graph_replay_rel_err"][name] = errs
        print(name, "graph replay rel err", errs, flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/cutlass_probe"))
    ap.add_argument("--which", choices=sorted(SHAPES), default="w13")
    ap.add_argument("--tile", default="128x128x64", help="cppgen threadblock tile (sm80 table)")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--skip", choices=["cppgen", "sm90"], action="append", default=[])
    ap.add_argument("--no-gpu", action="store_true")
    ap.add_argument("--reuse", action="store_true", help="skip nvcc where the artifact exists")
    a = ap.parse_args()
    global REUSE
    REUSE = a.reuse
    n, k = SHAPES[a.which]
    meta, cppgen = {}, None
    if "cppgen" not in a.skip:
        out = os.path.join(a.out, f"cppgen_{a.which}_{a.tile}x{a.stages}")
        meta["cppgen"], op = build_cppgen(out, n, k, tuple(int(x) for x in a.tile.split("x")), a.stages)
        cppgen = (out, meta["cppgen"], op)
    if "sm90" not in a.skip:
        meta["sm90"] = build_sm90(os.path.join(a.out, "sm90"))
    print(json.dumps(meta, indent=1), flush=True)
    try:
        import torch

        gpu = torch.cuda.is_available() and not a.no_gpu
    except ImportError:
        gpu = False
    if gpu:
        meta["gpu_" + a.which] = gpu_run(a.which, cppgen, meta.get("sm90"))
    else:
        print("no GPU: CPU part only")
    with open(os.path.join(a.out, f"meta_{a.which}.json"), "w") as f:
        json.dump(meta, f, indent=1)


if __name__ == "__main__":
    main()
