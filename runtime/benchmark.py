"""Measurements behind ``kiln bench``: decode latency against the read-bandwidth roofline,
offline throughput, start-up by phase, and the same figures for Hugging Face transformers on the
same weights (``--compare-hf``), so every claim is a ratio measured in one run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from kiln.errors import KilnError
from kiln.runtime.grammar import StructuredOutputs
from kiln.runtime.llm import LLM
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.step_stats import StepStatsSnapshot

T = TypeVar("T")


class StartupError(KilnError, RuntimeError):
    """A ``kiln bench startup`` child process that did not start (its last error line)."""


def read_bandwidth_gbps(device: torch.device) -> float:
    """Device read bandwidth (GB/s): a sum over 4 GiB of bf16, median of CUDA-event timings."""
    if device.type != "cuda":
        return float("nan")
    x = torch.randn(1 << 31, device=device, dtype=torch.bfloat16).view(-1, 8192)
    out = torch.empty(8192, device=device, dtype=torch.float32)
    times = []
    for i in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.sum(x, dim=0, dtype=torch.float32, out=out)
        b.record()
        b.synchronize()
        if i >= 2:
            times.append(a.elapsed_time(b) * 1e-3)
    nbytes = x.numel() * x.element_size()
    del x
    torch.cuda.empty_cache()
    return nbytes / statistics.median(times) / 1e9


def environment() -> dict[str, Any]:
    import triton

    env = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "command": " ".join(sys.argv),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


def random_prompts(n: int, length: int | tuple[int, int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lens = [length if isinstance(length, int) else rng.randint(*length) for _ in range(n)]
    return [[rng.randrange(10, vocab) for _ in range(k)] for k in lens]


def cycle_prompts(
    llm: LLM, n: int, input_len: int, output_len: int, seed: int = 0, skip: int = 0
) -> list[list[int]]:
    """``n`` prompts of ``input_len`` tokens whose greedy continuation the prompt already holds
    when the model continues each token the same way whatever came before (a successor checkpoint,
    ``bench/make_checkpoint.py --successor``: the greedy continuation of ``t`` is ``next(t)``):
    the workload n-gram speculative decoding applies to. Each prompt is a stretch ``S`` of the
    model's own greedy continuation of a random token (generated here, greedy, ``ignore_eos``),
    then the first ``m = max(1, (input_len - output_len) // 2)`` tokens of ``S`` again, so the
    output goes on along ``S``: up to ``len(S) - m >= output_len`` tokens (where ``input_len >=
    2 output_len + 1``) that every n-gram draft predicts. ``skip`` >= 2 drops every ``skip``-th
    token of the continuation before taking ``S`` (a cycle over a subset): drafts go wrong at each
    gap, so fewer are accepted; 0 drops none."""
    if skip == 1 or skip < 0:
        raise ValueError(f"skip must be 0 (none) or >= 2, got {skip}")
    eng = llm.engine
    m = max(1, (input_len - output_len) // 2)
    k = input_len - m  # len(S)
    need = k + (k // (skip - 1) + 1 if skip else 0)  # continuation length before the gaps
    if need > eng.max_seq_len:
        raise ValueError(
            f"cycle prompts of {input_len} tokens need {need} <= max_seq_len ({eng.max_seq_len})"
        )
    rng = random.Random(seed)
    starts = [[rng.randrange(10, eng.vocab_size)] for _ in range(n)]
    sp = SamplingParams(max_tokens=need - 1, temperature=0.0, ignore_eos=True)
    prompts = []
    for start, out in zip(starts, llm.generate(starts, sp)):
        seq = start + list(out.token_ids)
        stretch = [t for i, t in enumerate(seq) if not skip or (i + 1) % skip][:k]
        prompts.append(stretch + stretch[:m])
    return prompts


def spec_sums(llm: LLM) -> dict[str, Any] | None:
    """The engine's speculative-decoding sums (``Engine.step_metrics()["speculative"]``), None
    with speculation off."""
    return llm.engine.step_metrics().get("speculative")


def spec_figures(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any]:
    """Speculative decoding over a run, from :func:`spec_sums` before and after it:
    ``spec_acceptance_rate`` (drafts accepted / proposed), ``spec_mean_emitted`` (tokens a request
    gained per verify step: accepted drafts + 1), ``spec_verified`` (request-steps verified),
    ``spec_proposed``, ``spec_accepted``, ``verify_steps``, and ``spec_policy``: the measured
    policy's state at the end (runtime/spec_policy.py ``as_dict``; None without it); all None with
    speculation off."""
    if before is None or after is None:
        names = ("acceptance_rate", "mean_emitted", "verified", "proposed", "accepted", "policy")
        return {f"spec_{k}": None for k in names} | {"verify_steps": None}
    d = {k: after[k] - before[k] for k in ("steps", "verified", "proposed", "accepted", "emitted")}
    return {
        "spec_acceptance_rate": d["accepted"] / d["proposed"] if d["proposed"] else 0.0,
        "spec_mean_emitted": d["emitted"] / d["verified"] if d["verified"] else 0.0,
        "spec_verified": d["verified"],
        "spec_proposed": d["proposed"],
        "spec_accepted": d["accepted"],
        "spec_policy": after.get("policy"),
        "verify_steps": d["steps"],
    }


@dataclass
class LatencyResult:
    batch: int
    input_len: int
    output_len: int
    ttft_s: float  # submission to the batch's first tokens (prefill of every request)
    decode_tok_s: float  # B x (output_len - 1) / decode time
    itl_ms: float  # mean decode step
    host_ms_per_step: float  # median Python time per decode step (not waiting for the GPU)
    bytes_per_step: float  # weights + KV read per decode step (mean)
    roofline_tok_s: float  # B / (bytes_per_step / read bandwidth)
    frac_roofline: float
    extra: dict[str, Any] = field(default_factory=dict)
    # speculative decoding (None with it off): drafts accepted / proposed, tokens a request gained
    # per verify step, and the decode steps that verified drafts (the rest decoded plainly)
    spec_acceptance_rate: float | None = None
    spec_mean_emitted: float | None = None
    verify_steps: int | None = None


def weight_bytes_per_step(llm: LLM, batch: int = 1) -> int:
    """Bytes of weights a decode step of ``batch`` tokens reads (:func:`weight_bytes`) for a loaded
    artifact."""
    return weight_bytes(llm.engine.model.weights, llm.engine.artifact.manifest.routed_experts, batch)


def weight_bytes(weights: dict[str, torch.Tensor], experts: tuple[int, int] | None, batch: int = 1) -> int:
    """Bytes of ``weights`` a decode step of ``batch`` tokens reads: every tensor but the embedding
    table (only B rows), and of the routed experts (``*.moe.w13``/``w2`` and their scales;
    ``experts`` = (top_k, num_experts)) only the expected share the batch hits,
    ``1 - (1 - k/E)^B`` with uniform routing (the experts past E, shared experts fused as extra
    experts, always run)."""
    hit = 1.0 - (1.0 - experts[0] / experts[1]) ** batch if experts else 1.0
    total = 0.0
    for n, t in weights.items():
        if n == "embed.weight" and "lm_head.weight" in weights:
            continue
        if experts and ".moe.w" in n and t.dim() >= 1:
            e_local = t.shape[0]
            routed = min(e_local, experts[1])
            total += t.nbytes / e_local * (routed * hit + (e_local - routed))
        else:
            total += t.nbytes
    return int(total)


def kiln_latency(
    llm: LLM,
    batch: int,
    input_len: int,
    output_len: int,
    read_gbps: float,
    seed: int = 0,
    structured: StructuredOutputs | None = None,
    prompts: list[list[int]] | None = None,
) -> LatencyResult:
    """``structured``: every request's output under this structure (the cost of the grammar's
    masks; a structure that can end early shortens the run: use one that goes on, e.g. an array).
    ``prompts``: the batch's prompts, ``batch`` of ``input_len`` tokens (default: random tokens;
    :func:`cycle_prompts` for speculative decoding)."""
    eng = llm.engine
    eng.reset_prefix_cache()
    if prompts is None:
        prompts = random_prompts(batch, input_len, eng.vocab_size, seed)
    if len(prompts) != batch or any(len(p) != input_len for p in prompts):
        raise ValueError(f"kiln_latency: prompts must be {batch} of {input_len} tokens")
    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, structured=structured)
    masked0 = eng.stats["masked_rows"]
    spec0 = spec_sums(llm)
    for p in prompts:
        eng.add_request(p, sp)
    if eng.device.type == "cuda":
        torch.cuda.synchronize()
    hb = eng.host_breakdown
    parts = dict.fromkeys(hb, 0.0)  # seconds, decode steps only (prefill chunks are not counted)
    t0 = time.perf_counter()
    first_done = None
    step_times: list[float] = []
    host_times: list[float] = []
    finished = got_first = 0
    while finished < batch:
        before = dict(hb)
        ts = time.perf_counter()
        outs = eng.step()
        te = time.perf_counter()
        for o in outs:
            got_first += o.num_output_tokens == 1
            finished += o.finished
        if eng.last_step_mode == "decode":
            step_times.append(te - ts)
            host_times.append(eng.last_step_host_s)
            for k in parts:
                parts[k] += hb[k] - before[k]
        if first_done is None and got_first == batch:
            first_done = te
    t_end = time.perf_counter()
    assert first_done is not None, "the batch never produced its first tokens"
    breakdown = {k: 1e3 * v / max(len(step_times), 1) for k, v in parts.items()}  # ms per decode step
    decode_s = t_end - first_done
    kv_per_tok = eng.artifact.manifest.kv.bytes_per_token
    mean_ctx = input_len + output_len / 2
    nbytes = weight_bytes_per_step(llm, batch) + batch * mean_ctx * kv_per_tok
    roof = batch / (nbytes / (read_gbps * 1e9)) if read_gbps == read_gbps else float("nan")
    tok_s = batch * (output_len - 1) / decode_s
    spec = spec_figures(spec0, spec_sums(llm))
    return LatencyResult(
        batch=batch,
        input_len=input_len,
        output_len=output_len,
        ttft_s=first_done - t0,
        decode_tok_s=tok_s,
        itl_ms=1e3 * statistics.mean(step_times) if step_times else float("nan"),
        host_ms_per_step=1e3 * statistics.median(host_times) if host_times else float("nan"),
        bytes_per_step=nbytes,
        roofline_tok_s=roof,
        frac_roofline=tok_s / roof if roof == roof else float("nan"),
        # mean over decode steps (Engine.host_breakdown); rows a grammar masked over the run
        extra={"ms_per_step_by_part": breakdown, "masked_rows": eng.stats["masked_rows"] - masked0},
        spec_acceptance_rate=spec["spec_acceptance_rate"],
        spec_mean_emitted=spec["spec_mean_emitted"],
        verify_steps=spec["verify_steps"],
    )


def hf_latency(
    model_dir: str,
    batches: list[int],
    input_len: int,
    output_len: int,
    vocab: int,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> dict[int, dict[str, float]]:
    """Hugging Face transformers ``generate`` (greedy) on the same weights and prompt lengths."""
    model = _hf_model(model_dir, dtype)
    res = {}
    for b in batches:
        ids = torch.tensor(random_prompts(b, input_len, vocab, seed), device="cuda")
        kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
            torch.cuda.synchronize()
            ttft = time.perf_counter() - t
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kw)
            torch.cuda.synchronize()
            total = time.perf_counter() - t
        res[b] = {
            "ttft_s": ttft,
            "decode_tok_s": b * (output_len - 1) / max(total - ttft, 1e-9),
            "itl_ms": 1e3 * (total - ttft) / (output_len - 1),
        }
    del model
    torch.cuda.empty_cache()
    return res


def in_child(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a fresh (spawned) process, its result returned and its exception raised
    here. The Hugging Face side of ``--compare-hf`` runs so on a GPU: a process's caching allocator
    can keep a model's memory reserved after the model is gone (56.8 GiB of the full Qwen3-30B-A3B
    stayed reserved in one, so kiln's weights no longer fit the H100 beside it,
    bench/results/2026-12-06_h100_s30a_*); a process that exits gives every byte back."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _hf_model(model_dir: str, dtype: torch.dtype, device: str = "cuda") -> Any:
    from transformers import AutoModelForCausalLM

    if importlib.util.find_spec("accelerate") is None:  # device_map needs it: load, then move
        model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        return model.to(device).eval()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map=device).eval()


def throughput_workload(
    num_prompts: int,
    input_len: int | tuple[int, int],
    output_len: int | tuple[int, int],
    vocab: int,
    seed: int = 0,
) -> tuple[list[list[int]], list[int]]:
    """The offline-throughput prompts and their output lengths (the same for kiln and HF)."""
    rng = random.Random(seed + 1)
    prompts = random_prompts(num_prompts, input_len, vocab, seed)
    return prompts, [output_len if isinstance(output_len, int) else rng.randint(*output_len) for _ in prompts]


def hf_throughput(
    model_dir: str,
    prompts: list[list[int]],
    outs: list[int],
    batch_size: int,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, float]:
    """Hugging Face transformers on the same offline workload, as its users batch it: prompts
    sorted by length, ``batch_size`` at a time, left-padded, greedy ``generate`` of the batch's
    longest output. Only the tokens each prompt asked for count as output (the rest of a batch's
    steps are the price of static batching). Timed after one short warm-up generate."""
    model = _hf_model(model_dir, dtype, device)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():  # warm-up: kernels and allocator, one short batch
        model.generate(torch.tensor([prompts[order[0]]], device=device), max_new_tokens=2, **kw)
    generated = 0
    _sync(device)
    t = time.perf_counter()
    for lo in range(0, len(order), batch_size):
        idx = order[lo : lo + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for row, i in enumerate(idx):  # left padding: every row's last token at the same column
            ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]) :] = 1
        new = max(outs[i] for i in idx)
        with torch.no_grad():
            model.generate(
                ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, min_new_tokens=new, **kw
            )
        generated += len(idx) * new
    _sync(device)
    dt = time.perf_counter() - t
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    n_in, n_out = sum(map(len, prompts)), sum(outs)
    return {
        "seconds": dt,
        "num_prompts": len(prompts),
        "batch_size": batch_size,
        "input_tokens": n_in,
        "output_tokens": n_out,
        "generated_tokens": generated,
        "input_tok_s": n_in / dt,
        "output_tok_s": n_out / dt,
        "requests_s": len(prompts) / dt,
    }


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step_figures(snap: StepStatsSnapshot, seconds: float) -> dict[str, Any]:
    """The engine's step figures over a run of ``seconds`` (runtime/step_stats.py), flat:
    ``steps``, ``mean_running_batch`` (requests per step, weighted by steps), ``tokens_per_step``,
    ``host_ms_per_step``; per kind (``prefill``, ``decode``, ``mixed``) ``{kind}_steps``,
    ``{kind}_mean_batch``, ``{kind}_tokens_per_step``, ``{kind}_step_ms`` (mean wall time of a
    step), ``{kind}_host_ms_per_step`` and ``{kind}_frac_wall`` (its steps' share of ``seconds``);
    ``frac_wall_outside_steps``: the rest of ``seconds`` (submitting, the caller's loop). Means are
    None where no step of the kind ran; ``step_stats``: the raw sums."""
    total = snap.total
    out: dict[str, Any] = {
        "steps": total.steps,
        "mean_running_batch": total.mean_batch,
        "tokens_per_step": total.tokens_per_step,
        "host_ms_per_step": total.host_ms_per_step,
    }
    for k in snap.kinds:
        out |= {
            f"{k.kind}_steps": k.steps,
            f"{k.kind}_mean_batch": k.mean_batch,
            f"{k.kind}_tokens_per_step": k.tokens_per_step,
            f"{k.kind}_step_ms": k.step_ms,
            f"{k.kind}_host_ms_per_step": k.host_ms_per_step,
            f"{k.kind}_frac_wall": k.wall_s / seconds,
        }
    out["frac_wall_outside_steps"] = 1.0 - total.wall_s / seconds
    out["step_stats"] = snap.as_dict()
    return out


def kiln_throughput(llm: LLM, prompts: list[list[int]], outs: list[int]) -> dict[str, Any]:
    """Offline throughput of a :func:`throughput_workload`: every prompt submitted at once; with
    the engine's step figures over the run (:func:`step_figures`) and its speculative-decoding
    figures (:func:`spec_figures`)."""
    eng = llm.engine
    eng.reset_prefix_cache()
    eng.reset_step_stats()
    spec0 = spec_sums(llm)
    num_prompts = len(prompts)
    t = time.perf_counter()
    res = llm.generate(
        prompts, [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outs], use_tqdm=True
    )
    eng.run_until_done()  # the step overlap leaves in flight (its tokens discarded): launched in the run
    dt = time.perf_counter() - t
    n_in, n_out = sum(map(len, prompts)), sum(len(r.token_ids) for r in res)
    return {
        "seconds": dt,
        "input_tokens": n_in,
        "output_tokens": n_out,
        "input_tok_s": n_in / dt,
        "output_tok_s": n_out / dt,
        "total_tok_s": (n_in + n_out) / dt,
        "requests_s": num_prompts / dt,
        "preemptions": eng.scheduler.num_preemptions,
        **step_figures(eng.step_stats.snapshot(), dt),
        **spec_figures(spec0, spec_sums(llm)),
    }


STARTUP_CHILD = r"""
import json, sys, time
t0 = float(sys.argv[2])
from kiln import LLM, SamplingParams
t_import = time.time()
llm = LLM(sys.argv[1], log=False, verify=sys.argv[3] == "1")
t_ready = time.time()
out = llm.generate([[11, 12, 13, 14]], SamplingParams(max_tokens=1, temperature=0.0))
t_first = time.time()
print("KILN_STARTUP " + json.dumps({"import_s": t_import - t0, "ready_s": t_ready - t0,
      "first_token_s": t_first - t0, "phases": llm.engine.model.phases}))
"""


def import_breakdown(importtime: str) -> dict[str, float]:
    """The imports of a ``python -X importtime`` run (its stderr) by package, in seconds: each
    module's own time (without the modules it imported) summed under its top-level package, or
    for kiln under the second level (``kiln.ops``, ``kiln.runtime``, ...), largest first. The
    figures add up to the whole import time."""
    out: dict[str, float] = {}
    for line in importtime.splitlines():
        if not line.startswith("import time:"):
            continue
        fields = line[len("import time:") :].split("|")
        if len(fields) != 3 or not fields[0].strip().isdigit():
            continue  # the header
        parts = fields[2].strip().split(".")
        key = ".".join(parts[:2]) if parts[0] == "kiln" and len(parts) > 1 else parts[0]
        out[key] = out.get(key, 0.0) + int(fields[0]) * 1e-6
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _startup_once(artifact: str, verify: bool, imports: bool = False) -> dict[str, Any]:
    """One fresh process: start to ready and to first token, and the load's phases; ``imports``:
    the child runs under ``-X importtime`` (which adds its own cost) and the result gains
    ``imports``, :func:`import_breakdown` of its imports."""
    t0 = time.time()
    flags = ["-X", "importtime"] if imports else []
    p = subprocess.run(
        [sys.executable, *flags, "-c", STARTUP_CHILD, artifact, repr(t0), "1" if verify else "0"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    line = [x for x in p.stdout.splitlines() if x.startswith("KILN_STARTUP ")]
    if p.returncode or not line:  # the child's own error line (a refused artifact), else its tail
        errs = [x for x in p.stderr.splitlines() if x.strip()]
        last = errs[-1] if errs else f"exit status {p.returncode}"
        raise StartupError(f"the start-up child failed: {last}")
    r = {"verify": verify, **json.loads(line[0].split(" ", 1)[1])}
    if imports:
        r["imports"] = import_breakdown(p.stderr)
    return r


def startup(artifact: str, runs: int = 2, verify: bool = True, imports: bool = False) -> dict[str, Any]:
    """Fresh processes: process start to ready and to first token (the first run warms the page
    cache; the best of the later ones is reported). ``verify``: the load checks every file.
    ``imports``: each child also reports its imports by package (:func:`_startup_once`)."""
    results = [_startup_once(artifact, verify, imports) for _ in range(runs)]
    best = min(results[1:] or results, key=lambda r: r["first_token_s"])
    return {"runs": results, **best}


def startup_verify_cost(artifact: str, runs: int = 3) -> dict[str, Any]:
    """Start-up with the artifact check on and off, side by side: one warm-up process, then
    ``runs`` pairs alternating on/off (so page-cache state and machine drift hit both alike);
    the best of each and the ratio of their ready times; ``load_ratio`` compares what follows the
    imports (ready minus import: the part the check can change; the import time of a fresh process
    varies by a second or more between runs on the H200 host)."""
    _startup_once(artifact, True)
    pairs = [(_startup_once(artifact, True), _startup_once(artifact, False)) for _ in range(runs)]
    on = min((a for a, _ in pairs), key=lambda r: r["ready_s"])
    off = min((b for _, b in pairs), key=lambda r: r["ready_s"])

    def load(r: dict[str, Any]) -> float:
        return r["ready_s"] - r["import_s"]

    return {
        "runs": [r for pair in pairs for r in pair],
        "verify": on,
        "no_verify": off,
        "ready_ratio": on["ready_s"] / off["ready_s"],
        "load_ratio": min(load(a) for a, _ in pairs) / min(load(b) for _, b in pairs),
    }
