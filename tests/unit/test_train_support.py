"""Helpers for the draft-training tests: a tiny character-level tokenizer saved next to a tiny
random target, so the whole pipeline (text -> tokens -> features -> head -> dovetail-run)
runs in seconds without the testbed or the stdlib."""

from __future__ import annotations

import string
from pathlib import Path

import pytest

from conftest import save_tiny_model

VOCAB = 128
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TEXTS = [
    "def add(a, b):\n    return a + b\n\n" * 6,
    "class Stack:\n    def push(self, x):\n        self.items.append(x)\n" * 5,
    "for i in range(10):\n    print(i)\n" * 8,
    "import os\nimport sys\n\nprint(os.getcwd(), sys.argv)\n" * 6,
    "x = [n * n for n in range(20) if n % 2]\n" * 9,
    "while True:\n    line = f.readline()\n    if not line:\n        break\n" * 5,
]


def save_char_tokenizer(directory: Path, chat_template: bool = False) -> None:
    """<unk>=0, <s>=1, </s>=2, then one token per printable character; <s> is prepended."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {c: i + 3 for i, c in enumerate(chars)}
    assert len(vocab) <= VOCAB
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)


def make_tiny_target(directory: Path, chat_template: bool = False, **overrides) -> Path:
    fields = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, max_position_embeddings=256) | overrides
    save_tiny_model(directory, "llama", **fields)
    save_char_tokenizer(directory, chat_template)
    return directory


def write_corpus(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for index, text in enumerate(TEXTS):
        sub = directory / ("pkg" if index % 2 else "") / f"mod{index}.txt"
        sub.parent.mkdir(parents=True, exist_ok=True)
        sub.write_text(text)
    return directory


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp("train-target") / "target")


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("train-corpus") / "corpus")


def test_char_tokenizer_round_trips(tiny_target):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_target))
    ids = tokenizer("def f(x):\n    return x")["input_ids"]
    assert ids[0] == 1 and len(ids) == 1 + len("def f(x):\n    return x")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "def f(x):\n    return x"
