"""A Hugging Face config.json read without transformers, where nothing in it needs transformers.

Importing transformers to parse a config (AutoConfig) took ~2.8 s of every worker's start on two
cores: more than loading a small model. A config that names every field ``LlamaSpec.from_hf_config``
reads, each well formed, gives the same spec whoever parses it (transformers would only copy the
values); such a config is returned as a plain object here. Anything else (a field left to a
transformers default, a value of the wrong type, a legacy rope layout) returns None and is parsed by
transformers as before, so its defaults and its error messages stay the authority.
tests/unit/test_hf_config.py checks both give the same spec.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from cpu_worker.model.llama import SUPPORTED_MODEL_TYPES

# Sizes every supported family's config must state (a missing one is a transformers default).
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "max_position_embeddings")
# Absent or null, transformers derives these as from_hf_config does (head_dim = hidden_size / heads;
# Llama's key/value heads = heads: Mistral's and Qwen2's default to 8 and 32, so theirs must be stated),
# or defaults the flags to False, as from_hf_config's getattr does.
DERIVED_SIZES = ("num_key_value_heads", "head_dim")
FLAGS = ("attention_bias", "mlp_bias", "tie_word_embeddings", "use_sliding_window")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _rope_is_plain(raw: dict[str, Any]) -> bool:
    """Rope settings transformers would pass through untouched: a rope_parameters object with
    its theta, or (older files) a top-level rope_theta and no scaling at all."""
    parameters = raw.get("rope_parameters")
    if parameters is not None:
        return isinstance(parameters, dict) and _positive_number(parameters.get("rope_theta")) \
            and "rope_theta" not in raw and raw.get("rope_scaling") is None
    return _positive_number(raw.get("rope_theta")) and raw.get("rope_scaling") is None


def _window_is_stated(raw: dict[str, Any], model_type: str) -> bool:
    """Mistral always, Qwen2 when it turns the window on, read ``sliding_window``; unstated, it
    would be transformers' default (4096)."""
    if model_type == "mistral" or raw.get("use_sliding_window"):
        return "sliding_window" in raw and (raw["sliding_window"] is None or _positive_int(raw["sliding_window"]))
    return True


def plain_config(raw: dict[str, Any], model_type_default: str | None = None) -> SimpleNamespace | None:
    """``raw`` (config.json's object) as a config object for ``LlamaSpec.from_hf_config`` when it states
    everything that reads, well formed; None when transformers must parse it. ``model_type_default``
    stands in for a missing model_type (a draft head's config without one is a LlamaConfig)."""
    model_type = raw.get("model_type", model_type_default)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return None
    if not all(_positive_int(raw.get(name)) for name in SIZES):
        return None
    if not all(raw.get(name) is None or _positive_int(raw[name]) for name in DERIVED_SIZES):
        return None
    if model_type != "llama" and raw.get("num_key_value_heads") is None:
        return None
    if raw.get("head_dim") is None and raw["hidden_size"] % raw["num_attention_heads"]:
        return None  # transformers' own check of the split
    if not all(raw.get(name) is None or isinstance(raw[name], bool) for name in FLAGS):
        return None
    if not (_positive_number(raw.get("rms_norm_eps")) and _rope_is_plain(raw) and _window_is_stated(raw, model_type)):
        return None
    return SimpleNamespace(**{**raw, "model_type": model_type})
