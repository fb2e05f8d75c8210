"""Streamed text is the tokenizer's own text: decoded onwards from the prompt, chunk by chunk."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from dovetail_runtime.text import MAX_HELD_TOKENS, PROMPT_CONTEXT_TOKENS, IncrementalDecoder, TextStream
from dovetail_runtime.tokenizer import Tokenizer

from conftest import DEMO_TARGET
from tokenizer_folders import llama2_folder

# Text for long streams: byte-fallback characters (CJK, emoji) split into several tokens.
LONG_TEXT = ("The capital is Paris. Über naïve cafés: 日本語のテキスト 😀🎉 and 👨‍👩‍👧, "
             "def f(x):\n\treturn x ** 2  # ok\n")


@pytest.fixture(scope="module")
def llama2_dir(tmp_path_factory) -> Path:
    return llama2_folder(tmp_path_factory.mktemp("tok") / "llama2")


@pytest.fixture(scope="module")
def llama2(llama2_dir) -> Tokenizer:
    return Tokenizer.from_dir(llama2_dir)


@pytest.fixture(scope="module")
def demo() -> Tokenizer:
    return Tokenizer.from_dir(DEMO_TARGET)


class CountingTokenizer:
    """Records how many ids each decode call was given."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def stream_pieces(stream: TextStream, ids: Sequence[int], chunk_sizes: Sequence[int]) -> list[str]:
    """What each push showed, then what finish showed."""
    shown, start = [], 0
    for size in chunk_sizes:
        shown.append(stream.push(ids[start:start + size]))
        start += size
    assert start == len(ids)
    shown.append(stream.finish())
    return shown


def stream_all(stream: TextStream, ids: Sequence[int], chunk_sizes: Sequence[int]) -> str:
    return "".join(stream_pieces(stream, ids, chunk_sizes))


def random_chunks(total: int, seed: int, largest: int = 7) -> list[int]:
    rng, sizes = random.Random(seed), []
    while sum(sizes) < total:
        sizes.append(min(rng.randint(1, largest), total - sum(sizes)))
    return sizes


def test_sentencepiece_keeps_the_space_before_the_first_new_word(llama2, llama2_dir):
    prompt_ids = llama2.encode("The capital is")
    full_ids = llama2.encode("The capital is Paris.")
    assert full_ids[:len(prompt_ids)] == prompt_ids
    new_ids = full_ids[len(prompt_ids):]
    assert llama2.decode(new_ids) == "Paris."  # decoding the new tokens alone loses the space
    stream = TextStream(llama2, prompt_ids=prompt_ids)
    assert stream_all(stream, new_ids, [1] * len(new_ids)) == " Paris."
    assert stream.text == " Paris."
    # ... and matches transformers' decode of the whole sequence.
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(llama2_dir))
    whole = hf.decode(full_ids, skip_special_tokens=True)
    assert whole == "The capital is Paris." and whole.endswith(stream.text)


@pytest.mark.parametrize("name", ["llama2", "demo"])
def test_4000_streamed_tokens_equal_one_decode_and_cost_per_chunk_stays_flat(name, request):
    tokenizer: Tokenizer = request.getfixturevalue(name)
    prompt_ids = tokenizer.encode("The capital is")
    ids = tokenizer.encode(LONG_TEXT * 400, add_special_tokens=False)[:4000]
    assert len(ids) == 4000
    counting = CountingTokenizer(tokenizer)
    stream = TextStream(counting, prompt_ids=prompt_ids)
    chunks = random_chunks(len(ids), seed=1)
    pieces = stream_pieces(stream, ids, chunks)
    streamed = "".join(pieces)
    prompt_text = tokenizer.decode(prompt_ids)
    whole = tokenizer.decode(prompt_ids + ids)
    assert whole.startswith(prompt_text)
    assert streamed == whole[len(prompt_text):] == stream.text
    # Every character split across chunks was held back until complete (the last one may never be).
    assert not any("\ufffd" in piece for piece in pieces[:-1])
    # Each decode sees the previous chunk and the new one (more only while a run of chunks ends
    # inside characters), never the completion so far: the total work is linear in the tokens.
    assert max(counting.lengths) <= PROMPT_CONTEXT_TOKENS + MAX_HELD_TOKENS + 2 * 7
    assert sum(counting.lengths) <= 8 * len(ids)  # decoding all so far each time: ~500x more
    assert len(counting.lengths) <= 2 * len(chunks) + 3


def test_the_old_quadratic_scheme_would_fail_the_cost_bound(demo):
    # The bound above must be able to fail: decoding everything each time blows it at once.
    counting = CountingTokenizer(demo)
    ids = demo.encode(LONG_TEXT * 20, add_special_tokens=False)[:400]
    for end in range(1, len(ids) + 1):
        counting.decode(ids[:end])
    assert sum(counting.lengths) > 8 * len(ids)


def test_incomplete_characters_are_held_back(llama2):
    ids = llama2.encode("x 😀 y", add_special_tokens=False)
    byte_tokens = [i for i in ids if llama2.decode([i]) == "\ufffd"]
    assert len(byte_tokens) == 4  # the emoji is four byte-fallback tokens
    decoder = IncrementalDecoder(llama2, llama2.encode("a"))
    pieces = [decoder.push([token]) for token in ids]
    assert "".join(pieces) + decoder.flush() == " x 😀 y"
    assert all("\ufffd" not in piece for piece in pieces)
    assert pieces[ids.index(byte_tokens[0]):ids.index(byte_tokens[-1])] == ["", "", ""]


def test_flush_shows_a_character_that_never_completes(llama2):
    ids = llama2.encode("😀", add_special_tokens=False)[:3]  # three of the emoji's four bytes
    stream = TextStream(llama2)
    assert stream.push(ids) == ""
    assert stream.finish() == llama2.decode(ids) != ""
    assert stream.text.endswith("\ufffd")


def test_stop_string_across_chunks_cuts_and_holds_back(demo):
    prompt_ids = demo.encode("x =")
    ids = demo.encode(" 1\n\ny = 2", add_special_tokens=False)
    stream = TextStream(demo, stop=["\n\ny"], prompt_ids=prompt_ids)
    shown = []
    for token in ids:
        shown.append(stream.push([token]))
        if stream.stopped:
            break
    assert stream.stopped
    assert "".join(shown) == stream.text == " 1"
    assert stream.finish() == ""


def test_partial_stop_string_is_released_at_the_end(demo):
    stream = TextStream(demo, stop=["STOP"], prompt_ids=demo.encode("say"))
    ids = demo.encode(" x ST", add_special_tokens=False)
    assert stream.push(ids) == " x "  # "ST" could start "STOP": held back
    assert stream.text == " x "
    assert stream.finish() == "ST"
    assert stream.text == " x ST" and not stream.stopped


def test_special_tokens_are_skipped(llama2):
    prompt_ids = llama2.encode("The capital is")
    ids = llama2.encode("The capital is Paris.", add_special_tokens=False)[len(prompt_ids) - 1:]
    stream = TextStream(llama2, prompt_ids=prompt_ids)
    text = stream_all(stream, ids + [llama2.eos_token_id], [1] * (len(ids) + 1))
    assert text == " Paris."
    kept = TextStream(llama2, prompt_ids=prompt_ids, skip_special_tokens=False)
    assert stream_all(kept, ids + [llama2.eos_token_id], [len(ids) + 1]) == " Paris.</s>"
