"""kiln.hub against a mock Hugging Face Hub: a stdlib HTTP server on 127.0.0.1 serving the endpoints
huggingface_hub's ``snapshot_download`` calls for a model repository, with the Hub's headers and
error conventions:

- ``GET /api/models/{repo}[/revision/{rev}]``: model info (``sha``, ``siblings``, ``gated``);
- ``GET /api/models/{repo}/tree/{rev}[/{path}]``: the file listing (``type``, ``path``, ``size``,
  ``oid``, ``lfs`` for the LFS-stored weights);
- ``HEAD``/``GET /{repo}/resolve/{rev}/{file}``: the file, with ``X-Repo-Commit``, ``ETag`` (git blob
  sha1, or the sha256 for LFS files, which also get ``X-Linked-Etag``/``X-Linked-Size``) and
  ``Content-Length``;
- errors: ``X-Error-Code`` ``RepoNotFound`` (401 without a token, 404 with one), ``RevisionNotFound``
  (404), ``GatedRepo`` (401 without a token, 403 with a token not granted), ``EntryNotFound`` (404),
  401 ``Invalid credentials in Authorization header`` for an unknown token.

Every request is logged, so the tests assert which files were (never) fetched. huggingface_hub
reads HF_ENDPOINT, HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE when it is imported: the fixture sets
the environment and patches ``huggingface_hub.constants`` alike.
"""

from __future__ import annotations

import hashlib
import json
import socket
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import numpy as np
import pytest
from huggingface_hub import constants
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from kiln.errors import KilnError
from kiln.hub import ALLOW_PATTERNS, HubError, is_hub_id, is_local, resolve_checkpoint

SHA_A = "a" * 40
SHA_B = "b" * 40
GRANTED, VALID = "hf_granted", "hf_valid_not_granted"  # tokens the mock Hub knows
LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".onnx", ".msgpack", ".h5", ".pth")


# ------------------------------------------------------------------------------ repositories
def _config(layers: int) -> bytes:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 4,
        "torch_dtype": "float16",
    }
    return json.dumps(cfg, indent=2).encode()


def _weights(fill: float) -> bytes:
    return st_save({"model.embed_tokens.weight": np.full((4, 8), fill, dtype=np.float16)})


def _tokenizer() -> bytes:
    tok = Tokenizer(WordLevel({"[UNK]": 0, "the": 1, "sky": 2, "blue": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return tok.to_str().encode()


KILN_FILES = {  # what kiln reads, at the top level
    "config.json": _config(1),
    "generation_config.json": b'{"eos_token_id": 0}',
    "model.safetensors": _weights(0.5),
    "tokenizer.json": _tokenizer(),
    "tokenizer_config.json": b'{"model_max_length": 64}',
}
NEVER = {  # what it must never fetch
    "pytorch_model.bin": b"\x80\x02pickled" * 64,
    "modeling_x.py": b"import os\nos.system('echo remote code')\n",
    "model.gguf": bytes(4 << 20),
    "flax_model.msgpack": b"\x00" * 64,
    "tf_model.h5": b"\x00" * 64,
    "onnx/model.onnx": b"\x00" * 64,
    "original/model.safetensors": _weights(9.0),  # a subfolder: kiln reads the top level only
    "original/tokenizer.model": b"\x00" * 64,
    "README.md": b"# tiny\n",
    ".gitattributes": b"*.safetensors filter=lfs\n",
}


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]]  # commit sha -> path -> bytes
    refs: dict[str, str] = field(default_factory=lambda: {"main": SHA_A})  # branch or tag -> sha
    gated: bool = False  # files need the GRANTED token
    fail: int | None = None  # every request answers this status
    login_required: bool = False  # anonymous requests get a bare 401 (a mirror behind a login)


REPOS = {
    "org/tiny": Repo({SHA_A: KILN_FILES | NEVER}),
    "org/pinned": Repo(
        {
            SHA_A: KILN_FILES | {"config.json": _config(1)},
            SHA_B: KILN_FILES | {"config.json": _config(2), "model.safetensors": _weights(2.0)},
        },
        refs={"main": SHA_A, "v2": SHA_B},
    ),
    "org/sharded": Repo(  # Mistral's layout: an index of two shards, and the same weights consolidated
        {
            SHA_A: {
                "config.json": _config(1),
                "model.safetensors.index.json": json.dumps(
                    {
                        "metadata": {"total_size": 128},
                        "weight_map": {
                            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors",
                        },
                    }
                ).encode(),
                "model-00001-of-00002.safetensors": _weights(1.0),
                "model-00002-of-00002.safetensors": _weights(2.0),
                "consolidated.safetensors": _weights(3.0),
            }
        }
    ),
    "org/gated": Repo({SHA_A: dict(KILN_FILES)}, gated=True),
    "org/binonly": Repo(
        {SHA_A: {"config.json": _config(1), "pytorch_model.bin": NEVER["pytorch_model.bin"]}}
    ),
    "org/down": Repo({SHA_A: dict(KILN_FILES)}, fail=500),
    "solo": Repo({SHA_A: dict(KILN_FILES)}),  # an id without an organization
    "org/login": Repo({SHA_A: dict(KILN_FILES)}, login_required=True),
}


# -------------------------------------------------------------------------------- the mock Hub
def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _is_lfs(path: str) -> bool:
    return path.endswith(LFS_SUFFIXES)


class MockHub(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str]] = []  # (method, path), in arrival order

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def log(self, method: str, path: str) -> None:
        with self.lock:
            self.requests.append((method, path))

    def fetched(self) -> Counter[str]:
        """Requests (HEAD and GET) per repository file, keyed ``{repo}:{file}``."""
        out: Counter[str] = Counter()
        with self.lock:
            for _, path in self.requests:
                if "/resolve/" in path:
                    repo_id, rest = path[1:].split("/resolve/", 1)
                    out[f"{repo_id}:{unquote(rest.partition('/')[2])}"] += 1
        return out


class _Handler(BaseHTTPRequestHandler):
    server: MockHub

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._handle(body=True)

    def do_HEAD(self) -> None:
        self._handle(body=False)

    # ---------------------------------------------------------------- plumbing
    def _send(
        self, status: int, data: bytes = b"", headers: dict[str, str] | None = None, body: bool = True
    ) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _error(self, status: int, code: str | None, message: str, body: bool, **extra: str) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": message, **extra}
        if code is not None:
            headers["X-Error-Code"] = code
        self._send(status, json.dumps({"error": message}).encode(), headers, body)

    def _handle(self, body: bool) -> None:
        path = urlsplit(self.path).path
        self.server.log(self.command, path)
        auth = self.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None
        if token is not None and token not in (GRANTED, VALID):
            return self._error(401, None, "Invalid credentials in Authorization header", body)
        if path == "/api/agent-harnesses":  # huggingface_hub 2's User-Agent agent detection (cached daily)
            registry: dict[str, Any] = {"standardEnvVars": [], "harnesses": {}}
            return self._send(200, json.dumps(registry).encode(), {"Content-Type": "application/json"}, body)
        if path.startswith("/api/models/"):
            return self._api(path.removeprefix("/api/models/"), token, body)
        if "/resolve/" in path:
            repo_id, rest = path[1:].split("/resolve/", 1)
            rev, _, file = rest.partition("/")
            return self._resolve(repo_id, unquote(rev), unquote(file), token, body)
        return self._error(404, None, "Not Found", body)

    def _repo(self, repo_id: str, token: str | None, body: bool) -> Repo | None:
        repo = REPOS.get(repo_id)
        if repo is None:
            # the Hub answers 401 to an anonymous caller, 404 to a logged-in one (it never says "private")
            self._error(401 if token is None else 404, "RepoNotFound", "Repository not found", body)
        elif repo.login_required and token is None:
            self._error(401, None, "Unauthorized", body)
            return None
        elif repo.fail is not None:
            self._error(repo.fail, None, "Internal Error", body)
            return None
        return repo

    def _commit(self, repo: Repo, rev: str, body: bool) -> str | None:
        sha = repo.refs.get(rev, rev if rev in repo.commits else None)
        if sha is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", body)
        return sha

    # ---------------------------------------------------------------- endpoints
    def _api(self, rest: str, token: str | None, body: bool) -> None:
        repo_id, tail = rest.rstrip("/"), ""
        for marker in ("/revision/", "/tree/"):
            if marker in rest:
                repo_id, tail = rest.split(marker, 1)
                tail = marker + tail
                break
        repo = self._repo(repo_id, token, body)
        if repo is None:
            return
        if tail == "" or tail.startswith("/revision/"):
            sha = self._commit(repo, unquote(tail.removeprefix("/revision/")) or "main", body)
            if sha is None:
                return
            info = {
                "_id": hashlib.md5(repo_id.encode()).hexdigest()[:24],
                "id": repo_id,
                "modelId": repo_id,
                "author": repo_id.split("/")[0] if "/" in repo_id else None,
                "sha": sha,
                "lastModified": "2026-01-01T00:00:00.000Z",
                "private": False,
                "gated": "manual" if repo.gated else False,
                "disabled": False,
                "tags": ["safetensors"],
                "downloads": 0,
                "likes": 0,
                "siblings": [{"rfilename": p} for p in sorted(repo.commits[sha])],
            }
            return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        if tail.startswith("/tree/"):
            rev, _, sub = tail.removeprefix("/tree/").partition("/")
            sha = self._commit(repo, unquote(rev), body)
            if sha is None:
                return
            return self._send(200, json.dumps(_tree(repo.commits[sha], unquote(sub))).encode(), {}, body)
        self._error(404, None, "Not Found", body)

    def _resolve(self, repo_id: str, rev: str, file: str, token: str | None, body: bool) -> None:
        repo = self._repo(repo_id, token, body)
        if repo is None:
            return
        if repo.gated and token != GRANTED:
            msg = f"Access to model {repo_id} is restricted. You must have access to it and be authenticated."
            return self._error(401 if token is None else 403, "GatedRepo", msg, body)
        sha = self._commit(repo, rev, body)
        if sha is None:
            return
        data = repo.commits[sha].get(file)
        if data is None:
            return self._error(404, "EntryNotFound", "Entry not found", body, **{"X-Repo-Commit": sha})
        headers = {"X-Repo-Commit": sha, "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
        if _is_lfs(file):
            digest = hashlib.sha256(data).hexdigest()
            headers |= {
                "ETag": f'"{digest}"',
                "X-Linked-Etag": f'"{digest}"',
                "X-Linked-Size": str(len(data)),
            }
        else:
            headers["ETag"] = f'"{_git_sha1(data)}"'
        self._send(200, data, headers, body)


def _tree(files: dict[str, bytes], sub: str) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = []
    folders = sorted({p.rsplit("/", 1)[0] for p in files if "/" in p})
    for folder in folders:
        if folder.startswith(sub):
            entries.append(
                {"type": "directory", "oid": _git_sha1(folder.encode()), "size": 0, "path": folder}
            )
    for path, data in sorted(files.items()):
        if not path.startswith(sub):
            continue
        entry: dict[str, Any] = {"type": "file", "oid": _git_sha1(data), "size": len(data), "path": path}
        if _is_lfs(path):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        entries.append(entry)
    return entries


@pytest.fixture(scope="module")
def hub() -> Iterator[MockHub]:
    server = MockHub()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _point_at(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, endpoint: str) -> Path:
    """huggingface_hub aimed at ``endpoint``, its home in tmp_path, no token, online; returns the hub cache."""
    home = tmp_path / "hf"
    cache = home / "hub"
    for var in (
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "HF_OIDC_RESOURCE",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    for name, value in {
        "ENDPOINT": endpoint,
        "HUGGINGFACE_CO_URL_TEMPLATE": endpoint + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(cache),
        "HF_TOKEN_PATH": str(home / "token"),
        "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"),
        "AGENT_HARNESSES_PATH": str(home / ".agent_harnesses.json"),
        "HF_XET_CACHE": str(home / "xet"),
        "HF_HUB_OFFLINE": False,
    }.items():
        monkeypatch.setattr(constants, name, value, raising=False)
    return cache


@pytest.fixture
def hf_cache(hub: MockHub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    with hub.lock:
        hub.requests.clear()
    return _point_at(monkeypatch, tmp_path, hub.url)


def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def _files(snap: Path) -> set[str]:
    return {str(p.relative_to(snap)) for p in snap.rglob("*") if p.is_file()}


# ------------------------------------------------------------------------------------- tests
def test_id_resolves_to_a_snapshot_of_the_allowed_files_only(hub, hf_cache):
    snap = resolve_checkpoint("org/tiny", progress=False)
    assert snap == hf_cache / "models--org--tiny" / "snapshots" / SHA_A
    assert _files(snap) == set(KILN_FILES)
    for name, data in KILN_FILES.items():
        assert (snap / name).read_bytes() == data, name
    np.testing.assert_array_equal(
        st_load((snap / "model.safetensors").read_bytes())["model.embed_tokens.weight"], np.full((4, 8), 0.5)
    )
    assert Tokenizer.from_file(str(snap / "tokenizer.json")).encode("the sky").ids == [1, 2]
    fetched = hub.fetched()
    assert not [p for p in NEVER if fetched[f"org/tiny:{p}"]], fetched  # not even a HEAD
    assert all(fetched[f"org/tiny:{p}"] >= 1 for p in KILN_FILES)
    allowed = ("/api/models/org/tiny/", "/org/tiny/resolve/", "/api/agent-harnesses")
    assert all(p.startswith(allowed) for _, p in hub.requests), hub.requests


def test_allow_patterns_list_what_kiln_reads_and_nothing_pickled_or_executable():
    from huggingface_hub.utils import filter_repo_objects

    kept = set(filter_repo_objects(list(KILN_FILES) + list(NEVER), allow_patterns=list(ALLOW_PATTERNS)))
    assert set(KILN_FILES) <= kept
    assert not kept & {
        "pytorch_model.bin",
        "modeling_x.py",
        "model.gguf",
        "flax_model.msgpack",
        "tf_model.h5",
    }
    for name in (
        "tokenizer.model",
        "vocab.json",
        "merges.txt",
        "chat_template.jinja",
        "x.safetensors.index.json",
    ):
        assert list(filter_repo_objects([name], allow_patterns=list(ALLOW_PATTERNS))) == [name]


def test_second_resolve_offline_reads_the_cache_with_no_request(hub, hf_cache, monkeypatch):
    first = resolve_checkpoint("org/tiny", progress=False)
    with hub.lock:
        hub.requests.clear()
    _offline(monkeypatch)
    assert resolve_checkpoint("org/tiny", progress=False) == first
    assert hub.requests == []


def test_online_resolve_of_a_cached_snapshot_downloads_nothing_again(hub, hf_cache):
    resolve_checkpoint("org/tiny", progress=False)
    with hub.lock:
        hub.requests.clear()
    resolve_checkpoint("org/tiny", progress=False)
    assert [p for m, p in hub.requests if m == "GET" and "/resolve/" in p] == []


def test_revision_pins_branch_tag_and_commit(hub, hf_cache, monkeypatch):
    main = resolve_checkpoint("org/pinned", progress=False)
    v2 = resolve_checkpoint("org/pinned", revision="v2", progress=False)
    by_sha = resolve_checkpoint("org/pinned", revision=SHA_B, progress=False)
    assert (main.name, v2.name, by_sha.name) == (SHA_A, SHA_B, SHA_B)
    assert json.loads((main / "config.json").read_text())["num_hidden_layers"] == 1
    assert json.loads((v2 / "config.json").read_text())["num_hidden_layers"] == 2
    assert st_load((v2 / "model.safetensors").read_bytes())["model.embed_tokens.weight"][0, 0] == 2.0
    assert st_load((main / "model.safetensors").read_bytes())["model.embed_tokens.weight"][0, 0] == 0.5
    _offline(monkeypatch)  # the tag is remembered in the cache
    assert resolve_checkpoint("org/pinned", revision="v2", progress=False) == v2


def test_index_fetches_exactly_its_shards(hub, hf_cache):
    snap = resolve_checkpoint("org/sharded", progress=False)
    assert _files(snap) == {
        "config.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    }
    assert hub.fetched()["org/sharded:consolidated.safetensors"] == 0


def test_id_without_organization(hub, hf_cache):
    assert _files(resolve_checkpoint("solo", progress=False)) == set(KILN_FILES)


@pytest.mark.parametrize("token", [None, VALID], ids=["anonymous-401", "logged-in-404"])
def test_missing_repo_names_the_id_and_the_fix(hub, hf_cache, monkeypatch, token):
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    with pytest.raises(KilnError) as err:
        resolve_checkpoint("org/no-such-model", progress=False)
    msg = str(err.value)
    assert "'org/no-such-model'" in msg and "not found" in msg and "typo" in msg
    assert "hf auth login" in msg and "HF_TOKEN" in msg and "\n" not in msg


def test_gated_repo_says_accept_the_license_then_set_hf_token(hub, hf_cache, monkeypatch):
    for token in (None, VALID):  # 401 anonymous, 403 with a token whose account did not accept
        if token:
            monkeypatch.setenv("HF_TOKEN", token)
        with pytest.raises(HubError) as err:
            resolve_checkpoint("org/gated", progress=False)
        msg = str(err.value)
        assert "'org/gated'" in msg and "gated" in msg and "accept its license" in msg
        assert f"{hub.url}/org/gated" in msg and "HF_TOKEN" in msg and "\n" not in msg
    monkeypatch.setenv("HF_TOKEN", GRANTED)  # HF_TOKEN is what the downloads send
    assert _files(resolve_checkpoint("org/gated", progress=False)) == set(KILN_FILES)


def test_refused_token(hub, hf_cache, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_expired")
    with pytest.raises(HubError, match=r"refused the token sent for 'org/tiny'.*HF_TOKEN"):
        resolve_checkpoint("org/tiny", progress=False)


def test_login_required_without_a_token(hub, hf_cache, monkeypatch):
    with pytest.raises(HubError, match=r"asks for a login to download 'org/login': run `hf auth login`"):
        resolve_checkpoint("org/login", progress=False)
    monkeypatch.setenv("HF_TOKEN", VALID)
    assert _files(resolve_checkpoint("org/login", progress=False)) == set(KILN_FILES)


def test_missing_revision_names_it(hub, hf_cache):
    with pytest.raises(HubError) as err:
        resolve_checkpoint("org/pinned", revision="v9", progress=False)
    msg = str(err.value)
    assert "'org/pinned'" in msg and "no revision 'v9'" in msg and "--revision" in msg


def test_offline_with_empty_cache(hub, hf_cache, monkeypatch):
    _offline(monkeypatch)
    with pytest.raises(HubError) as err:
        resolve_checkpoint("org/tiny", revision="main", progress=False)
    msg = str(err.value)
    assert "HF_HUB_OFFLINE=1" in msg and "'org/tiny'" in msg and "is not in the cache" in msg
    assert str(hf_cache) in msg and "run once online" in msg and "local checkpoint directory" in msg
    assert hub.requests == []


def test_config_only_then_offline_full_resolve_is_partly_cached(hub, hf_cache, monkeypatch):
    snap = resolve_checkpoint("org/tiny", progress=False, config_only=True)
    assert _files(snap) == {"config.json", "generation_config.json"}
    _offline(monkeypatch)
    with pytest.raises(HubError, match=r"'org/tiny' is only partly in the cache"):
        resolve_checkpoint("org/tiny", progress=False)


def test_hub_unreachable(hub, hf_cache, monkeypatch, tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    _point_at(monkeypatch, tmp_path, dead)
    with pytest.raises(HubError) as err:
        resolve_checkpoint("org/tiny", progress=False)
    msg = str(err.value)
    assert msg.startswith("could not download Hugging Face model 'org/tiny'") and dead in msg
    assert "network connection" in msg and "local checkpoint directory" in msg and "\n" not in msg


def test_hub_error_status(hub, hf_cache):
    with pytest.raises(HubError, match=r"answered HTTP 500 for 'org/down'.*retry later"):
        resolve_checkpoint("org/down", progress=False)


def test_repo_without_safetensors_is_refused(hub, hf_cache):
    with pytest.raises(
        HubError, match=r"'org/binonly' has no \*\.safetensors weights; kiln reads safetensors"
    ):
        resolve_checkpoint("org/binonly", progress=False)
    assert hub.fetched()["org/binonly:pytorch_model.bin"] == 0


def test_progress_bars_only_when_asked(hub, hf_cache, monkeypatch, capsys):
    monkeypatch.setenv("TQDM_POSITION", "-1")  # huggingface_hub then draws its bars off a terminal too
    bars = sys.modules["huggingface_hub.utils.tqdm"]  # not disabled by HF_HUB_DISABLE_PROGRESS_BARS or code
    monkeypatch.setattr(bars, "HF_HUB_DISABLE_PROGRESS_BARS", None)
    monkeypatch.setattr(bars, "progress_bar_states", {})
    resolve_checkpoint("org/tiny", progress=False)
    assert "Fetching" not in capsys.readouterr().err
    resolve_checkpoint("org/pinned", progress=True)
    assert "Fetching" in capsys.readouterr().err


# ------------------------------------------------------------------------- local arguments
def test_local_directory_passes_through_untouched(hub, hf_cache, tmp_path, monkeypatch):
    ckpt = tmp_path / "org" / "tiny"  # spelled like a Hub id, and it exists: the directory wins
    ckpt.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert is_local("org/tiny")
    assert resolve_checkpoint("org/tiny") == Path("org/tiny")
    assert resolve_checkpoint(str(ckpt)) == ckpt
    assert hub.requests == [] and not hf_cache.exists()
    with pytest.raises(HubError, match=r"--revision 'v2' applies to Hugging Face model ids only"):
        resolve_checkpoint(str(ckpt), revision="v2")


@pytest.mark.parametrize(
    ("arg", "pattern"),
    [
        ("./missing", r"checkpoint directory './missing' does not exist"),
        ("/no/such/dir", r"checkpoint directory '/no/such/dir' does not exist"),
        ("models/llama/8b", r"checkpoint directory 'models/llama/8b' does not exist"),
        ("bad id!", r"'bad id!' is neither an existing directory nor a Hugging Face model id"),
        ("org/-x", r"neither an existing directory nor a Hugging Face model id"),
        ("org/a--b", r"neither an existing directory nor a Hugging Face model id"),
        ("", r"the checkpoint argument is empty"),
    ],
)
def test_bad_arguments_fail_before_any_request(hub, hf_cache, tmp_path, monkeypatch, arg, pattern):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(HubError, match=pattern):
        resolve_checkpoint(arg)
    assert hub.requests == []


def test_a_file_is_not_a_checkpoint(tmp_path):
    f = tmp_path / "config.json"
    f.write_text("{}")
    with pytest.raises(HubError, match=r"is a file, not a directory"):
        resolve_checkpoint(str(f))


def test_id_and_path_shapes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen3-30B-A3B", "gpt2", "org/name_v1.5"):
        assert is_hub_id(name) and not is_local(name), name
    for name in ("/abs", "~/models/x", "./x", "../x", ".", "a/b/c", "a/", "C:\\models\\x"):
        assert is_local(name), name
    for name in ("a b", "org/.x", "org/x.", "a..b", "x.git", "o/" + "n" * 97, "a/b/c"):
        assert not is_hub_id(name), name


def test_kiln_compile_and_llm_take_a_hub_id(hub, hf_cache, monkeypatch, demo_one_rank, tmp_path):
    """The wiring: `kiln compile ORG/NAME` and `LLM(ORG/NAME)` (so serve / generate / bench) fetch
    the demo checkpoint from the Hub (here the mock) and compile it, the second through the cache."""
    from click.testing import CliRunner

    from kiln.cli import cli
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    ckpt = demo_one_rank.parent / "checkpoint"
    files = {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()}
    monkeypatch.setitem(REPOS, "org/demo", Repo({SHA_A: files}))
    args = ["--dtype", "float32", "--max-batch-size", "4", "--max-seq-len", "256"]
    r = CliRunner().invoke(
        cli, ["compile", "org/demo", "-o", str(tmp_path / "art"), "--device", "cpu", *args]
    )
    assert r.exit_code == 0, r.output
    assert (tmp_path / "art" / "manifest.json").is_file()
    llm = LLM("org/demo", device="cpu", cache_dir=str(tmp_path / "cache"), compile_args=" ".join(args))
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7]], sp)[0].token_ids) == 4
    assert hub.fetched()["org/demo:config.json"] >= 1


def test_kiln_inspect_of_a_hub_id_reads_its_config_only(hub, hf_cache, monkeypatch, demo_one_rank):
    from click.testing import CliRunner

    from kiln.cli import cli

    ckpt = demo_one_rank.parent / "checkpoint"
    files = {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()}
    monkeypatch.setitem(REPOS, "org/demo2", Repo({SHA_A: files}))
    r = CliRunner().invoke(cli, ["inspect", "org/demo2", "--json"])
    assert r.exit_code == 0, r.output
    want = json.loads(files["config.json"])
    assert json.loads(r.output)["architecture"] == want["architectures"][0]
    fetched = {k for k in hub.fetched() if k.startswith("org/demo2:")}
    assert "org/demo2:config.json" in fetched
    assert not any(k.endswith(".safetensors") or "tokenizer" in k for k in fetched)
