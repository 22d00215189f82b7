"""Engine: the decode loop. One ``step()`` = schedule -> model step -> sample -> stop checks.

The engine is synchronous and single-threaded; the offline API (``kiln.LLM``) calls ``step()``
until its requests finish, and the server drives it from a worker thread.
"""

from __future__ import annotations

import atexit
import itertools
import time
import warnings
from dataclasses import dataclass, fields, replace
from numbers import Integral
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from kiln import gc_paused, settings
from kiln.artifact_format import ArtifactError
from kiln.errors import KilnError
from kiln.manifest import DraftSpec, Manifest, VerifySpec
from kiln.runtime.detokenizer import prepare as prepare_detokenizer
from kiln.runtime.grammar import GrammarCompiler, GrammarError, Matcher, StructuredOutputs
from kiln.runtime.kv_pool import BlockTable, KVPool, size_for_memory
from kiln.runtime.loader import LoadedModel, load_model
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.radix_cache import RadixCache
from kiln.runtime.request import Req, RequestOutput, Status
from kiln.runtime.sampler import Sampler, resolve_seed
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import Scheduler, SchedulerConfig
from kiln.runtime.spec_draft import DraftModel, load_draft
from kiln.runtime.spec_eagle import Eagle3Drafter
from kiln.runtime.spec_policy import SpecPolicy
from kiln.runtime.speculative import AcceptanceStats, NgramConfig, NgramDrafter
from kiln.runtime.staging import HostStager
from kiln.runtime.step_stats import KINDS
from kiln.runtime.stepper import PLACEHOLDER, Launched, SpecParts, StepParts, Stepper
from kiln.runtime.tokenizer import RequestText, load_tokenizer
from kiln.weights.index import PackError

if TYPE_CHECKING:
    from kiln.runtime.tensor_parallel import RankGroup

GIB = 1024**3


class FieldError(KilnError, ValueError):
    """A value kiln refuses; ``param`` names the offending field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class RequestError(FieldError):
    """A request the engine cannot accept."""


class OptionError(FieldError):
    """An :class:`EngineOptions` value no engine can run with."""


# (field, its flag, what leaving it out does): each must be above 0 (the counts >= 1, the GiB > 0)
_POSITIVE_OPTIONS: tuple[tuple[str, str, str], ...] = (
    ("max_running", "--max-running", "leave it out for the artifact's max batch size"),
    ("chunk_size", "--chunk-size", "leave it out for the artifact's prefill chunk"),
    ("kv_memory_gib", "--kv-memory", "leave it out to size the KV pool from free memory"),
)


@dataclass(frozen=True)
class EngineOptions:
    """How an engine runs an artifact. The fields after ``log`` are the run-time settings of
    kiln/settings.py (one per setting, same name; flags of serve / generate / bench): None takes the
    environment variable, then the default. The engine applies them process-wide when it starts
    (the ops read them through ``kiln.settings``)."""

    device: str | None = None  # default: the artifact's device kind
    kv_memory_gib: float | None = None  # default: free device memory after weights and a reserve
    cuda_graph: bool = True
    radix_cache: bool = True
    # Launch the next decode step before finishing the current one (runtime/stepper.py): the host
    # work of a step hides behind the GPU. 13-27% more decode tok/s on the H200 (bench/results,
    # latency_run5 vs latency_run5_overlap); same tokens as sequential (tests/runtime).
    overlap: bool = True
    max_running: int | None = None  # default (and at most): the artifact's max_batch_size
    chunk_size: int | None = None  # default: the artifact's chunk size
    activation_reserve_gib: float = 4.0
    gpu_memory_fraction: float = 0.90
    # Check every artifact file against the manifest while it loads (weights: a fast hash in the
    # reader threads; issue 25). False (``--no-verify``): sizes only.
    verify: bool = True
    # Where Triton kernels the artifact lacks are compiled (never into the artifact;
    # kiln/kernel_cache.py); default ~/.cache/kiln/triton.
    kernel_cache_dir: str | None = None
    # A checkpoint instead of an artifact: the `kiln compile` flags its cached artifact is built
    # with (kiln/compile_cache.py; e.g. "--max-batch-size 64 --page-size 16").
    compile_args: str | None = None
    revision: str | None = None  # a Hugging Face Hub id's branch, tag or commit (kiln/hub.py)
    log: bool = True
    # ---- run-time settings (kiln/settings.py; None: KILN_* in the environment, else the default)
    gemv: bool | None = None  # kiln::linear on the GEMV where the graph's plan says (off: cuBLAS)
    pdl: bool | None = None  # programmatic dependent launch (sm_90+)
    prewait: str | None = None  # pre-wait loads: comma list of parts, "all" or "none"
    graph_greedy: bool | None = None  # the greedy argmax captured in each decode graph
    startup_graphs: str | None = None  # decode graphs captured at start: "all" or "smallest"
    graph_format: str | None = None  # "python" or "pt2"
    fp8_gemm: str | None = None  # "auto", "cutlass", "triton" or "cublas"
    fp8_fast_accum: str | None = None  # "auto", "0" or "1"
    moe_cutlass: bool | None = None  # MoE rungs recorded for CUTLASS run it (off: their Triton configs)
    prefill_graphs: bool | None = None  # extend steps replay CUDA graphs (runtime/prefill_graphs.py)
    mixed_steps: bool | None = None  # decode tokens and a prefill chunk in one step (runtime/scheduler.py)
    gc_freeze: bool | None = None  # kiln serve freezes the start-up heap (runtime/gc_pauses.py)
    tp_timeout: int | None = None  # seconds a tensor-parallel collective waits for the other ranks
    tp_all_reduce: str | None = None  # "auto" (symmetric memory where it is faster) or "nccl"
    cache_dir: str | None = None  # where artifacts compiled from a checkpoint are kept
    speculative: str | None = None  # "off" or "ngram" (docs/speculative.md)
    speculative_policy: str | None = None  # "measured" or "always" (runtime/spec_policy.py)
    num_draft_tokens: int | None = None  # drafts per request and verify step
    ngram_max: int | None = None  # longest suffix the n-gram drafter looks up
    ngram_min: int | None = None  # shortest suffix the n-gram drafter looks up
    draft_branches: int | None = None  # candidates per draft position: token trees (1: chains)

    def __post_init__(self) -> None:
        """Refuse a value no engine can run with, naming the field and its flag, before anything
        loads (a negative chunk size once started a server that failed its first request)."""
        for name, flag, what in _POSITIVE_OPTIONS:
            v = getattr(self, name)
            if v is not None and v <= 0:
                bound = "> 0" if name == "kv_memory_gib" else ">= 1"
                raise OptionError(name, f"{name} ({flag}) must be {bound}, got {v}: {what}")
        if self.activation_reserve_gib < 0 or not 0 < self.gpu_memory_fraction <= 1:
            raise OptionError(
                "gpu_memory_fraction",
                "activation_reserve_gib must be >= 0 and gpu_memory_fraction in (0, 1], got "
                f"{self.activation_reserve_gib} and {self.gpu_memory_fraction}",
            )

    def setting_values(self) -> dict[str, Any]:
        """``{run-time setting name: this option's value or None}`` (for :func:`kiln.settings.apply`)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in settings.SETTINGS}


def _token_ids(prompt: Any) -> list[int]:
    """A prompt given as token ids (a list or tuple of integers, or a 1-D array) as a list
    of ints; anything else (floats, bools, None) is a :class:`RequestError`."""
    ids = prompt.tolist() if hasattr(prompt, "tolist") else prompt
    if isinstance(ids, list | tuple) and all(
        isinstance(t, Integral) and not isinstance(t, bool) for t in ids
    ):
        return [int(t) for t in ids]
    raise RequestError(
        "prompt",
        f"a prompt is a string or a list of token ids (ints), got {type(prompt).__name__} {prompt!r:.60}",
    )


def _kv_bytes(opts: EngineOptions, device: torch.device, kv_bytes_per_token: int, max_tokens: int) -> int:
    if opts.kv_memory_gib is not None:
        return int(opts.kv_memory_gib * GIB)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        usable = free - (1 - opts.gpu_memory_fraction) * total - opts.activation_reserve_gib * GIB
        return max(int(usable), 0)
    # CPU: enough for the largest batch at full length, within 2 GiB.
    return min(2 * GIB, kv_bytes_per_token * max_tokens)


def _spec_mode(setting: str, m: Manifest) -> str:
    """The ``speculative`` setting resolved for an artifact: ``auto`` is ``draft`` when it has a
    draft (a draft model, an EAGLE-3 head or a DeepSeek MTP layer), else ``off``; ``draft`` without
    one is refused."""
    if setting == "auto":
        return "draft" if m.draft is not None else "off"
    if setting == "draft" and m.draft is None:
        raise KilnError(
            "--speculative draft: this artifact has no draft model; compile it with --draft-model, "
            "--eagle3 or --mtp (DeepSeek-V3), or use --speculative ngram"
        )
    return setting


class Engine:
    def __init__(self, artifact: str, options: EngineOptions | None = None):
        t0 = time.perf_counter()
        opts = options or EngineOptions()
        artifact, dev = self._resolve(artifact, opts)
        # Loading allocates many objects that live as long as the engine: no cyclic collection
        # walks them (and the whole heap of torch) meanwhile (kiln.gc_paused). Not around a
        # compile (_resolve): tracing makes garbage cycles.
        with gc_paused():
            try:
                self._start(artifact, opts, dev, t0)
            except (PackError, ArtifactError) as e:  # altered or damaged files: the way to rebuild
                if self.cache_key is not None:
                    e.args = (
                        f"{e} (a compile-cache entry: `kiln cache rm {self.cache_key}` and the next start builds it again)",
                    )
                raise

    def _resolve(self, artifact: str, opts: EngineOptions) -> tuple[str, str]:
        """Apply the run-time settings; the artifact to load (a checkpoint's from the compile
        cache, compiled there the first time) and the device kind."""
        self.opts = opts
        # the run-time settings, process-wide, before anything reads them (load, capture, ops);
        # a bad value in the environment fails here in one line
        self.settings = settings.apply("run", opts.setting_values())
        for line in settings.environment_warnings("run"):
            warnings.warn(f"kiln: {line}", stacklevel=3)
        dev = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if dev.startswith("cuda") and not torch.cuda.is_available():
            raise OptionError(
                "device", f"device ({dev}): no CUDA device is available to this torch; use --device cpu"
            )
        # A checkpoint (a directory or a Hub id): its artifact from the compile cache, built there
        # the first time.
        self.source = str(artifact)  # as given (the server's default model name)
        self.cache_key: str | None = None  # the compile-cache entry loaded, if one
        if not (Path(artifact) / "manifest.json").is_file():
            import shlex

            from kiln.compile_cache import resolve_artifact

            cache = self.settings["cache_dir"]
            try:
                args = shlex.split(opts.compile_args or "")
            except ValueError as e:  # an unbalanced quote
                raise OptionError("compile_args", f"--compile-args {opts.compile_args!r}: {e}") from None
            artifact = str(resolve_artifact(artifact, args, dev, cache, opts.revision))
            self.cache_key = Path(artifact).parent.name  # CACHE/<key>/artifact
        return artifact, dev

    def _start(self, artifact: str, opts: EngineOptions, dev: str, t0: float) -> None:
        # A tensor-parallel artifact: ranks 1..N-1 start as follower processes before the load
        # (runtime/tensor_parallel.py).
        self.ranks: RankGroup | None = None
        head = Manifest.load(Path(artifact))
        tp = head.tp
        self.spec_mode = _spec_mode(self.settings["speculative"], head)
        if tp > 1:
            from kiln.runtime import tensor_parallel as tpl

            launch = tpl.launched_rank()
            if launch is None:  # spawn the followers on this machine
                timeout = self.settings["tp_timeout"]
                self.ranks = tpl.start_ranks(
                    str(artifact), tp, dev, timeout, opts.verify, opts.setting_values()
                )
            elif launch[0] == 0:  # torchrun started every rank: join them
                self.ranks = tpl.join_launched(str(artifact), tp, dev, self.settings["tp_timeout"])
                dev = tpl.rank_device(dev, launch[2])
            else:
                raise tpl.TensorParallelError(
                    f"rank {launch[0]} of a launched world runs no engine: it follows rank 0 "
                    "(kiln serve / kiln generate do; from Python call "
                    "kiln.runtime.tensor_parallel.follow_launched(ARTIFACT, DEVICE))"
                )
            atexit.register(self.close)
        tokenizer: list[Any] = [None]

        def load_text(art: Any) -> None:  # runs while the weights stream in
            has_tok = {"tokenizer.json", "tokenizer.model", "vocab.json"} & set(art.manifest.tokenizer_files)
            if has_tok:
                tokenizer[0] = load_tokenizer(art.tokenizer_dir)
                prepare_detokenizer(tokenizer[0])  # shared tables built here, not on first use

        # One rank and no draft model: the KV pool and the CUDA graphs are built while the weights
        # stream in (a capture records addresses, not values; load_model's weights_placed). A draft
        # model loads after the target, and tensor-parallel followers build theirs in step with
        # rank 0, so those build once the load is done.
        early = tp == 1 and self.spec_mode != "draft"
        self.model = load_model(
            artifact,
            dev,
            verify=opts.verify,
            log=opts.log,
            while_weights_load=load_text,
            kernel_cache_dir=opts.kernel_cache_dir,
            graph_format=self.settings["graph_format"],
            weights_placed=(lambda model: self._build_runner(model, opts, None)) if early else None,
        )
        self.tokenizer = tokenizer[0]
        self.artifact, self.device = self.model.artifact, self.model.device
        draft = None
        if self.spec_mode == "draft":  # its own pool of as many slots, one block table for both
            t = time.perf_counter()
            draft = load_draft(
                self.model, self.device, opts.verify, self.settings["graph_format"], opts.kernel_cache_dir
            )
            self.model.phases["draft"] = time.perf_counter() - t
        if not early:
            self._build_runner(self.model, opts, draft)
        m = self.artifact.manifest
        page_size = m.kv.page_size
        self.radix = RadixCache(page_size, disabled=not opts.radix_cache)
        chunk = m.chunk_size if opts.chunk_size is None else min(opts.chunk_size, m.chunk_size)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_running=self.max_running,
                chunk_size=chunk,
                max_seq_len=self.max_seq_len,
                mixed_steps=self.settings["mixed_steps"],
            ),
            self.pool,
            self.bt,
            self.radix,
        )
        self.vocab_size = m.vocab_size
        self.sampler = Sampler(self.vocab_size, self.bt.num_rows, self.device)
        self.eos_ids = frozenset(m.eos_token_ids)
        self._grammar: GrammarCompiler | None = None  # built on the first structured request
        self.requests: dict[str, Req] = {}
        self._ids = itertools.count()
        # masked_rows: rows of sampled logits a grammar masked (structured outputs)
        self.stats = {
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "generated_tokens": 0,
            "steps": 0,
            "masked_rows": 0,
        }
        # Speculative decoding (docs/speculative.md): n-gram drafts verified in decode steps.
        self.spec_stats = AcceptanceStats()
        self.spec_policy: SpecPolicy | None = None  # when steps speculate (the measured policy)
        self.drafter: NgramDrafter | DraftModel | None = None
        if draft is not None:
            pool = KVPool.for_spec(draft.artifact.manifest.kv, self.pool.num_slots, self.device)
            common = (draft, pool, self.bt, self.settings["num_draft_tokens"], m.vocab_size, opts.cuda_graph)
            eos = tuple(sorted(m.eos_token_ids))
            # an EAGLE-3 head or MTP layer: the target's streams at aux_layers (one drafter for both)
            if m.draft is not None and m.draft.kind in DraftSpec.HEADS:
                branches = self.settings["draft_branches"] if self.trees else 1
                self.drafter = Eagle3Drafter(*common, self.runner.aux_args[0], self.stager, eos, branches)
            else:
                self.drafter = DraftModel(*common, eos)
        elif self.spec_mode == "ngram":
            ngram = NgramConfig(
                num_draft_tokens=self.settings["num_draft_tokens"],
                ngram_max=self.settings["ngram_max"],
                ngram_min=self.settings["ngram_min"],
                branches=self.settings["draft_branches"],
            )
            if not self.trees:
                ngram = replace(ngram, branches=1)
            self.drafter = NgramDrafter(ngram)
        spec = None
        if self.drafter is not None:
            # the measured policy decides for n-gram drafts; a draft model, EAGLE-3 head or MTP layer
            # must see every token, so it verifies every step it can (runtime/spec_policy.py)
            measured = self.settings["speculative_policy"] == "measured" and isinstance(
                self.drafter, NgramDrafter
            )
            policy = self.spec_policy = SpecPolicy(self.runner.bucket_for) if measured else None
            spec = SpecParts(
                self.drafter,
                self.spec_stats,
                m.verify.buckets[-1] if m.verify else None,
                trees=self.trees,
                policy=policy,
            )
        parts = StepParts(
            self.scheduler,
            self.runner,
            self.sampler,
            self.stager,
            self.device,
            self.eos_ids,
            self.stats,
            self._outputs,
            spec=spec,
        )
        self.stepper = Stepper(parts, overlap=opts.overlap)
        self.host_breakdown = self.stepper.host_breakdown  # seconds per part of a step (Stepper)
        self.step_stats = self.stepper.step_stats  # per-kind step figures (runtime/step_stats.py)
        self.startup_seconds = time.perf_counter() - t0
        if opts.log:
            print(
                f"[kiln] KV pool: {self.pool.capacity_tokens:,} tokens "
                f"({self.pool.nbytes / GIB:.2f} GiB, page size {page_size}); "
                f"ready in {self.startup_seconds:.2f} s "
                f"({', '.join(f'{k} {v:.2f}s' for k, v in self.model.phases.items())})",
                flush=True,
            )
            if self.drafter is not None:
                graphs = f"verify graphs k in {list(m.verify.lengths)}" if m.verify else "eager verify steps"
                print(
                    f"[kiln] speculative decoding: {self.spec_mode}, up to "
                    f"{self.settings['num_draft_tokens']} drafts per request ({graphs})",
                    flush=True,
                )

    def _build_runner(self, model: LoadedModel, opts: EngineOptions, draft: LoadedModel | None) -> None:
        """The KV pool, block table, host stager and model runner of ``model`` (its CUDA graphs
        captured); beside the weight stream when called from ``load_model``'s ``weights_placed``."""
        self.model = model
        art = model.artifact
        self.artifact = art
        self.device = self.model.device
        m = art.manifest  # typed fields, read here once
        kv, page_size = m.kv, m.kv.page_size
        self.max_seq_len = m.max_seq_len
        # Requests running at once: the option, at most the largest decode bucket (max_batch_size).
        self.max_running = (
            m.max_batch_size if opts.max_running is None else min(opts.max_running, m.max_batch_size)
        )
        t = time.perf_counter()
        per_token = kv.bytes_per_token + (draft.artifact.manifest.kv.bytes_per_token if draft else 0)
        want = _kv_bytes(opts, self.device, per_token, self.max_running * self.max_seq_len + page_size)
        slots = size_for_memory(want, per_token, page_size)
        self.pool = KVPool.for_spec(kv, slots, self.device)
        self.bt = BlockTable(self.max_running, m.max_blocks, self.device, page_size)
        # Per-step copies: persistent pinned rings with overlap (no host syncs), fresh pinned
        # tensors otherwise (the path measured on the H200 without overlap).
        self.stager = HostStager(self.device, ring=opts.overlap)
        self.bt.stager = self.stager
        self.model.phases["kv_pool"] = time.perf_counter() - t
        t = time.perf_counter()
        spec_on = self.spec_mode != "off"
        drafts = self.settings["num_draft_tokens"] if spec_on else 0  # the verify graphs to capture
        # draft trees (draft_branches > 1; n-gram or an EAGLE-3 head / MTP layer, an artifact with the
        # tree graph): their verify steps get the tree graph's (B, k) graphs too
        trees = self.trees = self.settings["draft_branches"] > 1 and self._trees_possible(draft)
        if self.ranks is not None:  # the followers build the same pool, table and runner now
            self.ranks.setup(
                self.pool.num_slots,
                self.max_running,
                opts.cuda_graph,
                self.settings["graph_greedy"],
                drafts,
                trees,
            )
        if spec_on:
            self._check_verify(m.verify)
        self.runner = ModelRunner(
            self.model,
            self.pool,
            self.bt,
            cuda_graph=opts.cuda_graph,
            graph_greedy=self.settings["graph_greedy"],
            num_draft_tokens=drafts,
            tree_graphs=trees,
            # the rest between steps (Stepper): not with tensor-parallel followers (each capture is
            # collective) or speculation (a capture's warm-ups overwrite the aux streams a head reads)
            startup_graphs=self.settings["startup_graphs"] if self.ranks is None and not spec_on else "all",
            # not with tensor parallelism: a capture failing on one rank would split the collectives
            prefill_graphs=self.settings["prefill_graphs"] and self.ranks is None,
        )
        if self.ranks is not None:
            from kiln.runtime.tensor_parallel import BroadcastRunner

            self.runner = cast(ModelRunner, BroadcastRunner(self.runner, self.ranks))
        self.model.phases["cuda_graphs"] = time.perf_counter() - t

    # ------------------------------------------------------------------ requests
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("prompt", "this artifact has no tokenizer; pass token ids")
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    @property
    def max_request_tokens(self) -> int:
        """Prompt plus generated tokens one request may reach: the context (``max_seq_len``) or,
        when smaller, the KV pool (a request must fit the pool alone, or retraction could not
        make room for it)."""
        return min(self.max_seq_len, self.pool.capacity_tokens)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        rid: str | None = None,
        seed_index: int = 0,
    ) -> Req:
        params = params or SamplingParams()
        params.validate()
        ids = self.encode(prompt) if isinstance(prompt, str) else _token_ids(prompt)
        if not ids:
            raise RequestError("prompt", "the prompt is empty")
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise RequestError("prompt", f"token ids must be in [0, {vocab})")
        if len(ids) >= self.max_seq_len:
            raise RequestError(
                "prompt",
                f"the prompt has {len(ids)} tokens but the context is {self.max_seq_len} "
                f"(the artifact's max_seq_len); shorten the prompt",
            )
        if len(ids) + 1 > self.pool.capacity_tokens:
            raise RequestError(
                "prompt",
                f"the prompt needs {len(ids) + 1} KV slots but the pool holds "
                f"{self.pool.capacity_tokens}; raise --kv-memory",
            )
        rid = rid or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise RequestError("rid", f"request id {rid!r} is already in use")
        req = Req(rid=rid, prompt_ids=ids, params=params, seed=resolve_seed(params, seed_index))
        if not self.scheduler.fits_alone(req):  # it would fill the pool and wait forever
            cap = self.pool.capacity_tokens
            raise RequestError(
                "max_tokens",
                f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) needs "
                f"{self.scheduler.max_len(req)} KV slots but the KV pool holds {cap} tokens; "
                f"lower max_tokens to at most {cap - len(ids)} or raise --kv-memory",
            )
        if self.tokenizer is not None:
            req.detok = RequestText(self.tokenizer, ids, params)
        if params.structured is not None:
            req.grammar = self._grammar_matcher(params.structured)
        self.requests[rid] = req
        self.scheduler.add(req)
        self.stats["prompt_tokens"] += len(ids)
        return req

    def _check_verify(self, verify: VerifySpec | None) -> None:
        """Speculative decoding on this artifact: refuses more drafts than its verify graphs take;
        without verify graphs (``kiln compile --verify-lengths``) warns on a GPU that every verify
        step runs eagerly."""
        k = self.settings["num_draft_tokens"]
        if verify is None:
            if self.device.type == "cuda":
                warnings.warn(
                    "kiln: speculative decoding on an artifact without verify graphs: each verify step "
                    "runs the extend graph eagerly; compile with --verify-lengths (e.g. 4,8) for CUDA graphs",
                    stacklevel=3,
                )
            return
        if k > verify.lengths[-1]:
            # compile's bound on a verify length (compiler/build.py VERIFY_MAX_LENGTH, 32)
            fix = (
                f"or compile with --verify-lengths including {k}" if k <= 32 else "(compile takes at most 32)"
            )
            raise KilnError(
                f"--num-draft-tokens is {k} but this artifact's verify graphs take at most "
                f"{verify.lengths[-1]} drafts (manifest verify.lengths {list(verify.lengths)}); lower "
                f"--num-draft-tokens {fix}"
            )

    def _trees_possible(self, head: LoadedModel | None) -> bool:
        """Whether draft trees (``draft_branches`` > 1) can run: n-gram drafts or a draft head
        (EAGLE-3, MTP; ``head``: the loaded draft), the target and the head with the
        token-tree graph (``Manifest.TREE_GRAPH``, compiled with the verify graphs); else a warning
        says why the drafts go as chains."""
        why = None
        draft = self.model.artifact.manifest.draft
        if self.spec_mode == "draft" and draft is not None and draft.kind not in DraftSpec.HEADS:
            why = "a draft model drafts chains (trees come from n-gram drafts, EAGLE-3 heads and MTP layers)"
        elif self.spec_mode == "draft" and head is not None and Manifest.TREE_GRAPH not in head.graphs:
            kind = {"eagle3": "EAGLE-3", "mtp": "MTP"}.get(draft.kind if draft else "", "draft")
            why = (
                f"this artifact's {kind} head has no {Manifest.TREE_GRAPH} graph (compiled before it had one)"
            )
        elif Manifest.TREE_GRAPH not in self.model.graphs:
            why = (
                f"this artifact has no {Manifest.TREE_GRAPH} graph (compile it with --verify-lengths, "
                "e.g. 4,8; sliding-window models have none)"
            )
        if why is not None and self.spec_mode != "off":
            warnings.warn(f"kiln: --draft-branches {self.settings['draft_branches']}: {why}; the "
                          "drafts go as chains", stacklevel=4)  # fmt: skip
        return why is None and self.spec_mode != "off"

    def _grammar_matcher(self, spec: StructuredOutputs) -> Matcher:
        """A matcher for a structured-output request (runtime/grammar.py); the compiler is built
        on the first such request."""
        if self.tokenizer is None:
            raise RequestError("structured", "structured outputs need the artifact's tokenizer")
        if self._grammar is None:
            self._grammar = GrammarCompiler(
                self.tokenizer.backend_tokenizer, self.vocab_size, sorted(self.eos_ids)
            )
        try:
            return self._grammar.matcher(spec)
        except GrammarError as e:
            raise RequestError("structured", str(e)) from None

    def abort(self, rid: str) -> None:
        req = self.requests.pop(rid, None)
        if self.drafter is not None:
            self.drafter.forget(rid)
        if req is not None and not req.finished:
            self.scheduler.abort(req)
            req.finish_reason = "abort"
            while req.output_ids and req.output_ids[-1] == PLACEHOLDER:
                req.output_ids.pop()

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.stepper.inflight is not None

    def idle(self) -> bool:
        """Work for an engine with no requests: capture one pending decode graph (``startup_graphs``
        smallest), else one prefill graph captured ahead (runtime/prefill_graphs.py; the runner
        has none with tensor parallelism); True if one was captured (call again), False when there
        is nothing to do."""
        if self.has_work():
            return False
        if self.runner.pending_graphs:
            self.runner.capture_pending()
            return True
        prefill = self.runner.prefill
        return prefill is not None and prefill.capture_next()

    def captures_pending(self) -> int:
        """The CUDA graphs :meth:`idle` may still capture: pending decode buckets and prefill shapes
        to capture ahead (:meth:`PrefillGraphs.ahead_left`); 0 once it has nothing left to do.
        Until then a first step of a new shape may capture."""
        prefill = self.runner.prefill
        return len(self.runner.pending_graphs) + (prefill.ahead_left() if prefill is not None else 0)

    def finish_captures(self) -> int:
        """Capture every pending decode graph and the prefill graphs captured ahead now, while no
        request runs; the benchmarks call it so that no timed step pays a capture. How many."""
        n = 0
        while self.idle():
            n += 1
        return n

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Run one step (see ``runtime/stepper.py``); returns the requests' new outputs."""
        return self.stepper.step()

    @property
    def last_step_mode(self) -> str:
        """``decode`` or ``extend``: the mode of the step launched last."""
        return self.stepper.last_step_mode

    @property
    def last_step_host_s(self) -> float:
        """Host seconds of the last ``step()`` call: launching plus finishing, not the device wait."""
        return self.stepper.last_step_host_s

    def _outputs(self, launched: Launched) -> list[RequestOutput]:
        """The stepper's ``outputs`` callback: apply a finished step's tokens (on the host now) to
        its requests (stop conditions, text) and build their outputs."""
        h = launched.host
        if "num_emitted" in h:
            return self._verify_outputs(launched)
        next_ids = h["ids"].tolist()
        lp = h["logprobs"].tolist() if "logprobs" in h else None
        top_ids = h["top_ids"].tolist() if "top_ids" in h else None
        top_lp = h["top_logprobs"].tolist() if "top_logprobs" in h else None
        now = time.perf_counter()
        outputs: list[RequestOutput] = []
        append = outputs.append
        generated = 0
        finished = Status.FINISHED
        check_stop = self._check_stop
        for j, (req, tok, k) in enumerate(zip(launched.reqs, next_ids, launched.index)):
            if req.status is finished:  # finished or aborted while this step was in flight: discard
                continue
            req.output_ids[k] = tok
            generated += 1
            first = req.first_token_time
            if first is None:
                first = req.first_token_time = now
            p = req.params
            new_lp: list[dict[str, Any]] = []
            if lp is not None and p.logprobs is not None:
                n = p.logprobs
                entry = {
                    "token_id": tok,
                    "logprob": lp[j],
                    "top": list(zip(top_ids[j][:n], top_lp[j][:n])) if top_ids and top_lp else [],
                }
                req.logprobs.append(entry)
                new_lp.append(entry)
            new_text = check_stop(req, p, tok, k + 1)
            reason = req.finish_reason
            done = reason is not None
            if done:
                del req.output_ids[k + 1 :]  # a token sampled by a step launched after this one
                req.finish_time = now
                self.scheduler.finish(req)
                self.requests.pop(req.rid, None)
                if self.drafter is not None:
                    self.drafter.forget(req.rid)
            # RequestOutput's fields in order (positional: a third of the keyword call's cost):
            # rid, new_text, new_token_ids, token_ids, text, finished, finish_reason,
            # num_output_tokens, num_prompt_tokens, num_cached_tokens, new_logprobs, ttft, latency.
            append(
                RequestOutput(
                    req.rid,
                    new_text,
                    [tok],
                    req.output_ids if done else [],
                    req.text,
                    done,
                    reason,
                    k + 1,
                    len(req.prompt_ids),
                    req.prefix_hit,
                    new_lp,
                    first - req.arrival,
                    now - req.arrival if done else None,
                )
            )
        self.stats["generated_tokens"] += generated
        return outputs

    def _verify_outputs(self, launched: Launched) -> list[RequestOutput]:
        """:meth:`_outputs` of a verify step (runtime/stepper.py ``_verify_step``): request ``j``
        emitted ``num_emitted[j]`` tokens (``ids[j]``); they are applied one by one, stop conditions
        checked after each (those after a stop are discarded), and its KV length advances by the
        tokens kept: the K/V of the newest token and the accepted drafts were written at
        ``kv_len ..``, so ``kv_len == seq_len - 1`` again (rejected drafts' K/V lie past it, never
        read, rewritten later; the radix cache sees ``tokens(0, kv_len)`` only)."""
        h = launched.host
        rows = h["ids"].tolist()
        nums = h["num_emitted"].tolist()
        lp = h["logprobs"].tolist() if "logprobs" in h else None
        top_ids = h["top_ids"].tolist() if "top_ids" in h else None
        top_lp = h["top_logprobs"].tolist() if "top_logprobs" in h else None
        now = time.perf_counter()
        outputs: list[RequestOutput] = []
        generated = 0
        for j, req in enumerate(launched.reqs):
            p = req.params
            new_ids: list[int] = []
            new_lp: list[dict[str, Any]] = []
            new_text = ""
            for i in range(nums[j]):
                tok = rows[j][i]
                req.output_ids.append(tok)
                new_ids.append(tok)
                if lp is not None and p.logprobs is not None:
                    n = p.logprobs
                    entry = {
                        "token_id": tok,
                        "logprob": lp[j][i],
                        "top": list(zip(top_ids[j][i][:n], top_lp[j][i][:n])) if top_ids and top_lp else [],
                    }
                    req.logprobs.append(entry)
                    new_lp.append(entry)
                new_text += self._check_stop(req, p, tok, len(req.output_ids))
                if req.finish_reason is not None:
                    break
            req.kv_len += len(new_ids)  # the newest token's and the kept drafts' K/V
            generated += len(new_ids)
            reason = req.finish_reason
            done = reason is not None
            if req.first_token_time is None:
                req.first_token_time = now
            if done:
                req.finish_time = now
                self.scheduler.finish(req)
                self.requests.pop(req.rid, None)
                if self.drafter is not None:
                    self.drafter.forget(req.rid)
            outputs.append(
                RequestOutput(
                    req.rid,
                    new_text,
                    new_ids,
                    req.output_ids if done else [],
                    req.text,
                    done,
                    reason,
                    len(req.output_ids),
                    len(req.prompt_ids),
                    req.prefix_hit,
                    new_lp,
                    req.first_token_time - req.arrival,
                    now - req.arrival if done else None,
                )
            )
        self.stats["generated_tokens"] += generated
        return outputs

    def _check_stop(self, req: Req, p: SamplingParams, tok: int, n_out: int) -> str:
        """Stop conditions for ``tok``, the ``n_out``-th output token of ``req`` (whose params are
        ``p``); returns the text to emit now."""
        detok = req.detok
        stop_tok = (tok in self.eos_ids and not p.ignore_eos) or tok in (p.stop_token_ids or ())
        if stop_tok and n_out > p.min_tokens - 1:
            req.finish_reason = "stop"
            new_text = detok.flush() if detok else ""
        else:
            new_text, stopped = detok.add(tok) if detok else ("", False)
            if stopped:
                req.finish_reason = "stop"
            elif n_out >= p.max_tokens or len(req.prompt_ids) + n_out >= self.max_seq_len:
                req.finish_reason = "length"
                if detok:
                    new_text += detok.flush()
        if new_text:
            req.text += new_text
        return new_text

    def run_until_done(self) -> None:
        while self.has_work():
            self.step()

    def close(self) -> None:
        """Stop a tensor-parallel run's follower ranks (nothing to do for one rank)."""
        if self.ranks is not None:
            runner = getattr(self, "runner", None)  # None: the start failed before it existed
            self.ranks.close(runner.release_graphs if runner is not None else None)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        self.bt.flush()
        self.bt.check()

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix not in use (for benchmarks that must start cold)."""
        self.radix.evict(self.radix.evictable_size, self.pool.free_pages)

    def step_metrics(self) -> dict[str, Any]:
        """The step figures since the engine started or :meth:`reset_step_stats`, as plain numbers:
        ``{"prefill" | "decode" | "mixed" | "all": {steps, requests, prefill_tokens, decode_tokens,
        wall_s, host_s, calls, batch_hist, wall_hist, mean_batch, tokens_per_step, step_ms,
        host_ms_per_step},
        "discarded_tokens": n}`` (runtime/step_stats.py says what each figure means), with
        speculative decoding on also ``"speculative"``: ``AcceptanceStats.as_dict()``."""
        m = self.step_stats.as_dict()
        if self.drafter is not None:
            m["speculative"] = self.spec_stats.as_dict()
            if self.spec_policy is not None:
                m["speculative"]["policy"] = self.spec_policy.as_dict()
        return m

    def reset_step_stats(self) -> None:
        """Zero the step figures (for benchmarks that measure one run)."""
        self.step_stats.reset()

    def status(self) -> dict[str, Any]:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_capacity_tokens": self.pool.capacity_tokens,
            "kv_free_tokens": self.pool.num_free_slots,
            "kv_cached_tokens": self.radix.total_size,
            "preemptions": self.scheduler.num_preemptions,
            **self.stats,
            # speculative decoding's sums (zero with it off): requests verified, drafts proposed
            # and accepted, tokens emitted by verify steps
            "spec_verified": self.spec_stats.verified,
            "spec_proposed": self.spec_stats.proposed,
            "spec_accepted": self.spec_stats.accepted,
            "spec_emitted": self.spec_stats.emitted,
            "spec_accepted_hist": dict(sorted(self.spec_stats.hist.items())),  # drafts accepted: rows
            # the measured policy's mode changes and probes (zero under --speculative-policy always)
            "spec_policy_switches": self.spec_policy.switches if self.spec_policy else 0,
            "spec_policy_probes": self.spec_policy.probes if self.spec_policy else 0,
            # per step kind (prefill, decode, mixed): steps, requests, fed tokens, wall and host
            # seconds since start or reset_step_stats (runtime/step_stats.py)
            "step_kinds": {k: v for k, v in self.step_stats.as_dict().items() if k in KINDS},
            # CUDA-graph capture runs since start (ModelRunner.capturing blocks: start-up's decode
            # and verify graphs are one, each later decode bucket or prefill shape one; each stalls
            # the steps once), their wall seconds, and the graphs idle time may still capture
            "graph_captures": self.runner.captures,
            "graph_capture_seconds": self.runner.capture_seconds,
            "graph_captures_pending": self.captures_pending(),
        }

    def __repr__(self) -> str:
        return f"Engine({self.artifact.root}, device={self.device}, kv={self.pool.capacity_tokens} tokens)"
