"""A checkpoint argument -> a local checkpoint directory: a directory as it is, a Hugging Face Hub
model id downloaded into the user's Hugging Face cache.

Protocol of :func:`resolve_checkpoint` (what every command that takes a checkpoint directory calls
with its argument, and ``--revision``):

1. ``name`` is local (:func:`is_local`: an existing path, or one shaped like a path: absolute,
   ``~``, ``./``, ``../``, a backslash, more than one ``/``, a trailing ``/``): it must be a
   directory, and is returned as it is (``~`` expanded). A local directory takes no revision.
   A directory wins over a Hub id of the same spelling (``org/name`` beside the working directory).
2. Otherwise ``name`` must be a Hub model id, ``org/name`` or ``name`` (letters, digits, ``-``,
   ``_``, ``.``; neither ``--`` nor ``..``; not starting or ending with ``-`` or ``.``; at most 96
   characters a part). It is fetched with ``huggingface_hub.snapshot_download`` at ``revision``
   (a branch, tag or commit; default the repository's default branch) into the Hugging Face cache,
   which huggingface_hub places and authenticates as it always does (``HF_HOME``,
   ``HF_HUB_CACHE``, ``HF_TOKEN`` or the saved login, ``HF_ENDPOINT``, ``HF_HUB_OFFLINE``: a cached
   snapshot without any request). The result is the snapshot directory
   ``.../models--org--name/snapshots/<commit>``: its name is the commit that was resolved.
3. Only what kiln reads is downloaded: :data:`ALLOW_PATTERNS`, at the top level of the repository
   (:data:`IGNORE_PATTERNS`). Never pickled weights (``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``),
   ``*.msgpack``, ``*.h5``, ONNX, GGUF or any Python file: no remote code is ever fetched. Weights
   come second, after the metadata: when the repository has a safetensors index
   (``model.safetensors.index.json``, else its only ``*.safetensors.index.json``) exactly the shards
   its ``weight_map`` names are fetched (``weights/discover.py`` reads no others: Mistral repositories
   also hold the same weights as ``consolidated.safetensors``), else every top-level ``*.safetensors``.
   A snapshot without any ``*.safetensors`` is refused (kiln takes safetensors only from the Hub).
4. ``progress``: huggingface_hub's own progress bars (tqdm, on a terminal) when True, none when False.
5. Every failure is a :class:`HubError` (a :class:`~kiln.errors.KilnError`): one line naming the
   model id and what to do: a path that does not exist or is not a directory, a name that is no Hub
   id, a repository not found (typo, or private: log in), a gated one (accept the license, then set
   HF_TOKEN), a refused token, a revision not found, offline with the model not (fully) cached, the
   Hub unreachable or failing, a snapshot without safetensors.

``config_only=True`` (``kiln inspect``) fetches ``config.json`` and ``generation_config.json`` only.
huggingface_hub is imported only when a Hub id is resolved.
"""

from __future__ import annotations

import glob
import json
import re
from pathlib import Path
from typing import Any

from kiln.artifact_format import TOKENIZER_FILES
from kiln.errors import KilnError

WEIGHT_PATTERN = "*.safetensors"
INDEX_PATTERN = "*.safetensors.index.json"
CONFIG_PATTERNS: tuple[str, ...] = ("config.json", "generation_config.json")
ALLOW_PATTERNS: tuple[str, ...] = (
    *CONFIG_PATTERNS,
    WEIGHT_PATTERN,
    INDEX_PATTERN,
    *(f for f in TOKENIZER_FILES if f not in CONFIG_PATTERNS),  # the files the compiler copies
)
IGNORE_PATTERNS: tuple[str, ...] = ("*/*",)  # kiln reads a checkpoint's top level only
METADATA_PATTERNS: tuple[str, ...] = tuple(p for p in ALLOW_PATTERNS if p != WEIGHT_PATTERN)

_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?"
HUB_ID_RE = re.compile(rf"(?:(?P<org>{_PART})/)?(?P<name>{_PART})")
MAX_PART = 96


class HubError(KilnError):
    """A checkpoint argument that cannot be resolved to a local directory. Names the model id."""


def is_hub_id(name: str) -> bool:
    """Whether ``name`` is spelled as the Hub spells a model id (``org/name`` or ``name``)."""
    m = HUB_ID_RE.fullmatch(name)
    return (
        m is not None
        and "--" not in name
        and ".." not in name
        and not name.endswith(".git")
        and all(len(part) <= MAX_PART for part in name.split("/"))
    )


def _path_shaped(name: str) -> bool:
    return (
        name.startswith(("/", "~", "./", "../"))
        or name in (".", "..")
        or "\\" in name
        or name.count("/") > 1
        or name.endswith("/")
    )


def is_local(name: str) -> bool:
    """Whether ``name`` is read from the filesystem: it exists, or it is shaped like a path (absolute,
    ``~``, ``./``, ``../``, a backslash, more than one ``/``, a trailing ``/``). Anything else is
    taken for a Hub model id."""
    return _path_shaped(name) or Path(name).expanduser().exists()


def resolve_checkpoint(
    name: str, revision: str | None = None, progress: bool = True, *, config_only: bool = False
) -> Path:
    """The local checkpoint directory ``name`` stands for (module docstring: the protocol).

    ``revision``: a branch, tag or commit of a Hub model (a local directory takes none).
    ``progress``: huggingface_hub's progress bars while downloading. ``config_only``: fetch the
    config files only (enough for ``kiln inspect``). Raises :class:`HubError`."""
    if not name.strip():
        raise HubError(
            "the checkpoint argument is empty; give a directory or a Hugging Face model id (org/name)"
        )
    if revision is not None and not revision.strip():
        raise HubError(
            f"--revision for {name!r} is empty; give a branch, tag or commit hash, or leave it out"
        )
    if is_local(name):
        path = Path(name).expanduser()
        if not path.exists():
            raise HubError(
                f"checkpoint directory {name!r} does not exist; give an existing directory or a "
                "Hugging Face model id (org/name)"
            )
        if not path.is_dir():
            raise HubError(
                f"checkpoint {name!r} is a file, not a directory; give the directory that holds "
                "config.json and the *.safetensors weights, or a Hugging Face model id"
            )
        if revision is not None:
            raise HubError(
                f"--revision {revision!r} applies to Hugging Face model ids only, but {name!r} is a "
                "local directory; leave --revision out"
            )
        return path
    if not is_hub_id(name):
        raise HubError(
            f"{name!r} is neither an existing directory nor a Hugging Face model id (org/name: "
            "letters, digits, '-', '_', '.'); check the spelling"
        )
    try:
        return _download(name, revision, progress, config_only)
    except HubError:
        raise
    except Exception as err:
        mapped = _explain(err, name, revision)
        if mapped is None:
            raise
        raise mapped from err


# ------------------------------------------------------------------------------- downloading
def _silent_tqdm() -> type[Any]:
    from huggingface_hub.utils import tqdm as hf_tqdm

    class Silent(hf_tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent


def _snapshot(repo_id: str, revision: str | None, patterns: list[str], progress: bool) -> Path:
    from huggingface_hub import snapshot_download

    return Path(
        snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=patterns,
            ignore_patterns=list(IGNORE_PATTERNS),
            tqdm_class=None if progress else _silent_tqdm(),
        )
    )


def _weight_patterns(snap: Path, repo_id: str) -> list[str]:
    """The shards the snapshot's safetensors index names (as exact patterns), else every
    ``*.safetensors``: the files ``weights/discover.py`` reads."""
    index = snap / "model.safetensors.index.json"
    if not index.is_file():
        found = sorted(snap.glob(INDEX_PATTERN))
        if len(found) != 1:
            return [WEIGHT_PATTERN]
        index = found[0]
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({str(f) for f in weight_map.values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise HubError(
            f"{repo_id}: its {index.name} is not a safetensors index with a 'weight_map' ({err}); "
            "use another revision or pass a local directory"
        ) from None
    return [glob.escape(f) for f in files] or [WEIGHT_PATTERN]


def _download(repo_id: str, revision: str | None, progress: bool, config_only: bool) -> Path:
    if config_only:
        return _snapshot(repo_id, revision, list(CONFIG_PATTERNS), progress)
    snap = _snapshot(repo_id, revision, list(METADATA_PATTERNS), progress)
    # the weights at the commit just resolved (the directory's name): no second look-up of the branch
    snap = _snapshot(repo_id, snap.name, _weight_patterns(snap, repo_id), progress)
    if not any(snap.glob(WEIGHT_PATTERN)):
        at = f" at revision {revision!r}" if revision else ""
        raise HubError(
            f"Hugging Face model {repo_id!r}{at} has no *.safetensors weights; kiln reads safetensors "
            "only (never pickled .bin/.pt from the Hub): pick a repository or revision that has them, "
            "or convert the checkpoint and pass its local directory"
        )
    return snap


# ----------------------------------------------------------------------------------- errors
def _chain(err: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = err
    while cur is not None and cur not in out:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _first_line(err: BaseException) -> str:
    text = " ".join(str(err).split("\n\n")[0].split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _explain(err: Exception, repo_id: str, revision: str | None) -> HubError | None:
    """The one-line error a huggingface_hub failure means for a kiln user (None: not a Hub failure)."""
    from huggingface_hub import constants
    from huggingface_hub import errors as hf

    at = f" at revision {revision!r}" if revision else ""
    page = f"{constants.ENDPOINT}/{repo_id}"
    cache = constants.HF_HUB_CACHE
    chain = _chain(err)
    if isinstance(err, hf.GatedRepoError):
        return HubError(
            f"Hugging Face model {repo_id!r} is gated: accept its license on {page} (logged in), then "
            "set HF_TOKEN to a token of that account (or run `hf auth login`)"
        )
    if isinstance(err, hf.RepositoryNotFoundError):
        return HubError(
            f"Hugging Face model {repo_id!r} was not found (and there is no local directory of that "
            "name): check the id for a typo; if the repository is private, run `hf auth "
            "login` or set HF_TOKEN to a token that can read it"
        )
    disabled = getattr(hf, "DisabledRepoError", None)
    if disabled is not None and isinstance(err, disabled):
        return HubError(
            f"Hugging Face model {repo_id!r} is disabled on the Hub (its owner or the Hub took it "
            "down): use another repository or a local checkpoint directory"
        )
    if isinstance(err, hf.RevisionNotFoundError):
        return HubError(
            f"Hugging Face model {repo_id!r} has no revision {revision!r}: give an existing branch, "
            f"tag or commit hash to --revision (see {page})"
        )
    if isinstance(err, hf.HFValidationError):
        return HubError(
            f"{repo_id!r}{at} is not a valid Hugging Face model id or revision ({_first_line(err)})"
        )
    offline = any(isinstance(e, hf.OfflineModeIsEnabled) for e in chain)
    if offline or (
        isinstance(err, hf.LocalEntryNotFoundError) and getattr(constants, "HF_HUB_OFFLINE", False)
    ):
        how = "only partly" if any(type(e).__name__ == "IncompleteSnapshotError" for e in chain) else "not"
        return HubError(
            f"offline mode is on (HF_HUB_OFFLINE=1) and Hugging Face model {repo_id!r}{at} is {how} "
            f"in the cache {cache}: run once online to download it, or pass a local checkpoint "
            "directory"
        )
    status = _status(chain)
    if status == 401:
        from huggingface_hub import get_token

        if get_token() is None:
            return HubError(
                f"the Hugging Face Hub asks for a login to download {repo_id!r}: run `hf auth "
                "login` or set HF_TOKEN to a token that can read it"
            )
        return HubError(
            f"the Hugging Face Hub refused the token sent for {repo_id!r} (HF_TOKEN or the saved "
            "login): set HF_TOKEN to a valid token, run `hf auth login` again, or unset it"
        )
    if status is not None and status != 404:
        return HubError(
            f"the Hugging Face Hub ({constants.ENDPOINT}) answered HTTP {status} for {repo_id!r}{at} "
            f"and it is not in the cache {cache}: retry later, or pass a local checkpoint directory"
        )
    if isinstance(err, (hf.LocalEntryNotFoundError, hf.HfHubHTTPError, OSError, *_http_client_errors())):
        cause = _first_line(chain[-1])
        return HubError(
            f"could not download Hugging Face model {repo_id!r}{at} from {constants.ENDPOINT} into "
            f"{cache} ({cause}): check the network connection, proxy and HF_ENDPOINT, or pass a local "
            "checkpoint directory"
        )
    return None


def _status(chain: list[BaseException]) -> int | None:
    from huggingface_hub.errors import HfHubHTTPError

    for e in chain:
        if isinstance(e, HfHubHTTPError) and e.response is not None:
            return int(e.response.status_code)
    return None


def _http_client_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client's own error base (httpx2 in huggingface_hub 2, httpx in 1, requests before),
    from which its connect, read and timeout errors derive: the class HfHubHTTPError extends."""
    from huggingface_hub.errors import HfHubHTTPError

    return tuple(b for b in HfHubHTTPError.__mro__[1:] if b.__name__ == "HTTPError")
