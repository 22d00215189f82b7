"""bench/report.py's speculative-decoding table: issue 30's ratios and computed tok/s from the
decode-step benchmark's verify and draft rows."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "bench" / "report.py"


def _report():
    spec = importlib.util.spec_from_file_location("bench_report_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def test_speculative_table_from_verify_and_draft_rows(capsys):
    rows = [
        {"batch": 1, "drafts": 0, "plan": "gemv", "ms": 3.8},
        {"batch": 1, "drafts": 4, "plan": "gemv", "ms": 4.1},
        {"batch": 1, "drafts": 4, "plan": "cublas", "ms": 4.5},  # not what the artifact runs
        {"batch": 1, "draft": "llama-3.2-1b", "ms": 0.9},
        {"batch": 8, "drafts": 0, "plan": "gemv", "ms": 4.0},  # no verify(4) at 8: no computed tok/s
        {"name": "a kernel", "ms": 0.01},
    ]
    (one, eight) = _report().speculative_table(rows)
    assert one["verify4_over_decode"] == pytest.approx(4.1 / 3.8)
    assert one["plain_tok_s"] == pytest.approx(1 / 3.8e-3)
    for L in (2, 3, 4):
        assert one[f"llama-3.2-1b_L{L}_tok_s_computed"] == pytest.approx(L / (4.1 + 4 * 0.9) * 1e3)
    assert eight == {"batch": 8, "decode_ms": 4.0, "plain_tok_s": pytest.approx(2000.0)}
    assert "verify4_over_decode" in capsys.readouterr().out
