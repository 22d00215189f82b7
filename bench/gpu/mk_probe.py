"""Build, check and time the persistent decode-layer probe (bench/gpu/mk_probe.cu) on the GPU.

The question it answers (docs/decode_budget.md): with one persistent launch whose producer warp
streams every weight chunk into shared memory while the consumer warps wait on the layer's small
dependent stages, how close does a batch-1 Qwen3-30B-A3B-shaped MoE layer get to the read
bandwidth? Same bytes as kiln's layer (qkv, o, router, 8 of 128 experts, 544 keys of KV), random
bf16 weights, ``--layers`` layers in one launch.

Checks, per layer, on the kernel's own inputs of that layer (so a near-tie in the top-k of one
layer cannot derail the rest): qkv, the attention output, h, the router logits, the expert ids
(exact), the activations and the layer output against a float32 torch reference with the same
bf16 roundings. Times: median of CUDA-event timings of whole launches (counters zeroed between
launches, outside the timed region), with the producer streaming ahead (``prefetch``) and with
it waiting for each instruction's input like an ordinary kernel (``no_prefetch``).

Usage on the GPU machine: ``python bench/gpu/mk_probe.py --json OUT.json`` (nvcc on PATH).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kiln.runtime.benchmark import read_bandwidth_gbps

H, QKV, NQ, NKV, D, E, TOPK, I = 2048, 5120, 32, 4, 128, 128, 8, 768
CTX, SPLIT, NSPLIT = 544, 32, 17
NATT = NKV * NSPLIT
QKV_OP, ATTN, MERGE, O_OP, ROUTER, TOPK_OP, W13, W2_OP = range(8)
C_QKV, C_SPLIT, C_MERGE, C_O, C_ROUTER, C_TOPK, C_W13, C_W2 = range(8)
NCTR = 8
CT_CTA, CT_MAX = 1, 4096  # mk_probe.cu: the CTA whose chunks are traced
HERE = Path(__file__).resolve().parent


def build(out: Path) -> ctypes.CDLL:
    cmd = ["nvcc", "-std=c++17", "-arch=sm_90a", "-O3", "-Xcompiler", "-fPIC", "-shared", "-Xptxas", "-v",
           "-o", str(out), str(HERE / "mk_probe.cu")]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit("nvcc failed:\n" + r.stderr)
    print(
        "ptxas:", " | ".join(ln.strip() for ln in r.stderr.splitlines() if "registers" in ln or "spill" in ln)
    )
    lib = ctypes.CDLL(str(out))
    lib.mk_launch.restype = ctypes.c_int
    lib.mk_launch.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3 + [ctypes.c_void_p]
    lib.mk_error.restype = ctypes.c_char_p
    return lib


def spread(n: int, parts: int) -> list[tuple[int, int]]:
    """``n`` items over ``parts`` contiguous ranges, sizes differing by at most one."""
    return [(p * n // parts, (p + 1) * n // parts) for p in range(parts)]


def schedule(layers: int, grid: int) -> np.ndarray:
    """Per-CTA instruction lists ``[grid, max, 8]`` int32 (op -1 ends a list): every stage of
    every layer, in stage order in each list, each stage spread over the CTAs."""
    lists: list[list[list[int]]] = [[] for _ in range(grid)]
    att_ctas = list(range(NATT))  # one split per CTA
    merge_ctas = [NATT + g for g in range(NKV)]
    router_ctas = [grid - 1 - 8 * r for r in range(16)]  # away from the attention CTAs
    topk_cta = grid // 2
    w2_ctas = [c * grid // (H // 16) for c in range(H // 16)]  # 128 of the 132
    for L in range(layers):
        ctr = lambda k, L=L: L * NCTR + k
        # stage: (op, [(cta, c0, nc, task)], wait counter, target, signal)
        stages = [
            (QKV_OP, [(c, a, b - a, 0) for c, (a, b) in enumerate(spread(QKV // 8, grid)) if b > a],
             ctr(C_W2) - NCTR if L else -1, len(w2_ctas), ctr(C_QKV)),
            (ATTN, [(c, 0, 1, t) for t, c in enumerate(att_ctas)], ctr(C_QKV), grid, ctr(C_SPLIT)),
            (MERGE, [(c, 0, 0, g) for g, c in enumerate(merge_ctas)], ctr(C_SPLIT), NATT, ctr(C_MERGE)),
            (O_OP, [(c, a, b - a, 0) for c, (a, b) in enumerate(spread(H // 4, grid)) if b > a],
             ctr(C_MERGE), NKV, ctr(C_O)),
            (ROUTER, [(c, r, 1, 0) for r, c in enumerate(router_ctas)], ctr(C_O), grid, ctr(C_ROUTER)),
            (TOPK_OP, [(topk_cta, 0, 0, 0)], ctr(C_ROUTER), len(router_ctas), ctr(C_TOPK)),
            (W13, [(c, a, b - a, 0) for c, (a, b) in enumerate(spread(TOPK * I // 4, grid)) if b > a],
             ctr(C_TOPK), 1, ctr(C_W13)),
            (W2_OP, [(c, 0, TOPK, g) for g, c in enumerate(w2_ctas)], ctr(C_W13), grid, ctr(C_W2)),
        ]  # fmt: skip
        for op, items, wait, target, signal in stages:
            if op == QKV_OP and wait < 0:
                target = 0
            for cta, c0, nc, task in items:
                lists[cta].append([op, L, c0, nc, task, wait, target, signal])
    m = max(map(len, lists)) + 1
    out = np.full((grid, m, 8), -1, dtype=np.int32)
    for c, lst in enumerate(lists):
        out[c, : len(lst)] = np.array(lst, dtype=np.int32)
    for op, lim in ((O_OP, 32), (W13, 16)):  # the kernel's per-instruction accumulator space
        assert out[..., 3][out[..., 0] == op].max() <= lim, (op, lim)
    return out


class Probe:
    def __init__(self, lib: ctypes.CDLL, layers: int, seed: int = 0):
        self.lib, self.layers = lib, layers
        dev = torch.device("cuda")
        g = torch.Generator(dev).manual_seed(seed)

        def rnd(*shape, scale):
            return (torch.randn(*shape, generator=g, device=dev) * scale).to(torch.bfloat16)

        self.w = [
            dict(wqkv=rnd(QKV, H, scale=H**-0.5), wo=rnd(H, NQ * D, scale=(NQ * D) ** -0.5),
                 wr=rnd(E, H, scale=H**-0.5), w13=rnd(E, 2 * I, H, scale=H**-0.5), w2=rnd(E, H, I, scale=I**-0.5),
                 kc=rnd(NKV, CTX, D, scale=1.0), vc=rnd(NKV, CTX, D, scale=1.0))
            for _ in range(layers)
        ]  # fmt: skip
        names = ("wqkv", "wo", "wr", "w13", "w2", "kc", "vc")
        table = torch.tensor([[lw[n].data_ptr() for n in names] for lw in self.w], dtype=torch.int64)
        self.table = table.to(dev)
        Lz = layers
        self.buf = dict(
            x=torch.zeros(Lz + 1, H, dtype=torch.bfloat16, device=dev), qkv=torch.zeros(Lz, QKV, dtype=torch.bfloat16, device=dev),
            att=torch.zeros(Lz, NQ * D, dtype=torch.bfloat16, device=dev), h=torch.zeros(Lz, H, dtype=torch.bfloat16, device=dev),
            act=torch.zeros(Lz, TOPK, I, dtype=torch.bfloat16, device=dev), logits=torch.zeros(Lz, E, device=dev),
            tw=torch.zeros(Lz, TOPK, device=dev), po=torch.zeros(Lz, NATT, 8, D, device=dev),
            pml=torch.zeros(Lz, NATT, 8, 2, device=dev), ids=torch.zeros(Lz, TOPK, dtype=torch.int32, device=dev),
            cnt=torch.zeros(Lz, NCTR, dtype=torch.int32, device=dev),
        )  # fmt: skip
        self.grid = torch.cuda.get_device_properties(0).multi_processor_count
        self.lists = torch.from_numpy(schedule(layers, self.grid)).to(dev)
        self.buf["trace"] = torch.zeros(self.grid, self.lists.shape[1], 3, dtype=torch.int64, device=dev)
        self.buf["ctrace"] = torch.zeros(4, CT_MAX, dtype=torch.int64, device=dev)
        order = ("x", "qkv", "att", "h", "act", "logits", "tw", "po", "pml", "ids", "cnt", "trace", "ctrace")
        self.ptrs = [self.buf[n].data_ptr() for n in order]
        self.set_tracing(True)
        self.buf["x"][0] = rnd(H, scale=1.0)

    def set_tracing(self, on: bool) -> None:
        class B(ctypes.Structure):
            _fields_ = [(f"p{i}", ctypes.c_void_p) for i in range(len(self.ptrs))] + [
                ("tracing", ctypes.c_int)
            ]

        self.bufs = B(*self.ptrs, int(on))

    def launch(self, prefetch: bool) -> None:
        """One launch of every layer (the counters must be zero: ``zero_counters``)."""
        e = self.lib.mk_launch(self.table.data_ptr(), ctypes.addressof(self.bufs), self.lists.data_ptr(),
                               self.lists.shape[1], self.grid, int(prefetch), torch.cuda.current_stream().cuda_stream)  # fmt: skip
        if e:
            sys.exit(f"mk_launch: {self.lib.mk_error(e).decode()}")

    def zero_counters(self) -> None:
        self.buf["cnt"].zero_()

    def time_ms(self, prefetch: bool, reps: int) -> list[float]:
        """CUDA-event times of ``reps`` launches, the counters zeroed outside the timed region."""
        out = []
        for _ in range(reps):
            self.zero_counters()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            self.launch(prefetch)
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        return out

    def bytes_per_layer(self) -> int:
        lw = self.w[0]
        dense = sum(lw[n].nbytes for n in ("wqkv", "wo", "wr", "kc", "vc"))
        return dense + TOPK * (lw["w13"][0].nbytes + lw["w2"][0].nbytes)


STAGES = ("qkv", "attn", "merge", "o", "router", "topk", "w13", "w2")


def timeline(p: Probe, layer: int) -> dict[str, dict[str, float]]:
    """From the last launch's trace, per stage of ``layer`` (us from the layer's first qkv start):
    when its first CTA's input was ready, when its last CTA finished."""
    tr = p.buf["trace"].cpu().numpy()
    lists = p.lists.cpu().numpy()
    sel = lists[..., 1] == layer
    t0 = tr[..., 1][sel & (lists[..., 0] == QKV_OP)].min()
    out = {}
    for op, name in enumerate(STAGES):
        m = sel & (lists[..., 0] == op)
        out[name] = dict(ready_first=(tr[..., 1][m].min() - t0) / 1e3, ready_last=(tr[..., 1][m].max() - t0) / 1e3,
                         done_last=(tr[..., 2][m].max() - t0) / 1e3)  # fmt: skip
    return out


def chunk_timeline(p: Probe, layer: int) -> list[tuple[str, float, float, float]]:
    """CTA ``CT_CTA``'s chunks of ``layer``: (stage, issued, landed as the consumers saw it, consumed),
    us from the layer's first qkv input ready on that CTA."""
    lists = p.lists.cpu().numpy()[CT_CTA]
    ct = p.buf["ctrace"].cpu().numpy()
    tr = p.buf["trace"].cpu().numpy()[CT_CTA]
    rows, seq, t0 = [], 0, None
    for i, (op, lay, _c0, nc, *_rest) in enumerate(lists):
        if op < 0:
            break
        n = 0 if op in (MERGE, TOPK_OP) else nc
        if lay == layer:
            t0 = tr[i, 1] if t0 is None else t0
            rows += [(STAGES[op], *(ct[k, seq + c] for k in range(3))) for c in range(n)]
        seq += n
    return [(name, *((v - t0) / 1e3 for v in vals)) for name, *vals in rows]


def rb(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def check(p: Probe) -> dict[str, float]:
    """Worst relative error per quantity over the layers, each layer on the kernel's own inputs."""
    b = {k: v.float() if v.is_floating_point() else v for k, v in p.buf.items()}
    worst: dict[str, float] = {}

    def rel(name, got, ref):
        err = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        if math.isnan(err):
            err = float("inf")
        worst[name] = max(worst.get(name, 0.0), err)

    for L, lw in enumerate(p.w):
        kid = b["ids"][L].long()
        w = {k: v.float() for k, v in lw.items() if k not in ("w13", "w2")}
        w["w13"], w["w2"] = lw["w13"][kid].float(), lw["w2"][kid].float()  # the experts picked
        x = b["x"][L]
        qkv = rb(w["wqkv"] @ x)
        rel("qkv", b["qkv"][L], qkv)
        q = b["qkv"][L][: NQ * D].view(NQ, D)
        kn, vn = (
            b["qkv"][L][NQ * D : NQ * D + NKV * D].view(NKV, D),
            b["qkv"][L][NQ * D + NKV * D :].view(NKV, D),
        )
        k = torch.cat([w["kc"], kn[:, None]], 1)  # [NKV, CTX + 1, D]
        v = torch.cat([w["vc"], vn[:, None]], 1)
        s = torch.einsum("hd,hnd->hn", q, k.repeat_interleave(NQ // NKV, 0)) * D**-0.5
        att = rb(torch.einsum("hn,hnd->hd", s.softmax(-1), v.repeat_interleave(NQ // NKV, 0)).flatten())
        rel("attention", b["att"][L], att)
        h = rb(x + rb(w["wo"] @ b["att"][L]))
        rel("h", b["h"][L], h)
        hk = b["h"][L]
        hn = rb(hk * torch.rsqrt(hk.pow(2).mean() + 1e-6))
        logits = w["wr"] @ hn
        rel("logits", b["logits"][L], logits)
        pr = b["logits"][L].softmax(-1)
        top = torch.sort(pr, descending=True, stable=True)
        ids, tw = top.indices[:TOPK], top.values[:TOPK] / top.values[:TOPK].sum()
        worst["ids_mismatch_layers"] = worst.get("ids_mismatch_layers", 0) + int(
            not torch.equal(ids.int(), b["ids"][L])
        )
        rel("topk_weights", b["tw"][L], tw)
        gu = torch.einsum("jnh,h->jn", w["w13"], hn)
        g_, u_ = rb(gu[:, :I]), rb(gu[:, I:])
        act = rb(rb(g_ * torch.sigmoid(g_)) * u_)
        rel("act", b["act"][L], act)
        y = (b["tw"][L][:, None] * rb(torch.einsum("jhi,ji->jh", w["w2"], b["act"][L]))).sum(0)
        rel("out", b["x"][L + 1], rb(hk + rb(y)))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    t0 = time.perf_counter()
    lib = build(Path("/tmp/mk_probe.so"))
    print(f"built in {time.perf_counter() - t0:.1f} s", flush=True)
    bw = read_bandwidth_gbps(torch.device("cuda"))
    p = Probe(lib, a.layers)
    res: dict = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, read_gbps=bw, layers=a.layers,
                     grid=p.grid, instr_per_cta=int(p.lists.shape[1]), bytes_per_layer=p.bytes_per_layer())  # fmt: skip
    for prefetch in (True, False):
        name = "prefetch" if prefetch else "no_prefetch"
        for k in ("x", "qkv", "att", "h", "act"):
            if k != "x":
                p.buf[k].fill_(float("nan"))
        p.buf["x"][1:].fill_(float("nan"))
        p.zero_counters()
        p.launch(prefetch)
        torch.cuda.synchronize()
        res[f"{name}_check"] = check(p)
        ms = p.time_ms(prefetch, a.reps)
        per = statistics.median(ms) * 1e3 / a.layers
        res[f"{name}_us_per_layer"] = per
        res[f"{name}_ms_runs"] = ms
        res[f"{name}_frac_bw"] = p.bytes_per_layer() / (per * 1e-6) / 1e9 / bw
        ct = p.buf["ctrace"].cpu().numpy()
        n = int((ct[1] > 0).sum())
        res[f"{name}_sm_clock_ghz"] = ghz = float((ct[3, n - 1] - ct[3, 0]) / (ct[1, n - 1] - ct[1, 0]))
        p.set_tracing(False)
        ms_off = p.time_ms(prefetch, a.reps)
        p.set_tracing(True)
        res[f"{name}_untraced_us_per_layer"] = off = statistics.median(ms_off) * 1e3 / a.layers
        print(
            f"{name}: SM clock {ghz:.2f} GHz over CTA {CT_CTA}'s chunks; untraced {off:.2f} us/layer "
            f"({100 * p.bytes_per_layer() / (off * 1e-6) / 1e9 / bw:.1f}%)",
            flush=True,
        )
        res[f"{name}_timeline_layer8"] = tl = timeline(p, min(8, a.layers - 1))
        res[f"{name}_chunks_cta{CT_CTA}_layer8"] = ch = chunk_timeline(p, min(8, a.layers - 1))
        print(name, f"CTA {CT_CTA} chunks (stage issued/landed/consumed us):",
              " ".join(f"{n}:{i:.1f}/{la:.1f}/{c:.1f}" for n, i, la, c in ch))  # fmt: skip
        print(name, "layer 8 (us: first ready / last ready / last done):",
              " ".join(f"{k} {v['ready_first']:.1f}/{v['ready_last']:.1f}/{v['done_last']:.1f}" for k, v in tl.items()))  # fmt: skip
        print(f"{name}: {per:.2f} us/layer ({100 * res[f'{name}_frac_bw']:.1f}% of {bw:.0f} GB/s), "
              f"check {json.dumps({k: round(v, 5) for k, v in res[f'{name}_check'].items()})}", flush=True)  # fmt: skip
    Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
