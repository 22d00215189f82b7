"""``kiln bench latency|throughput|startup ART``: figures measured side by side in one run."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from kiln import settings
from kiln.runtime.cli_generate import engine_options, options_from


def _range(s: str) -> int | tuple[int, int]:
    if ":" in s:
        lo, hi = (int(x) for x in s.split(":"))
        if not 1 <= lo <= hi:
            raise click.BadParameter(f"{s!r}: need 1 <= LO <= HI")
        return lo, hi
    return int(s)


def _num(x: float | None, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}{spec}}"


def step_table(r: dict[str, Any]) -> list[str]:
    """The step figures of a ``kiln bench throughput`` result (:func:`benchmark.step_figures`)
    as a table: one row per step kind and one for all steps."""
    lines = [
        f"{'step kind':<9} {'steps':>7} {'mean batch':>10} {'tokens/step':>11} {'step ms':>8} "
        f"{'host ms/step':>12} {'wall':>6}"
    ]
    for kind in ("prefill", "decode", "mixed", "all"):
        raw = r["step_stats"][kind]
        frac = raw["wall_s"] / r["seconds"]
        lines.append(
            f"{kind:<9} {raw['steps']:>7} {_num(raw['mean_batch'], '.2f', 10)} "
            f"{_num(raw['tokens_per_step'], '.1f', 11)} {_num(raw['step_ms'], '.3f', 8)} "
            f"{_num(raw['host_ms_per_step'], '.3f', 12)} {frac:>6.1%}"
        )
    lines.append(
        f"outside steps {r['frac_wall_outside_steps']:.1%} of the wall time; "
        f"tokens discarded by overlap {r['step_stats']['discarded_tokens']}"
    )
    return lines


def _write(report: dict[str, Any], path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=2) + "\n")
        click.echo(f"[kiln bench] wrote {path}")


@click.group("bench")
def bench_cmd() -> None:
    """Benchmarks: decode latency vs the roofline, throughput, start-up; optionally beside
    Hugging Face transformers on the same weights (--compare-hf)."""


@bench_cmd.command("latency")
@click.argument("artifact")
@click.option("--batch-sizes", default="1,8,64,256", show_default=True)
@click.option("--input-len", default=512, show_default=True)
@click.option("--output-len", default=256, show_default=True)
@click.option(
    "--compare-hf",
    "hf_dir",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="Also run Hugging Face transformers generate (bf16) on this checkpoint.",
)
@click.option(
    "--json-schema",
    "json_schema",
    default=None,
    help="Every request's output under this JSON schema (its text, or a file holding it): the cost "
    "of structured outputs. Pick one that does not end early, e.g. an array of integers.",
)
@click.option("--json", "json_path", default=None, help="Write the full report here.")
@engine_options
def latency_cmd(
    artifact: str,
    batch_sizes: str,
    input_len: int,
    output_len: int,
    hf_dir: str | None,
    json_schema: str | None,
    json_path: str | None,
    **kw: Any,
) -> None:
    """Decode tokens/s per batch size, TTFT, inter-token latency, host time per step, and bytes
    moved per step over the device read bandwidth measured in the same run."""
    from kiln.runtime.artifact import open_artifact
    from kiln.runtime.benchmark import environment, hf_latency, kiln_latency, read_bandwidth_gbps
    from kiln.runtime.llm import LLM

    batches = [int(b) for b in batch_sizes.split(",")]
    report: dict[str, Any] = {"env": environment(), "artifact": artifact}
    structured = None
    if json_schema is not None:
        from kiln.runtime.grammar import StructuredOutputs

        text = Path(json_schema).read_text() if Path(json_schema).is_file() else json_schema
        structured = StructuredOutputs(json_schema=text)
        report["json_schema"] = text
    if hf_dir:  # first, so its memory is back before kiln sizes its KV pool
        vocab = open_artifact(artifact, "cuda").manifest.vocab_size
        report["hf"] = {
            str(b): v for b, v in hf_latency(hf_dir, batches, input_len, output_len, vocab).items()
        }
    llm = LLM(artifact, log=True, **options_from(kw))
    bw = read_bandwidth_gbps(llm.engine.device)
    kiln_latency(llm, 1, min(input_len, 32), 4, bw)  # warm-up
    rows = [kiln_latency(llm, b, input_len, output_len, bw, structured=structured) for b in batches]
    report |= {
        "read_gbps": bw,
        "kiln": [asdict(r) for r in rows],
        "startup_phases": llm.engine.model.phases,
        "settings": settings.snapshot("run"),  # the run-time settings in effect (kiln/settings.py)
    }
    click.echo(f"\nread bandwidth {bw:.0f} GB/s; input {input_len}, output {output_len}")
    click.echo(
        f"{'batch':>6} {'tok/s':>10} {'roofline':>9} {'ITL ms':>8} {'host ms':>8} {'TTFT s':>7}"
        + (f" {'HF tok/s':>9} {'kiln/HF':>8}" if hf_dir else "")
    )
    for r in rows:
        line = (
            f"{r.batch:>6} {r.decode_tok_s:>10.1f} {r.frac_roofline:>9.1%} {r.itl_ms:>8.2f} "
            f"{r.host_ms_per_step:>8.3f} {r.ttft_s:>7.3f}"
        )
        if hf_dir:
            h = report["hf"][str(r.batch)]
            line += f" {h['decode_tok_s']:>9.1f} {r.decode_tok_s / h['decode_tok_s']:>8.2f}"
        click.echo(line)
    _write(report, json_path)


@bench_cmd.command("report")
@click.option("--latency", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("--throughput", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("--startup", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option(
    "--kernels",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="The kernel suite's results (bench/report.py output).",
)
@click.option("--json", "json_path", default=None, help="Write the merged report here.")
@click.option("--plot", "plot_path", default=None, help="Write a PNG: decode tok/s vs batch, roofline, HF.")
def report_cmd(
    latency: str | None,
    throughput: str | None,
    startup: str | None,
    kernels: str | None,
    json_path: str | None,
    plot_path: str | None,
) -> None:
    """Merge latency, throughput, start-up and kernel results into one report (and a plot)."""
    from kiln.runtime.bench_report import merge, plot, ratios

    report = merge({"latency": latency, "throughput": throughput, "startup": startup, "kernels": kernels})
    report["kiln_over_hf"] = ratios(report)
    for r in report["kiln_over_hf"]:
        click.echo(f"batch {r['batch']:>4}: kiln/HF decode {r['decode_tok_s']:.2f}x, TTFT {r['ttft']:.2f}x")
    _write(report, json_path)
    if plot_path:
        plot(report, plot_path)
        click.echo(f"[kiln bench] wrote {plot_path}")


@bench_cmd.command("throughput")
@click.argument("artifact", type=click.Path(exists=True, file_okay=False))
@click.option("--num-prompts", default=1000, show_default=True)
@click.option("--input-len", default="128:1024", show_default=True, help="N or LO:HI (uniform).")
@click.option("--output-len", default="128:1024", show_default=True, help="N or LO:HI (uniform).")
@click.option(
    "--compare-hf",
    "hf_dir",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="Also run Hugging Face transformers on this checkpoint: the same prompts and output lengths, "
    "sorted by length and generated --hf-batch-size at a time (static batching, left padding).",
)
@click.option("--hf-batch-size", default=64, show_default=True, help="Prompts per HF generate call.")
@click.option(
    "--hf-num-prompts",
    type=int,
    default=None,
    help="HF runs the first N of the prompts only (default: all); its rates are per second all the same.",
)
@click.option("--json", "json_path", default=None)
@engine_options
def throughput_cmd(
    artifact: str,
    num_prompts: int,
    input_len: str,
    output_len: str,
    hf_dir: str | None,
    hf_batch_size: int,
    hf_num_prompts: int | None,
    json_path: str | None,
    **kw: Any,
) -> None:
    """Offline throughput: every prompt submitted at once; input and output tokens/s (beside HF
    transformers on the same workload with --compare-hf)."""
    from kiln.runtime.artifact import open_artifact
    from kiln.runtime.benchmark import environment, hf_throughput, kiln_throughput, throughput_workload
    from kiln.runtime.llm import LLM

    if hf_batch_size < 1:
        raise click.BadParameter("must be >= 1", param_hint="--hf-batch-size")
    if hf_num_prompts is not None and not 1 <= hf_num_prompts <= num_prompts:
        raise click.BadParameter(
            f"must be in 1..--num-prompts ({num_prompts})", param_hint="--hf-num-prompts"
        )
    import torch

    device = kw.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    art = open_artifact(artifact, device)
    prompts, lens = throughput_workload(
        num_prompts, _range(input_len), _range(output_len), art.manifest.vocab_size
    )
    report: dict[str, Any] = {"env": environment(), "artifact": artifact}
    if hf_dir:  # first, so its memory is back before kiln sizes its KV pool
        n = hf_num_prompts or num_prompts
        report["hf"] = hf_throughput(hf_dir, prompts[:n], lens[:n], hf_batch_size, device, art.dtype)
    llm = LLM(artifact, log=True, **options_from(kw))
    r = kiln_throughput(llm, prompts, lens)
    report["kiln"] = r
    report["settings"] = settings.snapshot("run")  # the run-time settings in effect (kiln/settings.py)
    click.echo(
        f"{num_prompts} prompts in {r['seconds']:.1f} s: input {r['input_tok_s']:.0f} tok/s, output "
        f"{r['output_tok_s']:.0f} tok/s, {r['requests_s']:.2f} req/s, preemptions {r['preemptions']}"
    )
    for line in step_table(r):
        click.echo(line)
    if hf_dir:
        h = report["hf"]
        click.echo(
            f"HF transformers, {h['num_prompts']} prompts at batch {h['batch_size']} in {h['seconds']:.1f} s: "
            f"output {h['output_tok_s']:.0f} tok/s; kiln / HF {r['output_tok_s'] / h['output_tok_s']:.1f}x"
        )
    _write(report, json_path)


@bench_cmd.command("startup")
@click.argument("artifact", type=click.Path(exists=True, file_okay=False))
@click.option("--runs", default=2, show_default=True, help="Fresh processes; the first warms the page cache.")
@click.option(
    "--verify/--no-verify",
    default=True,
    show_default=True,
    help="Check every artifact file while loading (what `kiln serve` does by default).",
)
@click.option(
    "--compare-verify",
    is_flag=True,
    help="Measure start-up with the check on and off, alternating, and report the cost.",
)
@click.option(
    "--imports",
    default=0,
    show_default=True,
    metavar="N",
    help="Also list the N packages whose imports cost most in the child, the load's own imports "
    "included (the children run under python -X importtime, which adds its own cost).",
)
@click.option("--json", "json_path", default=None)
def startup_cmd(
    artifact: str, runs: int, verify: bool, compare_verify: bool, imports: int, json_path: str | None
) -> None:
    """Process start to ready and to first token, by phase, in fresh processes. The phases run
    one after another on the main thread after the imports; weights_load is the weight stream,
    on its own threads beside them from the graphs phase on ("weights (overlapped)": the wait
    for it once the main thread is done)."""
    from kiln.runtime.benchmark import environment, startup, startup_verify_cost

    def line(r: dict) -> str:
        return f"import {r['import_s']:.2f} s, ready {r['ready_s']:.2f} s, first token {r['first_token_s']:.2f} s"

    if compare_verify:
        c = startup_verify_cost(artifact, runs)
        click.echo(f"verify on:  {line(c['verify'])}")
        click.echo(f"verify off: {line(c['no_verify'])}")
        click.echo(
            f"ready with the check / without: {c['ready_ratio']:.3f}; "
            f"after the imports: {c['load_ratio']:.3f}"
        )
        _write({"env": environment(), "artifact": artifact, "startup_verify_cost": c}, json_path)
        return
    r = startup(artifact, runs, verify, imports > 0)
    click.echo(line(r))
    beside = {"weights_load"}  # on other threads, beside the phases
    click.echo("phases: " + ", ".join(f"{k} {v:.2f}s" for k, v in r["phases"].items() if k not in beside))
    click.echo("beside them: " + ", ".join(f"{k} {v:.2f}s" for k, v in r["phases"].items() if k in beside))
    if imports:
        top = list(r["imports"].items())[:imports]
        click.echo("imports by package (-X importtime): " + ", ".join(f"{k} {v:.2f}s" for k, v in top))
    _write({"env": environment(), "artifact": artifact, "startup": r}, json_path)


@bench_cmd.command("accuracy")
@click.argument("candidate", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--reference",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="The artifact to compare against, compiled from the same checkpoint (e.g. its bf16 build).",
)
@click.option("--num-seqs", default=16, show_default=True, help="Synthetic sequences of random tokens.")
@click.option("--seq-len", default=256, show_default=True, help="Tokens per sequence (<= max_seq_len).")
@click.option("--seed", default=0, show_default=True, help="Seed of the synthetic sequences.")
@click.option("--device", default=None, help="cuda or cpu (default: cuda when there is one).")
@click.option("--json", "json_path", default=None, help="Write the full report here.")
def accuracy_cmd(
    candidate: str,
    reference: str,
    num_seqs: int,
    seq_len: int,
    seed: int,
    device: str | None,
    json_path: str | None,
) -> None:
    """Teacher-forced accuracy of CANDIDATE against --reference (one checkpoint, two builds: FP8
    weights against bf16, say): top-1 agreement, |logprob| difference at the reference's top-1
    token and KL(reference || candidate), over every position of the same sequences."""
    import torch

    from kiln.runtime.accuracy import compare_artifacts, format_report
    from kiln.runtime.benchmark import environment

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    r = compare_artifacts(candidate, reference, num_seqs=num_seqs, seq_len=seq_len, seed=seed, device=device)
    click.echo(format_report(r))
    _write({"env": environment(), "accuracy": r.to_dict()}, json_path)
