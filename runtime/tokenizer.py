"""Tokenizer loading and the per-request text pipeline (detokenizer -> stop-string matcher).

Start-up matters, so an artifact with a ``tokenizer.json`` is served by :class:`FastTokenizer`:
the Rust ``tokenizers`` library plus the chat template rendered with sandboxed Jinja, the way
transformers renders it (loading it takes ~0.04 s; ``AutoTokenizer`` took 3-6 s, most of it
importing transformers). Anything else falls back to ``AutoTokenizer`` (local files only, no
remote code). A tokenizer file that does not parse (or a chat template that does not compile, at
its first use) is a one-line :class:`TokenizerFileError` naming the file.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from kiln.runtime.artifact import RECOPY, ArtifactError, one_line
from kiln.runtime.detokenizer import IncrementalDetokenizer, StopMatcher
from kiln.runtime.sampling_params import SamplingParams


def _token_text(tok: Any) -> str | None:
    if isinstance(tok, dict):  # {"content": "<s>", ...} in some tokenizer_config.json files
        return tok.get("content")
    return tok


class TokenizerFileError(ArtifactError):
    """A tokenizer file of the artifact that does not parse."""

    def __init__(self, path: Path, err: BaseException):
        super().__init__(f"tokenizer file {path} does not load ({one_line(err)}); {RECOPY}.")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise TokenizerFileError(path, e) from None
    if not isinstance(doc, dict):
        raise TokenizerFileError(path, TypeError(f"holds {type(doc).__name__}, not an object"))
    return doc


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, ValueError) as e:
        raise TokenizerFileError(path, e) from None


class FastTokenizer:
    """The subset of a transformers tokenizer kiln uses, over ``tokenizers.Tokenizer``."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        root = Path(path)
        try:
            self.backend_tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        except Exception as e:  # the Rust library's errors (bad JSON, unknown model, bad UTF-8)
            raise TokenizerFileError(root / "tokenizer.json", e) from None
        cfg_path = root / "tokenizer_config.json"
        cfg = _read_json(cfg_path) if cfg_path.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        template = cfg.get("chat_template")
        self._template_file = cfg_path
        if template is None and (root / "chat_template.jinja").is_file():
            self._template_file = root / "chat_template.jinja"
            template = _read_text(self._template_file)
        if isinstance(template, list):  # named templates: use "default"
            named = [t for t in template if isinstance(t, dict)]
            template = next((t.get("template") for t in named if t.get("name") == "default"), None)
        if template is not None and not isinstance(template, str):
            raise TokenizerFileError(cfg_path, TypeError("chat_template is not a string"))
        self.chat_template: str | None = template
        self._compiled: Any = None

    @property
    def eos_token_id(self) -> int | None:
        return self.backend_tokenizer.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def bos_token_id(self) -> int | None:
        return self.backend_tokenizer.token_to_id(self.bos_token) if self.bos_token else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab()

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size()

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tokenize: bool = False,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str | list[int]:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if self._compiled is None:
            from jinja2 import TemplateSyntaxError
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise ValueError(message)

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
            )
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii
            )
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._compiled = env.from_string(self.chat_template)
            except TemplateSyntaxError as e:
                raise TokenizerFileError(self._template_file, e) from None
        text = self._compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def load_tokenizer(path: str | Path, fast: bool = True) -> Any:
    """The artifact's tokenizer: :class:`FastTokenizer` when ``tokenizer.json`` exists (and
    ``fast``), else transformers' ``AutoTokenizer`` from local files, without remote code."""
    if fast and (Path(path) / "tokenizer.json").is_file():
        return FastTokenizer(path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)
    except Exception as e:  # whichever of its files transformers could not parse
        raise TokenizerFileError(Path(path), e) from None


class RequestText:
    """Turns one request's generated token ids into emitted text, honouring stop strings."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], params: SamplingParams):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        self.stops = StopMatcher(stops, params.include_stop_str_in_output)

    @property
    def matched(self) -> str | None:
        return self.stops.matched

    def add(self, token_id: int) -> tuple[str, bool]:
        """Text safe to emit after ``token_id``, and whether a stop string completed."""
        piece = self.detok._add(int(token_id))  # IncrementalDetokenizer.add, one call less
        if not self.stops.stops:  # nothing to match: the piece is final as it is
            return piece, False
        return self.stops.feed(piece)

    def flush(self) -> str:
        """Everything still held back, when the request ends for another reason."""
        text, stopped = self.stops.feed(self.detok.flush())
        return text if stopped else text + self.stops.flush()
