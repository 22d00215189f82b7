"""Teacher-forced accuracy of one artifact against another compiled from the same checkpoint.

``kiln bench accuracy CANDIDATE --reference REF`` (e.g. ``--quant fp8`` weights, or later an FP8
KV cache, against the bf16 artifact of the same checkpoint)::

    report = compare_artifacts("art-fp8", "art-bf16", num_seqs=64, seq_len=512, seed=0, device="cuda")
    print(format_report(report))

Protocol. Both artifacts run the same token sequences (a synthetic workload drawn from ``seed``,
or the caller's) through their shared extend graph, teacher-forced: every position's logits come
from one forward over the sequence (its ``logits_indices`` select every token, not only the last),
so both models always condition on the same tokens. At every position both logit rows become a
float32 log-softmax over the vocabulary, and the report gives, over all positions:

* ``top1_agreement``: the fraction of positions where the two argmaxes are the same token;
* ``mean_abs_logprob_diff`` / ``max_abs_logprob_diff``: ``|cand_lp[t] - ref_lp[t]|`` at the
  reference's top-1 token ``t``;
* ``mean_kl``: ``KL(reference || candidate) = sum_v p_ref(v) (ref_lp(v) - cand_lp(v))`` in nats
  (each position's value clamped at 0 against float rounding);

and the same per sequence. Memory stays bounded: the sequences run a bounded number of tokens per
call (``logits_budget_bytes`` over the ``[T, V]`` float32 logits; longer sequences in chunks, their
KV kept between chunks), both models compute the same call's rows, the figures are reduced on the
device to three numbers per position and summed on the host; no ``[N, V]`` tensor of the workload
is kept. Both models are loaded at once (their weights and a KV pool for one call each).

What it measures is the extend (prefill) graph, whose attention reads every key and value back
from the paged KV cache (so a lower-precision cache shows here too). Decode steps run the decode
graphs, which round differently at the last bits (batch 1's folds the norms): on a tiny bf16 model
one position's logprob moves by 0.017 between the two paths of the same artifact.

Refusals (:class:`AccuracyError`, one line): two artifacts that were not compiled from the same
checkpoint (the manifests' model config, vocabulary, special tokens and tokenizer files; the weight
packs' source fingerprint; and every tensor both packs store with the same name, shape and dtype
must have the same checksum), sequences longer than an artifact's ``max_seq_len`` or with tokens
outside the vocabulary. A path that is not an artifact is refused by :meth:`Manifest.load`.
The runtime never imports the compiler: this module reads artifacts only.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.errors import KilnError
from kiln.manifest import Manifest
from kiln.runtime.kv_pool import BlockTable, KVPool
from kiln.runtime.loader import LoadedModel, load_model, use_artifact_kernels
from kiln.runtime.model_runner import aux_buffer, run_extend_graph
from kiln.weights.index import PackIndex

# Bytes of one call's [T, V] float32 logits per model (T = budget // (4 V), at most the chunk size);
# the figures' working set on the device peaks at about 7 such tensors.
DEFAULT_LOGITS_BUDGET = 256 << 20


class AccuracyError(KilnError, ValueError):
    """Two artifacts that cannot be compared, or a workload they cannot run (one line, with the fix)."""


# ------------------------------------------------------------------------------ the report
@dataclass(frozen=True)
class SequenceAccuracy:
    """The figures of one sequence (its positions only)."""

    length: int
    top1_agreement: float
    mean_abs_logprob_diff: float
    max_abs_logprob_diff: float
    mean_kl: float


@dataclass(frozen=True)
class AccuracyReport:
    """Candidate against reference over ``positions`` teacher-forced positions (module docstring)."""

    candidate: str
    reference: str
    candidate_build: str  # "dtype bfloat16, weights fp8, kv bfloat16"
    reference_build: str
    device: str
    seed: int | None  # None: the caller's sequences
    num_seqs: int
    positions: int
    top1_agreement: float
    mean_abs_logprob_diff: float
    max_abs_logprob_diff: float
    mean_kl: float
    max_kl: float
    seconds: float
    sequences: tuple[SequenceAccuracy, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def format_report(r: AccuracyReport, worst: int = 3) -> str:
    """A one-screen table: the two builds, the totals, the spread over sequences and the
    ``worst`` sequences by agreement."""
    lines = [
        f"candidate  {r.candidate}  ({r.candidate_build})",
        f"reference  {r.reference}  ({r.reference_build})",
        f"{r.num_seqs} sequences, {r.positions} teacher-forced positions on {r.device}"
        + (f", seed {r.seed}" if r.seed is not None else "")
        + f", {r.seconds:.1f} s",
        "",
        f"{'':<12} {'top-1 agree':>11} {'mean |dlogp|':>12} {'max |dlogp|':>11} {'mean KL':>10}",
        f"{'all':<12} {r.top1_agreement:>11.4f} {r.mean_abs_logprob_diff:>12.5f} "
        f"{r.max_abs_logprob_diff:>11.5f} {r.mean_kl:>10.3e}",
    ]
    seqs = sorted(range(len(r.sequences)), key=lambda i: (r.sequences[i].top1_agreement, -i))
    for i in seqs[:worst] if len(seqs) > 1 else []:
        s = r.sequences[i]
        lines.append(
            f"{f'seq {i} ({s.length})':<12} {s.top1_agreement:>11.4f} {s.mean_abs_logprob_diff:>12.5f} "
            f"{s.max_abs_logprob_diff:>11.5f} {s.mean_kl:>10.3e}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------ same checkpoint or not
def _flat(doc: Any, prefix: str) -> dict[str, Any]:
    if isinstance(doc, dict):
        out: dict[str, Any] = {}
        for k in sorted(doc):
            out |= _flat(doc[k], f"{prefix}.{k}")
        return out
    return {prefix: doc}


def _differ(what: str, a: Any, b: Any, cand: Path, ref: Path) -> AccuracyError:
    return AccuracyError(
        f"{cand} and {ref} were not compiled from the same checkpoint: {what} is {a!r} in the candidate "
        f"but {b!r} in the reference; compile both from one checkpoint (`kiln compile MODEL_DIR -o ART`, "
        "adding --quant fp8 for one of them)."
    )


def check_same_checkpoint(candidate: str | Path, reference: str | Path) -> tuple[Manifest, Manifest]:
    """The two manifests, after checking both artifacts were compiled from one checkpoint (module
    docstring); raises :class:`AccuracyError` naming the first field that differs."""
    cand, ref = Path(candidate), Path(reference)
    mc, mr = Manifest.load(cand), Manifest.load(ref)
    fc, fr = _flat(mc.model, "manifest field 'model"), _flat(mr.model, "manifest field 'model")
    for key in sorted(fc.keys() | fr.keys()):
        if fc.get(key) != fr.get(key):
            raise _differ(key + "'", fc.get(key), fr.get(key), cand, ref)
    for name in ("vocab_size", "eos_token_ids", "bos_token_id"):
        if getattr(mc, name) != getattr(mr, name):
            raise _differ(f"manifest field '{name}'", getattr(mc, name), getattr(mr, name), cand, ref)
    tok_c = {k: v.xxh3_128 for k, v in mc.files.items() if k.startswith("tokenizer/")}
    tok_r = {k: v.xxh3_128 for k, v in mr.files.items() if k.startswith("tokenizer/")}
    for rel in sorted(tok_c.keys() | tok_r.keys()):
        if tok_c.get(rel) != tok_r.get(rel):
            raise _differ(f"the hash of {rel}", tok_c.get(rel), tok_r.get(rel), cand, ref)
    pc, pr = PackIndex.load(cand / "weights"), PackIndex.load(ref / "weights")
    fp_c, fp_r = pc.source.get("fingerprint"), pr.source.get("fingerprint")
    if fp_c != fp_r:
        raise _differ("the weight pack's source fingerprint (weights/pack.json)", fp_c, fp_r, cand, ref)
    # Same config and shard headers, yet other weights (another seed, a fine-tune): every tensor
    # stored alike in both packs (same name, shape and dtype: not quantized, or quantized in both)
    # has the same bytes, so the same checksum.
    tc, tr = pc.rank(0).tensors, pr.rank(0).tensors
    for name in sorted(tc.keys() & tr.keys()):
        a, b = tc[name], tr[name]
        if a.shape == b.shape and a.dtype == b.dtype and a.wsum64 != b.wsum64:
            raise _differ(f"the checksum of weight {name} (weights/pack.json)", a.wsum64, b.wsum64, cand, ref)
    return mc, mr


def build_summary(m: Manifest) -> str:
    """What distinguishes two builds of one checkpoint: ``dtype bfloat16, weights fp8, kv bfloat16``."""
    return f"dtype {m.dtype}, weights {m.quant or m.dtype}, kv {m.kv.dtype}"


# ------------------------------------------------------------------------------ the workload
def synthetic_sequences(num_seqs: int, seq_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``num_seqs`` sequences of ``seq_len`` tokens drawn uniformly from ``[10, vocab_size)``
    (the first ids are special tokens in most vocabularies), deterministic in ``seed``."""
    rng = random.Random(seed)
    low = 10 if vocab_size > 20 else 0
    return [[rng.randrange(low, vocab_size) for _ in range(seq_len)] for _ in range(num_seqs)]


Segment = tuple[int, int, int]  # (sequence index, start, end): positions start..end-1 of one sequence


def plan_calls(lengths: Sequence[int], tokens_per_call: int, max_rows: int) -> list[list[Segment]]:
    """Group the sequences into calls of at most ``tokens_per_call`` tokens and ``max_rows``
    sequences; a longer sequence runs in chunks, each in a later call than the one before it."""
    calls: list[list[Segment]] = []
    cur: list[Segment] = []
    used = 0
    for i, n in enumerate(lengths):
        start = 0
        while start < n:
            take = min(n - start, tokens_per_call)
            if cur and (used + take > tokens_per_call or len(cur) == max_rows):
                calls.append(cur)
                cur, used = [], 0
            cur.append((i, start, start + take))
            used += take
            start += take
            if start < n:  # the next chunk needs this one's KV: it goes in a later call
                calls.append(cur)
                cur, used = [], 0
    if cur:
        calls.append(cur)
    return calls


# ------------------------------------------------------------------------------ running
class _TeacherForced:
    """One loaded artifact with a KV pool for one call: logits at every position of the segments."""

    def __init__(self, model: LoadedModel, num_slots: int, max_rows: int):
        self.model = model
        m = model.artifact.manifest
        page = m.kv.page_size
        self.vocab_size = m.vocab_size
        self.pool = KVPool.for_spec(m.kv, -(-num_slots // page) * page + page, model.device)
        self.bt = BlockTable(max_rows, m.max_blocks, model.device, page)
        self.rows: dict[int, int] = {}  # sequence index -> block-table row

    def logits(self, seqs: Sequence[Sequence[int]], segments: list[Segment]) -> torch.Tensor:
        """``[T, V]`` logits (the graph's dtype, vocabulary padding dropped) at every position of
        ``segments`` in order; frees a sequence's KV after its last segment."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        indptr = [0]
        for i, start, end in segments:
            if i not in self.rows:
                row = self.bt.alloc_row()
                assert row is not None, "plan_calls keeps the rows within max_rows"
                self.rows[i] = row
            row = self.rows[i]
            covered = self.bt.cover(row, end, self.pool)
            assert covered, "the pool holds one call and the longest sequence"
            ids += seqs[i][start:end]
            pos += range(start, end)
            slots += self.bt.slots(row, start, end)
            rows.append(row)
            indptr.append(indptr[-1] + end - start)
        lens = [end for _, _, end in segments]
        use_artifact_kernels(self.model.artifact)  # the process-wide Triton cache: this artifact's kernels
        m = self.model
        logits = run_extend_graph(
            m,
            self.pool,
            self.bt,
            ids,
            pos,
            slots,
            rows,
            lens,
            indptr,
            every_token=True,
            aux=aux_buffer(m, len(ids)),
        )
        for i, _, end in segments:
            if end == len(seqs[i]):
                self.pool.free_pages(self.bt.release(self.rows.pop(i)))
        return logits[:, : self.vocab_size]


def position_figures(cand_logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """``[3, T]`` float32 per position: top-1 agreement (0/1), |logprob difference| at the
    reference's top-1 token, KL(reference || candidate) (clamped at 0), from ``[T, V]`` logits."""
    ref = torch.log_softmax(ref_logits.float(), dim=-1)
    cand = torch.log_softmax(cand_logits.float(), dim=-1)
    top = ref.argmax(dim=-1, keepdim=True)
    agree = (cand.argmax(dim=-1, keepdim=True) == top).float()
    diff = (cand.gather(1, top) - ref.gather(1, top)).abs()
    p = ref.exp()
    kl = torch.where(p > 0, p * (ref - cand), torch.zeros_like(p)).sum(dim=-1, keepdim=True)
    return torch.cat([agree, diff, kl.clamp_min(0.0)], dim=1).T


@dataclass
class FigureSums:
    """Running sums of :func:`position_figures` over some positions (float64, on the host)."""

    positions: int = 0
    agree: float = 0.0
    diff: float = 0.0
    diff_max: float = 0.0
    kl: float = 0.0
    kl_max: float = 0.0

    def add(self, fig: torch.Tensor) -> None:
        """Add the ``[3, n]`` figures of ``n`` positions (on the host, float64)."""
        if fig.shape[1] == 0:
            return
        self.positions += fig.shape[1]
        self.agree += float(fig[0].sum())
        self.diff += float(fig[1].sum())
        self.diff_max = max(self.diff_max, float(fig[1].max()))
        self.kl += float(fig[2].sum())
        self.kl_max = max(self.kl_max, float(fig[2].max()))

    def mean(self, total: float) -> float:
        return total / self.positions if self.positions else math.nan


def check_workload(seqs: Sequence[Sequence[int]], manifests: Sequence[Manifest]) -> None:
    """Raise :class:`AccuracyError` unless every sequence is non-empty, fits every artifact's
    ``max_seq_len`` and holds ids inside the vocabulary."""
    if not seqs:
        raise AccuracyError("no sequences to compare: pass --num-seqs >= 1.")
    for i, s in enumerate(seqs):
        if not s:
            raise AccuracyError(f"sequence {i} is empty: every sequence needs at least one token.")
        for m in manifests:
            if len(s) > m.max_seq_len:
                raise AccuracyError(
                    f"sequence {i} has {len(s)} tokens but an artifact's max_seq_len is {m.max_seq_len}: "
                    "pass a smaller --seq-len (or compile with a larger --max-seq-len)."
                )
        bad = next((t for t in s if not 0 <= t < manifests[0].vocab_size), None)
        if bad is not None:
            raise AccuracyError(
                f"sequence {i} holds token id {bad}, outside the vocabulary [0, {manifests[0].vocab_size})."
            )


def compare_models(
    candidate: LoadedModel,
    reference: LoadedModel,
    seqs: Sequence[Sequence[int]],
    *,
    logits_budget_bytes: int = DEFAULT_LOGITS_BUDGET,
    max_rows: int = 64,
) -> tuple[FigureSums, list[FigureSums]]:
    """Run both loaded models teacher-forced over ``seqs``; the summed figures over all positions
    and per sequence. No same-checkpoint check here (:func:`compare_artifacts` makes it)."""
    mc, mr = candidate.artifact.manifest, reference.artifact.manifest
    check_workload(seqs, [mc, mr])
    vocab = mr.vocab_size
    max_tokens = min(mc.chunk_size, mr.chunk_size)  # the shared graph takes up to max(chunk, batch)
    per_call = max(1, min(max_tokens, logits_budget_bytes // (4 * vocab)))
    rows = max(1, min(max_rows, len(seqs), per_call))
    calls = plan_calls([len(s) for s in seqs], per_call, rows)
    longest = max(len(s) for s in seqs)
    sides = [
        _TeacherForced(model, per_call + longest + rows * model.artifact.manifest.kv.page_size, rows)
        for model in (candidate, reference)
    ]
    total = FigureSums()
    per_seq = [FigureSums() for _ in seqs]
    with torch.inference_mode():
        for segments in calls:
            cand_logits = sides[0].logits(seqs, segments)
            ref_logits = sides[1].logits(seqs, segments)
            fig = position_figures(cand_logits, ref_logits).double().cpu()
            del cand_logits, ref_logits
            total.add(fig)
            at = 0
            for i, start, end in segments:
                per_seq[i].add(fig[:, at : at + end - start])
                at += end - start
    return total, per_seq


def _sequence(s: FigureSums) -> SequenceAccuracy:
    return SequenceAccuracy(
        length=s.positions,
        top1_agreement=s.mean(s.agree),
        mean_abs_logprob_diff=s.mean(s.diff),
        max_abs_logprob_diff=s.diff_max,
        mean_kl=s.mean(s.kl),
    )


def compare_artifacts(
    candidate: str | Path,
    reference: str | Path,
    *,
    num_seqs: int = 16,
    seq_len: int = 256,
    seed: int = 0,
    device: str = "cpu",
    sequences: Sequence[Sequence[int]] | None = None,
    verify: bool = True,
    logits_budget_bytes: int = DEFAULT_LOGITS_BUDGET,
) -> AccuracyReport:
    """Candidate against reference, teacher-forced (module docstring): over ``sequences`` when
    given, else over :func:`synthetic_sequences` (``num_seqs`` of ``seq_len`` tokens from ``seed``).
    Checks the two were compiled from one checkpoint before loading either. ``verify``: hash
    the artifacts' files as they load (``load_model``)."""
    t0 = time.perf_counter()
    mc, mr = check_same_checkpoint(candidate, reference)
    if sequences is None:
        if num_seqs < 1 or seq_len < 1:
            raise AccuracyError(f"--num-seqs ({num_seqs}) and --seq-len ({seq_len}) must be >= 1.")
        seqs: Sequence[Sequence[int]] = synthetic_sequences(num_seqs, seq_len, mr.vocab_size, seed)
    else:
        seqs = sequences
    check_workload(seqs, [mc, mr])  # before the loads
    cand = load_model(str(candidate), device, verify=verify)
    ref = cand if Path(reference).resolve() == Path(candidate).resolve() else None
    ref = ref or load_model(str(reference), device, verify=verify)
    total, per_seq = compare_models(cand, ref, seqs, logits_budget_bytes=logits_budget_bytes)
    return AccuracyReport(
        candidate=str(candidate),
        reference=str(reference),
        candidate_build=build_summary(mc),
        reference_build=build_summary(mr),
        device=str(cand.device),
        seed=seed if sequences is None else None,
        num_seqs=len(seqs),
        positions=total.positions,
        top1_agreement=total.mean(total.agree),
        mean_abs_logprob_diff=total.mean(total.diff),
        max_abs_logprob_diff=total.diff_max,
        mean_kl=total.mean(total.kl),
        max_kl=total.kl_max,
        seconds=time.perf_counter() - t0,
        sequences=tuple(_sequence(s) for s in per_seq),
    )
