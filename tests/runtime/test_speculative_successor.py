"""N-gram speculative decoding on a workload where it applies (issue 30; docs/speculative.md section 7
item 4), float32 on CPU: a successor checkpoint (``compiler/synth.py``, ``successor=True``: zero o and
down projections, the LM head the embedding permuted by a cycle) decodes greedily ``next(t)`` after
``t``, so a prompt holding a stretch of the cycle predicts its own continuation. With
``speculative="ngram"`` the tokens equal plain decoding's, most drafts are accepted and the run takes
fewer steps; a prompt built from a cycle over a subset of the stretch (every third token dropped)
accepts fewer. ``kiln bench latency --prompt-kind cycle`` reports the same figures in its JSON."""

from __future__ import annotations

import json
import random

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from tiny_models import SUCCESSOR_NEXT, make_successor, successor_config, walk

from kiln import LLM, SamplingParams
from kiln.cli import cli
from kiln.compiler.build import CompileOptions, compile_model
from kiln.compiler.config import ConfigError
from kiln.compiler.synth import SUCCESSOR_SCALE, make_checkpoint, successor_next, successor_tensors
from kiln.runtime.spec_policy import MIN_SAMPLES

LAYERS = 2
CONFIG = successor_config(LAYERS)
NEXT = SUCCESSOR_NEXT
NEW = 24
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The successor checkpoint (root/hf) and its artifact (root/art)."""
    root = tmp_path_factory.mktemp("successor")
    make_successor(root / "hf", LAYERS)
    opts = CompileOptions(device="cpu", dtype="float32", max_batch_size=4, max_seq_len=128, chunk_size=64)
    compile_model(root / "hf", root / "art", opts, verbose=False)
    return root


@pytest.fixture
def art(root):
    return root / "art"


def cycle_prompt(start: int, input_len: int, output_len: int, skip: int = 0) -> list[int]:
    """A stretch S of the cycle from ``start`` (every ``skip``-th token dropped), then S's first m
    tokens again: the greedy output goes on along S (written independently of the bench's
    ``cycle_prompts``, which must agree)."""
    m = max(1, (input_len - output_len) // 2)
    seq = [start, *walk(start, 2 * input_len)]
    s = [t for i, t in enumerate(seq) if not skip or (i + 1) % skip][: input_len - m]
    return s + s[:m]


def _generate(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], dict, int]:
    """Outputs, the speculative sums gained (zeros with speculation off) and the steps taken."""
    eng = llm.engine
    before = dict(eng.status())
    outs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    eng.check_integrity()
    after = eng.status()
    spec = {
        k: after[f"spec_{k}"] - before[f"spec_{k}"] for k in ("verified", "proposed", "accepted", "emitted")
    }
    return outs, spec, after["steps"] - before["steps"]


def check_successor_weights(ckpt, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The layout itself: every o and down projection zero, embedding rows of signs times
    SUCCESSOR_SCALE, LM head row next(t) the embedding row t; other weights random."""
    w: dict[str, torch.Tensor] = {}
    for f in ckpt.glob("*.safetensors"):
        w |= load_file(f)
    assert all(t.dtype == dtype for t in w.values())
    for i in range(LAYERS):
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            assert not w[f"model.layers.{i}.{name}.weight"].any()
        for name in ("self_attn.q_proj", "mlp.up_proj"):
            assert w[f"model.layers.{i}.{name}.weight"].float().std() > 0.01
    embed, head = w["model.embed_tokens.weight"], w["lm_head.weight"]
    assert torch.equal(embed.abs(), torch.full_like(embed, SUCCESSOR_SCALE))
    assert torch.equal(head[torch.tensor(NEXT)], embed)
    return w


def test_successor_tensors_in_both_engines(root, tmp_path):
    hf = check_successor_weights(root / "hf", torch.float32)
    fast = make_successor(tmp_path / "fast", LAYERS, "bfloat16", engine="fast")
    w = check_successor_weights(fast, torch.bfloat16)
    assert torch.equal(w["lm_head.weight"], hf["lm_head.weight"].to(torch.bfloat16))


def test_successor_margin_in_bf16_at_8b_width():
    """At Llama-8B's hidden size in bf16 (a vocabulary of 2048 here): RMSNorm(embed[t]) times a
    final norm weight 1 + N(0, 0.02), against every LM head row, picks next(t) by a wide margin."""
    v, h = 2048, 4096
    embed, head = successor_tensors(v, h, 0, torch.bfloat16)
    g = (1 + 0.02 * torch.randn(h, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)
    x = embed[:256].float()
    hidden = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16) * g
    logits = (hidden.float() @ head.float().T).to(torch.bfloat16).float()
    top = logits.topk(2, dim=-1)
    assert top.indices[:, 0].tolist() == successor_next(v, 0)[:256]
    assert (top.values[:, 0] - top.values[:, 1]).min() > 0.5 * SUCCESSOR_SCALE * h


def test_greedy_follows_the_cycle(art):
    rng = random.Random(0)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (1, 7, 30)]
    outs, spec, _ = _generate(LLM(str(art), device="cpu", speculative="off"), prompts)
    assert outs == [walk(p[-1], NEW) for p in prompts]
    assert spec["verified"] == 0
    assert len(set(NEXT)) == 300 and len(set(walk(0, 300))) == 300  # one cycle through every id


def test_ngram_on_cycle_prompts(art):
    """Batch 1 then batch 3: the tokens with and without speculation equal the cycle; with it, most
    drafts accepted, several tokens per verify step and fewer steps; a subset of the cycle in the
    prompt accepts fewer drafts."""
    full = cycle_prompt(17, 60, NEW)
    subset = cycle_prompt(17, 60, NEW, skip=3)
    batch = [cycle_prompt(s, 50, NEW) for s in (5, 123, 250)]
    want = [walk(p[-1], NEW) for p in (full, subset, *batch)]
    off, on = LLM(str(art), device="cpu", speculative="off"), LLM(str(art), device="cpu", speculative="ngram")
    runs = {}
    for name, prompts in (("full", [full]), ("subset", [subset]), ("batch", batch)):
        runs[name] = (_generate(off, prompts), _generate(on, prompts))
    assert [t for (o, _, _), _ in runs.values() for t in o] == want
    assert [t for _, (o, _, _) in runs.values() for t in o] == want
    (_, _, steps_off), (_, s, steps_on) = runs["full"]
    assert s["accepted"] > 0.8 * s["proposed"] and s["emitted"] > 2 * s["verified"], s
    assert steps_on < steps_off, (steps_on, steps_off)
    _, (_, sb, steps_b) = runs["batch"]
    assert sb["accepted"] > 0.8 * sb["proposed"] and sb["emitted"] > 2 * sb["verified"], sb
    assert steps_b < runs["batch"][0][2]
    _, (_, ss, _) = runs["subset"]
    assert ss["proposed"] > 0 and ss["accepted"] / ss["proposed"] < s["accepted"] / s["proposed"], (ss, s)


def _latency(art, tmp_path, *args: str) -> dict:
    out = tmp_path / "lat.json"
    r = CliRunner().invoke(
        cli,
        ["bench", "latency", str(art), "--batch-sizes", "1,2", "--input-len", "41", "--output-len", "12",
         "--device", "cpu", "--json", str(out), *args],
        catch_exceptions=False,
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    return json.loads(out.read_text()) | {"stdout": r.output}


def test_bench_latency_reports_speculation(art, tmp_path):
    from kiln.runtime.benchmark import cycle_prompts, kiln_latency

    llm = LLM(str(art), device="cpu", speculative="ngram")
    rng = random.Random(0)  # the bench's starts: one random token each from random.Random(seed)
    starts = [rng.randrange(10, 300) for _ in range(2)]
    got = {skip: cycle_prompts(llm, 2, 41, 12, skip=skip) for skip in (0, 3)}
    assert got == {skip: [cycle_prompt(s, 41, 12, skip) for s in starts] for skip in (0, 3)}
    # each run's own figures: random prompts (drafts from chance repeats, rejected), then cycles
    nan = float("nan")
    rand = kiln_latency(llm, 2, 41, 12, nan)
    cyc = kiln_latency(llm, 2, 41, 12, nan, prompts=got[0])
    assert rand.spec_acceptance_rate < 0.5 and cyc.spec_acceptance_rate > 0.8, (rand, cyc)

    rep = _latency(art, tmp_path, "--speculative", "ngram", "--prompt-kind", "cycle")
    assert rep["prompt_kind"] == "cycle" and "accepted" in rep["stdout"]
    for r in rep["kiln"]:
        assert r["spec_acceptance_rate"] > 0.8 and r["spec_mean_emitted"] > 2, r
        # most of the 11 tokens after the prefill's come from verify steps of several tokens
        assert 1 <= r["verify_steps"] <= 11 / 2, r
    gaps = _latency(art, tmp_path, "--speculative", "ngram", "--prompt-kind", "cycle", "--cycle-skip", "3")
    for r, g in zip(rep["kiln"], gaps["kiln"]):
        assert g["spec_acceptance_rate"] < r["spec_acceptance_rate"]
        assert g["spec_mean_emitted"] < r["spec_mean_emitted"]
    rep_path = tmp_path / "rep.json"
    r = CliRunner().invoke(
        cli, ["bench", "report", "--latency", str(tmp_path / "lat.json"), "--json", str(rep_path)]
    )
    assert r.exit_code == 0 and "of drafts accepted" in r.output, r.output
    keys = ("batch", "spec_acceptance_rate", "spec_mean_emitted", "verify_steps")
    assert [{k: x[k] for k in keys} for x in json.loads(rep_path.read_text())["speculative"]] == [
        {k: x[k] for k in keys} for x in gaps["kiln"]
    ]
    plain = _latency(art, tmp_path, "--speculative", "off", "--prompt-kind", "cycle")
    assert all(r["spec_acceptance_rate"] is None and r["verify_steps"] is None for r in plain["kiln"])
    assert "accepted" not in plain["stdout"]


def test_successor_refuses_other_layouts(tmp_path):
    with pytest.raises(ConfigError, match="tie_word_embeddings"):
        make_checkpoint(tmp_path / "a", CONFIG | {"tie_word_embeddings": True}, successor=True)
    with pytest.raises(ConfigError, match="Llama-family"):
        make_checkpoint(tmp_path / "b", "qwen3-30b-a3b", num_layers=1, successor=True)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def _policy_run(art, monkeypatch, slow: str) -> tuple[dict, list[int]]:
    """Four cycle prompts one after another (batch 1, 24 new tokens each) under the measured
    policy, each step's cost as the policy sees it fixed: 0.1 s for ``slow`` ("verify" or "plain")
    steps, 1 ms for the others (the stepper's own wall times, checked positive, would make the
    decisions depend on this machine's load). The bucket's policy figures and the engine's
    speculative sums; the tokens are checked against the cycle."""
    from kiln.runtime.spec_policy import SpecPolicy

    original = SpecPolicy.observe
    walls: dict[bool, list[float]] = {True: [], False: []}

    def fixed(self, n, speculated, seconds, emitted_per_request=1.0):
        walls[speculated].append(seconds)
        cost = 0.1 if speculated == (slow == "verify") else 0.001
        original(self, n, speculated, cost, emitted_per_request)

    monkeypatch.setattr(SpecPolicy, "observe", fixed)
    llm = LLM(str(art), device="cpu", speculative="ngram", speculative_policy="measured")
    for start in (40, 90, 140, 190):
        prompt = cycle_prompt(start, 100, NEW)
        out = llm.generate([prompt], GREEDY)[0]
        assert out.token_ids == walk(prompt[-1], NEW)  # lossless whatever the policy chose
    assert walls[True] and walls[False] and min(walls[True] + walls[False]) > 0  # both modes timed
    policy = llm.engine.spec_policy
    assert policy is not None
    s = llm.engine.status()
    return policy.as_dict(), [s["spec_verified"], s["spec_policy_switches"], s["spec_policy_probes"]]


def test_measured_policy_drops_speculation_that_loses(art, monkeypatch):
    """Verify steps costing enough to lose (0.1 s each against 1 ms): after its first samples
    the policy decodes plainly, verifying again only in its probes (under ``always`` every step
    with drafts verifies: ``test_ngram_on_cycle_prompts``)."""
    figures, (verified, switches, probes) = _policy_run(art, monkeypatch, "verify")
    bucket = figures["buckets"][1]
    assert not bucket["speculating"] and switches == 1, figures
    assert bucket["verify_tok_s"] < bucket["plain_tok_s"]
    assert verified <= MIN_SAMPLES * (1 + probes) and probes <= 3, (verified, probes)


def test_measured_policy_keeps_speculation_that_wins(art, monkeypatch):
    """Plain steps costing 0.1 s: the policy keeps verifying (plain steps only for its first samples
    and its probes), and its figures say why."""
    figures, (verified, switches, _) = _policy_run(art, monkeypatch, "plain")
    bucket = figures["buckets"][1]
    assert bucket["speculating"] and switches == 0, figures
    assert bucket["mean_emitted"] > 2 and bucket["verify_tok_s"] > bucket["plain_tok_s"]
    assert verified >= 10, verified


def test_bench_throughput_reports_the_policy(art, tmp_path):
    """`kiln bench throughput` with n-gram drafts under the measured policy prints each batch
    bucket's mode at the end and keeps the policy's state in its JSON (strict JSON: int bucket
    keys become strings)."""
    out = tmp_path / "tp.json"
    r = CliRunner().invoke(
        cli,
        ["bench", "throughput", str(art), "--num-prompts", "3", "--input-len", "20", "--output-len", "8",
         "--device", "cpu", "--speculative", "ngram", "--speculative-policy", "measured", "--json", str(out)],
        catch_exceptions=False,
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "speculative policy by batch bucket: " in r.output, r.output
    policy = json.loads(out.read_text())["kiln"]["spec_policy"]
    assert policy["buckets"] and all(
        set(v) >= {"speculating", "plain_tok_s"} for v in policy["buckets"].values()
    )
