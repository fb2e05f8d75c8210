"""A GGUF target's tokenizer and chat template, rebuilt without torch, equal transformers' for the same file."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf_support import SMOLLM2_GGUF, need_fixture, write_gguf

from dovetail_runtime.chat_template import ChatTemplate, encode_chat
from dovetail_runtime.gguf_tokenizer import SPLITS, _byte_alphabet, merges_from_scores
from dovetail_runtime.tokenizer import Tokenizer, TokenizerLoadError
from ipc import messages as m

from conftest import save_tiny_model
from tokenizer_folders import sentencepiece_gguf_metadata

TEXTS = ["Hello world", "  leading spaces\n\nand\ttabs  ", "naïve café 東京 🤖", "I'm, you're... OK?! 12345",
         "def f(x):\n    return x ** 2  # done", "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>x<think>y", ""]
CHAT = [[{"role": "user", "content": "What is 2 + 2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
         {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}]]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def transformers_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def assert_same(ours: Tokenizer, theirs, texts=TEXTS) -> None:
    for text in texts:
        ids = theirs(text).input_ids
        assert ours.encode(text) == ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert (len(ours), ours.vocab_size) == (len(theirs), theirs.vocab_size)
    assert ours.special_tokens == {k: str(v) for k, v in theirs.special_tokens_map.items() if isinstance(v, str)}
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)


def byte_level_vocabulary() -> tuple[list[str], list[str], list[int]]:
    """Every byte, a few merges, control and user-defined tokens: (tokens, merges, token types)."""
    tokens = list(_byte_alphabet().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
    tokens += ["".join(merge.split(" ")) for merge in merges]
    specials = ["<|im_start|>", "<|im_end|>", "<think>"]
    types = [1] * len(tokens) + [3, 3, 4]
    return tokens + specials, merges, types


@pytest.fixture(scope="module")
def byte_level_gguf(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gguf-tok")
    tokens, merges, types = byte_level_vocabulary()
    folder = save_tiny_model(root / "hf", "llama", vocab_size=len(tokens))
    return write_gguf(folder, root / "bpe.gguf", extra={
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges, "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 256 + 11,
        "tokenizer.ggml.eos_token_id": 256 + 12, "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": TEMPLATE})


def test_our_split_regexes_are_transformers(byte_level_gguf):
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    assert {name: GGUF_PRE_TOKENIZER_SPLITS[name] for name in SPLITS} == SPLITS


def test_a_byte_level_gguf_tokenizes_as_transformers_does(byte_level_gguf):
    ours = Tokenizer.from_dir(byte_level_gguf)
    assert ours.encode("the world")[0] == ours.bos_token_id  # add_bos_token
    assert_same(ours, transformers_tokenizer(byte_level_gguf))


def test_a_gguf_chat_template_renders_as_transformers_does(byte_level_gguf):
    tokenizer = Tokenizer.from_dir(byte_level_gguf)
    theirs = transformers_tokenizer(byte_level_gguf)
    template = ChatTemplate.from_dir(byte_level_gguf, tokenizer.special_tokens)
    assert template.source == theirs.chat_template == TEMPLATE
    for chat in CHAT:
        expected = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
        assert encode_chat(tokenizer, template, [m.ChatMessage(**message) for message in chat]) == expected


SENTENCEPIECE_TEXTS = [*TEXTS, "<s>x</s> y<|im_end|>", "The capital of Italy is Rome, and Madrid.", "\u2581already",
                       "x" * 40]


@pytest.fixture(scope="module")
def sentencepiece_gguf(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gguf-spm")
    metadata = sentencepiece_gguf_metadata(root / "vocab")
    folder = save_tiny_model(root / "hf", "llama", vocab_size=len(metadata["tokenizer.ggml.tokens"]))
    return write_gguf(folder, root / "spm.gguf", extra=metadata)


def test_a_sentencepiece_gguf_tokenizes_as_transformers_does(sentencepiece_gguf):
    """A Llama-2-style file (scores, no merges, byte tokens): the same tokenizer transformers builds,
    down to its serialised form, and the same ids and text; BOS added though the file has no flag."""
    import json

    ours, theirs = Tokenizer.from_dir(sentencepiece_gguf), transformers_tokenizer(sentencepiece_gguf)
    assert json.loads(ours._backend.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    assert ours.encode("Rome")[0] == ours.bos_token_id
    assert_same(ours, theirs, SENTENCEPIECE_TEXTS)


def test_merges_from_scores_are_transformers_generate_merges(sentencepiece_gguf):
    from transformers.tokenization_utils_base import generate_merges

    from cpu_worker.model.gguf_file import GGUFFile

    with GGUFFile(sentencepiece_gguf) as file:
        tokens, scores = file.get("tokenizer.ggml.tokens"), [float(s) for s in file.get("tokenizer.ggml.scores")]
    ties = (["a", "b", "c", "ab", "bc", "abc", "ca", "cab", "b"], [0.0, 0.0, 0.0, -1.0, -1.0, -2.0, -1.0, -2.0, -3.0])
    for vocab_tokens, vocab_scores in ((tokens, scores), ties):
        vocab = {token: index for index, token in enumerate(vocab_tokens)}
        expected = generate_merges(vocab, dict(zip(vocab_tokens, vocab_scores)))
        assert merges_from_scores(vocab_tokens, vocab_scores) == expected


def test_a_sentencepiece_gguf_without_bos_and_other_vocabularies(tmp_path):
    metadata = sentencepiece_gguf_metadata(tmp_path / "vocab")
    count = len(metadata["tokenizer.ggml.tokens"])
    folder = save_tiny_model(tmp_path / "hf", "llama", vocab_size=count)
    no_bos = write_gguf(folder, tmp_path / "no-bos.gguf", extra={**metadata, "tokenizer.ggml.add_bos_token": False})
    ours = Tokenizer.from_dir(no_bos)
    assert ours.bos_token_id not in ours.encode("Rome")
    assert_same(ours, transformers_tokenizer(no_bos), SENTENCEPIECE_TEXTS)
    unigram = write_gguf(folder, tmp_path / "t5.gguf", extra={**metadata, "tokenizer.ggml.model": "t5"})
    with pytest.raises(TokenizerLoadError, match="tokenizer type 't5' is not supported"):
        Tokenizer.from_dir(unigram)
    no_scores = {key: value for key, value in metadata.items() if key != "tokenizer.ggml.scores"}
    with pytest.raises(TokenizerLoadError, match="tokenizer.ggml.scores is missing"):
        Tokenizer.from_dir(write_gguf(folder, tmp_path / "no-scores.gguf", extra=no_scores))


def test_the_fixtures_tokenizer_and_template_are_transformers():
    need_fixture()
    theirs = transformers_tokenizer(SMOLLM2_GGUF)
    ours = Tokenizer.from_dir(SMOLLM2_GGUF)
    assert_same(ours, theirs)
    template = ChatTemplate.from_dir(SMOLLM2_GGUF, ours.special_tokens)
    assert template.source == theirs.chat_template
    for chat in CHAT:
        expected = theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected
        assert encode_chat(ours, template, [m.ChatMessage(**message) for message in chat]) == expected


def assert_training_tokenizer_is_transformers(path: Path, texts=TEXTS, chats=CHAT) -> None:
    """dovetail-train's tokenizer for a GGUF target (``gguf_training_tokenizer``) against transformers'
    for the same file: everything training reads (ids with and without the added tokens, character
    offsets, the special tokens, the rendered chat template)."""
    from dovetail_runtime.train_cli import gguf_training_tokenizer

    ours, theirs = gguf_training_tokenizer(path), transformers_tokenizer(path)
    for text in texts:
        for special in (True, False):
            mine = ours(text, add_special_tokens=special, return_offsets_mapping=True)
            reference = theirs(text, add_special_tokens=special, return_offsets_mapping=True)
            assert (mine.input_ids, mine.offset_mapping) == (reference.input_ids, reference.offset_mapping), text
    assert ours.special_tokens_map == theirs.special_tokens_map
    names = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
    assert [getattr(ours, name) for name in names] == [getattr(theirs, name) for name in names]
    assert ours.chat_template == theirs.chat_template
    if theirs.chat_template:
        for chat in chats:
            for prompt in (True, False):
                assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt) == \
                    theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)


def test_the_training_tokenizer_of_a_gguf_is_transformers(byte_level_gguf, sentencepiece_gguf, tmp_path):
    assert_training_tokenizer_is_transformers(byte_level_gguf)
    assert_training_tokenizer_is_transformers(sentencepiece_gguf, SENTENCEPIECE_TEXTS)
    metadata = sentencepiece_gguf_metadata(tmp_path / "vocab")
    folder = save_tiny_model(tmp_path / "hf", "llama", vocab_size=len(metadata["tokenizer.ggml.tokens"]))
    no_bos = write_gguf(folder, tmp_path / "no-bos.gguf", extra={**metadata, "tokenizer.ggml.add_bos_token": False})
    assert_training_tokenizer_is_transformers(no_bos, SENTENCEPIECE_TEXTS)


def test_the_training_tokenizer_of_the_fixture_is_transformers():
    need_fixture()
    assert_training_tokenizer_is_transformers(SMOLLM2_GGUF)
