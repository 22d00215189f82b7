"""Synthetic Hugging Face checkpoints (random weights) for tests, benchmarks and the demo.

Two engines write the same tensor names and shapes Hugging Face's ``save_pretrained`` would:

* ``"hf"``: instantiate the model with transformers (``AutoModelForCausalLM.from_config``),
  re-randomize every parameter (std 0.02; norms 1 + noise, so biases and norms are not constant),
  and ``save_pretrained(max_shard_size=...)``. Exact, for tiny configs.
* ``"fast"``: build the model on the meta device for names and shapes (reverted to the on-disk
  names with transformers' own ``revert_weight_conversion``, as ``save_pretrained`` does), then
  write random tensors shard by shard with a thread pool, never materializing the model. Values come
  from a 64 Mi-element pool of N(0, 0.02) numbers copied from per-tensor random offsets, so an
  8B-shaped checkpoint takes seconds, not the minutes a fresh normal draw per element would.

``engine="auto"`` picks ``hf`` under 200 M parameters, ``fast`` above.

A config with ``num_nextn_predict_layers`` (DeepSeek-V3) also gets its next-token-prediction (MTP)
layers, which transformers' model does not create, by both engines: layer ``L + j`` (``L =
num_hidden_layers``) under ``model.layers.{L + j}.*`` with any decoder layer's tensor names (taken
from the model built with ``L + n`` layers), plus ``enorm``, ``hnorm``, ``eh_proj [H, 2H]``,
``shared_head.norm`` and ``shared_head.head [V, H]`` (random, as the engine's other tensors) and
``embed_tokens`` (a copy of the model's), listed in ``model.safetensors.index.json``.

``successor=True`` (Llama-family configs with untied embeddings) makes a checkpoint whose greedy
continuation of token ``t`` is ``next(t)``, a fixed cycle through the whole vocabulary, so outputs
copy what a prompt holding a stretch of the cycle already shows (the workload n-gram speculative
decoding needs, docs/speculative.md section 7): every layer's ``o_proj`` and ``down_proj`` (and
their biases) are zero, so each layer adds nothing to the residual stream while every weight is
still read at its full size; the embedding rows are random signs times ``SUCCESSOR_SCALE`` (equal
norms); and the LM head row ``next(t)`` is the embedding row ``t``. The final hidden state is then
``RMSNorm(embed[t]) = sign(embed[t]) * g`` (``g`` the final norm weight, 1 + N(0, 0.02)), whose
logit for ``next(t)`` is ``SUCCESSOR_SCALE * sum(g)`` (~ 0.02 H) while any other row scores
``SUCCESSOR_SCALE * sum(g * s)`` for an independent sign vector ``s`` (~ 0.02 sqrt(H) spread): a
margin of 8 standard deviations at H = 64 and 64 at H = 4096, far above bf16 rounding.
:func:`successor_next` gives ``next``: the ids in the order ``random.Random(seed).shuffle`` puts
``range(vocab_size)`` in, each followed by the next one, the last by the first.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from kiln.compiler.cli_inspect import bundled_configs
from kiln.compiler.config import ConfigError, normalize_config
from kiln.weights.st_format import plan_layout, pwrite_all, tensor_bytes

HF_ENGINE_MAX_PARAMS = 200_000_000
POOL_NUMEL = 64 * 1024 * 1024
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(s: int | str) -> int:
    """``5GB`` (decimal, as Hugging Face reads it), ``64MiB`` or a byte count -> bytes."""
    if isinstance(s, int):
        return s
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", s)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read size {s!r}; write e.g. 5GB, 64MiB or 1000000")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def resolve_config(config: dict[str, Any] | str, dtype: str, num_layers: int | None) -> dict[str, Any]:
    """A raw config.json dict from a dict or a bundled preset name, with dtype and layers applied."""
    if isinstance(config, str):
        presets = bundled_configs()
        if config not in presets:
            raise ConfigError(f"unknown preset {config!r}; bundled: {', '.join(sorted(presets))}.")
        raw = json.loads(presets[config].read_text())
    else:
        raw = json.loads(json.dumps(config))
    if num_layers is not None:
        raw["num_hidden_layers"] = num_layers
        if raw.get("mlp_only_layers"):
            raw["mlp_only_layers"] = [i for i in raw["mlp_only_layers"] if i < num_layers]
    raw["torch_dtype"] = dtype
    raw.pop("dtype", None)
    # the weights written here are in `dtype`: a preset's FP8 quantization_config (DeepSeek-V3's)
    # would make readers take them for an FP8 checkpoint
    raw.pop("quantization_config", None)
    normalize_config(raw)  # fail early on configs kiln cannot serve
    return raw


def _hf_config(raw: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    kw = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")}
    return AutoConfig.for_model(raw["model_type"], **kw)


def _is_norm(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 1 and "norm" in name


# ----------------------------------------------------------------------------- successor checkpoints
SUCCESSOR_SCALE = 0.02  # |every embedding value| of a successor checkpoint
_SUCCESSOR_ZERO = re.compile(r"\.(self_attn\.o_proj|mlp\.down_proj)\.(weight|bias)$")
_EMBED, _LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def successor_next(vocab_size: int, seed: int = 0) -> list[int]:
    """``next`` of a successor checkpoint (module docstring) of ``vocab_size`` ids written with
    ``seed``: ``next[t]`` is the token its greedy decoding emits after ``t``. One cycle through
    every id: ``order = list(range(vocab_size))``, ``random.Random(seed).shuffle(order)``, then
    ``next[order[i]] = order[(i + 1) % vocab_size]``."""
    order = list(range(vocab_size))
    random.Random(seed).shuffle(order)
    nxt = [0] * vocab_size
    for a, b in zip(order, order[1:] + order[:1]):
        nxt[a] = b
    return nxt


def successor_tensors(
    vocab_size: int, hidden_size: int, seed: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(embed, lm_head)``, both ``[vocab_size, hidden_size]`` in ``dtype``: embedding rows of
    random signs times :data:`SUCCESSOR_SCALE`, and ``lm_head[next[t]] = embed[t]``
    (:func:`successor_next`)."""
    g = torch.Generator().manual_seed(seed)
    embed = torch.empty(vocab_size, hidden_size, dtype=dtype)
    shifts = torch.arange(8, dtype=torch.uint8)
    rows = max(1, (1 << 25) // hidden_size)  # 32 Mi signs at a time
    for s in range(0, vocab_size, rows):
        n = min(rows, vocab_size - s)
        packed = torch.randint(0, 256, (n, (hidden_size + 7) // 8), dtype=torch.uint8, generator=g)
        bits = ((packed.unsqueeze(-1) >> shifts) & 1).reshape(n, -1)[:, :hidden_size]
        embed[s : s + n] = (bits.to(torch.int8) * 2 - 1).to(dtype) * SUCCESSOR_SCALE
    lm_head = torch.empty_like(embed)
    lm_head[torch.tensor(successor_next(vocab_size, seed))] = embed
    return embed, lm_head


def _check_successor(raw: dict[str, Any]) -> None:
    """Successor checkpoints are Llama-family and untied (module docstring)."""
    from kiln.compiler.registry import LLAMA, resolve_architecture

    arch = str((raw.get("architectures") or ["?"])[0])
    if resolve_architecture(arch).model != LLAMA:
        llama = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"
        raise ConfigError(
            f"successor checkpoints need a Llama-family architecture ({llama}); config.json field "
            f"'architectures' names {arch}. Pick one of those configs or drop successor."
        )
    if raw.get("tie_word_embeddings"):
        raise ConfigError(
            "successor checkpoints need untied embeddings (the LM head is the embedding permuted); "
            "config.json field 'tie_word_embeddings' is true. Set it to false or drop successor."
        )


def _successor_fixed(
    raw: dict[str, Any], names: list[str], seed: int, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The successor tensors by on-disk name (embedding, LM head) and the names to write as zeros;
    checks that ``names`` holds the embedding, the LM head and one o and one down projection per
    layer."""
    zero = {n for n in names if _SUCCESSOR_ZERO.search(n)}
    layers = raw["num_hidden_layers"]
    got = {(m.group(1), m.group(2)) for n in zero if (m := re.search(r"layers\.(\d+)\.(self_attn|mlp)\.", n))}
    if _EMBED not in names or _LM_HEAD not in names or len(got) != 2 * layers:
        raise ConfigError(
            f"successor: the checkpoint's tensor names lack {_EMBED}, {_LM_HEAD} or a layer's o_proj / "
            "down_proj; only Llama-family layouts are supported."
        )
    embed, lm_head = successor_tensors(raw["vocab_size"], raw["hidden_size"], seed, dtype)
    return {_EMBED: embed, _LM_HEAD: lm_head}, zero


# ----------------------------------------------------------------------------- MTP layers
def _nextn_items(raw: dict[str, Any], original: bool) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the MTP layers' tensors (module docstring), after the model's."""
    n = int(raw.get("num_nextn_predict_layers") or 0)
    if not n:
        return []
    first, h, v = raw["num_hidden_layers"], raw["hidden_size"], raw["vocab_size"]
    longer = _meta_tensors(raw | {"num_hidden_layers": first + n}, original)
    items: list[tuple[str, tuple[int, ...]]] = []
    for i in range(first, first + n):
        p = f"model.layers.{i}."
        items += [(name, shape) for name, shape in longer if name.startswith(p)]
        items += [(p + "enorm.weight", (h,)), (p + "hnorm.weight", (h,)), (p + "eh_proj.weight", (h, 2 * h))]
        items += [(p + "embed_tokens.weight", (v, h)), (p + "shared_head.norm.weight", (h,))]
        items.append((p + "shared_head.head.weight", (v, h)))
    return items


def _is_embed_copy(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith(".embed_tokens.weight")


def _add_nextn_file(out: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write the hf engine's MTP tensors as a shard of their own and list them in the index. A
    single-file checkpoint becomes two shards: readers take a ``model.safetensors`` alone."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = out / "model.safetensors.index.json"
    if path.is_file():
        index, name = json.loads(path.read_text()), "model-mtp.safetensors"
    else:
        first, name = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
        (out / "model.safetensors").rename(out / first)
        with safe_open(str(out / first), "pt") as st:
            index = {"metadata": {}, "weight_map": dict.fromkeys(st.keys(), first)}
    save_file(tensors, str(out / name))
    index["weight_map"].update(dict.fromkeys(tensors, name))
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    path.write_text(json.dumps(index, indent=2))


# ----------------------------------------------------------------------------- hf engine
def _write_hf(
    out: Path,
    raw: dict[str, Any],
    dtype: torch.dtype,
    seed: int,
    max_shard: int,
    original: bool,
    successor: bool = False,
) -> None:
    import inspect

    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_hf_config(raw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.02)
            if _is_norm(name, p):
                p.add_(1.0)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.02)
        if successor:
            params = dict(model.named_parameters(remove_duplicate=False))
            fixed, zero = _successor_fixed(raw, list(params), seed, torch.float32)
            for name in zero:
                params[name].zero_()
            for name, t in fixed.items():
                params[name].copy_(t)
    model.to(dtype)
    kw: dict[str, Any] = {"max_shard_size": max_shard}
    if "save_original_format" in inspect.signature(model.save_pretrained).parameters:
        kw["save_original_format"] = original
    model.save_pretrained(out, **kw)
    nextn = _nextn_items(raw, original)
    if nextn:
        g = torch.Generator().manual_seed(seed + 1)
        embed = model.get_input_embeddings().weight.detach()
        mtp = {}
        for name, shape in nextn:
            t = embed.clone() if _is_embed_copy(name) else torch.randn(shape, generator=g) * 0.02
            mtp[name] = (t + 1 if _is_norm(name, t) else t).to(dtype).contiguous()
        _add_nextn_file(out, mtp)


# ----------------------------------------------------------------------------- fast engine
def _meta_tensors(raw: dict[str, Any], original: bool) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor save_pretrained would write, from a meta-device model."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_hf_config(raw))
    sd = dict(model.state_dict())
    if raw.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    if original:
        try:
            from transformers.core_model_loading import revert_weight_conversion
        except ImportError:  # transformers 4: in-memory names are the on-disk names
            pass
        else:
            sd = revert_weight_conversion(model, sd)
    return [(n, tuple(t.shape)) for n, t in sd.items() if not n.endswith("inv_freq")]


class _Pool:
    """``size`` N(0, 0.02) values doubled end to end, so any offset < size has size values after it."""

    def __init__(self, seed: int, dtype: torch.dtype, size: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.size = size
        half = (torch.randn(size, generator=g) * 0.02).to(dtype)
        self.values = torch.cat([half, half])

    def fill(self, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        n = math.prod(shape)
        out = torch.empty(n, dtype=self.values.dtype)
        rng = random.Random(int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little"))
        for s in range(0, n, self.size):
            k = min(self.size, n - s)
            off = rng.randrange(self.size)
            out[s : s + k].copy_(self.values[off : off + k])
        t = out.view(shape)
        if _is_norm(name, t):
            t.add_(1.0)
        return t


def _shard(
    items: list[tuple[str, tuple[int, ...]]], itemsize: int, max_shard: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in items:
        n = math.prod(shape) * itemsize
        if shards[-1] and size + n > max_shard:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    return shards


def _write_fast(
    out: Path,
    raw: dict[str, Any],
    dtype: torch.dtype,
    seed: int,
    max_shard: int,
    original: bool,
    threads: int,
    successor: bool = False,
) -> None:
    items = _meta_tensors(raw, original) + _nextn_items(raw, original)
    fixed: dict[str, torch.Tensor] = {}
    zero: set[str] = set()
    if successor:
        fixed, zero = _successor_fixed(raw, [n for n, _ in items], seed, dtype)
    shards = _shard(items, dtype.itemsize, max_shard)
    largest = max(math.prod(s) for _, s in items)
    pool = _Pool(seed, dtype, min(POOL_NUMEL, 1 << (largest - 1).bit_length()))
    k = len(shards)
    names = (
        ["model.safetensors"] if k == 1 else [f"model-{i + 1:05d}-of-{k:05d}.safetensors" for i in range(k)]
    )
    budget = threading.BoundedSemaphore(2 * threads)  # tensors generated but not yet written
    weight_map: dict[str, str] = {}
    fds = []
    try:
        with ThreadPoolExecutor(max_workers=threads) as ex:
            futures = []
            for fname, shard in zip(names, shards):
                lay = plan_layout([(n, s, dtype) for n, s in shard], {"format": "pt"})
                fd = os.open(out / fname, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                fds.append(fd)
                os.ftruncate(fd, lay.size)
                pwrite_all(fd, lay.header, 0)

                def job(name: str, shape: tuple[int, ...], fd: int = fd, off: int = 0) -> None:
                    try:
                        if name in fixed:
                            t = fixed[name]
                        elif name in zero:
                            t = torch.zeros(shape, dtype=dtype)
                        elif _is_embed_copy(name):  # an MTP layer's: the model's embedding
                            t = fixed[_EMBED] if _EMBED in fixed else pool.fill(_EMBED, shape, seed)
                        else:
                            t = pool.fill(name, shape, seed)
                        pwrite_all(fd, tensor_bytes(t), off)
                    finally:
                        budget.release()

                for name, shape in shard:
                    weight_map[name] = fname
                    budget.acquire()
                    futures.append(ex.submit(job, name, shape, fd, lay.offsets[name]))
            for f in futures:
                f.result()
    finally:
        for fd in fds:
            os.close(fd)
    if k > 1:
        total = sum(math.prod(s) * dtype.itemsize for _, s in items)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf_cfg = _hf_config(raw)  # config.json as save_pretrained writes it (defaults filled in)
    hf_cfg.save_pretrained(out)
    gen = {
        k: getattr(hf_cfg, k)
        for k in ("bos_token_id", "eos_token_id")
        if getattr(hf_cfg, k, None) is not None
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))


# ----------------------------------------------------------------------------- entry point
def make_checkpoint(
    out_dir: str | Path,
    config: dict[str, Any] | str,
    dtype: str = "bfloat16",
    seed: int = 0,
    max_shard_size: int | str = "5GB",
    num_layers: int | None = None,
    with_tokenizer: bool = True,
    *,
    engine: str = "auto",
    original_format: bool = True,
    threads: int | None = None,
    successor: bool = False,
) -> Path:
    """Write a random-weight Hugging Face checkpoint of ``config`` (a config.json dict or a bundled
    preset name such as ``llama-3.1-8b``) into ``out_dir``: config.json, safetensors shards of at
    most ``max_shard_size`` (with model.safetensors.index.json when there are several),
    generation_config.json and, when asked, the synthetic tokenizer (``kiln.compiler.synth_tokenizer``;
    config.json and generation_config.json then carry its bos/eos ids).

    ``original_format=False`` keeps transformers 5's pre-stacked expert tensors
    (``mlp.experts.gate_up_proj``) instead of per-expert ones. ``successor=True``: a successor
    checkpoint (module docstring; greedy decoding emits ``successor_next(vocab_size, seed)[t]``
    after ``t``). Returns ``out_dir``.
    """
    raw = resolve_config(config, dtype, num_layers)
    if successor:
        _check_successor(raw)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tdt = getattr(torch, dtype)
    if engine == "auto":
        engine = "hf" if normalize_config(raw).num_params < HF_ENGINE_MAX_PARAMS else "fast"
    if engine == "hf":
        _write_hf(out, raw, tdt, seed, parse_size(max_shard_size), original_format, successor)
    elif engine == "fast":
        nthreads = threads or os.cpu_count() or 4
        _write_fast(out, raw, tdt, seed, parse_size(max_shard_size), original_format, nthreads, successor)
    else:
        raise ValueError(f"engine must be auto, hf or fast, got {engine!r}")
    if with_tokenizer:
        _add_tokenizer(out, raw["vocab_size"])
    return out


def _add_tokenizer(out: Path, vocab_size: int) -> None:
    """Write the synthetic tokenizer and point config.json / generation_config.json at its ids."""
    from kiln.compiler.synth_tokenizer import build_tokenizer

    tok = build_tokenizer(out, vocab_size=vocab_size)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    gen_path = out / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    gen.update(bos_token_id=tok.bos_token_id, eos_token_id=list(tok.eos_token_ids))
    gen_path.write_text(json.dumps(gen, indent=2))
