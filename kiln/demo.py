"""``kiln demo``: the whole pipeline on a built-in model, on this machine, in about a minute.

1. write a small Llama-shaped Hugging Face checkpoint (random weights) with a real tokenizer
   trained offline (byte-level BPE with a Llama-3-style chat template);
2. ``kiln compile`` it for this machine (CPU or GPU);
3. load the artifact and stream a greedy completion (random weights: expect word salad).
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import click
import torch

DEMO_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "vocab_size": 4096,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


def _usable(art: Path, device: str) -> bool:
    """Whether ``art`` is an artifact this kiln can load here (one built by another kiln, or before
    its kernels changed, is rebuilt)."""
    if not (art / "manifest.json").exists():
        return False
    from kiln.errors import KilnError
    from kiln.runtime.artifact import open_artifact

    try:
        open_artifact(art, device)
    except KilnError as e:
        click.echo(f"[demo] rebuilding the artifact: {e}")
        return False
    return True


def build_demo(root: Path, device: str, rebuild: bool = False) -> Path:
    """The demo artifact under ``root`` (built if missing); returns its path."""
    from kiln.compiler.build import CompileOptions, compile_model
    from kiln.compiler.synth import make_checkpoint

    ckpt, art = root / "checkpoint", root / f"artifact-{device}"
    if rebuild and root.exists():
        shutil.rmtree(root)
    if not (ckpt / "config.json").exists():
        t = time.perf_counter()
        make_checkpoint(ckpt, DEMO_CONFIG, dtype="float32", seed=0, with_tokenizer=True)
        click.echo(
            f"[demo] checkpoint with a trained tokenizer written to {ckpt} in {time.perf_counter() - t:.1f} s"
        )
    if not _usable(art, device):
        dtype = "bfloat16" if device == "cuda" else "float32"
        opts = CompileOptions(
            device=device,
            dtype=dtype,
            max_batch_size=8 if device == "cpu" else 64,
            max_seq_len=1024,
            chunk_size=512,
            force=True,
        )
        compile_model(ckpt, art, opts)
    return art


@click.command("demo")
@click.option(
    "--dir",
    "root",
    type=click.Path(file_okay=False),
    default=".kiln-demo",
    show_default=True,
    help="Where the demo checkpoint and artifact are kept (reused on the next run).",
)
@click.option(
    "--device", type=click.Choice(["cuda", "cpu"]), default=None, help="[default: cuda if present, else cpu]"
)
@click.option("--prompt", default="Once upon a time", show_default=True)
@click.option("--max-tokens", default=48, show_default=True, type=click.IntRange(min=1))
@click.option("--rebuild", is_flag=True, help="Rebuild the checkpoint and artifact from scratch.")
def demo_cmd(root: str, device: str | None, prompt: str, max_tokens: int, rebuild: bool) -> None:
    """Build a small Llama-shaped model with random weights and a real tokenizer, compile it for
    this machine, load the artifact and stream a completion."""
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev == "cuda" and not torch.cuda.is_available():  # before any work
        raise click.BadParameter(
            "no CUDA device is available to this torch; use --device cpu", param_hint="--device"
        )
    if dev == "cpu":
        # The demo's matrices are tiny: OpenMP hand-offs between threads cost more than the math
        # (measured on a 2-core machine: 4 tok/s with two threads, 158 tok/s with one).
        torch.set_num_threads(1)
    t0 = time.perf_counter()
    art = build_demo(Path(root), dev, rebuild)
    t1 = time.perf_counter()
    llm = LLM(str(art), device=dev, log=True)
    t2 = time.perf_counter()
    click.echo(f"[demo] prompt: {prompt!r}\n[demo] completion: ", nl=False)
    last = None
    for out in llm.stream(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0)):
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
        last = out
    t3 = time.perf_counter()
    n = len(last.token_ids) if last else 0
    click.echo(
        f"\n[demo] build {t1 - t0:.1f} s, load {t2 - t1:.2f} s, generate {n} tokens in "
        f"{t3 - t2:.2f} s ({n / max(t3 - t2, 1e-9):.1f} tok/s); artifact: {art}"
    )
