"""bench/gpu/replay_timeline.py's analysis of a profiler trace, on a made-up one: graph kernels told
from the rest by the ``cudaGraphLaunch`` correlation, each kernel's share of the critical path
from the ends (a PDL kernel starts early and waits), one middle layer found by its period."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu" / "replay_timeline.py"


@pytest.fixture
def timeline(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # its helper module beside it
    spec = importlib.util.spec_from_file_location("replay_timeline", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


LAYER = [("qkv", 5.0), ("rope", 1.0), ("attn", 3.0), ("o", 4.0)]


def _trace(steps: int, layers: int) -> dict:
    """``steps`` replays of embed + ``layers`` x LAYER + lm_head, each kernel starting 0.5 us before
    the previous one ends (PDL), then an argmax outside the graph and a 10 us gap."""
    events, t = [], 0.0
    for s in range(steps):
        corr = 100 + s
        events.append(
            {
                "cat": "cuda_runtime",
                "name": "cudaGraphLaunch",
                "ts": t,
                "dur": 1,
                "args": {"correlation": corr},
            }
        )
        for name, us in [("embed", 2.0)] + LAYER * layers + [("lm_head", 50.0)]:
            events.append(
                {
                    "cat": "kernel",
                    "name": f"{name}(int)",
                    "ts": t - 0.5,
                    "dur": us + 0.5,
                    "args": {"correlation": corr},
                }
            )
            t += us
        events.append(
            {"cat": "kernel", "name": "argmax", "ts": t + 1, "dur": 3.0, "args": {"correlation": 900 + s}}
        )
        t += 10.0
    return {"traceEvents": events}


def test_critical_path_by_kernel_and_layer(timeline):
    res = timeline.analyse(_trace(steps=6, layers=4), layers=4)
    assert res["steps"] == 4  # the first and last replays are dropped
    assert res["kernels_per_step"] == 2 + 4 * len(LAYER)
    crit = {name: c for name, c, _own, _per in res["critical_path_us"]}
    assert crit == {"lm_head": 50.0, "qkv": 20.0, "o": 16.0, "attn": 12.0, "rope": 4.0, "embed": 2.5}
    assert res["middle_layer"] == [(name, us) for name, us in LAYER]  # in launch order, from qkv
    assert res["graph_span_us"] == pytest.approx(2.5 + 4 * 13.0 + 50.0)
    assert res["step_period_us"] == pytest.approx(2.0 + 4 * 13.0 + 50.0 + 10.0)
    assert res["between_replays_us"] == {"argmax": 3.0}
    assert res["prologue_epilogue_us"] == pytest.approx(52.5)


def test_a_trace_without_replays_is_refused(timeline):
    with pytest.raises(SystemExit, match="no CUDA-graph replay"):
        timeline.analyse({"traceEvents": []}, layers=1)
