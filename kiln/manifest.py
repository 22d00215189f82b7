r"""``manifest.json`` as typed, frozen dataclasses: the one home of every artifact field.

The compiler builds a :class:`Manifest` and saves it (:meth:`Manifest.save`); the runtime loads it
(:meth:`Manifest.load`) and reads typed fields. Neither imports the other: both import this
module (and :mod:`kiln.artifact_format`, the hashes and file names under it).

Layout (JSON keys are the field names; schema :data:`~kiln.artifact_format.SCHEMA_VERSION`)::

    {"schema_version": 6, "manifest_xxh3_128": hex,          written by save, checked by load
     "model": {...},                   the compiler's normalized config (reports; the runtime
                                       reads only :attr:`Manifest.routed_experts` of it)
     "dtype", "quant", "tp", "ep", "device", "gpu_arch",
     "versions": Versions, "max_seq_len", "max_batch_size", "chunk_size",
     "decode_buckets": [1, 2, 4, ...]  ascending, the last is max_batch_size
     "graphs": {name: GraphEntry}, "kv": KVSpec, "rope": RopeSpec,
     "vocab_size", "eos_token_ids", "bos_token_id", "tokenizer_files",
     "norm_folds": {norm weight: [consumer weights]},
     "kernel_choices": KernelChoices, "files": {relative path: FileEntry},
     "verify": VerifySpec,             only with --verify-lengths (speculative decoding)
     "draft": DraftSpec,               with --draft-model / --eagle3 / --mtp (its artifact under draft/,
                                       eagle3/ or mtp/)
     "aux_layers": [...],              the target of an EAGLE-3 head or MTP layer: streams its graphs hand out
     "eagle3": Eagle3Spec,             an EAGLE-3 head's own artifact (the one nested in its target's)
     "mtp": MtpSpec}                   a DeepSeek MTP layer's own artifact (likewise)

The records are :class:`kiln.json_record.JsonRecord` dataclasses: a field whose default is ``None``
is left out of the JSON when it is None (and may be absent); every other field is always written
(``null`` included). :meth:`Manifest.from_json` refuses a missing field, one of another type, a key
this kiln does not know and a value out of range (:meth:`Manifest.problems`), each in one line naming
the field (``'kv.page_size' is missing``). ``build-log.json`` (how one build went) stays apart:
:func:`kiln.artifact_format.write_build_log`.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from kiln import artifact_format as fmt
from kiln.artifact_format import REBUILD, RECOPY, ArtifactError
from kiln.json_record import JsonRecord, RecordError

DTYPES = ("float32", "bfloat16", "float16")  # activation dtypes kiln compiles
KV_FP8 = "float8_e4m3fn"  # kv.dtype of --kv-dtype fp8 (else the activation dtype)


# -------------------------------------------------------------------------------- the records
@dataclass(frozen=True)
class Versions(JsonRecord):
    """What the artifact was built with; the runtime refuses other torch, triton (on a GPU), kiln
    or kernel sources."""

    torch: str
    triton: str
    cuda: str | None  # torch.version.cuda (None: a CPU build of torch)
    python: str
    kiln: str
    kernel_sources: str  # kiln.artifact_format.kernel_source_hash()

    @classmethod
    def current(cls) -> Versions:
        """This process's versions (imports torch and triton)."""
        import platform

        import torch
        import triton

        return cls(
            torch=torch.__version__,
            triton=triton.__version__,
            cuda=torch.version.cuda,
            python=platform.python_version(),
            kiln=fmt.kiln_version(),
            kernel_sources=fmt.kernel_source_hash(),
        )


@dataclass(frozen=True)
class KVSpec(JsonRecord):
    """The KV cache the graphs were traced for, per rank (docs/internals.md, "KV pool")."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: str  # the activation dtype, or KV_FP8 (--kv-dtype fp8: float32 scales beside the rows)
    page_size: int  # slots per page (--page-size); >= 1, checked here once
    bytes_per_token: int  # K plus V over all layers for one token

    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` tokens."""
        return -(-tokens // self.page_size)


@dataclass(frozen=True)
class RopeSpec(JsonRecord):
    rotary_dim: int
    base: float
    scaling: dict[str, Any]  # ops/attention/rope.py: rope_cos_sin_cache's scaling
    is_neox: bool


@dataclass(frozen=True)
class GraphCode(JsonRecord):
    """A graph's generated Python source (``graphs/{name}.py``) and how to call it."""

    file: str
    weight_keys: tuple[str, ...]  # the flat weight arguments, in order; then the inputs
    num_inputs: int
    output: str  # "tensor"


@dataclass(frozen=True)
class GraphEntry(JsonRecord):
    file: str  # the exported program, graphs/{name}.pt2
    inputs: tuple[str, ...]  # kiln.compiler.context.GRAPH_INPUTS, after the weights dict
    batch: int | None  # None: dynamic tokens and requests (the shared graph); else a static decode batch
    max_tokens: int | None = None  # the dynamic graph: the most tokens one call takes
    layout: str | None = None  # static decode graphs: "residual_stream" (folded norms) or "add_norm"
    python: GraphCode | None = None


@dataclass(frozen=True)
class VerifySpec(JsonRecord):
    """Speculative decoding's verify steps (``kiln compile --verify-lengths``; docs/speculative.md
    section 2): a verify step of ``B`` requests with up to ``k`` drafts each runs ``B * (k + 1)``
    tokens with logits at every one, as a CUDA graph of the shared graph per ``(B, k)`` in
    ``buckets x lengths``, captured at load and warmed up at compile time. Steps outside the
    buckets run eagerly."""

    lengths: tuple[int, ...]  # the draft counts k verify graphs exist for (ascending)
    buckets: tuple[int, ...]  # the batch sizes they exist for: decode buckets (ascending)

    def problems(self, decode_buckets: tuple[int, ...]) -> Iterator[str]:
        for name, vals in (("lengths", self.lengths), ("buckets", self.buckets)):
            if not vals or vals[0] < 1 or any(x >= y for x, y in itertools.pairwise(vals)):
                yield f"'verify.{name}' must be a non-empty ascending list of positive integers, is {list(vals)}"
        if not set(self.buckets) <= set(decode_buckets):
            yield f"'verify.buckets' {list(self.buckets)} are not all decode buckets {list(decode_buckets)}"


@dataclass(frozen=True)
class DraftSpec(JsonRecord):
    """A draft model compiled into the artifact (``kiln compile --draft-model``; docs/speculative.md
    section 4): a whole artifact of its own under ``path`` (its manifest checks its files), pinned
    here by its manifest's self-hash, with the same tokenizer vocabulary and KV page size."""

    path: str  # "draft", "eagle3" or "mtp": the nested artifact's directory, relative to this one
    manifest_xxh3_128: str  # the draft manifest's fmt.MANIFEST_HASH_KEY: a swapped draft is refused
    vocab_size: int  # its LM head's rows (may pad past the target's; drafts stay below both)
    # "model" (--draft-model), "eagle3" (--eagle3) or "mtp" (--mtp); the last two read the target's
    # hidden states (runtime/spec_eagle.py)
    kind: str = "model"

    KINDS: ClassVar[tuple[str, ...]] = ("model", "eagle3", "mtp")
    HEADS: ClassVar[tuple[str, ...]] = ("eagle3", "mtp")  # kinds fed the target's aux_layers streams


@dataclass(frozen=True)
class Eagle3Spec(JsonRecord):
    """An EAGLE-3 head's artifact (``kiln compile TARGET --eagle3 HEAD``, nested under the
    target's; compiler/eagle3.py): its graphs take the hidden-state buffer ``aux_hidden [rows,
    aux_width]`` float32, read the target's three streams (``[:T, :3 target_hidden_size]``, the
    shared graph, through ``fc``) or their own last output (``[:B, :hidden_size]``, the decode
    graphs) and write their output into ``[:T, :hidden_size]``; their logits are over the target's
    ids, ``-inf`` outside the ``draft_vocab_size`` the head predicts."""

    target_hidden_size: int
    draft_vocab_size: int


@dataclass(frozen=True)
class MtpSpec(JsonRecord):
    """A DeepSeek-V3 next-token-prediction (MTP) layer's artifact (``kiln compile TARGET --mtp``,
    nested under the target's; compiler/mtp.py): its graphs follow an EAGLE-3 head's protocol
    (:class:`Eagle3Spec`) over one stream of ``hidden_size`` columns: they read the target's last
    decoder layer output (``aux_hidden[:T, :hidden_size]``, the shared graph, which applies the
    target's final norm to it) or their own last output (``[:B, :hidden_size]``, the decode graphs)
    and write their output into ``[:T, :hidden_size]``; their logits are over the whole vocabulary."""

    layer: int  # the checkpoint's layer index of the MTP module (the target's num_hidden_layers)


@dataclass(frozen=True)
class LibraryRecord(JsonRecord):
    """A CUTLASS library built into ``kernels/`` (``library``: its path, listed in ``files``), or
    why there is none (``note``)."""

    library: str | None = None
    arch: str | None = None
    abi: int | None = None
    note: str | None = None


@dataclass(frozen=True)
class MoEChoice(JsonRecord):
    """The fused-MoE launch table the graphs pass to ``kiln::fused_moe`` (compiler/moe_tune.py)."""

    backend: str  # "triton", "cutlass" or "auto"; each rung of the table names what it runs
    method: str  # "default" (the op's table) or "measured" (kiln compile --moe-tune)
    table: dict[str, Any]  # {"<max tokens>": {"w13": cfg, "w2": cfg[, "backend": b]}}
    gpu: str | None = None  # measured: the GPU it was measured on
    cutlass_min_tokens: int | None = None  # backend "cutlass": rungs from this many tokens run it
    cutlass: LibraryRecord | None = None

    @property
    def uses_cutlass(self) -> bool:
        """Whether some rung runs the CUTLASS library (which must then be loaded)."""
        return any(isinstance(e, dict) and e.get("backend") == "cutlass" for e in self.table.values())


@dataclass(frozen=True)
class KernelChoices(JsonRecord):
    attention: str  # "triton"
    decode_graphs: str  # --decode-graphs: "shared" or "per-bucket"
    decode_num_splits: dict[int, int]  # decode bucket -> split-KV factor at max_seq_len
    gemv_plan: dict[str, int]  # --gemv-plan parsed: role -> the largest T on the GEMV kernel
    moe: MoEChoice | None = None
    fp8: LibraryRecord | None = None  # --quant fp8: the CUTLASS FP8 GEMM library


@dataclass(frozen=True)
class FileEntry(JsonRecord):
    """One file of the artifact: its size and xxh3-128, or (weight data) the index that checks it."""

    size: int
    xxh3_128: str | None = None  # fmt.HASH_KEY
    checked_by: str | None = None  # fmt.CHECKED_BY_KEY: weights/pack.json's block hashes


@dataclass(frozen=True)
class Manifest(JsonRecord):
    """An artifact's manifest (module docstring). Derived values are properties, computed here."""

    model: dict[str, Any]
    dtype: str  # --dtype: one of DTYPES
    quant: str | None  # --quant, resolved: None, "fp8" or "fp8-block" (compiler/config.py resolve_quant)
    tp: int
    device: str  # "cpu" or "cuda"
    gpu_arch: str  # fmt.gpu_arch: "sm_90" style, or "cpu"
    versions: Versions
    max_seq_len: int  # --max-seq-len
    max_batch_size: int  # --max-batch-size: the largest decode bucket
    chunk_size: int  # --chunk-size: the largest extend (prefill chunk) in tokens
    decode_buckets: tuple[int, ...]  # batch sizes the decode graphs run at (ascending)
    graphs: dict[str, GraphEntry]
    kv: KVSpec
    rope: RopeSpec
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    tokenizer_files: tuple[str, ...]  # in tokenizer/
    norm_folds: dict[str, tuple[str, ...]]  # weights/fold.py: norm weight -> consumer weights
    kernel_choices: KernelChoices
    files: dict[str, FileEntry]
    ep: int = 1  # --ep: MoE experts split into ep groups of tp/ep ranks (compiler/parallel.py)
    verify: VerifySpec | None = None  # --verify-lengths: speculative decoding's verify graphs
    draft: DraftSpec | None = None  # --draft-model: a draft model's artifact inside this one
    # the layers whose input residual stream every graph writes into its last input, aux_hidden
    # [rows, len(aux_layers) * hidden] float32 (CompileOptions.aux_layers; None: no such input)
    aux_layers: tuple[int, ...] | None = None
    eagle3: Eagle3Spec | None = None  # an EAGLE-3 head's artifact (its graphs' hidden-state buffer)
    mtp: MtpSpec | None = None  # a DeepSeek MTP layer's artifact (likewise, one stream)

    SHARED_GRAPH: ClassVar[str] = "model"
    # The shared graph traced for token trees (its inputs with "tree_mask"; logits at every token):
    # speculative tree verification (runtime/spec_tree.py). Compiled beside the verify graphs; an
    # artifact without it verifies chains only.
    TREE_GRAPH: ClassVar[str] = "verify_tree"

    @property
    def max_blocks(self) -> int:
        """Block-table width: the pages of a ``max_seq_len`` sequence (compile warm-up and runtime)."""
        return self.kv.pages_for(self.max_seq_len)

    @property
    def aux_width(self) -> int:
        """Columns of the hidden-state buffer the graphs take last (0: none): a target's streams at
        ``aux_layers``, or an EAGLE-3 head's or MTP layer's input and output (:class:`Eagle3Spec`,
        :class:`MtpSpec`)."""
        hidden = int(self.model["hidden_size"])
        if self.eagle3 is not None:
            return max(3 * self.eagle3.target_hidden_size, hidden)
        if self.mtp is not None:
            return hidden
        return len(self.aux_layers or ()) * hidden

    @property
    def routed_experts(self) -> tuple[int, int] | None:
        """``(top_k, num_experts)`` of a MoE model, None for a dense one."""
        moe = self.model.get("moe")
        return (int(moe["top_k"]), int(moe["num_experts"])) if isinstance(moe, dict) else None

    # ---------------------------------------------------------------- checks beyond the types
    def problems(self) -> Iterator[str]:
        """What is wrong beyond the field types, each naming its field."""
        if self.dtype not in DTYPES:
            yield f"'dtype' is {self.dtype!r}, not one of {', '.join(DTYPES)}"
        for name in ("tp", "max_seq_len", "max_batch_size", "chunk_size", "vocab_size"):
            if getattr(self, name) < 1:
                yield f"'{name}' is {getattr(self, name)}, not a positive integer"
        if self.ep < 1 or self.tp % self.ep:
            yield f"'ep' is {self.ep}, not a positive divisor of tp ({self.tp})"
        b = self.decode_buckets
        if not b or b[0] < 1 or any(x >= y for x, y in itertools.pairwise(b)) or b[-1] != self.max_batch_size:
            yield (
                f"'decode_buckets' must be a non-empty ascending list of positive integers ending at "
                f"max_batch_size ({self.max_batch_size}), is {list(b)}"
            )
        if self.kv.dtype not in (self.dtype, KV_FP8):
            yield f"'kv.dtype' is {self.kv.dtype!r}, not the activation dtype {self.dtype!r} or {KV_FP8!r}"
        for name in ("page_size", "bytes_per_token", "num_layers"):
            if getattr(self.kv, name) < 1:
                yield f"'kv.{name}' is {getattr(self.kv, name)}, not a positive integer"
        if self.SHARED_GRAPH not in self.graphs:
            yield f"'graphs.{self.SHARED_GRAPH}' is missing"
        if self.verify is not None:
            yield from self.verify.problems(self.decode_buckets)
        tree = self.graphs.get(self.TREE_GRAPH)
        if tree is not None and "tree_mask" not in tree.inputs:
            yield f"'graphs.{self.TREE_GRAPH}.inputs' lack 'tree_mask'"
        if self.draft is not None and self.draft.kind not in DraftSpec.KINDS:
            yield f"'draft.kind' is {self.draft.kind!r}, not one of {', '.join(DraftSpec.KINDS)}"
        if self.eagle3 is not None and self.mtp is not None:
            yield "'eagle3' and 'mtp' are both set; a head artifact is one or the other"
        for rel, entry in self.files.items():
            key = fmt.CHECKED_BY_KEY if fmt.is_weight_data(rel) else fmt.HASH_KEY
            if getattr(entry, key) is None:
                yield f"'files.{rel}.{key}' is missing"

    @classmethod
    def from_json(cls, doc: Any, path: str = "") -> Manifest:
        """The manifest of ``doc`` (without ``schema_version`` and the self-hash, which :meth:`load`
        checks); raises :class:`RecordError` naming the first bad field."""
        m: Manifest = super().from_json(doc, path)
        for problem in m.problems():
            raise RecordError(problem)
        return m

    # ---------------------------------------------------------------------- the file
    def document(self) -> dict[str, Any]:
        """The JSON written to ``manifest.json``: the fields, the schema version and the self-hash."""
        doc = {"schema_version": fmt.SCHEMA_VERSION, **self.to_json()}
        doc[fmt.MANIFEST_HASH_KEY] = fmt.manifest_digest(doc)
        return doc

    def save(self, root: str | Path) -> Path:
        """Write ``root/manifest.json`` (atomically); refuses a manifest :meth:`problems` finds fault with."""
        for problem in self.problems():
            raise RecordError(f"the manifest to write is wrong: {problem}")
        path = Path(root) / fmt.MANIFEST
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.document(), indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, root: str | Path) -> Manifest:
        """Read ``root/manifest.json``: refuses, in one line naming the file or field and the fix,
        one that is missing or not JSON, of another schema version, edited after the compile (its
        self-hash) or with a field :meth:`from_json` refuses."""
        root = Path(root)
        mf = root / fmt.MANIFEST
        if not mf.is_file():
            raise ArtifactError(
                f"{root} is not a kiln artifact (no manifest.json); build one with `kiln compile`."
            )
        try:
            doc = json.loads(mf.read_bytes())
        except (ValueError, OSError) as e:  # JSONDecodeError, UnicodeDecodeError
            raise ArtifactError(f"{mf} is not valid JSON ({e}); {RECOPY}.") from None
        if not isinstance(doc, dict):
            raise ArtifactError(f"{mf} holds {type(doc).__name__}, not a manifest object; {RECOPY}.")
        version = doc.pop("schema_version", None)
        if version != fmt.SCHEMA_VERSION:
            raise ArtifactError(
                f"manifest field 'schema_version' is {version!r}; this kiln reads {fmt.SCHEMA_VERSION}: "
                f"{REBUILD}."
            )
        recorded = doc.pop(fmt.MANIFEST_HASH_KEY, None)
        try:
            actual = fmt.manifest_digest({"schema_version": version, **doc})
        except ValueError:  # NaN or infinity: never written by kiln compile
            actual = "(not canonical JSON)"
        if recorded != actual:
            raise ArtifactError(
                f"{mf} was altered after `kiln compile` (field '{fmt.MANIFEST_HASH_KEY}' is {recorded!r}, "
                f"its content hashes to {actual!r}); {RECOPY}."
            )
        try:
            return cls.from_json(doc)
        except RecordError as e:
            raise ArtifactError(f"{mf}: field {e}; {RECOPY}.") from None


def file_table(root: Path, skip: tuple[str, ...] = ()) -> dict[str, FileEntry]:
    """Size and xxh3-128 of every file under ``root`` (relative POSIX paths, sorted) but the manifest,
    the build log and those under the folders ``skip`` (a nested draft artifact, which its own
    manifest lists); the weight data files get their size and ``checked_by`` pack.json instead of a
    hash (the pack loader checks their blocks against it while it streams them)."""
    rels = sorted(
        rel
        for p in root.rglob("*")
        if p.is_file()
        and (rel := p.relative_to(root).as_posix()) not in (fmt.MANIFEST, fmt.BUILD_LOG)
        and not any(rel.startswith(f"{d}/") for d in skip)
    )
    digests = fmt.file_digests(root, [r for r in rels if not fmt.is_weight_data(r)])
    return {
        rel: FileEntry(size=(root / rel).stat().st_size, checked_by=fmt.PACK_INDEX)
        if fmt.is_weight_data(rel)
        else FileEntry(size=(root / rel).stat().st_size, xxh3_128=digests[rel])
        for rel in rels
    }
