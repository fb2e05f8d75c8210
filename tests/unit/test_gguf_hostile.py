"""Hostile GGUF files: each defect is refused with one GGUFError line before anything large is
allocated, and a fuzz of mutated headers never raises anything else, nor hangs."""

from __future__ import annotations

import random
import struct
import time
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType
from gguf_support import write_gguf

from cpu_worker.model.gguf_file import GGUFError, GGUFFile
from cpu_worker.model.model_dir import read_config
from cpu_worker.target_loading import load_target_model

from conftest import save_tiny_model

TOKENS = [f"t{index}" for index in range(97)]


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> Path:
    """A 1-layer tiny Llama with a vocabulary and a chat template: strings, arrays and both tensor kinds."""
    root = tmp_path_factory.mktemp("hostile")
    folder = save_tiny_model(root / "hf", "llama", seed=4, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                             num_attention_heads=2, num_key_value_heads=1)
    return write_gguf(folder, root / "small.gguf", {"proj": GGMLQuantizationType.Q8_0},
                      extra={"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": TOKENS,
                             "tokenizer.chat_template": "{{ messages }}"})


def _load(path: Path) -> None:
    read_config(path)  # the coordinator's check: header, metadata, tensor table, shapes
    load_target_model(path, "q8_0")


def _header_end(path: Path) -> int:
    with GGUFFile(path) as file:
        return file.data_start


def _edited(source: Path, target: Path, edit) -> Path:
    data = bytearray(source.read_bytes())
    edit(data)
    target.write_bytes(bytes(data))
    return target


def _at(data: bytearray, marker: bytes) -> int:
    """The offset just past ``marker``'s string (its 8-byte length precedes it)."""
    return data.index(marker) + len(marker)


CASES = {
    "empty": (lambda d: d.clear(), "is empty"),
    "truncated header": (lambda d: d.__delitem__(slice(1000, None)), "runs past the end"),
    "truncated data": (lambda d: d.__delitem__(slice(len(d) - 100, None)), "lies outside the file"),
    "wrong magic": (lambda d: d.__setitem__(slice(0, 4), b"GGML"), "magic number"),
    "version 1": (lambda d: d.__setitem__(slice(4, 8), struct.pack("<I", 1)), "version 1 is not supported"),
    "version 99": (lambda d: d.__setitem__(slice(4, 8), struct.pack("<I", 99)), "version 99 is not supported"),
    "absurd tensor count": (lambda d: d.__setitem__(slice(8, 16), struct.pack("<Q", 1 << 62)), "cannot fit"),
    "absurd key count": (lambda d: d.__setitem__(slice(16, 24), struct.pack("<Q", (1 << 64) - 1)), "cannot fit"),
    "key too long": (lambda d: d.__setitem__(slice(24, 32), struct.pack("<Q", 1 << 40)), "more than the 65535"),
    "string past the end": (lambda d: d.__setitem__(slice(_at(d, b"general.architecture") + 4,
                                                          _at(d, b"general.architecture") + 12),
                                                    struct.pack("<Q", 1 << 40)), "past the end"),
    "array past the end": (lambda d: d.__setitem__(slice(_at(d, b"tokenizer.ggml.tokens") + 4,
                                                         _at(d, b"tokenizer.ggml.tokens") + 12),
                                                   struct.pack("<Q", 1 << 50)), "past the end"),
    # tokenizer.ggml.tokens: value type, item type, count (4 + 4 + 8 bytes), then item 0's length and bytes.
    "token past the end": (lambda d: d.__setitem__(slice(_at(d, b"tokenizer.ggml.tokens") + 16,
                                                         _at(d, b"tokenizer.ggml.tokens") + 24),
                                                   struct.pack("<Q", 1 << 40)), "item 0 of .* past the end"),
    "token not UTF-8": (lambda d: d.__setitem__(_at(d, b"tokenizer.ggml.tokens") + 24, 0xFF), "item 0 of .* UTF-8"),
    "offset outside the file": (lambda d: d.__setitem__(slice(_at(d, b"output.weight") + 4 + 16 + 4,
                                                              _at(d, b"output.weight") + 4 + 16 + 12),
                                                        struct.pack("<Q", 1 << 33)), "outside the file"),
    "unknown tensor type": (lambda d: d.__setitem__(slice(_at(d, b"output.weight") + 4 + 16,
                                                          _at(d, b"output.weight") + 4 + 20),
                                                    struct.pack("<I", 77)), "unknown type 77"),
    "shape against the config": (lambda d: d.__setitem__(slice(_at(d, b"llama.feed_forward_length") + 4,
                                                               _at(d, b"llama.feed_forward_length") + 8),
                                                         struct.pack("<I", 96)), "config implies"),
    "layers against the tensors": (lambda d: d.__setitem__(slice(_at(d, b"llama.block_count") + 4,
                                                                 _at(d, b"llama.block_count") + 8),
                                                           struct.pack("<I", 4000)), "block_count is 4000"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_file_gets_one_line_of_error(small_gguf, tmp_path, case):
    edit, message = CASES[case]
    path = _edited(small_gguf, tmp_path / "bad.gguf", edit)
    with pytest.raises(GGUFError, match=message) as caught:
        _load(path)
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)


def test_the_unedited_file_loads(small_gguf):
    _load(small_gguf)


def _mutate(data: bytearray, end: int, rng: random.Random) -> None:
    """One of: a few flipped bytes, an extreme integer written over a field, a cut, a repeated chunk."""
    choice = rng.randrange(4)
    if choice == 0:
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(end)] ^= 1 << rng.randrange(8)
    elif choice == 1:
        value = rng.choice([0, 1, 7, 255, 1 << 31, (1 << 32) - 1, 1 << 63, (1 << 64) - 1, len(data),
                            rng.getrandbits(64)])
        at = rng.randrange(end - 8)
        data[at:at + 8] = struct.pack("<Q", value)
    elif choice == 2:
        del data[rng.randrange(end):]
    else:
        at, size = rng.randrange(end), rng.randint(1, 64)
        data[at:at] = data[at:at + size]


def test_mutated_headers_give_only_our_error_in_bounded_time(small_gguf, tmp_path):
    source = bytearray(small_gguf.read_bytes())
    end = _header_end(small_gguf)
    rng = random.Random(31)
    path, outcomes, slowest = tmp_path / "fuzz.gguf", {"refused": 0, "loaded": 0}, 0.0
    for _ in range(1200):
        data = bytearray(source)
        _mutate(data, end, rng)
        path.write_bytes(bytes(data))
        began = time.perf_counter()
        try:
            _load(path)
            outcomes["loaded"] += 1
        except GGUFError as error:
            assert "\n" not in str(error)
            outcomes["refused"] += 1
        slowest = max(slowest, time.perf_counter() - began)
    assert outcomes["refused"] > 600 and slowest < 2.0, (outcomes, slowest)


def test_a_part_of_a_split_gguf_is_named_as_one(tmp_path):
    folder = save_tiny_model(tmp_path / "hf", "llama", seed=4, num_hidden_layers=1, hidden_size=32,
                             intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    part = write_gguf(folder, tmp_path / "model-00001-of-00002.gguf", extra={"split.no": 0, "split.count": 2})
    # llama.cpp's split files: the first holds some layers; was "block_count is N, but the tensors are of ..."
    with pytest.raises(GGUFError, match=r"is part 1 of a GGUF split into 2 files; merge them"):
        read_config(part)


def test_a_header_read_again_is_parsed_once_and_a_rewrite_in_place_again(small_gguf, tmp_path):
    """A start opens its GGUF file several times, and parsing the header each time cost 0.9 s of it; the
    parse is kept, but never for a file whose header changed in place (same inode, same size, and a
    timestamp too coarse to tell)."""
    path = write_gguf(small_gguf.parent / "hf", tmp_path / "copy.gguf",
                      extra={"tokenizer.chat_template": "{{ messages }}", "tokenizer.ggml.scores": [0.5, 0.25]})
    data = bytearray(path.read_bytes())
    with GGUFFile(path) as first, GGUFFile(path) as second:
        assert second.metadata is first.metadata and second.tensors is first.tensors
        assert first.get("tokenizer.chat_template") == "{{ messages }}"
        with pytest.raises(ValueError, match="read-only"):  # shared: an array cannot be changed by one reader
            first.get("tokenizer.ggml.scores")[0] = 1.0
    at = bytes(data).index(b"{{ messages }}")
    data[at:at + 14] = b"{{ MESSAGES }}"
    with open(path, "r+b") as handle:  # the same file, rewritten in place
        handle.write(bytes(data))
    with GGUFFile(path) as changed:
        assert changed.get("tokenizer.chat_template") == "{{ MESSAGES }}"
