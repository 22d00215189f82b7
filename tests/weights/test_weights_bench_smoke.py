"""The weights benchmarks still run (CPU smoke mode: a tiny config, no CUDA ceilings)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from weights_helpers import CONFIGS, hf_tensors

ROOT = Path(__file__).resolve().parents[2]


def test_make_checkpoint_cli(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "make_checkpoint_cli", ROOT / "bench" / "make_checkpoint.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    (tmp_path / "config.json").write_text(json.dumps(CONFIGS["qwen3"]))
    out = tmp_path / "ck"
    args = [
        "--config",
        str(tmp_path / "config.json"),
        "-o",
        str(out),
        "--engine",
        "fast",
        "--max-shard-size",
        "30KB",
    ]
    assert mod.main([*args, "--no-tokenizer"]) == 0
    assert (out / "model.safetensors.index.json").is_file() and "model.norm.weight" in hf_tensors(out)


def test_weights_load_bench_smoke(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(ROOT / "bench" / "weights_load.py"), "--tiny", "--json", str(out)]
    cmd += ["--workdir", str(tmp_path / "w"), "--threads", "2", "--chunks-mib", "1", "--reps", "1"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    r = json.loads(out.read_text())
    assert r["pack"]["bytes"] > 0 and r["pack"]["peak_anon_bytes"] > 0
    assert r["ceilings"]["page_cache_read_gbps"] > 0 and r["loads"]["default"]["gbps"] > 0
    # --verify both (the default): every configuration timed with the check on and off
    assert r["loads"]["default"]["verify"] and not r["loads"]["default no-verify"]["verify"]
    assert set(r["verify_cost"]) == {
        "default",
        "pinned t2 c1MiB d2 s1",
        "pinned t2 c1MiB d3 s1",
        "direct (preadv)",
    }
    assert r["verify_cost"]["default"]["on_median_s"] > 0
    assert r["checksum"]["numpy_gbps_one_thread"] > 0 and r["checksum"]["numpy_gbps_2_threads"] > 0
    assert not (tmp_path / "w").exists()  # cleaned up without --keep
