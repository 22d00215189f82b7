"""The fused-MoE launch table an artifact records (``manifest.kernel_choices.moe``).

Every MoE artifact carries its table, resolved for the model's shapes (``moe_gemm.moe_tuning_table``
of the op's ``DEFAULT_TABLE``), and its graphs pass it to ``kiln::fused_moe``: the runtime reads
block sizes from the artifact and never chooses or tunes. With ``CompileOptions.moe_tune`` on a
GPU, the compiler times candidate (w13, w2) configs of the whole op at a ladder of token counts
on random experts of the model's shapes and records the fastest per rung instead.

Backends (``--moe-backend``, ops/moe/cutlass.py): with "auto" (and the measurement) each rung also
times the CUTLASS grouped GEMM path and takes it (``"backend": "cutlass"`` in the rung's entry, its
Triton configs kept for calls CUTLASS cannot run) when it beats the rung's fastest Triton pair;
"cutlass" puts every rung from ``cutlass_min_tokens`` tokens on CUTLASS (``force_backend``).

``tune`` is the device-free part (candidates in, table out; a test drives it with a fake timer);
``cuda_timer`` builds the timing function on the device.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kiln.ops.moe import gemm as mg

Config = dict[str, int]
Pair = tuple[Config, Config]  # (w13, w2)
LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
CUTLASS_MIN_TOKENS = 2048  # --moe-backend cutlass: from here on (the H200 probe: CUTLASS won at 4096)

# Alternatives to the default pair at a rung: decode GEMV tiles (BLOCK_M 1), every w13 tile with
# every w2 tile (the two GEMMs' best tiles differ: at 1 token of Qwen3-30B-A3B, 16-row w13 programs
# with an unpipelined w2, bench/results/2026-11-30_h200_s7f_*), plus w2 programs that take a
# token's top-k pairs (GROUP_M top-k) and write the sum; grouped-GEMM tiles (BLOCK_N, BLOCK_K,
# GROUP_M, warps, stages), the same tile for both GEMMs.
GEMV_TILES: tuple[mg.Tile, ...] = (
    mg.Tile(16, 256, 1, 4, 3),
    mg.Tile(32, 256, 1, 4, 3),
    mg.Tile(32, 512, 1, 4, 3),
    mg.Tile(64, 256, 1, 8, 3),
)
GEMV_W2_TILES: tuple[mg.Tile, ...] = (*GEMV_TILES, mg.Tile(32, 256, 1, 4, 1))
GROUPED_TILES: tuple[mg.Tile, ...] = (
    mg.Tile(64, 128, 1, 4, 3),
    mg.Tile(128, 128, 1, 4, 2),
    mg.Tile(128, 64, 1, 4, 3),
    mg.Tile(256, 64, 16, 8, 3),
    mg.Tile(128, 64, 16, 8, 4),
)


@dataclass(frozen=True)
class MoEShape:
    num_experts: int  # local experts
    inter: int  # per-rank intermediate size
    hidden: int
    top_k: int


def _cfg(block_m: int, tile: mg.Tile, n: int, k: int) -> Config:
    return mg.clip_config(dict(zip(mg.CONFIG_KEYS, (block_m, *tile), strict=True)), n, k)


def candidates(s: MoEShape, tokens: int) -> list[Pair]:
    """The default pair at ``tokens`` first, then alternatives of the same kind (GEMV or grouped)."""
    default = mg.pick_configs("", s.num_experts, s.inter, s.hidden, tokens, s.top_k)
    out: list[Pair] = [default]
    bm = default[0]["BLOCK_M"]
    n13, k13, n2, k2 = 2 * s.inter, s.hidden, s.hidden, s.inter
    if bm == 1:
        pairs = [(a, b) for a in GEMV_TILES for b in GEMV_W2_TILES] + [
            (t, mg.Tile(t.block_n // 8 or 2, 256, s.top_k, 4, 3)) for t in GEMV_TILES
        ]
    else:
        pairs = [(t, t) for t in GROUPED_TILES]
    for a, b in pairs:
        pair = (_cfg(bm, a, n13, k13), _cfg(bm, b, n2, k2))
        if pair not in out:
            out.append(pair)
    return out


def tune(
    s: MoEShape,
    max_tokens: int,
    time_pair: Callable[[int, Pair], float],
    ladder: Sequence[int] = LADDER,
    time_cutlass: Callable[[int], float] | None = None,
) -> tuple[str, list[dict[str, Any]]]:
    """The fastest candidate at each rung of ``ladder`` up to ``max_tokens`` (``time_pair(tokens,
    pair)`` -> seconds; a candidate that fails to run is skipped). Returns the table JSON
    (``{"<rung>": {"w13", "w2"}}``: token counts up to a rung take its pair) and a report.
    ``time_cutlass(tokens)``: also time the CUTLASS backend; a rung it wins gets ``"backend":
    "cutlass"`` beside its fastest Triton pair."""
    rungs = [t for t in ladder if t < max_tokens] + [max_tokens]
    table: dict[str, dict[str, Any]] = {}  # rung -> {"w13": Config, "w2": Config[, "backend"]}
    report = []
    for t in rungs:
        timed = []
        cands = candidates(s, t)
        for pair in cands:
            try:
                timed.append((time_pair(t, pair), pair))
            except Exception as e:  # a config the device cannot hold (shared memory, registers)
                report.append({"tokens": t, "skipped": pair, "error": str(e)[:200]})
        if not timed:
            raise RuntimeError(f"moe tuning: no candidate ran at {t} tokens")
        best_s, best = min(timed, key=lambda x: x[0])
        default_s = timed[0][0] if timed[0][1] == cands[0] else float("nan")
        table[str(t)] = {"w13": best[0], "w2": best[1]}
        row: dict[str, Any] = {
            "tokens": t,
            "best_us": best_s * 1e6,
            "default_us": default_s * 1e6,
            "tried": len(timed),
        }
        if time_cutlass is not None:
            try:
                row["cutlass_us"] = time_cutlass(t) * 1e6
            except Exception as e:
                report.append({"tokens": t, "skipped": "cutlass", "error": str(e)[:200]})
            if row.get("cutlass_us", math.inf) < row["best_us"]:
                table[str(t)]["backend"] = "cutlass"
            row["backend"] = table[str(t)].get("backend", "triton")
        report.append(row)
    return json.dumps(table), report


def force_backend(table: str, backend: str, min_tokens: int) -> str:
    """``table`` (JSON) with ``backend`` on every token count from ``min_tokens`` on (an entry
    covering counts on both sides is split; the Triton configs stay as they were)."""
    out: dict[str, dict[str, Any]] = {}
    prev = 0
    for m, entry in mg.parse_tuning(table):
        if m >= min_tokens:
            if prev + 1 < min_tokens:  # counts prev+1 .. min_tokens-1 keep the entry as it was
                out[str(min_tokens - 1)] = dict(entry)
            out[str(m)] = dict(entry, backend=backend)
        else:
            out[str(m)] = dict(entry)
        prev = m
    return json.dumps(out)


def cuda_timer(s: MoEShape, dtype: torch.dtype, device: torch.device) -> Callable[[int, Pair | None], float]:
    """``time_pair`` on the device: the whole ``fused_moe`` on random experts of the model's
    shapes and uniform random routing (median of CUDA-event timings of a CUDA-graph replay of the op,
    ``triton.testing.do_bench``);
    ``pair`` None times the CUTLASS backend (ops/moe/cutlass.py; its library loaded)."""
    import triton.testing

    from kiln.ops.moe.cutlass import fused_moe_cutlass
    from kiln.ops.moe.fused import fused_moe_forward

    g = torch.Generator(device).manual_seed(0)
    w13 = (torch.randn(s.num_experts, 2 * s.inter, s.hidden, generator=g, device=device) / s.hidden**0.5).to(
        dtype
    )
    w2 = (torch.randn(s.num_experts, s.hidden, s.inter, generator=g, device=device) / s.inter**0.5).to(dtype)

    inputs: dict[int, tuple[torch.Tensor, ...]] = {}

    def time_pair(tokens: int, pair: Pair | None) -> float:
        if tokens not in inputs:  # the default table's output is the reference
            x = torch.randn(tokens, s.hidden, generator=g, device=device).to(dtype)
            ids = torch.rand(tokens, s.num_experts, generator=g, device=device).topk(s.top_k, dim=1).indices
            w = torch.full((tokens, s.top_k), 1.0 / s.top_k, device=device)
            ref = fused_moe_forward(x, w13, w2, w, ids.to(torch.int32), None, None, None, "")
            inputs[tokens] = (x, w, ids.to(torch.int32), ref.float())
        x, w, ids, ref = inputs[tokens]
        out = torch.empty_like(x)

        def run() -> None:
            if pair is None:
                fused_moe_cutlass(x, w13, w2, w, ids, None, out=out)
            else:
                fused_moe_forward(x, w13, w2, w, ids, None, None, None, "", configs=pair, out=out)

        run()  # compile (an OutOfResources config raises here and is skipped)
        err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        if not err < 2e-2:  # a candidate must compute the same op
            raise RuntimeError(f"relative error {err:.1e} against the default config")
        # timed as a CUDA-graph replay, as the runtime runs the op: eager timing on a slow host
        # measures its Python launch overhead (the first GPU run of the tuner chose tables that
        # were slower end to end, bench/results/2026-11-29_h200_qwen3moe_L16_moe_tune_choices.json)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        return float(triton.testing.do_bench(graph.replay, warmup=10, rep=40, return_mode="median")) * 1e-3

    return time_pair


def moe_tuning(
    s: MoEShape,
    max_tokens: int,
    measure: bool,
    dtype: torch.dtype,
    device: torch.device,
    backend: str = "triton",
    cutlass_min_tokens: int = CUTLASS_MIN_TOKENS,
    cutlass: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What ``manifest.kernel_choices.moe`` records: the table (JSON string, as the graphs pass it)
    and how it was made (``method``: "default" or "measured", with the per-rung report; ``backend``:
    "triton", "cutlass" or "auto", the rungs' own ``backend`` saying what each runs; ``cutlass``:
    the library's record, compiler/cutlass_build.py, whose library must be loaded for these two)."""
    out: dict[str, Any] = {"backend": backend}
    if measure and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        timer = cuda_timer(s, dtype, device)
        time_cutlass = (lambda t: timer(t, None)) if backend == "auto" else None
        table, report = tune(s, max_tokens, timer, time_cutlass=time_cutlass)
        out |= {"method": "measured", "gpu": torch.cuda.get_device_name(device), "report": report}
    else:
        table = mg.moe_tuning_table(s.num_experts, s.inter, s.hidden, s.top_k, max_tokens)
        out["method"] = "default"
    if backend == "cutlass":
        table = force_backend(table, "cutlass", cutlass_min_tokens)
        out["cutlass_min_tokens"] = cutlass_min_tokens
    if cutlass:
        out["cutlass"] = cutlass
    return out | {"table": table}
