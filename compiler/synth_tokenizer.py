"""A real tokenizer built offline, for the demo and the synthetic test checkpoints.

``build_tokenizer(out_dir, vocab_size=4096, byte_fallback=False, chat_template=None)`` trains a
BPE with the ``tokenizers`` library on bundled text (English, French, German, Spanish, Chinese,
Japanese, emoji, code, plus deterministic pseudo-words so the merges fill the vocabulary) and
writes a directory that ``transformers.AutoTokenizer.from_pretrained`` loads:
``tokenizer.json``, ``tokenizer_config.json`` (bos/eos, chat template, model_max_length) and
``special_tokens_map.json``.

Two flavours, both with Llama-3 special tokens placed after the learned tokens and reserved
special tokens filling the vocabulary to exactly ``vocab_size``:

* byte-level BPE (``byte_fallback=False``, Llama-3/GPT-2 style): every byte is a token, so rare
  characters (emoji, rare CJK) split into byte tokens that are not valid UTF-8 alone;
* SentencePiece-like BPE with byte fallback (``byte_fallback=True``, Llama-2/Mistral style):
  words carry a ``▁`` space marker, ``<0x00>``..``<0xFF>`` tokens (ids 0..255) spell characters
  outside the learned alphabet byte by byte. The decoder does not strip a leading space, so
  decoding is concatenative (what incremental detokenization needs).

Training is deterministic (single-threaded, fixed corpus) and takes well under a second.
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
BOS, EOT_TEXT, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"

LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    # tools (Llama 3.1's JSON tool calling): listed in a system turn with how to call one
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    'To call a function, answer with only a JSON object {"name": its name, "parameters": an object '
    "of its arguments}. The functions:\n\n{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}"
    "<|eot_id|>{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% for c in message['tool_calls'] %}"
    '{"name": {{ c["name"] | tojson }}, "parameters": {{ c["arguments"] | tojson }}}'
    "{% if not loop.last %}; {% endif %}{% endfor %}<|eot_id|>"
    "{% elif message['role'] == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# Llama-3's pre-tokenization split (words with one leading non-letter, 1-3 digits, punctuation runs).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TEXT = """\
The quick brown fox jumps over the lazy dog. A kiln turns clay into something that lasts.
Serving a language model means batching requests, caching prefixes and sampling tokens quickly.
She said: "It's done, we've measured it twice, and they'll ship it on Monday at 9:30."
In 2024 the team wrote 1,234 tests; 98.7% passed on the first run and the rest were fixed.
Le café crème était délicieux; nous sommes allés au théâtre près de la forêt à Noël.
Où est la bibliothèque? Elle est fermée à cause des grèves, mais ça ouvrira bientôt.
Über den Wolken muss die Freiheit wohl grenzenlos sein. Grüße aus München und Köln!
Die Größe des Modells hängt von der Anzahl der Schichten und der Breite der Köpfe ab.
¿Dónde está la estación? El niño comió piña y jalapeños en la mañana del sábado.
La programación es un arte: pequeñas funciones, nombres claros y pruebas rápidas.
今天天气很好，我们去公园散步吧。大模型推理需要理解模型结构与缓存管理。
机器学习的目标是从数据中学习规律，并用这些规律对新的输入做出预测。
服务器把请求放进队列，调度器决定哪些请求一起解码，缓存保存已经计算过的前缀。
東京の春は桜がきれいです。私は毎朝コーヒーを飲みながらニュースを読みます。
カタカナとひらがなと漢字を組み合わせて日本語を書きます。
Emoji tell stories too: 🚀 launch, 🔥 hot path, ✅ done, 🎉 party, 🤖 robot, 😀 smile, 🍕 pizza.
Greek and Cyrillic: Καλημέρα κόσμε, Привет мир, Здравствуйте! Ελληνικά και русский язык.
def forward(self, x: Tensor) -> Tensor:\n    return self.norm(x + self.mlp(x))\n
for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // dot product
{"role": "user", "content": "Hello!"} <html><body><p>Hi &amp; bye</p></body></html>
"""

CJK_COMMON = (
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可"
    "她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三"
    "已老从动两长知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部正名定女"
    "问力机给等几很业最间新什打便位因重被走电四第门相次东政海口使教西再平真听世气信北少关并内加化由"
)
CJK_RARE = "龘靐齉爩麤鱻驫厵灥燚"  # appear once each: byte-level BPE leaves them split into bytes
EMOJI = "😀😃😄😁😆🥹😂🤣🥲😊🙂🙃😉😌😍🥰😘🤔🫠🤗🚀🔥✅🎉🤖🍕🌍🌸🐍🦀"
ALPHABET = 160  # characters the byte-fallback flavour learns; the rest are spelled in bytes
ACCENTED = "aàáâäãåæbcçdeèéêëfghiìíîïjklmnñoòóôöõøœpqrsßtuùúûüvwxyýÿz"


@dataclass(frozen=True)
class SynthTokenizer:
    """What ``build_tokenizer`` wrote: its directory and the ids a checkpoint config needs."""

    path: Path
    vocab_size: int
    bos_token_id: int
    eos_token_id: int  # <|eot_id|>, the chat turn end (tokenizer_config's eos_token)
    eos_token_ids: tuple[int, ...]  # <|end_of_text|> and <|eot_id|> (generation_config style)
    byte_fallback: bool


def corpus() -> list[str]:
    """The bundled training text: fixed sentences plus deterministic pseudo-text."""
    rng = random.Random(20240601)
    lines = TEXT.splitlines() * 3
    cons, vows = "bcdfghjklmnprstvwz", "aeiouàéèêöüñ"
    for _ in range(1500):
        words = [
            "".join(rng.choice(cons) + rng.choice(vows) for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(4, 12))
        ]
        lines.append(" ".join(words).capitalize() + rng.choice([".", ",", "!", "?", ";"]))
    for _ in range(300):
        lines.append("".join(rng.choice(CJK_COMMON) for _ in range(rng.randint(6, 30))) + "。")
        lines.append(" ".join(str(rng.randint(0, 99999)) for _ in range(5)))
        lines.append(
            "".join(rng.choice(ACCENTED) for _ in range(rng.randint(3, 9))) + " " + rng.choice(EMOJI)
        )
    lines.append(CJK_RARE)
    return lines


def _train(vocab: int, byte_fallback: bool):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    if byte_fallback:
        tok = Tokenizer(models.BPE(byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
        # Rare characters stay out of the alphabet, so they are spelled with byte tokens. The
        # alphabet is picked here (ties by code point): the trainer's own pick breaks ties randomly.
        counts = Counter("".join(corpus()).replace(" ", "▁"))
        size = min(ALPHABET, vocab - 256)
        alphabet = sorted(counts, key=lambda c: (-counts[c], c))[:size]
        trainer = trainers.BpeTrainer(
            vocab_size=vocab - 256, initial_alphabet=alphabet, limit_alphabet=size, show_progress=False
        )
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        trainer = trainers.BpeTrainer(
            vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
        )
    tok.train_from_iterator(corpus(), trainer)
    if not byte_fallback:
        tok.decoder = decoders.ByteLevel()
        return tok
    # Rebuild with <0x00>..<0xFF> at ids 0..255, then the learned tokens, same merges.
    model = json.loads(tok.to_str())["model"]
    learned = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    vocab_map = {f"<0x{b:02X}>": b for b in range(256)}
    for piece, _ in learned:
        vocab_map.setdefault(piece, len(vocab_map))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    out = Tokenizer(models.BPE(vocab=vocab_map, merges=merges, byte_fallback=True))
    out.pre_tokenizer = tok.pre_tokenizer
    out.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return out


def build_tokenizer(
    out_dir: str | os.PathLike,
    vocab_size: int = 4096,
    byte_fallback: bool = False,
    chat_template: str | None = None,
    model_max_length: int = 8192,
) -> SynthTokenizer:
    """Train and write the tokenizer into ``out_dir`` (created); see the module docstring.

    ``chat_template``: a Jinja template for ``apply_chat_template`` (default: Llama-3 style).
    The vocabulary has exactly ``vocab_size`` entries: 256 byte tokens (or byte-fallback tokens),
    learned merges (or, for byte fallback, characters), 5 named and N reserved special tokens.
    """
    from tokenizers import AddedToken, processors

    least = 256 + len(SPECIAL_TOKENS) + 1
    if vocab_size < least:
        raise ValueError(
            f"build_tokenizer: vocab_size must be >= {least} (256 byte tokens + specials), got {vocab_size}"
        )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # deterministic, and no fork warnings
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train(vocab_size - len(SPECIAL_TOKENS), byte_fallback)
    n_reserved = vocab_size - tok.get_vocab_size() - len(SPECIAL_TOKENS)
    specials = SPECIAL_TOKENS + [f"<|reserved_special_token_{i}|>" for i in range(n_reserved)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    bos, eot_text, eot = (tok.token_to_id(t) for t in (BOS, EOT_TEXT, EOT))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOT,
        "pad_token": None,
        "add_bos_token": True,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template if chat_template is not None else LLAMA3_CHAT_TEMPLATE,
        "model_input_names": ["input_ids", "attention_mask"],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOT}, indent=2) + "\n"
    )
    return SynthTokenizer(out, vocab_size, bos, eot, (eot_text, eot), byte_fallback)
