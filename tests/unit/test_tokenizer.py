"""The coordinator's torch-free tokenizer gives the same ids and text as transformers' AutoTokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import (
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from tokenizers import Tokenizer as RawTokenizer

from dovetail_runtime.tokenizer import Tokenizer, TokenizerLoadError

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "demo" / "target-code-9m"

TEXTS = [
    "",
    "x",
    "Hello world",
    " Hello",
    "  leading and trailing  ",
    "a  b   c    d",
    "\n",
    "\n\n\n",
    "line one\nline two\r\nline three",
    "\ttabs\tand\t\tmore\t",
    "def add(a: int, b: int) -> int:\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { sum += x[i]; }",
    "import numpy as np\nx = np.zeros((3, 4), dtype=np.float32)",
    "if x != None and y >= 10:\n\t\tpass  # comment",
    'print(f"{name!r:>10}")',
    "SELECT * FROM users WHERE id = 42;",
    "12345 67890 3.14159 -0.5e-10",
    "café naïve résumé",
    "e\u0301 vs \u00e9",  # combining accent vs precomposed (NFC matters)
    "日本語のテキスト",
    "中文 和 English 混合",
    "مرحبا بالعالم",
    "Привет, мир!",
    "emoji 😀🎉 and 👨‍👩‍👧 family",
    "z€😀",
    "zero\u200bwidth space",
    "The quick brown fox jumps over the lazy dog.",
    "It's, don't, we'll, they've.",
    "Hello</s>\nworld",
    "<s>starts with bos",
    "ends with eos</s>",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "[INST] question [/INST] answer",
    "<unk> literal",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "~!@#$%^&*()_+`-={}|[]\\:\";'<>?,./",
    "   ",
]

CORPUS = [
    "def hello(world):\n    return world + 1\n",
    "The quick brown fox jumps over the lazy dog.",
    "import numpy as np\nx = np.zeros((3, 4))\n",
    "Hello, world! How are you doing today?",
    "for i in range(10):\n\tprint(i)\n",
    "café naïve résumé, unicode 日本語 テキスト",
    "  leading spaces and trailing   ",
] * 10

QWEN_REGEX = (  # Qwen2's pre-tokenizer split, as in its tokenizer.json
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data), encoding="utf-8")


def _llama2_folder(folder: Path, style: str, tokenizer_config: dict, model_type: str = "llama") -> Path:
    """A Llama-2-like sentencepiece BPE: byte fallback, "▁" word prefix, BOS from the post-processor."""
    tok = RawTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if style == "normalizer":  # how the Llama-2 tokenizer.json on the Hub is written
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    _write_json(folder / "tokenizer_config.json", tokenizer_config)
    _write_json(folder / "config.json", {"model_type": model_type})
    return folder


def _qwen_folder(folder: Path) -> Path:
    """A Qwen2-like byte-level BPE with no BOS, chat tokens as added special tokens."""
    tok = RawTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    spec = {"lstrip": False, "rstrip": False, "normalized": False, "single_word": False, "special": True}
    _write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "added_tokens_decoder": {
            "0": {"content": "<|endoftext|>", **spec},
            "1": {"content": "<|im_start|>", **spec},
            "2": {"content": "<|im_end|>", **spec},
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    })
    _write_json(folder / "config.json", {"model_type": "qwen2"})
    _write_json(folder / "generation_config.json", {"bos_token_id": 0, "eos_token_id": [2, 0]})
    return folder


LLAMA_CONFIG = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "LlamaTokenizer"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        "demo": DEMO,
        # Hub-style Llama-2 file: transformers' LlamaTokenizer replaces its normalizer with Metaspace.
        "llama2": _llama2_folder(root / "llama2", "normalizer",
                                 {**LLAMA_CONFIG, "add_bos_token": True, "add_eos_token": False, "legacy": False}),
        "llama2-metaspace": _llama2_folder(root / "llama2-metaspace", "metaspace",
                                           {**LLAMA_CONFIG, "add_bos_token": True}),
        "llama2-legacy": _llama2_folder(root / "llama2-legacy", "normalizer", {**LLAMA_CONFIG, "legacy": True}),
        # Config flags that transformers ignores when tokenizer.json exists: BOS still comes, no EOS.
        "llama2-flags-ignored": _llama2_folder(root / "llama2-flags", "metaspace",
                                               {**LLAMA_CONFIG, "add_bos_token": False, "add_eos_token": True}),
        # Extra special tokens, some absent from the vocab (transformers adds them).
        "llama2-extras": _llama2_folder(root / "llama2-extras", "normalizer", {
            **LLAMA_CONFIG, "pad_token": "<pad>", "additional_special_tokens": ["[INST]", "[/INST]"],
        }),
        # Mistral declares LlamaTokenizer too, but transformers loads its tokenizer.json as is.
        "mistral": _llama2_folder(root / "mistral", "normalizer", LLAMA_CONFIG, model_type="mistral"),
        "qwen": _qwen_folder(root / "qwen"),
    }


_HF_CACHE: dict[str, object] = {}


def _pair(folders: dict[str, Path], name: str):
    from transformers import AutoTokenizer

    if name not in _HF_CACHE:
        _HF_CACHE[name] = AutoTokenizer.from_pretrained(str(folders[name]))
    return _HF_CACHE[name], Tokenizer.from_dir(folders[name])


FOLDER_NAMES = ["demo", "llama2", "llama2-metaspace", "llama2-legacy", "llama2-flags-ignored",
                "llama2-extras", "mistral", "qwen"]


@pytest.mark.parametrize("name", FOLDER_NAMES)
def test_encode_matches_transformers(folders, name):
    hf, ours = _pair(folders, name)
    for text in TEXTS:
        assert ours.encode(text) == hf(text)["input_ids"], (name, text)


@pytest.mark.parametrize("name", FOLDER_NAMES)
def test_decode_matches_transformers(folders, name):
    hf, ours = _pair(folders, name)
    specials = sorted({i for i in (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.unk_token_id)
                       if i is not None})
    for text in TEXTS:
        ids = hf(text)["input_ids"]
        half = len(ids) // 2
        for case in (ids, specials + ids + specials, ids[:half] + specials + ids[half:], ids[1:], ids[:-1]):
            for skip in (True, False):
                assert ours.decode(case, skip_special_tokens=skip) == hf.decode(case, skip_special_tokens=skip), (
                    name, text, case, skip)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("name", FOLDER_NAMES)
def test_special_ids_match_transformers(folders, name):
    hf, ours = _pair(folders, name)
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.eos_token_id == hf.eos_token_id
    assert ours.vocab_size == hf.vocab_size
    assert len(ours) == len(hf)


def test_bos_comes_from_the_saved_post_processor(folders):
    demo = Tokenizer.from_dir(folders["demo"])
    assert demo.encode("x")[0] == demo.bos_token_id == 1
    # add_bos_token: false / add_eos_token: true in tokenizer_config.json change nothing.
    flags = Tokenizer.from_dir(folders["llama2-flags-ignored"])
    ids = flags.encode("Hello world")
    assert ids[0] == flags.bos_token_id and ids[-1] != flags.eos_token_id


def test_byte_level_tokenizer_without_bos(folders):
    qwen = Tokenizer.from_dir(folders["qwen"])
    assert qwen.bos_token_id is None
    assert qwen.encode("") == []
    assert qwen.encode("<|im_start|>hi")[0] == 1  # chat tokens are matched as special tokens
    assert qwen.decode(qwen.encode("<|im_start|>hi<|im_end|>")) == "hi"


def test_eos_ids_include_generation_config(folders):
    qwen = Tokenizer.from_dir(folders["qwen"])
    assert qwen.eos_token_id == 2
    assert qwen.eos_token_ids == frozenset({2, 0})
    assert Tokenizer.from_dir(folders["demo"]).eos_token_ids == frozenset({2})  # int in generation_config.json


def test_eos_ids_without_generation_config(folders):
    llama = Tokenizer.from_dir(folders["llama2"])
    assert llama.eos_token_ids == frozenset({llama.eos_token_id})


def test_folder_without_tokenizer_json(tmp_path):
    _write_json(tmp_path / "tokenizer_config.json", LLAMA_CONFIG)
    with pytest.raises(TokenizerLoadError) as info:
        Tokenizer.from_dir(tmp_path)
    message = str(info.value)
    assert "tokenizer.json" in message and "save_pretrained" in message and str(tmp_path) in message
    assert isinstance(info.value, ValueError)


def test_corrupt_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerLoadError):
        Tokenizer.from_dir(tmp_path)


def test_never_imports_torch_or_transformers():
    code = (
        "import dovetail_runtime.tokenizer as t, sys; "
        "t.Tokenizer.from_dir('demo/target-code-9m').encode('x'); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
