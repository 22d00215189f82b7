"""All-reduce time on the GPUs of one machine, by method and size: NCCL vs torch's symmetric memory.

    torchrun --standalone --nproc-per-node 2 bench/gpu/allreduce.py --json OUT.json

One process per GPU. For each message size (bf16 elements; the default sizes are a decode step's
all-reduces of Llama-3.1-8B / 70B (hidden 4096 / 8192) at batch 1..256, then prefill-sized ones
for the bus bandwidth) and each method, ``--reps`` all-reduces are captured in one CUDA graph
(as the engine's decode graph holds them) and the replay is timed; the time per all-reduce is the
replay's over ``--reps``. Methods:

* ``nccl``: ``torch.distributed.all_reduce`` (NCCL; NVLink multicast (NVLS) stays off on the
  lent machines, see the device notes);
* ``nccl_eager``: the same, launched one by one (no graph: the host's launch cost included);
* ``symm_one_shot``: ``torch.ops.symm_mem.one_shot_all_reduce_copy``: each rank copies its input
  into a symmetric buffer and every rank reads all peers' buffers over NVLink (one pass; best at
  small sizes);
* ``symm_two_shot``: ``torch.ops.symm_mem.two_shot_all_reduce_`` (reduce-scatter + all-gather
  through the symmetric buffer).

Bus bandwidth is NCCL's convention: ``2 (n - 1) / n * bytes / time``. Each method's result is
checked against the exact sum first (inputs are small integers, exact in bf16). Rank 0 prints a
table and writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

DECODE = [h * b for h in (4096, 8192) for b in (1, 8, 64, 256)]
LARGE = [1 << 22, 1 << 24, 1 << 26]  # 8, 32, 128 MB of bf16


def _methods(group_name: str, buf: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    def nccl(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def one_shot(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.symm_mem.one_shot_all_reduce_copy(buf[: x.numel()], x, "sum", group_name)

    def two_shot(x: torch.Tensor) -> torch.Tensor:
        b = buf[: x.numel()]
        b.copy_(x)
        return torch.ops.symm_mem.two_shot_all_reduce_(b, "sum", group_name)

    return {"nccl": nccl, "symm_one_shot": one_shot, "symm_two_shot": two_shot}


def _graph_time(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, reps: int, iters: int) -> float:
    """Seconds per all-reduce: ``reps`` calls captured in a CUDA graph, replayed ``iters`` times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn(x)
    g.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (iters * reps)


def _eager_time(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, n: int) -> float:
    for _ in range(5):
        fn(x)
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn(x)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default=",".join(str(n) for n in DECODE + LARGE), help="bf16 elements")
    ap.add_argument("--reps", type=int, default=20, help="all-reduces per CUDA graph")
    ap.add_argument("--iters", type=int, default=20, help="replays timed")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [int(s) for s in a.sizes.split(",")]
    import torch.distributed._symmetric_memory as symm_mem

    group_name = dist.group.WORLD.group_name
    buf = symm_mem.empty(max(sizes), dtype=torch.bfloat16, device="cuda")
    symm_mem.rendezvous(buf, group_name)
    methods = _methods(group_name, buf)
    rows = []
    for n in sizes:
        x = torch.full((n,), float(rank + 1), dtype=torch.bfloat16, device="cuda")
        want = world * (world + 1) / 2
        row: dict[str, float | int | str] = {"elements": n, "bytes": 2 * n}
        for name, fn in methods.items():
            try:
                got = fn(x.clone())
                torch.cuda.synchronize()
                ok = bool((got == want).all())
                t = _graph_time(fn, x.clone().fill_(0.0), a.reps, a.iters)
                row[name + "_us"] = round(t * 1e6, 2) if ok else "wrong sum"
            except Exception as e:  # a method this machine or size does not support
                row[name + "_us"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        row["nccl_eager_us"] = round(_eager_time(methods["nccl"], x.clone().fill_(0.0), 50) * 1e6, 2)
        nccl = row["nccl_us"]
        if isinstance(nccl, float):
            row["nccl_busbw_GBps"] = round(2 * (world - 1) / world * 2 * n / (nccl * 1e-6) / 1e9, 1)
        rows.append(row)
    if rank == 0:
        cols = [
            "bytes",
            "nccl_us",
            "nccl_eager_us",
            "symm_one_shot_us",
            "symm_two_shot_us",
            "nccl_busbw_GBps",
        ]
        print(" ".join(f"{c:>17}" for c in cols))
        for r in rows:
            print(" ".join(f"{r.get(c, '')!s:>17.17}" for c in cols))
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"world": world, "reps": a.reps, "iters": a.iters, "rows": rows}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
