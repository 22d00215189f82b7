"""`kiln demo` builds, compiles and generates on this machine; `kiln generate` streams from the
artifact it left; `kiln.LLM.chat` uses the artifact's chat template."""

import re
import subprocess
import sys


def test_demo_command(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo")
    p = subprocess.run(
        [sys.executable, "-m", "kiln", "demo", "--dir", str(d), "--max-tokens", "12"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    m = re.search(r"generate (\d+) tokens", p.stdout)
    assert m and int(m.group(1)) == 12, p.stdout[-2000:]
    assert "[kiln compile] artifact" in p.stdout


def test_generate_streams_from_demo_artifact(demo_artifact):
    art = demo_artifact
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "kiln",
            "generate",
            str(art),
            "Hello there",
            "--max-tokens",
            "5",
            "--seed",
            "3",
            "--temperature",
            "0.8",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "5 tokens in" in p.stderr and "finish: length" in p.stderr


def test_chat_and_reproducible_seed(demo_artifact):
    from kiln import LLM, SamplingParams

    llm = LLM(str(demo_artifact), device="cpu")
    sp = SamplingParams(max_tokens=6, temperature=1.0, seed=1234)
    a = llm.chat([{"role": "user", "content": "Hi!"}], sp)[0]
    b = llm.chat([{"role": "user", "content": "Hi!"}], sp)[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 6
    prompt = llm.apply_chat_template([{"role": "user", "content": "Hi!"}])
    assert "Hi!" in prompt and prompt != "Hi!"
    assert a.prompt_token_ids == llm.tokenizer.encode(prompt, add_special_tokens=False)


def test_demo_output_is_outside_lint_and_git():
    """`make demo` then `make test` (the README's order): the generated graphs the demo leaves in
    its default directory are neither linted nor seen by git."""
    from pathlib import Path

    from kiln.demo import demo_cmd

    default = next(p.default for p in demo_cmd.params if p.name == "root")
    repo = Path(__file__).resolve().parents[1]
    generated = f"{default}/artifact-cpu/graphs/model.py"
    ruff = [sys.executable, "-m", "ruff", "check", "--force-exclude", "--stdin-filename", generated, "-"]
    p = subprocess.run(ruff, input="import os\n", capture_output=True, text=True, cwd=repo, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr  # an unused import everywhere else
    p = subprocess.run(["git", "check-ignore", "-q", generated], cwd=repo, timeout=60)
    assert p.returncode == 0, f"git does not ignore {generated}"
