"""Test helpers: a tiny HF checkpoint written as a GGUF file the way llama.cpp's converter writes one
(``convert_hf_to_gguf.py``: its tensor names, its q/k row permutation for Llama), with
``gguf.GGUFWriter`` and ``gguf.quants.quantize``; and the real fixture's paths."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from dovetail_runtime.demo_models import FIXTURES, SMOLLM2_DIR, SMOLLM2_GGUF


def need_fixture() -> None:
    """The real-model tests need scripts/fetch_fixture.sh's files (scripts/test.sh, and so CI, fetches
    them first): without them a test fails saying so, never passes by skipping."""
    if not (SMOLLM2_GGUF.is_file() and (SMOLLM2_DIR / "model.safetensors").is_file()):
        pytest.fail(f"the SmolLM2 fixture is not at {FIXTURES}: run bash scripts/fetch_fixture.sh")


_LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
                "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, index, rest = hf_name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{index}.{_LAYER_NAMES[module]}.{kind}"


def converter_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: HF's rotary halves into pairs of neighbours."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _metadata(writer: GGUFWriter, config) -> None:
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]))
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)


def _stored(name: str, values: np.ndarray,
            types: dict[str, GGMLQuantizationType]) -> tuple[np.ndarray, GGMLQuantizationType]:
    """The tensor as the file stores it: projections at ``types['proj']``, the output matrix at
    ``types['output']``, the embedding at ``types['embd']``, norms and biases F32."""
    role = "embd" if name == "token_embd.weight" else "output" if name == "output.weight" else \
        "proj" if values.ndim == 2 else "norm"
    kind = types.get(role, GGMLQuantizationType.F32)
    if kind == GGMLQuantizationType.F32:
        return values.astype(np.float32), kind
    if kind == GGMLQuantizationType.F16:
        return values.astype(np.float16), kind
    return quantize(values.astype(np.float32), kind), kind


def write_gguf(hf_dir: Path, path: Path, types: dict[str, GGMLQuantizationType] | None = None,
               extra: dict | None = None) -> Path:
    """The checkpoint in ``hf_dir`` as a GGUF file at ``path``; ``types`` by role (see ``_stored``);
    ``extra`` {key: string or int} metadata added as is (a tokenizer, a chat template)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    arch = "qwen2" if config.model_type == "qwen2" else "llama"
    state = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
    writer = GGUFWriter(str(path), arch)
    _metadata(writer, config)
    for key, value in (extra or {}).items():
        _add(writer, key, value)
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name, values = gguf_name(hf_name), tensor.numpy()
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            values = converter_permute(values, config.num_attention_heads if ".attn_q." in name
                                       else config.num_key_value_heads)
        stored, kind = _stored(name, values, types or {})
        writer.add_tensor(name, stored, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add(writer: GGUFWriter, key: str, value) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, list(value))


def tokenizer_metadata(folder: Path) -> dict:
    """A byte-level BPE folder's tokenizer as GGUF metadata, the way llama.cpp's converter writes it:
    tokens by id, merges as "a b", its added special tokens marked control, BOS/EOS ids and flags."""
    import json

    data = json.loads((folder / "tokenizer.json").read_text())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = dict(data["model"]["vocab"]) | {token["content"]: token["id"] for token in data["added_tokens"]}
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = {token["content"] for token in data["added_tokens"] if token["special"]}
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in data["model"]["merges"]]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.token_type": [3 if token in special else 1 for token in tokens],
            "tokenizer.ggml.bos_token_id": vocab[config["bos_token"]],
            "tokenizer.ggml.eos_token_id": vocab[config["eos_token"]],
            "tokenizer.ggml.unknown_token_id": vocab[config["unk_token"]],
            "tokenizer.ggml.add_bos_token": bool(config.get("add_bos_token", False))}
