"""``kiln serve`` on an artifact with a draft model (speculative decoding on by the artifact's
default), through the official ``openai`` client: completions and chats, streamed and not, equal the
offline engine's on the plain demo artifact, although verify steps emit several tokens at once; a
request can turn speculation off; ``/metrics`` counts the drafts."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from serve_harness import LiveServer

from kiln.runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def spec_server(demo_one_rank, tmp_path_factory):
    from kiln.compiler.build import CompileOptions, compile_model

    ckpt = Path(demo_one_rank).parent / "checkpoint"
    art = tmp_path_factory.mktemp("demo-draft") / "art"
    opts = CompileOptions(
        device="cpu",
        dtype="float32",
        max_batch_size=8,
        max_seq_len=1024,
        chunk_size=512,
        draft_model=str(ckpt),
    )
    compile_model(ckpt, art, opts, verbose=False)  # the model as its own draft: drafts accepted
    s = LiveServer(art)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm(demo_one_rank):
    from kiln import LLM

    return LLM(str(demo_one_rank), device="cpu")


def test_outputs_equal_plain_decoding(spec_server, llm):
    c = spec_server.client()
    assert spec_server.kiln.worker.engine.spec_mode == "draft"
    ref = llm.generate("Once upon a time", SamplingParams(max_tokens=24, temperature=0))[0]
    r = c.completions.create(model=spec_server.model, prompt="Once upon a time", max_tokens=24, temperature=0)
    assert r.choices[0].text == ref.text and r.usage.completion_tokens == 24
    chunks = list(
        c.completions.create(
            model=spec_server.model, prompt="Once upon a time", max_tokens=24, temperature=0, stream=True
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.text
    msgs = [{"role": "user", "content": "Tell me a story"}]
    ref = llm.chat(msgs, SamplingParams(max_tokens=16, temperature=0))[0]
    stream = c.chat.completions.create(
        model=spec_server.model, messages=msgs, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == ref.text
    off = c.completions.create(
        model=spec_server.model,
        prompt="The sky",
        max_tokens=12,
        temperature=0,
        extra_body={"speculative": False},
    )
    assert (
        off.choices[0].text == llm.generate("The sky", SamplingParams(max_tokens=12, temperature=0))[0].text
    )
    spec_server.wait_idle()
    metrics = httpx.get(spec_server.url + "/metrics").text
    values = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("kiln_spec_") and " " in line
    }
    drafts, accepted = values["kiln_spec_draft_tokens_total"], values["kiln_spec_accepted_tokens_total"]
    assert drafts > 0 and accepted >= 0.8 * drafts, values
    # the acceptance gauge and the histogram of drafts accepted per verified row agree with them
    assert values["kiln_spec_acceptance_rate"] == pytest.approx(accepted / drafts), values
    assert values["kiln_spec_accepted_drafts_count"] == values["kiln_spec_verify_requests_total"], values
    assert values["kiln_spec_accepted_drafts_sum"] == accepted, values
    assert values['kiln_spec_accepted_drafts_bucket{le="+Inf"}'] == values["kiln_spec_accepted_drafts_count"]
