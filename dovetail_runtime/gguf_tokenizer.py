"""A GGUF file's tokenizer and chat template, rebuilt without torch the way transformers 5.24 builds
them for ``AutoTokenizer.from_pretrained(folder, gguf_file=name)`` (its ``integrations.gguf``),
so ``encode`` and ``decode`` give the same ids and text.

Byte-level BPE vocabularies (``tokenizer.ggml.model`` gpt2: Llama 3, Qwen2, SmolLM, Mistral's
tekken): the vocabulary respelled in the byte alphabet where a token is not, the file's merges,
the split regex its ``tokenizer.ggml.pre`` names, the tokens it marks as control (special) and
user-defined (plain added tokens), BOS added when ``tokenizer.ggml.add_bos_token`` says so.

SentencePiece vocabularies (``llama``: Llama 2, Mistral 7B, CodeLlama), as transformers' LlamaTokenizer:
a BPE over the tokens as spelled, with byte fallback (``<0x0A>``), merges from the file or else
recovered from the tokens' scores (every split of a token into two tokens, best score first), "▁"
for spaces and before the text; BOS added unless the file says not to. Architectures whose
SentencePiece files transformers builds otherwise (Gemma, Phi-3) are refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from cpu_worker.model.gguf_file import GGUFFile

from .tokenizer import Tokenizer, TokenizerLoadError

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
SPACE = "\u2581"  # SentencePiece's spelling of a space
# SentencePiece files of these architectures transformers builds with their own rules (not LlamaTokenizer's).
OTHER_SENTENCEPIECE = ("gemma", "gemma2", "gemma3", "gemma4", "phi3")
# The split regexes transformers uses for a file's tokenizer.ggml.pre (others: ByteLevel's own).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                        "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3)
SPLITS |= dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2)
SPLITS["tekken"] = _TEKKEN
# GPT2Tokenizer's defaults for unk/bos/eos: transformers adds this token even where the vocabulary lacks it.
_GPT2_DEFAULT = "<|endoftext|>"


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of every byte (transformers' ``bytes_to_unicode``)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    spelled = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in spelled:
            spelled[byte] = chr(256 + extra)
            extra += 1
    return spelled


def _strings(file: GGUFFile, key: str, required: bool = True) -> list[str]:
    value = file.get(key)
    if value is None and not required:
        return []
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise TokenizerLoadError(f"{file.path}: {key} is missing or not a list of strings")
    return value


def _token_id(file: GGUFFile, key: str, tokens: list[str]) -> int | None:
    value = file.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(tokens):
        raise TokenizerLoadError(f"{file.path}: {key} {value!r} is not a token of its vocabulary")
    return int(value)


def _byte_level_backend(file: GGUFFile, tokens: list[str]) -> _Backend:
    """GPT2Tokenizer(vocab, merges) as transformers builds it for the file, with the file's split regex."""
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {token if set(token) <= alphabet else "".join(spelling[byte] for byte in token.encode("utf-8")): index
             for index, token in enumerate(tokens)}
    backend = _bpe(file, vocab, _merges(file), continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    split = SPLITS.get(file.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_tokens(file: GGUFFile, backend: _Backend, tokens: list[str], named: dict[str, str | None]) -> None:
    """Added tokens in transformers' order: GPT2Tokenizer's default special token, the file's control
    tokens (those spelled in the byte alphabet) as special, its user-defined ones as plain, then any
    named special token not yet added."""
    types = file.get("tokenizer.ggml.token_type")
    types = [] if types is None else [int(value) for value in types]
    alphabet = set(_byte_alphabet().values())
    backend.add_tokens([AddedToken(_GPT2_DEFAULT, special=True)])
    control = [AddedToken(token, normalized=False, special=True) for token, kind in zip(tokens, types)
               if kind == CONTROL and set(token) <= alphabet]
    if control:
        backend.add_special_tokens(control)
    vocab = backend.get_vocab(with_added_tokens=True)
    user = [AddedToken(token, normalized=False, special=False) for token, kind in zip(tokens, types)
            if kind == USER_DEFINED and token in vocab]
    if user:
        backend.add_tokens(user)
    present = {str(token) for token in backend.get_added_tokens_decoder().values()}
    missing = [AddedToken(token, special=True) for token in named.values() if token and token not in present]
    if missing:
        backend.add_tokens(missing)


def _merges(file: GGUFFile) -> list[tuple[str, str]]:
    pieces = [merge.split(" ") for merge in _strings(file, "tokenizer.ggml.merges")]
    if any(len(merge) != 2 for merge in pieces):
        raise TokenizerLoadError(f"{file.path}: tokenizer.ggml.merges holds an entry that is not two tokens")
    return [(left, right) for left, right in pieces]


def _bpe(file: GGUFFile, vocab: dict[str, int], merges: list[tuple[str, str]], **options: Any) -> _Backend:
    try:
        return _Backend(models.BPE(vocab=vocab, merges=merges, dropout=None, **options))
    except Exception as error:  # tokenizers raises plain Exceptions for a merge of unknown tokens
        raise TokenizerLoadError(f"{file.path}: its vocabulary and merges do not make a tokenizer: {error}") from None


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies (transformers' ``generate_merges``): every split of
    a token into two tokens of the vocabulary, at the token's score; best score first, then longer
    left and right parts; within one token, by the parts' ids."""
    vocab = {token: index for index, token in enumerate(tokens)}
    found: list[tuple[str, str, float]] = []
    for merged, score in dict(zip(tokens, scores)).items():
        splits = [(merged[:cut], merged[cut:], score) for cut in range(1, len(merged))
                  if merged[:cut] in vocab and merged[cut:] in vocab]
        found.extend(sorted(splits, key=lambda split: (vocab[split[0]], vocab[split[1]])))
    found = sorted(found, key=lambda split: (split[2], len(split[0]), len(split[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _scores(file: GGUFFile, count: int) -> list[float]:
    """``tokenizer.ggml.scores``: one number per token (the reader gives a numeric array as numpy's)."""
    scores = np.asarray(file.get("tokenizer.ggml.scores", []))
    if scores.shape != (count,) or scores.dtype.kind not in "fiu":
        raise TokenizerLoadError(f"{file.path}: tokenizer.ggml.scores is missing or not a number per token, "
                                 "and there are no merges")
    return [float(score) for score in scores]


def _sentencepiece_backend(file: GGUFFile, tokens: list[str]) -> _Backend:
    """LlamaTokenizer(vocab, merges) as transformers builds it for a ``llama`` vocabulary."""
    if file.get("tokenizer.ggml.merges") is not None:
        merges = _merges(file)
    else:
        merges = merges_from_scores(tokens, _scores(file, len(tokens)))
    backend = _bpe(file, {token: index for index, token in enumerate(tokens)}, merges, fuse_unk=True,
                   byte_fallback=True)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return backend


def _add_sentencepiece_tokens(file: GGUFFile, backend: _Backend, tokens: list[str],
                              named: dict[str, str | None]) -> None:
    """Added tokens as transformers adds them: the named special tokens and the file's control tokens
    as special, its user-defined ones as plain."""
    types = file.get("tokenizer.ggml.token_type")
    types = [] if types is None else [int(value) for value in types]
    special = [token for token in named.values() if token]
    special += [token for token, kind in zip(tokens, types) if kind == CONTROL and token not in special]
    if special:
        backend.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in special])
    user = [AddedToken(token, normalized=False, special=False) for token, kind in zip(tokens, types)
            if kind == USER_DEFINED]
    if user:
        backend.add_tokens(user)


def _post_processor(file: GGUFFile, named: dict[str, str | None], backend: _Backend,
                    bos_by_default: bool) -> processors.PostProcessor:
    """What transformers' ``update_post_processor`` installs for the file's add_bos/add_eos flags
    (a SentencePiece file without the flag gets BOS, as llama.cpp gives it)."""
    add_bos, add_eos = bool(file.get("tokenizer.ggml.add_bos_token", bos_by_default)), \
        bool(file.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = named.get("bos_token"), named.get("eos_token")
    if (add_bos and bos is None) or (add_eos and eos is None):
        raise TokenizerLoadError(f"{file.path} asks for a BOS/EOS token it does not name")
    bos_text, eos_text = bos or "", eos or ""  # present wherever the flags use them (checked above)
    single = f"{bos_text + ':0 ' if add_bos else ''}$A:0{' ' + eos_text + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos_text + ':1' if add_bos else ''} $B:1{' ' + eos_text + ':1' if add_eos else ''}"
    special = [(token, backend.token_to_id(token)) for token in {bos if add_bos else None, eos if add_eos else None}
               if token is not None]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _tokenizer_kind(file: GGUFFile) -> str:
    """``gpt2`` or ``llama``, the vocabularies built here; anything else refused by name."""
    kind = file.get("tokenizer.ggml.model")
    architecture = file.get("general.architecture")
    if kind == "llama" and architecture in OTHER_SENTENCEPIECE:
        raise TokenizerLoadError(f"{file.path}: a SentencePiece vocabulary of architecture {architecture!r} is not "
                                 "supported from a GGUF file yet (Llama's and Mistral's are)")
    if kind not in ("gpt2", "llama"):
        raise TokenizerLoadError(f"{file.path}: tokenizer type {kind!r} is not supported from a GGUF file yet "
                                 "(byte-level BPE, 'gpt2', and SentencePiece, 'llama', are)")
    return str(kind)


def gguf_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer a GGUF file describes, as transformers builds it from the same file."""
    with GGUFFile(path) as file:
        kind = _tokenizer_kind(file)
        tokens = _strings(file, "tokenizer.ggml.tokens")
        ids = {name: _token_id(file, f"tokenizer.ggml.{key}", tokens) for name, key in
               (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                ("pad_token", "padding_token_id"))}
        named = {name: None if index is None else tokens[index] for name, index in ids.items()}
        if kind == "gpt2":
            backend = _byte_level_backend(file, tokens)
            _add_tokens(file, backend, tokens, named)
        else:
            backend = _sentencepiece_backend(file, tokens)
            _add_sentencepiece_tokens(file, backend, tokens, named)
        backend.post_processor = _post_processor(file, named, backend, bos_by_default=kind == "llama")
        # llama.cpp ends generation at end-of-turn and end-of-message tokens as well as EOS.
        stops = [_token_id(file, f"tokenizer.ggml.{key}", tokens) for key in ("eot_token_id", "eom_token_id")]
    backend.no_truncation()
    backend.no_padding()
    return Tokenizer(backend, {name: token for name, token in named.items() if token is not None},
                     [index for index in stops if index is not None])


def gguf_chat_template(path: str | Path) -> str | None:
    """The file's chat template (``tokenizer.chat_template``), or None."""
    with GGUFFile(path) as file:
        template = file.get("tokenizer.chat_template")
    return template if isinstance(template, str) else None
