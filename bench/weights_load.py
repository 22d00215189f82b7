"""Weight packs end to end on one GPU machine: make an 8B-shaped bf16 checkpoint, pack it (peak host
memory beyond the page cache), then from a warm page cache measure the two ceilings and the load.

    python bench/weights_load.py --json bench/results/weights_load.json [--num-layers N] [--keep]
    python bench/weights_load.py --verify both --threads 16 --chunks-mib 8 --depths 2 --streams 2

Ceilings, measured in the same run: (1) pinned host-to-device copy bandwidth (1 GiB, CUDA events);
(2) reading the pack files from the page cache (``preadv`` into 16 MiB buffers, 1..16 threads, the
best). Target (issue 3): ``load_pack`` to CUDA >= 80% of the lower ceiling; packing < 4 GB of
anonymous memory. Without CUDA it runs as a smoke test (``--tiny``: a small config, CPU loads).

The integrity check's own cost (``checksum``): the numpy wsum64 reference on in-memory data, one
thread and ``--threads``' largest (what the packer and CPU loads run), and on CUDA the checksum
kernel alone over a loaded arena (CUDA events, median of ``--reps``: ms and GB/s) and the whole
device check as ``load_pack`` runs it (table upload, kernel, read-back of the sums; wall time). The
kernel is compiled before the first timed load, as an artifact's cache holds it precompiled.

Loads: ``LoadOptions()`` (the default) first, so its ``first_s`` is a fresh process's first load
(pinned staging buffers allocated), then the sweep ``--threads`` x ``--chunks-mib`` x ``--depths``
(pinned buffers per reader) x ``--streams`` (CUDA copy streams); each entry records its options.
``--verify`` (``both`` by default) says which integrity settings each configuration is timed
with: ``on`` (the product default: every tensor's wsum64 checked where it landed, on a GPU by one
kernel after the copies), ``off``, or ``both``, alternating on/off within each repetition so drift
hits both alike; then ``verify_cost`` records, per configuration, the median load with and
without the check and the difference (issue 25: start-up may grow by at most 5%).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

GB = 1e9
MIB = 1 << 20
TINY = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=2048,
)
PACK_CHILD = r"""
import json, sys, time
from kiln.compiler.config import load_config
from kiln.compiler.parallel import ParallelConfig
from kiln.compiler.mappings import all_rank_specs, skip_patterns
from kiln.weights import pack_checkpoint
from kiln.weights.memory import PeakAnonMemory, rss_kib
src, out = sys.argv[1], sys.argv[2]
cfg = load_config(src)
specs = all_rank_specs(cfg, ParallelConfig(tp=1))
t = time.perf_counter()
with PeakAnonMemory(interval=0.005) as mem:
    idx = pack_checkpoint(src, out, specs, 1, 1, "bfloat16", None, progress=True, skip=skip_patterns(cfg),
                          force=True)
print(json.dumps({"seconds": time.perf_counter() - t, "bytes": idx.nbytes, "peak_anon_bytes": mem.peak,
                  "anon_before_bytes": mem.baseline, "vm_hwm_bytes": rss_kib().get("VmHWM", 0) * 1024}))
"""


def h2d_ceiling(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Pinned host -> device copy bandwidth, GB/s (median of ``reps``)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    rates = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        rates.append(nbytes / (a.elapsed_time(b) * 1e-3) / GB)
    return statistics.median(rates)


def read_rate(files: list[Path], threads: int, chunk: int = 16 * MIB) -> float:
    """Bytes of ``files`` read from the page cache per second (GB/s), ``threads`` readers."""
    jobs = [
        (f, off, min(chunk, f.stat().st_size - off))
        for f in files
        for off in range(0, f.stat().st_size, chunk)
    ]
    it, lock = iter(jobs), threading.Lock()
    fds = {f: os.open(f, os.O_RDONLY) for f in files}

    def reader() -> None:
        buf = memoryview(bytearray(chunk))
        while True:
            with lock:
                j = next(it, None)
            if j is None:
                return
            f, off, n = j
            got = 0
            while got < n:
                got += os.preadv(fds[f], [buf[got:n]], off + got)

    t = time.perf_counter()
    ths = [threading.Thread(target=reader) for _ in range(threads)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    dt = time.perf_counter() - t
    for fd in fds.values():
        os.close(fd)
    return sum(n for _, _, n in jobs) / dt / GB


def numpy_wsum_rate(threads: int, nbytes: int = 512 * MIB) -> float:
    """The numpy wsum64 reference on ``threads`` threads over in-memory buffers, GB/s (best of 3)."""
    import numpy as np

    from kiln.weights.checksum import wsum64_many

    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    bufs = [data[i : i + 32 * MIB] for i in range(0, nbytes, 32 * MIB)]
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        wsum64_many(bufs, threads)
        best = max(best, nbytes / (time.perf_counter() - t) / GB)
    return best


def time_kernel(pack_dir: Path, reps: int) -> dict:
    """The checksum kernel alone over a loaded rank's arena (CUDA events), and the whole device check
    as load_pack runs it (wall time, ends with the sums on the host)."""
    from kiln.weights import load_pack
    from kiln.weights.checksum import arena_of, device_wsum64, launch, program_table

    w = load_pack(pack_dir, 0, "cuda", verify=False)
    buf, offsets, sizes = arena_of(list(w.values()))
    rows = torch.from_numpy(program_table(offsets, sizes)).cuda()
    sums = torch.zeros(len(sizes), dtype=torch.int64, device="cuda")
    launch(buf, rows, sums)
    kernel, check = [], []
    for _ in range(reps):
        sums.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        launch(buf, rows, sums)
        b.record()
        b.synchronize()
        kernel.append(a.elapsed_time(b) * 1e-3)
        t = time.perf_counter()
        device_wsum64(buf, offsets, sizes)
        check.append(time.perf_counter() - t)
    nbytes = sum(sizes)
    return {
        "bytes": nbytes,
        "tensors": len(sizes),
        "programs": len(rows),
        "kernel_ms": statistics.median(kernel) * 1e3,
        "kernel_gbps": nbytes / statistics.median(kernel) / GB,
        "check_ms": statistics.median(check) * 1e3,
    }


def time_load(pack_dir: Path, device: str, opts, reps: int, verify: tuple[bool, ...] = (True,)) -> dict:
    """``{verify: timings}`` for each setting in ``verify``; the settings alternate within each of
    the ``reps + 1`` repetitions (the first is ``first_s``, left out of best and median)."""
    from kiln.weights import load_pack

    times: dict[bool, list[float]] = {v: [] for v in verify}
    nbytes = 0
    for _ in range(reps + 1):
        for v in verify:
            t = time.perf_counter()
            w = load_pack(pack_dir, 0, device, verify=v, options=opts)
            if device == "cuda":
                torch.cuda.synchronize()
            times[v].append(time.perf_counter() - t)
            nbytes = sum(x.numel() * x.element_size() for x in w.values())
            del w
    return {
        v: {
            "verify": v,
            "first_s": ts[0],
            "best_s": min(ts[1:]),
            "median_s": statistics.median(ts[1:]),
            "bytes": nbytes,
            "gbps": nbytes / statistics.median(ts[1:]) / GB,
        }
        for v, ts in times.items()
    }


def record(loads: dict, cost: dict, name: str, timed: dict, options: dict) -> None:
    """File ``timed`` (from :func:`time_load`) under ``name`` (verify on) and ``name + " no-verify"``,
    and the verify cost when both were timed."""
    for v, r in timed.items():
        loads[name if v else f"{name} no-verify"] = {**r, "options": options}
    if len(timed) == 2:
        on, off = timed[True]["median_s"], timed[False]["median_s"]
        cost[name] = {"on_median_s": on, "off_median_s": off, "delta_s": on - off, "fraction": on / off - 1}


def main(argv: list[str] | None = None) -> int:
    from kiln.compiler.synth import make_checkpoint
    from kiln.weights import LoadOptions

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--tiny", action="store_true", help="a small llama config (smoke test)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/kiln-weights-bench"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", default="8,16", help="reader threads to try for load_pack")
    ap.add_argument("--chunks-mib", default="4,8,16", help="staging chunk sizes to try (MiB)")
    ap.add_argument("--depths", default="2,3", help="pinned buffers per reader thread to try")
    ap.add_argument("--streams", default="1", help="CUDA copy streams to try")
    ap.add_argument(
        "--verify",
        choices=("both", "on", "off"),
        default="both",
        help="time each load with the integrity check on, off, or both side by side",
    )
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and pack")
    ap.add_argument("--no-sync", action="store_true", help="skip os.sync() after writing (slow disks)")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    verify = {"both": (True, False), "on": (True,), "off": (False,)}[a.verify]
    res: dict = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "config": "tiny" if a.tiny else a.preset,
        "num_layers": a.num_layers,
    }
    ckpt, out = a.workdir / "checkpoint", a.workdir / "pack"
    shutil.rmtree(a.workdir, ignore_errors=True)
    a.workdir.mkdir(parents=True)
    t = time.perf_counter()
    make_checkpoint(
        ckpt, TINY if a.tiny else a.preset, "bfloat16", 0, "5GB", a.num_layers, False, engine="fast"
    )
    size = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    res["checkpoint"] = {"bytes": size, "seconds": time.perf_counter() - t}
    t = time.perf_counter()
    if not a.no_sync:
        os.sync()  # a downloaded checkpoint is clean in the page cache; do not make the packer pay its writeback
    res["checkpoint"]["sync_seconds"] = time.perf_counter() - t
    print(f"checkpoint: {size / GB:.2f} GB in {res['checkpoint']['seconds']:.1f} s", flush=True)
    child = subprocess.run(
        [sys.executable, "-c", PACK_CHILD, str(ckpt), str(out)],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    res["pack"] = json.loads(child.stdout.strip().splitlines()[-1])
    t = time.perf_counter()
    if not a.no_sync:
        os.sync()  # let writeback finish so it does not disturb the read measurements
    res["pack"]["sync_seconds"] = time.perf_counter() - t
    pk = res["pack"]
    print(
        f"pack: {pk['seconds']:.1f} s, peak anon {pk['peak_anon_bytes'] / GB:.2f} GB; syncs "
        f"{res['checkpoint']['sync_seconds']:.1f} s + {pk['sync_seconds']:.1f} s",
        flush=True,
    )
    files = sorted(out.glob("rank0*.safetensors"))
    read_rate(files, 8)  # warm the page cache
    reads = {th: read_rate(files, th) for th in (1, 4, 8, 16)}
    res["ceilings"] = {"page_cache_read_gbps_by_threads": reads, "page_cache_read_gbps": max(reads.values())}
    top = max(int(x) for x in a.threads.split(","))
    sample = (64 if a.tiny else 512) * MIB
    res["checksum"] = {
        "numpy_gbps_one_thread": numpy_wsum_rate(1, sample),
        f"numpy_gbps_{top}_threads": numpy_wsum_rate(top, sample),
    }
    if cuda:
        res["ceilings"]["h2d_pinned_gbps"] = h2d_ceiling()
        from kiln.weights.checksum import device_wsum64

        device_wsum64(torch.zeros(256, dtype=torch.uint8, device="cuda"), [0], [9])  # compiled here
        res["checksum"]["device"] = time_kernel(out, max(3, a.reps))
    loads: dict = {}
    cost: dict = {}

    def show(name: str, timed: dict, label: str = "") -> None:
        for v, r in timed.items():
            print(
                f"load {label or name} verify={'on' if v else 'off'}: {r['gbps']:.2f} GB/s, median "
                f"{r['median_s']:.3f} s (first {r['first_s']:.2f} s)",
                flush=True,
            )
        if name in cost:
            print(
                f"  verify cost: {cost[name]['delta_s'] * 1e3:+.1f} ms ({cost[name]['fraction']:+.1%})",
                flush=True,
            )

    # The default first: its first load is what a fresh process pays (pinned buffers allocated).
    timed = time_load(out, dev, LoadOptions(), a.reps, verify)
    record(loads, cost, "default", timed, dataclasses.asdict(LoadOptions()))
    show("default", timed, f"default {dataclasses.asdict(LoadOptions())}")
    for th, ch, dp, st in itertools.product(
        *([int(x) for x in v.split(",")] for v in (a.threads, a.chunks_mib, a.depths, a.streams))
    ):
        opts = LoadOptions("pinned", th, ch * MIB, dp, st)
        name = f"pinned t{th} c{ch}MiB d{dp} s{st}"
        timed = time_load(out, dev, opts, a.reps, verify)
        record(loads, cost, name, timed, dataclasses.asdict(opts))
        show(name, timed)
    name = "direct (safetensors)" if cuda else "direct (preadv)"
    timed = time_load(out, dev, LoadOptions("direct"), 1, verify)
    record(loads, cost, name, timed, dataclasses.asdict(LoadOptions("direct")))
    show(name, timed)
    direct = loads.get(name) or loads[f"{name} no-verify"]
    res["loads"] = loads
    res["verify_cost"] = cost
    ceiling = min(v for k, v in res["ceilings"].items() if k in ("page_cache_read_gbps", "h2d_pinned_gbps"))
    default = loads.get("default") or loads["default no-verify"]
    res["target"] = {
        "lower_ceiling_gbps": ceiling,
        "default_load_fraction": default["gbps"] / ceiling,
        "best_load_fraction": max(v["gbps"] for v in loads.values()) / ceiling,
        "load_ok": cuda and default["gbps"] >= 0.8 * ceiling,
        "verify_fraction_default": cost["default"]["fraction"] if "default" in cost else None,
        "pack_peak_anon_ok": res["pack"]["peak_anon_bytes"] < 4e9,
    }
    if not a.keep:
        shutil.rmtree(a.workdir, ignore_errors=True)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=2))
    c, p = res["ceilings"], res["pack"]
    rows = [
        ("checkpoint", f"{size / GB:.2f} GB written in {res['checkpoint']['seconds']:.1f} s"),
        (
            "pack",
            f"{p['seconds']:.1f} s, {p['bytes'] / GB / p['seconds']:.2f} GB/s, peak anon {p['peak_anon_bytes'] / GB:.2f} GB",
        ),
        ("ceiling: H2D pinned", f"{c['h2d_pinned_gbps']:.1f} GB/s" if cuda else "n/a (no CUDA)"),
        (
            "ceiling: page-cache read",
            f"{c['page_cache_read_gbps']:.1f} GB/s (threads: "
            + ", ".join(f"{k}={v:.1f}" for k, v in reads.items())
            + ")",
        ),
        (
            f"load_pack -> {dev} (default)",
            f"{default['gbps']:.1f} GB/s = {res['target']['default_load_fraction']:.0%} of {ceiling:.1f}",
        ),
        (
            "load_pack best",
            f"{max(loads.items(), key=lambda kv: kv[1]['gbps'])[0]}: {max(v['gbps'] for v in loads.values()):.1f} GB/s",
        ),
        ("direct baseline", f"{direct['gbps']:.1f} GB/s"),
        (
            "wsum64 (numpy)",
            ", ".join(
                f"{k.removeprefix('numpy_gbps_')} {v:.1f} GB/s"
                for k, v in res["checksum"].items()
                if k != "device"
            ),
        ),
    ]
    if cuda:
        k = res["checksum"]["device"]
        rows.append(
            (
                "wsum64 kernel",
                f"{k['kernel_ms']:.2f} ms = {k['kernel_gbps']:.0f} GB/s over {k['bytes'] / GB:.2f} GB "
                f"({k['tensors']} tensors, {k['programs']} programs); the check as load_pack runs it "
                f"{k['check_ms']:.2f} ms",
            )
        )
    if "default" in cost:
        dc = cost["default"]
        rows.append(
            (
                "verify cost (default)",
                f"{dc['on_median_s']:.3f} s on vs {dc['off_median_s']:.3f} s off: "
                f"{dc['delta_s'] * 1e3:+.1f} ms ({dc['fraction']:+.1%} of the load)",
            )
        )
    w = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{w}}  {v}" for k, v in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
