"""``kiln generate ART PROMPT``: stream a completion to the terminal."""

from __future__ import annotations

import sys
import time

import click

from kiln import gc_paused, settings
from kiln.runtime.sampling_params import SamplingParams


def engine_options(f):  # shared by generate, serve and bench
    """The ``EngineOptions`` flags: the engine's own, then one per run-time setting of
    kiln/settings.py (built from its declarations; not given: the environment, then the default)."""
    opts = [
        click.option(
            "--device",
            type=click.Choice(["cuda", "cpu"]),
            default=None,
            help="Device to run on [default: cuda if present, else cpu].",
        ),
        click.option(
            "--kv-memory",
            type=float,
            default=None,
            metavar="GiB",
            help="KV-cache memory [default: free device memory after weights and a reserve].",
        ),
        click.option(
            "--no-cuda-graph", is_flag=True, help="Run decode steps eagerly instead of replaying CUDA graphs."
        ),
        click.option("--no-radix-cache", is_flag=True, help="Disable prefix caching."),
        click.option(
            "--overlap/--no-overlap",
            default=True,
            show_default=True,
            help="Launch each decode step before the previous one is finished on the host (hides the "
            "host work of a step behind the GPU).",
        ),
        click.option(
            "--max-running",
            type=int,
            default=None,
            help="Cap on concurrently running requests (at most the artifact's max batch size).",
        ),
        click.option(
            "--chunk-size",
            type=int,
            default=None,
            help="Most prompt tokens in one prefill step (capped at the artifact's chunk, 4096 by "
            "default). A prefill step delays every stream by its length: serving the 8B shape at "
            "16 req/s on an H100, 1024 cut the longest inter-token gap from 68 to 38 ms, for 1.6% "
            "less offline throughput (docs/performance.md).",
        ),
        click.option(
            "--verify/--no-verify",
            default=True,
            show_default=True,
            help="Check every artifact file against the hash the manifest records as it loads (the "
            "weights in the reader threads as they stream); --no-verify checks sizes only (graphs and "
            "CUTLASS libraries, being code, are checked either way).",
        ),
        click.option(
            "--revision",
            default=None,
            help="When ARTIFACT is a Hugging Face model id: its branch, tag or commit.",
        ),
        click.option(
            "--compile-args",
            default=None,
            help="When ARTIFACT is a checkpoint (a directory or a Hub id): the `kiln compile` flags of its artifact, "
            'e.g. "--max-batch-size 64". It is compiled once into the cache (--cache-dir) and loaded '
            "from there at the next start (`kiln cache ls`).",
        ),
    ]
    f = settings.click_options("run")(f)
    for o in reversed(opts):
        f = o(f)
    return f


def options_from(kw: dict) -> dict:
    """``EngineOptions`` keyword arguments from a command's (popped from ``kw``)."""
    return dict(
        **settings.pop_options(kw, "run"),
        device=kw.pop("device"),
        kv_memory_gib=kw.pop("kv_memory"),
        cuda_graph=not kw.pop("no_cuda_graph"),
        radix_cache=not kw.pop("no_radix_cache"),
        overlap=kw.pop("overlap"),
        max_running=kw.pop("max_running"),
        chunk_size=kw.pop("chunk_size"),
        verify=kw.pop("verify"),
        compile_args=kw.pop("compile_args"),
        revision=kw.pop("revision"),
    )


@click.command("generate")
@click.argument("artifact")
@click.argument("prompt")
@click.option("--max-tokens", default=128, show_default=True, help="New tokens at most.")
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--top-k", default=-1, show_default=True, help="-1 = off.")
@click.option("--seed", type=int, default=None, help="Same seed, same output.")
@click.option("--chat", is_flag=True, help="Wrap PROMPT as a user message with the chat template.")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@engine_options
def generate_cmd(
    artifact: str,
    prompt: str,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    chat: bool,
    stop: tuple[str, ...],
    **kw,
) -> None:
    """Load ARTIFACT (or a checkpoint directory: compiled once into the cache) and stream a
    completion of PROMPT to the terminal."""
    with gc_paused():  # torch, the kernels and the runtime (kiln.gc_paused)
        from kiln.runtime.engine import EngineOptions
        from kiln.runtime.llm import LLM
        from kiln.runtime.tensor_parallel import follow_launched

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=list(stop) or None,
    )
    params.validate()  # before the load: a bad flag fails in a second
    options = options_from(kw)
    if follow_launched(artifact, EngineOptions(**options)):
        return  # a launched rank other than 0 (torchrun): it followed rank 0's steps
    llm = LLM(artifact, log=True, **options)
    text: str | list[int] = prompt
    if chat:
        text = llm.tokenizer.encode(
            llm.apply_chat_template([{"role": "user", "content": prompt}]), add_special_tokens=False
        )
    t0 = time.perf_counter()
    last = None
    for out in llm.stream(text, params):
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
        last = out
    dt = time.perf_counter() - t0
    if last is not None:
        n = len(last.token_ids)
        click.echo(
            f"\n[kiln] {n} tokens in {dt:.2f} s ({n / dt:.1f} tok/s), TTFT {last.ttft * 1e3:.0f} ms, "
            f"finish: {last.finish_reason}",
            err=True,
        )
