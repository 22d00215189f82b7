"""Start-up (issue 32): what the serving path imports, and what a start-up leaves for later.

The import checks run in a fresh interpreter each (this one has imported everything already):
a heavy module that creeps back onto the path of ``LLM``, ``kiln serve`` or the CLI fails them.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref

import pytest

from kiln import gc_paused

# Modules the serving path must not import: transformers (seconds; the tokenizer is the Rust
# `tokenizers` over the artifact's files), the compiler (the runtime never imports it), xgrammar
# (only when a request has a grammar), jinja2 (only when a chat template renders), huggingface_hub
# (only for a Hub id), torch's compiler stack (what the custom-op dispatcher would pull in: 6 s of
# the H200 start-up once).
HEAVY = (
    "transformers",
    "kiln.compiler",
    "xgrammar",
    "tvm_ffi",
    "jinja2",
    "huggingface_hub",
    "torch._dynamo",
    "torch._inductor",
)


class _Node:
    def __init__(self, cycle: list) -> None:
        self.cycle = cycle
        cycle.append(self)


def _modules_after(code: str) -> set[str]:
    """``sys.modules`` of a fresh interpreter after it ran ``code``."""
    probe = code + "\nimport json, sys\nprint('MODULES ' + json.dumps(sorted(sys.modules)))\n"
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("MODULES "))
    return set(json.loads(line.split(" ", 1)[1]))


def _heavy(mods: set[str]) -> list[str]:
    return [h for h in HEAVY if any(m == h or m.startswith(h + ".") for m in mods)]


def test_serving_entry_points_import_no_heavy_module():
    mods = _modules_after(
        "from kiln import LLM, SamplingParams\n"
        "import kiln.runtime.engine, kiln.runtime.server, kiln.runtime.server_run\n"
        "import kiln.runtime.cli_serve, kiln.runtime.cli_generate\n"
    )
    assert "kiln.runtime.engine" in mods and "fastapi" in mods  # the probe imported the path
    assert _heavy(mods) == []


def test_cli_commands_import_only_their_own_modules():
    """`kiln serve|generate|bench --help` (click builds each command from its module): no torch,
    no kernels, no compiler until a command runs."""
    mods = _modules_after(
        "from kiln.cli import cli\n"
        "for name in ('serve', 'generate', 'bench'):\n"
        "    assert cli.get_command(None, name) is not None\n"
    )
    assert "kiln.runtime.cli_serve" in mods and "kiln.runtime.cli_bench" in mods
    assert [m for m in ("torch", "triton", "kiln.ops", "kiln.compiler") if m in mods] == []


def test_a_loaded_engine_serves_without_heavy_modules(demo_artifact):
    """Loading the artifact (weights, graphs, tokenizer, detokenizer tables) and completing a text
    prompt import none of them either."""
    mods = _modules_after(
        "from kiln import LLM, SamplingParams\n"
        f"llm = LLM({str(demo_artifact)!r}, device='cpu')\n"
        "out = llm.generate(['Once upon a time'], SamplingParams(max_tokens=3, temperature=0))\n"
        "assert len(out[0].token_ids) == 3 and out[0].text\n"
    )
    assert "kiln.ops" in mods and "tokenizers" in mods
    assert _heavy(mods) == []


def test_bench_startup_breaks_the_imports_down_by_package(demo_artifact, tmp_path):
    """`kiln bench startup --imports N`: the child's imports by package, which add up to all of
    them (-X importtime's own time of every module)."""
    from click.testing import CliRunner

    from kiln.cli import cli

    out = tmp_path / "startup.json"
    r = CliRunner().invoke(
        cli, ["bench", "startup", str(demo_artifact), "--runs", "1", "--imports", "4", "--json", str(out)]
    )
    assert r.exit_code == 0, r.output
    assert (
        "imports by package (-X importtime): torch " in r.output and "beside them: weights_load" in r.output
    )
    imports = json.loads(out.read_text())["startup"]["imports"]
    assert {"torch", "kiln.ops", "kiln.runtime", "tokenizers"} <= set(imports)
    assert list(imports.values()) == sorted(imports.values(), reverse=True)
    assert not {"transformers", "kiln.compiler", "xgrammar", "jinja2"} & set(imports)


def test_import_breakdown_adds_up_to_the_imports():
    from kiln.runtime.benchmark import import_breakdown

    p = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import kiln.manifest"], capture_output=True, text=True
    )
    rows = [x.split("|") for x in p.stderr.splitlines() if x.startswith("import time:") and "self" not in x]
    top_level = sum(int(c) for _, c, name in rows if not name.startswith("  ")) * 1e-6
    parts = import_breakdown(p.stderr)
    assert "kiln.manifest" in parts and "json" in parts
    assert sum(parts.values()) == pytest.approx(top_level, rel=0.01)  # (each figure rounded to 1 us)


def test_byte_token_ids_by_lookup_equal_a_vocabulary_scan(tmp_path):
    """The byte-fallback ids the window path needs come from 484 lookups, not a pass over the
    vocabulary: the same ids for both kinds of tokenizer kiln builds."""
    from kiln.compiler.synth_tokenizer import build_tokenizer
    from kiln.runtime.detokenizer import _BYTE_TOKEN, _byte_ids_cache, _byte_token_ids
    from kiln.runtime.tokenizer import load_tokenizer

    for byte_fallback in (False, True):
        d = tmp_path / str(byte_fallback)
        build_tokenizer(d, vocab_size=4096, byte_fallback=byte_fallback)
        tok = load_tokenizer(d)
        vocab = tok.get_vocab()
        scan = {i for t, i in vocab.items() if len(t) == 6 and _BYTE_TOKEN.match(t)}
        _byte_ids_cache.clear()
        ids, _ = _byte_token_ids(tok)
        assert ids == scan and len(ids) == (256 if byte_fallback else 0)


def test_server_start_leaves_the_length_bound_to_long_texts(demo_one_rank, monkeypatch) -> None:
    """``kiln serve`` no longer reads the whole tokenizer for its length bound at start-up (0.5 s
    for a 128k vocabulary): only a text long enough for the bound to refuse it computes it, once."""
    pytest.importorskip("fastapi")
    from kiln.runtime import server
    from kiln.runtime.engine import Engine, EngineOptions
    from kiln.runtime.server_protocol import APIError

    calls: list[int] = []
    real = server.chars_per_token_bound

    def counted(tok: object) -> int | None:
        calls.append(1)
        return real(tok)

    monkeypatch.setattr(server, "chars_per_token_bound", counted)
    engine = Engine(str(demo_one_rank), EngineOptions(device="cpu", log=False))
    st = server.create_app(engine).state.kiln
    assert calls == []
    assert st._tokenize("Once upon a time", True, "prompt") == engine.encode("Once upon a time")
    assert calls == []  # shorter than max_request_tokens characters: the bound cannot refuse it
    bound = real(engine.tokenizer)
    assert bound is not None
    huge = "a" * (bound * st.max_request_tokens)  # at least max_request_tokens tokens by the bound
    with pytest.raises(APIError) as e:
        st._tokenize(huge, True, "prompt")
    assert "at least" in e.value.body()["error"]["message"] and calls == [1]
    assert st.chars_per_token == bound and calls == [1]  # computed once


def test_gc_paused_nests_restores_and_ages_what_it_made() -> None:
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner pause found it off: leaves it off
        made = [[i] for i in range(5000)]  # tracked objects, counted in the youngest generation
        assert gc.get_count()[0] >= 5000
        runs: list[int] = []
        gc.callbacks.append(lambda phase, info: runs.append(info["generation"]))
    try:
        assert gc.isenabled()
        more = [[i] for i in range(100)]  # (an allocation would walk `made` were it still young)
    finally:
        gc.callbacks.pop()
    assert runs == [] and gc.get_freeze_count() == 0  # moved on unexamined, not left frozen
    assert any(x is made[0] for x in gc.get_objects(generation=2)) and more
    a: list = []
    b: list = [a]
    a.append(b)  # a cycle, made unreachable in a pause, is still collected
    ref = weakref.ref(_Node(a))
    with gc_paused():
        del a, b
    gc.collect()
    assert ref() is None
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a collector the caller turned off stays off
    finally:
        gc.enable()


def test_switch_interval_is_short_beside_the_weight_stream_on_a_gpu_only(demo_one_rank) -> None:
    """The loader shortens the interpreter's switch interval while this thread runs Python beside
    the weight stream, on a GPU (its readers then get the GIL within 0.1 ms, not 5): not on a CPU,
    where it measured no faster; restored after either way."""
    from kiln.runtime.loader import OVERLAP_SWITCH_INTERVAL_S, _switch_interval, load_model

    default = sys.getswitchinterval()
    seen: list[float] = []
    load_model(str(demo_one_rank), "cpu", while_weights_load=lambda art: seen.append(sys.getswitchinterval()))
    assert seen == [default] and sys.getswitchinterval() == default
    with _switch_interval(OVERLAP_SWITCH_INTERVAL_S):
        assert sys.getswitchinterval() == pytest.approx(OVERLAP_SWITCH_INTERVAL_S)
    assert sys.getswitchinterval() == default


def test_one_rank_engine_builds_its_runner_while_the_weights_stream(demo_one_rank, monkeypatch) -> None:
    """A one-rank engine builds its KV pool and model runner (its CUDA graphs on a GPU) inside
    ``load_model``'s ``weights_placed``, beside the weight stream and before the tokenizer, on the
    very tensors the load returns (every other one-rank engine test serves from such a build)."""
    import kiln.runtime.engine as engine_mod
    from kiln.runtime.engine import Engine, EngineOptions

    order: list[str] = []
    load, build, tok = engine_mod.load_model, Engine._build_runner, engine_mod.load_tokenizer

    def spy_load(*a, **kw):
        model = load(*a, **kw)
        order.append("loaded")
        return model

    def spy_build(self, model, opts, draft):
        order.append("runner")
        build(self, model, opts, draft)
        self.placed = model.weights

    def spy_tok(*a, **kw):
        order.append("tokenizer")
        return tok(*a, **kw)

    monkeypatch.setattr(engine_mod, "load_model", spy_load)
    monkeypatch.setattr(Engine, "_build_runner", spy_build)
    monkeypatch.setattr(engine_mod, "load_tokenizer", spy_tok)
    engine = Engine(str(demo_one_rank), EngineOptions(device="cpu", log=False))
    assert order == ["runner", "tokenizer", "loaded"]
    assert engine.placed is engine.model.weights and engine.runner.m is engine.model
    assert {"kv_pool", "cuda_graphs", "tokenizer", "weights_load"} <= set(engine.model.phases)


def test_a_failed_load_beside_an_early_build_still_names_the_altered_file(demo_one_rank, tmp_path) -> None:
    """The early build (``weights_placed``) runs on the placed tensors before the check of their
    data finishes: an altered weight file is still refused, after the build, with its name."""
    import shutil

    from kiln.runtime.loader import load_model
    from kiln.weights.index import PackError

    art = tmp_path / "art"
    shutil.copytree(demo_one_rank, art)
    f = art / "weights" / "rank0.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF  # the last byte: tensor data, not the header
    f.write_bytes(bytes(data))
    built: list[bool] = []
    with pytest.raises(PackError, match=f.name):
        load_model(str(art), "cpu", weights_placed=lambda model: built.append(True))
    assert built == [True]


def test_the_early_build_runs_only_on_an_artifact_whose_files_check(demo_one_rank, tmp_path) -> None:
    """``weights_placed`` runs the artifact's kernels and graph code (the capture's warm-ups): it
    runs only once the file hashes have checked; and a failure in it while the weights turn out
    altered is reported as the altered weight file, not as the failure it caused."""
    import json
    import shutil

    from kiln.runtime.artifact import ArtifactError
    from kiln.runtime.loader import load_model
    from kiln.weights.index import PackError

    art = tmp_path / "art"
    shutil.copytree(demo_one_rank, art)
    files = json.loads((art / "manifest.json").read_text())["files"]
    rel = next(r for r, f in files.items() if f.get("xxh3_128") and r.endswith("tokenizer.json"))
    data = bytearray((art / rel).read_bytes())
    i = data.index(b'"', 100)
    data[i + 1] ^= 0x01  # still JSON that parses: only the hash tells
    (art / rel).write_bytes(bytes(data))
    built: list[bool] = []
    with pytest.raises(ArtifactError, match="hash"):
        load_model(str(art), "cpu", weights_placed=lambda model: built.append(True))
    assert built == []

    def boom(model) -> None:
        raise RuntimeError("a warm-up failed")

    (art / rel).write_bytes((demo_one_rank / rel).read_bytes())  # the files check again
    f = art / "weights" / "rank0.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF  # weight data: checked where it landed, after the build began
    f.write_bytes(bytes(data))
    with pytest.raises(PackError, match=f.name):  # not the RuntimeError it explains
        load_model(str(art), "cpu", weights_placed=boom)


@pytest.mark.parametrize("overlap", [True, False])
def test_startup_graphs_smallest_captures_the_rest_between_steps(demo_one_rank, monkeypatch, overlap) -> None:
    """``startup_graphs=smallest``: the engine starts with the smallest decode graph; the bucket a
    batch needs (growing at admission, shrinking as requests finish) is captured when no step is in
    flight, the rest while the engine is idle, and the tokens are those of an engine that captured
    every graph at start. Captures are recorded by a stand-in (no GPU here) that writes the padding
    inputs and runs the warm-ups as the real one does, and whose replays run the graph eagerly."""
    from kiln import SamplingParams
    from kiln.runtime.engine import Engine, EngineOptions
    from kiln.runtime.model_runner import ModelRunner

    engines: list = []
    captured: list[list[int]] = []

    class Replay:
        def __init__(self, runner, b: int) -> None:
            self.runner, self.b = runner, b

        def replay(self) -> None:
            self.runner._out[self.b].copy_(self.runner._run_decode_graph(self.b))

    def fake_capture(self, buckets, verify=False) -> None:
        if engines and hasattr(engines[-1], "stepper"):
            assert engines[-1].stepper.inflight is None, "a capture while a step is in flight"
        captured.append(sorted(buckets))
        self._i64.zero_()  # the real capture's padding inputs, then two warm-ups and the capture
        self._i32[0].zero_()
        self._i32[1].fill_(1)
        for b in sorted(buckets, reverse=True):
            for _ in range(2):
                self._run_decode_graph(b)
            self.graphs[b], self._out[b] = Replay(self, b), self._run_decode_graph(b).clone()
            self.pending_graphs.remove(b)

    monkeypatch.setattr(ModelRunner, "CAPTURE_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(ModelRunner, "_capture", fake_capture)

    def run(startup: str) -> list[list[int]]:
        opts = EngineOptions(device="cpu", log=False, startup_graphs=startup, overlap=overlap)
        engine = Engine(str(demo_one_rank), opts)
        engines.append(engine)
        reqs = [  # 7 requests finishing one after another: batches 7 down to 1
            engine.add_request(
                [5 + i, 7, 11 + i], SamplingParams(max_tokens=2 + 2 * i, temperature=0, ignore_eos=True)
            )
            for i in range(7)
        ]
        engine.run_until_done()
        return [list(r.output_ids) for r in reqs]

    want = run("all")
    buckets = list(engines[-1].runner.decode_buckets)
    assert captured == [buckets]
    captured.clear()
    got = run("smallest")
    assert got == want
    engine = engines[-1]
    # at start; then, between steps, the batch of 7's bucket and those of the shrinking batch
    assert captured[0] == [1] and [8] in captured and [4] in captured and [2] in captured
    while engine.idle():  # the rest while idle
        pass
    assert not engine.runner.pending_graphs and sorted(b for c in captured for b in c) == buckets
    # what the benchmarks call before timing: every pending graph at once
    fresh = Engine(str(demo_one_rank), EngineOptions(device="cpu", log=False, startup_graphs="smallest"))
    assert sorted(fresh.runner.pending_graphs) == buckets[1:]
    assert fresh.finish_captures() == len(buckets) - 1 and not fresh.runner.pending_graphs
    assert fresh.finish_captures() == 0
