"""Graphs loaded from their generated Python source: integrity checks and the format switch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from kiln.runtime.artifact import open_artifact
from kiln.runtime.graph_code import CodeGraph, GraphCodeError
from kiln.runtime.loader import graph_format, load_graphs


def test_artifact_records_python_graph(demo_artifact):
    m = json.loads((demo_artifact / "manifest.json").read_text())
    code = m["graphs"]["model"]["python"]
    assert code["file"] == "graphs/model.py" and code["file"] in m["files"]
    assert code["num_inputs"] == len(m["graphs"]["model"]["inputs"])
    assert len(code["weight_keys"]) == len(set(code["weight_keys"])) > 0
    src = (demo_artifact / code["file"]).read_text()
    assert "torch.ops.kiln." in src and "import " not in src  # graph calls only, nothing imported


def test_tampered_source_is_refused(demo_artifact, tmp_path):
    art_dir = tmp_path / "art"
    shutil.copytree(demo_artifact, art_dir)
    py = art_dir / "graphs" / "model.py"
    src = py.read_text()
    py.write_text(src.replace("torch.ops.kiln.", "torch.ops.kilN.", 1)[: len(src)].ljust(len(src)))
    art = open_artifact(art_dir, "cpu")  # same size: only the hash tells
    with pytest.raises(GraphCodeError, match="does not match its hash"):
        load_graphs(art, "python")
    assert not isinstance(load_graphs(art, "pt2")["model"], CodeGraph)  # the .pt2 still loads


def test_format_switch(monkeypatch, demo_artifact):
    monkeypatch.setenv("KILN_GRAPH_FORMAT", "onnx")
    with pytest.raises(ValueError, match="KILN_GRAPH_FORMAT"):
        graph_format()
    monkeypatch.delenv("KILN_GRAPH_FORMAT")
    assert graph_format() == "python"
    graphs = load_graphs(open_artifact(demo_artifact, "cpu"))
    assert isinstance(graphs["model"], CodeGraph)
    with pytest.raises(TypeError, match="inputs"):
        graphs["model"]({}, torch.zeros(1))


def test_loader_supplies_exactly_the_names_the_compiler_allows():
    # the two sides of the boundary (runtime never imports compiler) keep one list each
    from kiln.compiler.graph_code import ALLOWED_GLOBALS
    from kiln.runtime.graph_code import GLOBALS

    assert set(GLOBALS) == ALLOWED_GLOBALS


def test_direct_dispatch_matches_the_dispatcher(monkeypatch, demo_artifact):
    from kiln import LLM, SamplingParams
    from kiln.runtime import graph_code

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    runs = []
    for direct in (True, False):
        if not direct:  # the graphs see the real torch: their op calls go through the dispatcher
            monkeypatch.setattr(graph_code, "_direct_torch", lambda: torch)
        llm = LLM(str(demo_artifact), cuda_graph=False)
        graph = llm.engine.model.graphs["model"]
        assert isinstance(graph, CodeGraph) and (graph.forward.__globals__["torch"] is torch) != direct
        out = llm.generate([[5, 9, 200, 31], "a longer prompt than that"], params)
        runs.append([(o.token_ids, o.logprobs) for o in out])
    assert runs[0] == runs[1]


def test_direct_dispatch_never_imports_dynamo(demo_artifact):
    # the dispatcher's first custom-op call imports torch._dynamo: ~6 s of start-up on the H200 host
    child = (
        "import sys; from kiln import LLM, SamplingParams; "
        f"llm = LLM({str(demo_artifact)!r}); "
        "out = llm.generate(['hi'], SamplingParams(max_tokens=3, temperature=0.0)); "
        "print('DYNAMO', 'torch._dynamo' in sys.modules, len(out[0].token_ids))"
    )
    p = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "DYNAMO False 3" in p.stdout, p.stdout


def test_generated_code_runs_on_the_rank_device():
    """A graph traced on ``cuda:0`` names that device in its code (``_assert_tensor_metadata``,
    factory ops); rank 1 of a tensor-parallel run executes it on ``cuda:1``: the code's devices of
    the run's type follow the run's device, others stay as written (fails without the mapping:
    'Tensor device mismatch! Expected: cuda:0, Got: cuda:1' on the H200 pair)."""
    from kiln.runtime.graph_code import _devices_on

    on_rank1 = _devices_on(torch.device("cuda", 1))
    assert on_rank1(type="cuda", index=0) == torch.device("cuda", 1)
    assert on_rank1(type="cpu") == torch.device("cpu")
    assert _devices_on(None)(type="cuda", index=0) == torch.device("cuda", 0)
