"""`kiln bench accuracy` (runtime/accuracy.py): teacher-forced top-1 agreement, |logprob| difference
and KL of one artifact against another of the same checkpoint, on tiny random checkpoints (CPU).

Bounds for FP8 weights against bf16 (tiny llama, hidden 64, vocabulary 300, the test init of
std 0.08; measured over workload seeds 0-3, 4 x 64 tokens each): top-1 agreement 0.80-0.86, mean
|logprob diff| 0.049-0.052, mean KL 2.0e-3-2.3e-3. For scale: bf16 against float32 of the same
checkpoint agrees at 0.96-0.98 (|diff| 0.0065), two different checkpoints at 0.012 (|diff| 1.94, KL
0.44). The bounds below (agreement >= 0.75, |diff| <= 0.1, KL <= 0.01) leave room for rounding
differences between torch versions and fail for anything near unrelated weights.

An FP8 KV cache (``--kv-dtype fp8``) against bf16, same measurement: agreement 0.91-0.96, |diff|
0.014-0.018, KL 1.9e-4-3.1e-4 (bounded at 0.85, 0.04, 1e-3); FP8 weights and FP8 KV together:
0.80-0.83, 0.050-0.058, 2.2e-3-2.6e-3 (the FP8-weight bounds).
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from tiny_models import make_checkpoint

from kiln.artifact_format import ArtifactError
from kiln.compiler.build import CompileOptions, compile_model
from kiln.runtime.accuracy import (
    AccuracyError,
    compare_artifacts,
    compare_models,
    format_report,
    plan_calls,
    synthetic_sequences,
)
from kiln.runtime.direct import DirectRunner
from kiln.runtime.loader import load_model

BASE = dict(device="cpu", dtype="bfloat16", max_batch_size=2, max_seq_len=128, chunk_size=64)


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    """bf16 and FP8-weight artifacts of one tiny checkpoint, bf16 of another seed (same config)
    and of another config (a narrower MLP)."""
    root = tmp_path_factory.mktemp("accuracy")
    make_checkpoint(root / "hf", "llama-untied", seed=2)
    make_checkpoint(root / "hf-seed3", "llama-untied", seed=3)
    make_checkpoint(root / "hf-narrow", "llama-untied", seed=2, intermediate_size=96)
    builds = {
        "bf16": ("hf", {}),
        "fp8": ("hf", {"quant": "fp8"}),
        "fp8-kv": ("hf", {"kv_dtype": "fp8"}),
        "fp8-all": ("hf", {"quant": "fp8", "kv_dtype": "fp8"}),
        "other-seed": ("hf-seed3", {}),
        "other-config": ("hf-narrow", {}),
    }
    for name, (src, extra) in builds.items():
        compile_model(root / src, root / name, CompileOptions(**BASE, **extra), verbose=False)
    return {name: str(root / name) for name in builds} | {"root": root}


def test_artifact_against_a_copy_of_itself_is_exact(arts):
    copy = arts["root"] / "bf16-copy"  # another path: two loads, two KV pools
    shutil.copytree(arts["bf16"], copy)
    r = compare_artifacts(str(copy), arts["bf16"], num_seqs=3, seq_len=70, seed=1)
    assert r.positions == 3 * 70 and r.num_seqs == 3 and len(r.sequences) == 3
    assert r.top1_agreement == 1.0
    assert r.mean_abs_logprob_diff == 0.0 and r.max_abs_logprob_diff == 0.0
    assert r.mean_kl == 0.0 and r.max_kl == 0.0
    assert r.to_dict()["sequences"][0]["length"] == 70


def test_fp8_weights_against_bf16_within_bounds(arts):
    r = compare_artifacts(arts["fp8"], arts["bf16"], num_seqs=6, seq_len=80, seed=0)
    assert r.positions == 480
    assert r.candidate_build == "dtype bfloat16, weights fp8, kv bfloat16"
    assert r.reference_build == "dtype bfloat16, weights bfloat16, kv bfloat16"
    # close to bf16 (module docstring: measured 0.80-0.86, 0.05, 2e-3) ...
    assert r.top1_agreement >= 0.75, format_report(r)
    assert r.mean_abs_logprob_diff <= 0.1 and r.mean_kl <= 0.01, format_report(r)
    # ... yet measurably not bf16: the FP8 weights ran
    assert r.top1_agreement < 1.0 and r.mean_abs_logprob_diff > 0.005 and r.mean_kl > 1e-4
    assert r.max_abs_logprob_diff >= r.mean_abs_logprob_diff and r.max_kl >= r.mean_kl
    text = format_report(r)
    assert f"{r.top1_agreement:.4f}" in text and "weights fp8" in text and len(text.splitlines()) <= 12


@pytest.mark.parametrize(
    "build, weights, bounds",
    [("fp8-kv", "bfloat16", (0.85, 0.04, 1e-3)), ("fp8-all", "fp8", (0.75, 0.1, 0.01))],
)
def test_fp8_kv_cache_against_bf16_within_bounds(arts, build, weights, bounds):
    """An FP8 KV cache (``--kv-dtype fp8``: e4m3 rows, a float32 scale per head row), alone and with
    FP8 weights, against bf16 of the same checkpoint: the manifest says FP8, and the figures stay
    within the FP8 bounds (module docstring) while differing from bf16."""
    m = load_model(arts[build]).artifact.manifest
    assert m.kv.dtype == "float8_e4m3fn" and m.graphs["model"].inputs[-2:] == ("k_scale", "v_scale")
    layers, heads, d = m.kv.num_layers, m.kv.num_kv_heads, m.kv.head_dim
    assert m.kv.bytes_per_token == layers * heads * (2 * d + 2 * 4)  # fp8 K and V, two f32 scales
    r = compare_artifacts(arts[build], arts["bf16"], num_seqs=6, seq_len=80, seed=0)
    assert r.candidate_build == f"dtype bfloat16, weights {weights}, kv float8_e4m3fn"
    agree, diff, kl = bounds  # module docstring
    assert r.top1_agreement >= agree, format_report(r)
    assert r.mean_abs_logprob_diff <= diff and r.mean_kl <= kl, format_report(r)
    assert r.top1_agreement < 1.0 or r.mean_abs_logprob_diff > 1e-3  # the FP8 cache ran


def test_fp8_kv_decode_steps_read_what_prefill_wrote(arts):
    """The engine's decode steps (decode kernel, one token each) on an FP8 cache give the tokens
    that the extend path, teacher-forced over the same sequence, ranks first: K/V and their scales
    written by prefill and by each decode step are read back alike."""
    from kiln.runtime.accuracy import _TeacherForced
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    prompts = synthetic_sequences(3, 20, 300, seed=4)
    llm = LLM(arts["fp8-kv"], device="cpu")
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    tf = _TeacherForced(llm.engine.model, num_slots=256, max_rows=3)
    for p, o in zip(prompts, outs, strict=True):
        seq = p + o.token_ids
        logits = tf.logits([seq], [(0, 0, len(seq))]).float()
        ranked = logits[len(p) - 1 : len(seq) - 1].argmax(-1).tolist()
        assert ranked == o.token_ids


def test_bounds_fail_for_unrelated_weights(arts):
    """The same bounds on a pair that is not one checkpoint (compare_models skips the identity
    check): they fail by far, so the FP8 test above can fail."""
    seqs = synthetic_sequences(4, 64, 300, seed=0)
    total, _ = compare_models(load_model(arts["other-seed"]), load_model(arts["bf16"]), seqs)
    assert total.agree / total.positions < 0.2
    assert total.diff / total.positions > 1.0 and total.kl / total.positions > 0.1


@pytest.mark.parametrize(
    "other, field",
    [
        ("other-seed", "the checksum of weight embed.weight"),
        ("other-config", "'model.intermediate_size' is 96"),
    ],
)
def test_different_checkpoints_are_refused(arts, other, field):
    with pytest.raises(AccuracyError) as e:
        compare_artifacts(arts[other], arts["fp8"], num_seqs=1, seq_len=4)
    msg = str(e.value)
    assert "\n" not in msg and "not compiled from the same checkpoint" in msg and field in msg, msg


def test_not_an_artifact_and_bad_workloads_are_refused(arts, tmp_path):
    with pytest.raises(ArtifactError, match="is not a kiln artifact"):
        compare_artifacts(str(tmp_path), arts["bf16"])
    with pytest.raises(AccuracyError, match="max_seq_len is 128"):
        compare_artifacts(arts["fp8"], arts["bf16"], num_seqs=1, seq_len=129)
    with pytest.raises(AccuracyError, match="token id 300, outside the vocabulary"):
        compare_artifacts(arts["fp8"], arts["bf16"], sequences=[[5, 300]])


def _direct_logprobs(art: str, seq: list[int]) -> torch.Tensor:
    """[len, V] log-softmax at every position from DirectRunner prefills of each prefix
    (ModelRunner.extend's last-token logits). Position 0 is prefilled beside the two-token prefix:
    a lone one-token prompt would run the decode graph, whose batch-1 form folds the norms and
    rounds differently in bf16 (0.017 in one logprob here); the harness measures the extend graph."""
    runner = DirectRunner(art, device="cpu", num_slots=256)
    rows = [runner.prefill([seq[:1], seq[:2]])[0, :300]]
    rows += [runner.prefill([seq[: k + 1]])[0, :300] for k in range(1, len(seq))]
    return torch.log_softmax(torch.stack(rows).float(), dim=-1)


def test_figures_equal_a_direct_computation(arts):
    """Two sequences, run 16 tokens per call (the budget), so the 20-token one is chunked 16 + 4
    and the 9-token one shares a call: the figures equal those of prefix-by-prefix prefills (the
    same logits to the bit: only the order of the float64 sums differs)."""
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(10, 300, (n,), generator=g).tolist() for n in (20, 9)]
    r = compare_artifacts(
        arts["fp8"], arts["bf16"], sequences=seqs, logits_budget_bytes=16 * 300 * 4, verify=False
    )
    assert r.seed is None and r.positions == 29 and [s.length for s in r.sequences] == [20, 9]
    agree, diff, kl, per_seq = 0, [], [], []
    for seq in seqs:
        cand, ref = _direct_logprobs(arts["fp8"], seq), _direct_logprobs(arts["bf16"], seq)
        s_agree = 0
        s_diff = []
        for c, f in zip(cand, ref):
            t = int(f.argmax())
            s_agree += int(c.argmax()) == t
            s_diff.append(abs(float(c[t]) - float(f[t])))
            kl.append(max(0.0, float((f.exp() * (f - c)).sum())))
        agree += s_agree
        diff += s_diff
        per_seq.append((s_agree / len(seq), sum(s_diff) / len(seq)))
    assert 0 < agree < 29  # a case where agreement, like the other figures, is not trivial
    assert r.top1_agreement == agree / 29
    assert math.isclose(r.mean_abs_logprob_diff, sum(diff) / 29, rel_tol=1e-9)
    assert r.max_abs_logprob_diff == max(diff)
    assert math.isclose(r.mean_kl, sum(kl) / 29, rel_tol=1e-5)
    for s, (a, d) in zip(r.sequences, per_seq):
        assert s.top1_agreement == a and math.isclose(s.mean_abs_logprob_diff, d, rel_tol=1e-9)


def test_plan_calls_bounds_tokens_and_orders_chunks():
    calls = plan_calls([20, 9, 5, 40], tokens_per_call=16, max_rows=2)
    assert all(sum(e - s for _, s, e in c) <= 16 and len(c) <= 2 for c in calls)
    covered: dict[int, list[tuple[int, int]]] = {}
    for c in calls:
        for i, s, e in c:
            covered.setdefault(i, []).append((s, e))
    # every sequence covered once, in order, each chunk in a later call than the one before
    assert {i: [p for p in v] for i, v in covered.items()} == {
        0: [(0, 16), (16, 20)],
        1: [(0, 9)],
        2: [(0, 5)],
        3: [(0, 16), (16, 32), (32, 40)],
    }
    where = {(i, s): k for k, c in enumerate(calls) for i, s, _ in c}
    assert where[(0, 0)] < where[(0, 16)] and where[(3, 0)] < where[(3, 16)] < where[(3, 32)]
