"""The fast tokenizer path (tokenizers + sandboxed Jinja) agrees with transformers' AutoTokenizer
on encode, decode and the chat template, for both synthetic tokenizer kinds."""

import pytest
from transformers import AutoTokenizer

from kiln.compiler.synth_tokenizer import build_tokenizer
from kiln.runtime.tokenizer import FastTokenizer, load_tokenizer

TEXTS = ["Hello world", "  leading spaces and ünïcödé, 中文字符, emoji 🎉!", "<|eot_id|> special inside", ""]
CHATS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " padded \n"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again"},
    ],
]


@pytest.fixture(scope="module", params=[False, True], ids=["bytelevel", "bytefallback"])
def tok_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d, vocab_size=600, byte_fallback=request.param)
    return d


def test_fast_matches_auto(tok_dir):
    fast, hf = FastTokenizer(tok_dir), AutoTokenizer.from_pretrained(str(tok_dir))
    assert isinstance(load_tokenizer(tok_dir), FastTokenizer)
    assert fast.eos_token_id == hf.eos_token_id and fast.bos_token_id == hf.bos_token_id
    for text in TEXTS:
        for special in (True, False):
            assert fast.encode(text, add_special_tokens=special) == hf.encode(
                text, add_special_tokens=special
            )
        ids = hf.encode(text)
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    for chat in CHATS:
        for gen in (True, False):
            assert fast.apply_chat_template(chat, add_generation_prompt=gen) == hf.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=gen
            )


def test_template_errors_are_value_errors(tmp_path):
    build_tokenizer(tmp_path, vocab_size=600, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="roles must alternate"):
        FastTokenizer(tmp_path).apply_chat_template(CHATS[0])
