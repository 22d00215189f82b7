"""On a GPU: a compiled bf16 artifact reproduces Hugging Face within bf16 tolerance, CUDA-graph
replay equals eager graph execution, and loading plus serving a varied workload compiles no
Triton kernel (every specialization was built into the artifact), also for an FP8 artifact whose
linears run the Triton FP8 GEMM and for a tiny Qwen3-MoE artifact."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import make_checkpoint

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_art(tmp_path_factory):
    from kiln.compiler.build import CompileOptions, compile_model

    root = tmp_path_factory.mktemp("gpu")
    hf = make_checkpoint(root / "hf", "qwen3-qknorm", seed=5, eos=None)
    opts = CompileOptions(device="cuda", dtype="bfloat16", max_batch_size=16, max_seq_len=256, chunk_size=64)
    compile_model(root / "hf", root / "art", opts, verbose=False)
    # a copy no test loads in this process: loading points Triton's cache at the artifact's
    # kernels, so the kernels earlier tests build there would hide what the compile missed
    shutil.copytree(root / "art", root / "art_fresh")
    return hf, root / "art"


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0).item()


def test_bf16_logits_close_to_hf(gpu_art):
    from kiln.runtime.direct import DirectRunner

    hf, art = gpu_art
    hf = hf.to("cuda", torch.float32)
    r = DirectRunner(str(art), device="cuda", num_slots=1024, cuda_graph=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (33, 17, 1)]
    logits = r.prefill(prompts)
    seqs = [list(p) for p in prompts]
    for _ in range(4):
        with torch.no_grad():
            for i, s in enumerate(seqs):
                ref = hf(torch.tensor([s], device="cuda")).logits[0, -1]
                assert _cos(logits[i], ref) > 0.999
        nxt = logits.argmax(-1).tolist()
        for s, t in zip(seqs, nxt):
            s.append(t)
        logits = r.decode(nxt)


def test_cuda_graph_replay_equals_eager(gpu_art):
    from kiln.runtime.direct import DirectRunner

    _, art = gpu_art
    a = DirectRunner(str(art), device="cuda", num_slots=1024, cuda_graph=True)
    b = DirectRunner(str(art), device="cuda", num_slots=1024, cuda_graph=False)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12] * 40]
    torch.testing.assert_close(a.prefill(prompts), b.prefill(prompts), rtol=0, atol=0)
    for t in range(5):
        toks = [20 + t, 30 + t, 40 + t]
        torch.testing.assert_close(a.decode(toks), b.decode(toks), rtol=0, atol=0)


def test_prefill_graphs_match_eager(gpu_art):
    """Prefill and mixed steps on captured padded-shape graphs (runtime/prefill_graphs.py) give the
    eager extend graph's first tokens (bf16: padded GEMMs may round differently, so the greedy
    token's logprob within 0.05), replay what they captured, and leave the engine consistent."""
    from kiln import LLM, SamplingParams

    _, art = gpu_art
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (7, 90, 33, 150, 2, 64, 41)]
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    runs = {}
    for graphs in (False, True):
        for mixed in (False, True):
            llm = LLM(str(art), device="cuda", prefill_graphs=graphs, mixed_steps=mixed, max_running=4,
                      radix_cache=False, kv_memory_gib=1)  # fmt: skip
            outs = [llm.generate(prompts, params) for _ in range(2)]
            pg = llm.engine.runner.prefill
            assert (pg is not None) == graphs
            if graphs:
                assert pg.steps["graph"] > 0 and pg.graphs and all(x is not None for x in pg.graphs.values())
                assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]  # replayed
            # a lone 250-token prompt: four chunks back to back, nothing decoding, none sampling
            # but the last (the host runs ahead of the device: the graphs' pinned inputs must wait)
            long = llm.generate([list(range(3, 253))], params)
            llm.engine.check_integrity()
            runs[graphs, mixed] = outs[1] + long
            del llm, pg
            gc.collect()  # the engine and its graphs go before the next one (and later tests) start
            torch.cuda.empty_cache()
    for mixed in (False, True):
        for want, got in zip(runs[False, mixed], runs[True, mixed]):
            w, x = want.logprobs[0], got.logprobs[0]
            assert x["top"][0][0] == w["top"][0][0]  # the greedy token
            assert x["top"][0][1] == pytest.approx(w["top"][0][1], abs=0.05)


CHILD = r"""
import sys, random
from kiln import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cuda", overlap=True)
rng = random.Random(0)
for batch in (1, 3, 16, 5):
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(1, 90))] for _ in range(batch)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=rng.randint(2, 20), temperature=0.7, top_p=0.9, seed=1))
    assert all(o.token_ids for o in outs)
    outs = llm.generate(prompts, SamplingParams(max_tokens=rng.randint(2, 20), temperature=0.0))  # greedy
    assert all(o.token_ids for o in outs)
print("CHILD-OK")
"""


def test_loading_compiles_no_triton_kernel(gpu_art):
    _, art = gpu_art
    _assert_loading_compiles_nothing(art.parent / "art_fresh")


def test_fp8_triton_loading_compiles_no_triton_kernel(tmp_path, monkeypatch):
    # FP8 linears on the Triton FP8 GEMM (forced, so that the tiny shapes use it: the auto backend
    # sends them to cuBLAS): the warm-up's one prefill per M bucket must have built every config
    from kiln.compiler.build import CompileOptions, compile_model

    monkeypatch.setenv("KILN_FP8_GEMM", "triton")
    make_checkpoint(tmp_path / "hf", "qwen3-qknorm", seed=6, eos=None)
    opts = CompileOptions(
        device="cuda", dtype="bfloat16", quant="fp8", max_batch_size=16, max_seq_len=256, chunk_size=64,
        fp8_cutlass=False,
    )  # fmt: skip
    compile_model(tmp_path / "hf", tmp_path / "art", opts, verbose=False)
    _assert_loading_compiles_nothing(tmp_path / "art", {"KILN_FP8_GEMM": "triton"})


def test_moe_loading_compiles_no_triton_kernel(tmp_path):
    # a tiny Qwen3-MoE (16 experts, top-4, one dense layer): the warm-up must have built every
    # grouped-GEMM rung, the decode GEMVs, routing and the top-k for the same workload
    from tiny_moe_models import make_moe_checkpoint

    from kiln.compiler.build import CompileOptions, compile_model

    make_moe_checkpoint(tmp_path / "hf", "qwen3-moe", seed=7, eos=None)
    opts = CompileOptions(device="cuda", dtype="bfloat16", max_batch_size=16, max_seq_len=256, chunk_size=64)
    compile_model(tmp_path / "hf", tmp_path / "art", opts, verbose=False)
    _assert_loading_compiles_nothing(tmp_path / "art")


def _assert_loading_compiles_nothing(art: Path, env: dict[str, str] | None = None) -> None:
    """A fresh process loads ``art`` and serves a workload: no Triton kernel is compiled (the
    runtime would put one in the user cache, kiln/kernel_cache.py, under a private HOME here)
    and nothing in the artifact changes."""
    kernels = art / "kernels"
    home = art.parent / f"home-{art.name}"
    user_cache = home / ".cache" / "kiln" / "triton"
    before = sorted(p.relative_to(kernels) for p in kernels.rglob("*"))
    p = subprocess.run(
        [sys.executable, "-c", CHILD, str(art)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {}), "HOME": str(home)},
    )
    assert p.returncode == 0 and "CHILD-OK" in p.stdout, p.stderr[-3000:]
    assert sorted(p.relative_to(kernels) for p in kernels.rglob("*")) == before, (
        "the runtime wrote into kernels/"
    )
    new = sorted(q for q in user_cache.rglob("*") if q.is_file())  # what the load compiled

    # the new kernels' signatures (argument types and specialization attributes, from their TTIR)
    # beside those of the same kernel the warm-up built say what the warm-up missed
    def signature(ttir: Path) -> str:
        return next((ln.strip()[:4000] for ln in ttir.read_text().splitlines() if "tt.func" in ln), "?")

    names = {q.stem for q in new if q.suffix == ".ttir"}
    seen = [signature(q) for q in new if q.suffix == ".ttir"]
    old = [signature(kernels / q) for q in before if q.suffix == ".ttir" and q.stem in names][:3]
    assert not new, (
        f"Triton kernels compiled at load: {[str(q.relative_to(user_cache)) for q in new[:6]]}\nnew:\n"
        + "\n".join(seen)
        + "\nbuilt:\n"
        + "\n".join(old)
    )


def test_overlapped_decoding_matches_sequential(gpu_art):
    from kiln import LLM, SamplingParams

    _, art = gpu_art
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (7, 30, 64, 2, 19)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (5, 40, 17, 40, 1)]
    runs = []
    for overlap in (False, True):
        # An explicit pool: the default sizes itself from free memory, which other tests' engines
        # (kept alive until collected) still hold.
        llm = LLM(str(art), device="cuda", overlap=overlap, kv_memory_gib=0.5)
        runs.append([o.token_ids for o in llm.generate(prompts, params)])
        assert (llm.engine.stepper.overlapped > 0) == overlap
        llm.engine.check_integrity()
    assert runs[0] == runs[1]


def test_graph_greedy_matches_the_sampler(gpu_art, monkeypatch):
    """``KILN_GRAPH_GREEDY=1`` (runtime/model_runner.py): the argmax captured in each decode graph,
    its ids left in the input row for the next replay, gives the tokens the sampler gives."""
    from kiln import LLM, SamplingParams

    _, art = gpu_art
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (9, 33, 2, 50)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (40, 12, 40, 25)]
    runs = []
    for flag in ("0", "1"):
        monkeypatch.setenv("KILN_GRAPH_GREEDY", flag)
        llm = LLM(str(art), device="cuda", overlap=True, kv_memory_gib=0.5)
        runs.append([o.token_ids for o in llm.generate(prompts, params)])
        assert (llm.engine.runner.ids_in_place > 0) == (flag == "1")
        llm.engine.check_integrity()
    assert runs[0] == runs[1]


def test_weight_thread_loads_no_kernel_launcher(gpu_art, monkeypatch):
    """The checksum kernel's first launch (which loads its Triton launcher) runs on the main thread
    before the weight reader starts: a first launch on the reader, beside the graph captures on the
    main thread, once got another kernel's launcher (kiln/weights/checksum.py, load_kernel). And
    the engine counts its CUDA-graph capture runs and those pending (/metrics)."""
    import threading

    from kiln import LLM
    from kiln.weights import checksum

    _, art = gpu_art
    checksum._wsum64_kernel.device_caches.clear()  # as in a fresh process: nothing loaded yet
    threads: list[str] = []
    launch = checksum.launch

    def record(*args):
        threads.append(threading.current_thread().name)
        launch(*args)

    monkeypatch.setattr(checksum, "launch", record)
    eng = LLM(str(art), device="cuda", kv_memory_gib=0.5).engine
    assert threads and threads[0] == threading.main_thread().name, threads
    assert "kiln-load-weights" in threads  # the pack's check itself still runs on the reader
    # the capture runs /metrics counts: start-up's, then one per graph captured while idle
    start = eng.status()["graph_captures"]
    assert start >= 1 and eng.captures_pending() > 0  # prompt shapes to capture ahead
    made = eng.finish_captures()
    s = eng.status()
    assert s["graph_captures"] == start + made and s["graph_captures_pending"] == 0 and made > 0
    assert s["graph_capture_seconds"] > 0
