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


def sentencepiece_gguf_metadata(folder: Path) -> dict:
    """GGUF tokenizer metadata (``tokenizer.ggml.model`` llama, as llama.cpp writes Llama-2's) for the
    vocabulary of ``llama2_folder(folder)``: tokens by id, scores that rank merged tokens by their
    merge (sentencepiece's piece scores play that part), llama.cpp's token types, and two extra
    tokens: a control one and a user-defined one."""
    data = json.loads(llama2_folder(folder).joinpath("tokenizer.json").read_text(encoding="utf-8"))
    vocab, merges = data["model"]["vocab"], data["model"]["merges"]
    tokens = sorted(vocab, key=vocab.__getitem__) + ["<|im_end|>", "<think>"]
    rank = {"".join(merge if isinstance(merge, list) else merge.split(" ")): index
            for index, merge in enumerate(merges)}
    scores = [-float(rank[token]) if token in rank else -1000.0 for token in tokens]
    types = [2 if token == "<unk>" else 3 if token in ("<s>", "</s>", "<|im_end|>") else 4 if token == "<think>"
             else 6 if token.startswith("<0x") else 1 for token in tokens]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": tokens.index("<s>"),
            "tokenizer.ggml.eos_token_id": tokens.index("</s>"), "tokenizer.ggml.unknown_token_id": 0}
