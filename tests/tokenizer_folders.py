"""Tokenizer folders that tests build: small, trained in milliseconds, shaped like real ones."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

CORPUS = [
    "The capital is Paris. The capital of Italy is Rome, and the capital of Spain is Madrid.",
    "def hello(world):\n    return world + 1\n",
    "The quick brown fox jumps over the lazy dog.",
    "café naïve résumé, unicode 日本語 テキスト",
] * 20


def llama2_folder(folder: Path) -> Path:
    """A Llama-2-style sentencepiece tokenizer: Metaspace "▁" word starts, byte fallback, BOS."""
    tok = RawTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    # Trained on words (as sentencepiece is: no piece crosses a space), saved unsplit as Llama-2's.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"],
                                                        show_progress=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for byte in range(256):  # ordinary vocabulary entries, as in Llama-2 (not special tokens)
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    folder.mkdir(parents=True)
    (folder / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "LlamaTokenizer",
              "legacy": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}), encoding="utf-8")
    return folder
