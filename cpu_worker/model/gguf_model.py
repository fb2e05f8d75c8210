"""What a GGUF file says about its model, in our terms, without torch: a Hugging Face style config
(the keys ``config.json`` would hold), our tensor names for its tensors, and the precision its
weights are stored at.

Llama-family architectures only: ``llama`` (Llama 1-3 and Mistral, which llama.cpp writes as
llama; their q/k rows are permuted for llama.cpp's rotary layout, which the loader undoes) and
``qwen2`` (q/k/v biases, no permutation). Anything else is refused by name.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from gguf import GGMLQuantizationType

from cpu_worker.model.gguf_file import GGUFError, GGUFFile

ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}  # GGUF architecture -> our model_type
PERMUTED_ARCHITECTURES = ("llama",)  # convert_hf_to_gguf.py's LlamaModel permutes attn_q / attn_k rows
NATIVE_TYPES = {GGMLQuantizationType.Q8_0: "q8_0", GGMLQuantizationType.Q4_0: "q4_0",
                GGMLQuantizationType.Q4_1: "q4_1"}
FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
# Types of at most ~4.5 bits a weight requantize to q4_1 (affine like the K-quants' minimums); wider ones to q8_0.
_NARROW = {"Q2_K", "Q3_K", "Q4_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
           "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4", "Q1_0"}

_GLOBAL_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_LAYER = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")


def our_name(gguf_name: str) -> str | None:
    """Our decoder's name for a GGUF tensor (``blk.3.attn_q.weight`` -> ``layers.3.self_attn.q_proj.weight``),
    or None for a tensor we do not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    return f"layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{match.group(3)}"


def architecture(file: GGUFFile) -> str:
    parts = file.get("split.count", 1)
    if isinstance(parts, int) and parts > 1:  # one part holds only some layers: was "block_count is N, but ..."
        raise GGUFError(f"{file.path} is part {int(file.get('split.no', 0)) + 1} of a GGUF split into {parts} files; "
                        "merge them into one first (llama.cpp: llama-gguf-split --merge FIRST-PART OUT.gguf)")
    arch = file.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"{file.path} has no general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{file.path}: architecture {arch!r} is not supported (supported: "
                        f"{', '.join(ARCHITECTURES)}, the Llama family)")
    return arch


def _integer(file: GGUFFile, key: str, default: int | None = None, low: int = 1, high: int = 1 << 24) -> int:
    value = file.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise GGUFError(f"{file.path}: {key} is {value!r}; expected an integer from {low} to {high}")
    return int(value)


def _number(file: GGUFFile, key: str, default: float) -> float:
    value = file.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < float(value) < float("inf"):
        raise GGUFError(f"{file.path}: {key} is {value!r}; expected a positive number")
    return float(value)


def _rope_scaling(file: GGUFFile, arch: str) -> dict[str, Any] | None:
    if "rope_freqs.weight" in file.tensors:
        raise GGUFError(f"{file.path}: RoPE frequency factors (rope_freqs, Llama 3.1 style scaling) are not "
                        f"supported yet")
    kind = file.get(f"{arch}.rope.scaling.type", "none")
    if kind in ("none", None):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _number(file, f"{arch}.rope.scaling.factor", 1.0)}
    raise GGUFError(f"{file.path}: RoPE scaling {kind!r} is not supported (none or linear)")


def _layer_count(file: GGUFFile, arch: str) -> int:
    """block_count, checked against the layers the tensor table holds (before a model of that many is built)."""
    count = _integer(file, f"{arch}.block_count", high=1 << 12)
    indices = {int(match.group(1)) for match in map(_LAYER.fullmatch, file.tensors) if match is not None}
    if indices != set(range(count)):
        raise GGUFError(f"{file.path}: {arch}.block_count is {count}, but the tensors are of layers "
                        f"{min(indices, default=None)} to {max(indices, default=None)} ({len(indices)} layers)")
    return count


def hf_config(file: GGUFFile) -> dict[str, Any]:
    """The file's model as ``config.json`` would describe it (the keys our loaders read)."""
    arch = architecture(file)
    hidden = _integer(file, f"{arch}.embedding_length")
    heads = _integer(file, f"{arch}.attention.head_count", high=1 << 16)
    kv_heads = _integer(file, f"{arch}.attention.head_count_kv", heads, high=heads)
    if heads % kv_heads:
        raise GGUFError(f"{file.path}: {heads} attention heads do not share {kv_heads} key/value heads evenly")
    head_dim = _integer(file, f"{arch}.attention.key_length", hidden // heads if hidden % heads == 0 else None)
    if head_dim % 2:
        raise GGUFError(f"{file.path}: the head dimension {head_dim} is odd; rotary embeddings need an even one")
    if file.get(f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise GGUFError(f"{file.path}: rotary dimension {file.get(f'{arch}.rope.dimension_count')} differs from "
                        f"the head dimension {head_dim} (partial rotary is not supported)")
    embedding = file.tensors.get("token_embd.weight")
    if embedding is None or len(embedding.dims) != 2:
        raise GGUFError(f"{file.path} has no two-dimensional token_embd.weight")
    tokens = file.get("tokenizer.ggml.tokens")
    vocab = _integer(file, f"{arch}.vocab_size", len(tokens) if isinstance(tokens, list) else embedding.dims[1])
    config: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch], "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
        "intermediate_size": _integer(file, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _layer_count(file, arch), "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "vocab_size": vocab,
        "max_position_embeddings": _integer(file, f"{arch}.context_length", 2048, high=1 << 24),
        "rms_norm_eps": _number(file, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _number(file, f"{arch}.rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(file, arch),
        "tie_word_embeddings": "output.weight" not in file.tensors,
        "attention_bias": arch == "qwen2",
    }
    for key in ("bos_token_id", "eos_token_id"):
        value = file.get(f"tokenizer.ggml.{key}")
        if isinstance(value, int) and not isinstance(value, bool):
            config[key] = value
    return config


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """{our name: shape} of every tensor a model of this config has (the lm_head unless tied)."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (vocab, hidden), "norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    layer = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
             "self_attn.q_proj.weight": (q_rows, hidden), "self_attn.k_proj.weight": (kv_rows, hidden),
             "self_attn.v_proj.weight": (kv_rows, hidden), "self_attn.o_proj.weight": (hidden, q_rows),
             "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
             "mlp.down_proj.weight": (hidden, inter)}
    if config["attention_bias"]:
        layer |= {"self_attn.q_proj.bias": (q_rows,), "self_attn.k_proj.bias": (kv_rows,),
                  "self_attn.v_proj.bias": (kv_rows,)}
    for index in range(config["num_hidden_layers"]):
        shapes |= {f"layers.{index}.{name}": shape for name, shape in layer.items()}
    return shapes


def tensor_names(file: GGUFFile, config: dict[str, Any]) -> dict[str, str]:
    """{GGUF name: our name} for every tensor, each checked against the shape the config implies;
    GGUFError for a tensor the model has no place for, a shape that disagrees, or a missing one."""
    expected = expected_shapes(config)
    names: dict[str, str] = {}
    for info in file.tensors.values():
        name = our_name(info.name)
        if name is None or name not in expected:
            raise GGUFError(f"{file.path}: tensor {info.name} has no place in a {config['model_type']} model of "
                            f"{config['num_hidden_layers']} layers")
        if info.shape != expected[name]:
            raise GGUFError(f"{file.path}: tensor {info.name} has shape {list(info.shape)}, but the file's "
                            f"config implies {list(expected[name])}")
        names[info.name] = name
    missing = sorted(set(expected) - set(names.values()))
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise GGUFError(f"{file.path} lacks {len(missing)} of the model's tensors: {shown}")
    return names


def checked_config(file: GGUFFile) -> dict[str, Any]:
    """``hf_config``, once every tensor has been checked against it (``tensor_names``)."""
    config = hf_config(file)
    tensor_names(file, config)
    return config


def nearest_native(kind: GGMLQuantizationType) -> str:
    """The block type (q8_0, q4_0, q4_1) a weight of this GGUF type runs as."""
    if kind in NATIVE_TYPES:
        return NATIVE_TYPES[kind]
    return "q4_1" if kind.name in _NARROW else "q8_0"


def native_precision(file: GGUFFile) -> str:
    """The precision the file's projections are stored at: the block type most of their bytes have
    (or would run as: K-quants' nearest), or fp32 for a float file."""
    weights: Counter[str] = Counter()
    for info in file.tensors.values():
        name = our_name(info.name)
        if name is None or not name.startswith("layers.") or len(info.dims) != 2:
            continue
        weights["fp32" if info.type in FLOAT_TYPES else nearest_native(info.type)] += info.nbytes
    if not weights:
        raise GGUFError(f"{file.path} has no layer weights")
    return weights.most_common(1)[0][0]
