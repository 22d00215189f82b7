"""A model whose chat template marks thinking (its generation prompt opens ``<think>``, as
DeepSeek-R1's does): chat replies carry the thinking in ``reasoning_content`` and the answer in
``content``, streamed or whole alike (runtime/reasoning.py). The demo model's weights are random,
so a regex gives its output the shape of a thought and an answer."""

from __future__ import annotations

import json
import shutil

import pytest
from serve_harness import LiveServer

from kiln.compiler.synth_tokenizer import LLAMA3_CHAT_TEMPLATE

THINKING_TEMPLATE = LLAMA3_CHAT_TEMPLATE.replace(
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}",
    "<|start_header_id|>assistant<|end_header_id|>\n\n<think>\n{% endif %}",
)


@pytest.fixture(scope="module")
def thinking_server(demo_one_rank, tmp_path_factory):
    from kiln.compiler.build import CompileOptions, compile_model

    assert THINKING_TEMPLATE != LLAMA3_CHAT_TEMPLATE
    root = tmp_path_factory.mktemp("thinking")
    ckpt = shutil.copytree(demo_one_rank.parent / "checkpoint", root / "checkpoint")
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": THINKING_TEMPLATE}))
    opts = CompileOptions(device="cpu", dtype="float32", max_batch_size=8, max_seq_len=1024, chunk_size=512)
    compile_model(ckpt, root / "art", opts, verbose=False)
    s = LiveServer(root / "art")
    yield s
    s.stop()


def test_thinking_goes_to_reasoning_content_streamed_or_whole(thinking_server):
    s = thinking_server
    c = s.client()
    kw = dict(
        model=s.model, messages=[{"role": "user", "content": "2+2?"}], max_tokens=40, temperature=0.0,
        extra_body={"regex": "[a-z]{1,8} [a-z]{1,8}</think>\\n\\n[a-z]{1,8}"},
    )  # fmt: skip
    msg = c.chat.completions.create(**kw).choices[0].message
    thought, answer = msg.model_extra["reasoning_content"], msg.content
    assert thought and " " in thought and "</think>" not in thought
    assert answer and answer.isalpha()
    streamed = ["", ""]
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            streamed[0] += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            streamed[1] += ch.delta.content or ""
    assert streamed == [thought, answer]
