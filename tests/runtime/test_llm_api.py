"""The offline API's contract with its users (``kiln.LLM``) and the start-up checks of the options
every entry point shares: streams and generate() calls that interleave each get all of their own
outputs; a value no engine can run with fails at once, naming its field; bad prompts and
parameters are refused with one-line errors."""

import json
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from kiln.cli import cli
from kiln.runtime.engine import EngineOptions, OptionError, RequestError
from kiln.runtime.grammar import StructuredOutputs
from kiln.runtime.llm import LLM
from kiln.runtime.sampling_params import InvalidSamplingParams, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def llm(demo_artifact):
    return LLM(str(demo_artifact), device="cpu")


def _settled(llm):
    """No box left and no request unfinished (a step launched ahead by the overlap may be in flight)."""
    return not llm._boxes and not llm.engine.scheduler.has_work()


def _within(seconds, fn):
    """``fn()``'s result, or a failure (not a hang) when it does not return in time."""
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("out", fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"no result within {seconds} s (a lost output leaves its reader waiting)"
    return box["out"]


def test_streams_and_generate_interleave_without_losing_outputs(llm):
    want = {p: llm.generate(p, GREEDY)[0].token_ids for p in ("Alpha", "Beta", "Gamma")}

    def run():
        a, b = llm.stream("Alpha", GREEDY), llm.stream("Beta", GREEDY)
        first_b = next(b)  # b's request runs while a is read to its end
        got_a = list(a)
        mid = llm.generate("Gamma", GREEDY)[0]  # steps b's request further, unread
        got_b = [first_b, *b]
        return got_a, got_b, mid

    got_a, got_b, mid = _within(120, run)
    assert got_a[-1].finished and got_b[-1].finished
    assert got_a[-1].token_ids == want["Alpha"] and got_b[-1].token_ids == want["Beta"]
    for got in (got_a, got_b):  # every delta arrived, in order
        assert [t for o in got for t in o.new_token_ids] == got[-1].token_ids
        assert "".join(o.new_text for o in got) == got[-1].text
    assert mid.token_ids == want["Gamma"]
    assert _settled(llm)  # nothing left behind


def test_an_abandoned_stream_is_aborted(llm):
    s = llm.stream("Alpha", SamplingParams(max_tokens=50, temperature=0))
    next(s)
    s.close()
    assert _settled(llm)
    assert llm.generate("Beta", GREEDY)[0].finish_reason == "length"


def test_bad_sampling_params_and_prompts_are_refused(llm):
    with pytest.raises(InvalidSamplingParams, match=r"^n: "):
        llm.generate(["Hello"], SamplingParams(n=0))
    with pytest.raises(InvalidSamplingParams, match="use generate"):
        next(llm.stream("Hello", SamplingParams(n=2)))
    for bad in ([1.7, 2.2], [True, False], None, [1, "2"]):
        with pytest.raises(RequestError, match="list of token ids"):
            llm.generate([bad], GREEDY)
    ids = llm.tokenizer.encode("Hello", add_special_tokens=False)
    plain = llm.generate([ids], GREEDY)[0].token_ids
    assert llm.generate([np.array(ids)], GREEDY)[0].token_ids == plain
    assert llm.generate([[np.int64(t) for t in ids]], GREEDY)[0].token_ids == plain
    with pytest.raises(ValueError, match=r"messages\[0\] must be a dict with a 'role'"):
        llm.chat([{"content": "Hi!"}])
    assert _settled(llm)


def test_a_json_schema_may_be_a_dict(llm):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    as_dict = StructuredOutputs(json_schema=schema)
    assert as_dict == StructuredOutputs(json_schema=json.dumps(schema)) and hash(as_dict)
    assert StructuredOutputs(choice=["x", "y"]).choice == ("x", "y")
    text = StructuredOutputs(json_schema=json.dumps(schema))
    outs = [
        llm.generate("Hi", SamplingParams(max_tokens=12, temperature=0, structured=st))[0]
        for st in (as_dict, text)
    ]
    assert outs[0].token_ids == outs[1].token_ids and outs[0].text.lstrip().startswith("{")


@pytest.mark.parametrize(
    "field, value, flag",
    [("chunk_size", -5, "--chunk-size"), ("chunk_size", 0, "--chunk-size"), ("max_running", 0, "--max-running"),
     ("max_running", -1, "--max-running"), ("kv_memory_gib", -1.0, "--kv-memory"), ("kv_memory_gib", 0.0, "--kv-memory")],
)  # fmt: skip
def test_engine_options_refuse_values_no_engine_runs_with(field, value, flag):
    with pytest.raises(OptionError, match=rf"^{field} \({flag}\) must be") as e:
        EngineOptions(**{field: value})
    assert e.value.param == field
    EngineOptions(chunk_size=1, max_running=1, kv_memory_gib=0.01)  # the least values pass


def _kiln(*args):
    return subprocess.run(
        [sys.executable, "-m", "kiln", *map(str, args)], capture_output=True, text=True, timeout=120
    )


def test_cli_refuses_bad_options_before_loading(demo_artifact):
    r = _kiln("generate", demo_artifact, "hi", "--chunk-size", "-1")
    assert r.returncode == 2 and "chunk_size (--chunk-size) must be >= 1, got -1" in r.stderr
    assert "Traceback" not in r.stderr
    r = CliRunner().invoke(cli, ["serve", str(demo_artifact), "--port", "99999"])
    assert r.exit_code == 2 and "--port" in r.output and "0<=x<=65535" in r.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line(demo_artifact):
    r = _kiln("generate", demo_artifact, "hi", "--device", "cuda")
    assert r.returncode == 2 and "device (cuda): no CUDA device is available" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_port_in_use_fails_before_the_load():
    from kiln.runtime.server_run import BindError, check_bindable

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(BindError, match=f"--port {port}: cannot bind"):
            check_bindable("127.0.0.1", port)
    check_bindable("127.0.0.1", port)  # free again


def test_a_stream_closed_inside_a_step_is_aborted_after_it(llm, monkeypatch):
    """A stream finalized while the engine steps (the garbage collector may run there) does not
    abort its request inside the step (its pages would be freed under the step's feet): after it."""
    a = llm.stream("Alpha", SamplingParams(max_tokens=50, temperature=0))
    next(a)
    step, abort = llm.engine.step, llm.engine.abort
    aborted_inside = []

    def stepping():
        a.close()  # as a collector finalizing the generator here would
        return step()

    monkeypatch.setattr(llm.engine, "step", stepping)
    monkeypatch.setattr(llm.engine, "abort", lambda rid: aborted_inside.append(llm._stepping) or abort(rid))
    b = llm.generate("Beta", GREEDY)[0]
    assert aborted_inside == [False] and b.token_ids == llm.generate("Beta", GREEDY)[0].token_ids
    assert _settled(llm)
