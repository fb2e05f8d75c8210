"""A torch-free tokenizer for the coordinator, built on the Hugging Face ``tokenizers`` library.

``transformers`` 5.x imports torch as soon as ``AutoTokenizer`` is imported, and the coordinator
must never import torch. This module reads a model folder's JSON files and rebuilds what
``AutoTokenizer.from_pretrained(folder)`` would give, so that ``encode`` and ``decode`` return the
same ids and text. What it reproduces (as of transformers 5.24):

* ``tokenizer.json`` is used as saved, except for folders that transformers loads with its
  ``LlamaTokenizer`` class, which rebuilds the pipeline around the saved vocab and merges
  (Metaspace pre-tokenizer, no normalizer, its own decoder); see ``_uses_llama_class``.
* ``add_bos_token``/``add_eos_token`` in tokenizer_config.json are ignored: transformers drops them
  whenever a tokenizer.json exists, so BOS/EOS come only from the saved post-processor.
* special tokens named in tokenizer_config.json / special_tokens_map.json (and the config's
  ``added_tokens_decoder``) are registered the way transformers registers them, which decides
  which strings in a prompt become special tokens and which ids ``skip_special_tokens`` drops.
* ``clean_up_tokenization_spaces`` in decode, which transformers skips for BPE models.

Anything loaded through remote code (``auto_map``) or a model-specific class other than
LlamaTokenizer is taken from tokenizer.json as saved.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from cpu_worker.model.model_dir import is_gguf

# The special-token attributes every transformers tokenizer has, in its order.
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# Model types for which transformers 5.24 does not use LlamaTokenizer even when the folder says
# ``tokenizer_class: LlamaTokenizer`` (its registered class for the type wins, or it falls back to
# the plain tokenizers backend). Snapshot of its auto-tokenizer routing; Mistral and Phi-3 matter most.
_NOT_LLAMA_CLASS_MODEL_TYPES = frozenset({
    "EvollaModel", "arctic", "aria", "beam", "bigbird_pegasus", "camembertv2-base", "canary", "chatlm",
    "cohere_asr", "ernie4_5", "ernie4_5_moe", "flex_olmo", "fuyu", "glm", "glm4", "glm4_moe", "glm4_moe_lite",
    "glm4v", "glm4v_moe", "glm_image", "glmasr", "got_ocr2", "gpt_bigcode", "gradium_phonon_tts", "granite",
    "granitemoe", "granitemoehybrid", "granitemoeshared", "h2ovl_chat", "hyperclovax", "hyperclovax_vision_v2",
    "hyperclovax_vlm", "internlm2", "internlm3", "iquestcoder", "jamba", "kimi_k25", "kimi_linear", "kosmos-2",
    "llava", "llava_next", "mimo_v2_flash", "minicpm3", "minicpm_ocr", "minicpmv", "minicpmv4_6", "minicpmv4_7",
    "minimax_m2", "ministral", "ministral3", "mistral", "mistral3", "mistral_large4", "mixtral", "modernbert",
    "modernbert-decoder", "molmo", "molmo2", "nemo_speechlm", "nemotron", "nvfp4", "nystromformer", "olmo2",
    "olmo3", "olmo_hybrid", "omniasr", "opencua", "openvla", "paddleocr_vl", "pegasus_x", "persimmon", "phi3",
    "phi3_v", "phimoe", "pix2struct", "pixtral", "pocket_tts", "qwen2", "qwen3_5", "qwen3_5_moe",
    "qwen3_5_moe_text", "qwen4_exp", "siglip2", "smolvlm", "stablelm", "step3_vl", "umt5", "vipllava",
    "voxtral", "voxtral_realtime", "xlm-roberta-xl",
})


class TokenizerLoadError(ValueError):
    """A model folder's tokenizer files are missing or unreadable."""


def _read_json(path: Path) -> Any:
    """The parsed file, or None when it does not exist."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(f"cannot read {path}: {exc}") from exc


def _as_token(value: Any) -> Any:
    """Saved token dicts ({"content": ..., "lstrip": ...}) become AddedToken; anything else is kept."""
    if isinstance(value, dict) and "content" in value:
        fields = {k: v for k, v in value.items() if k != "__type"}
        return AddedToken(**fields)
    return value


def _is_token(value: Any) -> bool:
    return isinstance(value, (str, AddedToken))


def _uses_llama_class(config: dict, model_config: dict, tokenizer_json_text: str, model_type: str | None) -> bool:
    """Whether AutoTokenizer would load this folder with transformers' LlamaTokenizer class."""
    declared = config.get("tokenizer_class") or model_config.get("tokenizer_class")
    if not isinstance(declared, str) or declared.removesuffix("Fast") != "LlamaTokenizer":
        return False
    if "auto_map" in config:  # remote code decides; we cannot run it
        return False
    if '"ByteLevel"' in tokenizer_json_text:  # Llama-3 style folders: transformers uses the file as is
        return False
    if model_config.get("model_type") in _NOT_LLAMA_CLASS_MODEL_TYPES:
        return False
    return model_type == "BPE"  # LlamaTokenizer rebuilds a BPE model; anything else would not load the same


def _llama_backend(data: dict, saved: _Backend, config: dict) -> _Backend:
    """The pipeline transformers' LlamaTokenizer builds around the saved vocab, merges and post-processor."""
    add_prefix_space = config.get("add_prefix_space")
    add_prefix_space = True if add_prefix_space is None else bool(add_prefix_space)
    legacy = bool(config.get("legacy", False))
    # Non-legacy prepends "▁" only to the start of the text, not after each special token.
    scheme = ("always" if legacy else "first") if add_prefix_space else "never"

    vocab = data["model"]["vocab"]
    # Saved merges are "a b" strings (older files) or ["a", "b"] pairs.
    merges: list[tuple[str, str]] = []
    for merge in data["model"].get("merges", []):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        merges.append((left, right))
    # Same constructor arguments as LlamaTokenizer (note: no unk_token, byte fallback on).
    backend = _Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    backend.post_processor = saved.post_processor
    return backend


def _special_tokens(
    config: dict, special_map: dict | None, saved_added: list[dict], class_defaults: dict[str, str]
) -> tuple[dict[str, Any], list[Any], list[AddedToken]]:
    """(named special tokens, extra special tokens, added_tokens_decoder) as transformers resolves them."""
    init = {k: v for k, v in config.items() if k not in ("tokenizer_class", "add_bos_token", "add_eos_token")}
    if "additional_special_tokens" in init and not init.get("extra_special_tokens"):
        init["extra_special_tokens"] = init.pop("additional_special_tokens")

    decoder: dict[int, AddedToken] = {}
    if "added_tokens_decoder" in init:
        # With a saved added_tokens_decoder, transformers ignores special_tokens_map.json.
        for index, token in init["added_tokens_decoder"].items():
            decoder[int(index)] = _as_token(token)
    else:
        for key, value in (special_map or {}).items():
            if isinstance(value, dict) and key != "extra_special_tokens":
                fields = {k: v for k, v in value.items() if k not in ("special", "__type")}
                value = AddedToken(**fields, special=True)
            elif key == "extra_special_tokens" and isinstance(value, list):
                merged = list(init.get("extra_special_tokens") or [])
                for token in value:
                    token = _as_token(token)
                    if token not in merged:
                        merged.append(token)
                value = merged
            init[key] = value
        for entry in saved_added:  # the tokenizer.json's own added tokens
            fields = {k: v for k, v in entry.items() if k != "id"}
            decoder[int(entry["id"])] = AddedToken(**fields)
    if "additional_special_tokens" in init and "extra_special_tokens" not in init:
        init["extra_special_tokens"] = init.pop("additional_special_tokens")
    init = {k: ([_as_token(t) for t in v] if isinstance(v, list) else _as_token(v)) for k, v in init.items()}

    # Saved AddedToken objects replace same-named strings (keeps their lstrip/rstrip/normalized).
    by_content = {str(token): token for token in decoder.values()}
    named: dict[str, Any] = {}
    for key in _NAMED_SPECIAL:
        value = init[key] if key in init else class_defaults.get(key)
        if value is not None and by_content:
            value = by_content.get(str(value), value)
        named[key] = value
    extras = init.get("extra_special_tokens")
    if isinstance(extras, dict):  # a dict of named model-specific tokens
        named.update(extras)
        extras = []
    # Any other "<name>_token" string (image_token, ...) is a model-specific special token too.
    for key, value in init.items():
        if key.endswith("_token") and key not in named and _is_token(value):
            named[key] = value
    return named, list(extras or []), [decoder[i] for i in sorted(decoder)]


class Tokenizer:
    """Encode text to ids and decode ids to text, like ``AutoTokenizer`` on the same folder."""

    def __init__(
        self,
        backend: _Backend,
        named_special: dict[str, Any],
        generation_eos: Iterable[int] = (),
        clean_up_tokenization_spaces: bool = False,
    ):
        self._backend = backend
        self._max_chars: int | None = None  # max_chars_per_token, once computed
        self.special_tokens = {k: str(v) for k, v in named_special.items() if v is not None}
        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.eos_token: str | None = self.special_tokens.get("eos_token")
        self.bos_token_id = self.token_to_id(self.bos_token)
        self.eos_token_id = self.token_to_id(self.eos_token)
        eos = set(generation_eos)
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        # transformers never applies the clean-up to BPE models: it would eat real spaces.
        self._clean_up = clean_up_tokenization_spaces and type(backend.model).__name__ != "BPE"

    @property
    def backend(self) -> _Backend:
        """The ``tokenizers`` object underneath (what transformers' fast tokenizers wrap)."""
        return self._backend

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load from a model folder holding tokenizer.json (and its JSON config files), or from a
        GGUF file's metadata (``gguf_tokenizer``)."""
        folder = Path(path)
        if is_gguf(folder):
            from .gguf_tokenizer import gguf_tokenizer

            return gguf_tokenizer(folder)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerLoadError(
                f"{folder} has no tokenizer.json: the coordinator needs a fast tokenizer saved as "
                f"tokenizer.json. Make one on a machine with transformers: "
                f"AutoTokenizer.from_pretrained({str(folder)!r}).save_pretrained({str(folder)!r})"
            )
        text = tokenizer_file.read_text(encoding="utf-8")
        try:
            data = json.loads(text)
            saved = _Backend.from_str(text)
        except Exception as exc:  # tokenizers raises a plain Exception on bad files
            raise TokenizerLoadError(f"cannot load {tokenizer_file}: {exc}") from exc
        config = _read_json(folder / "tokenizer_config.json") or {}
        special_map = _read_json(folder / "special_tokens_map.json")
        model_config = _read_json(folder / "config.json") or {}
        generation = _read_json(folder / "generation_config.json") or {}

        model_type = data.get("model", {}).get("type")
        llama = _uses_llama_class(config, model_config, text, model_type)
        backend = _llama_backend(data, saved, config) if llama else saved
        defaults = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"} if llama else {}
        named, extras, added = _special_tokens(config, special_map, data.get("added_tokens", []), defaults)
        _register_added_tokens(backend, named, extras, added)

        # Plain encode/decode never truncate or pad, whatever the file says.
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        if backend.post_processor is None:  # what transformers installs (adds nothing to a single text)
            backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")

        eos = generation.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else [i for i in (eos or []) if isinstance(i, int)]
        return cls(backend, named, eos_ids, bool(config.get("clean_up_tokenization_spaces", False)))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text``, with the special tokens the tokenizer adds (e.g. BOS) unless
        ``add_special_tokens`` is False (a rendered chat template writes its own)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for ``ids``; special tokens are dropped unless ``skip_special_tokens`` is False."""
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                                  (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(before, after)
        return text

    def token_to_id(self, token: str | None) -> int | None:
        """The id of one token string, or None."""
        return None if token is None else self._backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Size of the base vocabulary, without added tokens (transformers' ``vocab_size``)."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        """Vocabulary size with added tokens (transformers' ``len(tokenizer)``)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def max_chars_per_token(self) -> int:
        """An upper bound on the prompt characters one token can stand for, so that a prompt
        can be judged too long for the context without tokenizing it: the longest vocabulary
        string (byte-level strings have one character per byte, and a character is at least
        one byte; "▁" stands for one space), times 4 when a normalizer runs first (Unicode
        composition can fold a few characters into one)."""
        if self._max_chars is None:  # a scan of the vocabulary (~20 ms for 49k entries): once
            longest = max(map(len, self._backend.get_vocab(with_added_tokens=True)), default=1)
            self._max_chars = max(longest, 1) * (4 if self._backend.normalizer is not None else 1)
        return self._max_chars


def _register_added_tokens(
    backend: _Backend, named: dict[str, Any], extras: list[Any], added: list[AddedToken]
) -> None:
    """Add saved and special tokens to the backend in the order, and with the flags, transformers uses."""
    present_content = [str(t) for t in backend.get_added_tokens_decoder().values()]
    # transformers re-adds every saved added token (its "already present" check never matches).
    to_add: list[Any] = list(added)
    known = present_content + [str(t) for t in to_add]
    named_content = {str(v) for v in named.values() if v}
    for value in [*named.values(), *extras]:
        if value is None or str(value) in known or value in to_add:
            continue
        to_add.append(value)
    tokens = []
    for token in to_add:
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif not token.special and str(token) in named_content:
            token.special = True
        tokens.append(token)
    if tokens:
        backend.add_tokens(tokens)
