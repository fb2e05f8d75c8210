"""A Hugging Face Llama or Qwen2 folder written as a GGUF file the way llama.cpp's converter
(``convert_hf_to_gguf.py``) writes one: its tensor names, its q/k row permutation for Llama, the
config as GGUF metadata. Tensors are read one at a time and stored through the ``gguf`` package's
writer and quantizer, so a 13 GB stand-in never sits in memory as floats (the writer holds the
stored tensors until it writes them: about the file's size). The tests' GGUF files come from here,
and so do the 7B GGUF stand-ins of docs/performance.md:

    python -m tools.gguf_standin SRC OUT.gguf [--proj q4_0] [--embd q4_0] [--output q8_0] [--tokenizer]

Types by role: ``proj`` every 2-D weight of the decoder layers, ``embd`` the embedding, ``output`` the
output matrix (absent when the embedding is tied); norms and biases are F32. ``--tokenizer`` adds a
byte-level BPE folder's tokenizer and chat template as llama.cpp's converter writes them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from cpu_worker.kernels.progress import progress_bar
from cpu_worker.model import iter_tensors, tensor_shapes

Types = dict[str, GGMLQuantizationType]

_LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
                "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name for a Hugging Face Llama/Qwen2 tensor."""
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, index, rest = hf_name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{index}.{_LAYER_NAMES[module]}.{kind}"


def converter_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: Hugging Face's rotary halves into pairs of neighbours."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _metadata(writer: GGUFWriter, config: Any) -> None:
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


def _stored(name: str, values: np.ndarray, types: Types) -> tuple[np.ndarray, GGMLQuantizationType]:
    """The tensor as the file stores it, at its role's type (``types``; F32 for a role not given)."""
    role = "embd" if name == "token_embd.weight" else "output" if name == "output.weight" else \
        "proj" if values.ndim == 2 else "norm"
    kind = types.get(role, GGMLQuantizationType.F32)
    if kind == GGMLQuantizationType.F32:
        return values.astype(np.float32), kind
    if kind == GGMLQuantizationType.F16:
        return values.astype(np.float16), kind
    return quantize(values.astype(np.float32), kind), kind


def _add(writer: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, list(value))


def write_gguf(hf_dir: Path, path: Path, types: Types | None = None, extra: dict[str, Any] | None = None) -> Path:
    """The checkpoint in ``hf_dir`` as a GGUF file at ``path``; ``types`` by role (module docstring);
    ``extra`` {key: string, int, bool or list} metadata added as is (a tokenizer, a chat template)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    arch = "qwen2" if config.model_type == "qwen2" else "llama"
    writer = GGUFWriter(str(path), arch)
    _metadata(writer, config)
    for key, value in (extra or {}).items():
        _add(writer, key, value)
    count = len(tensor_shapes(Path(hf_dir)))
    with progress_bar(count, f"write {Path(path).name}", "tensor") as bar:  # shown on a terminal only
        for hf_name, tensor in iter_tensors(Path(hf_dir)):
            bar.update()
            if hf_name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            name, values = gguf_name(hf_name), tensor.float().numpy()
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


def tokenizer_metadata(folder: Path) -> dict[str, Any]:
    """A byte-level BPE folder's tokenizer as GGUF metadata, the way llama.cpp's converter writes it:
    tokens by id, merges as "a b", its added special tokens marked control, BOS/EOS ids and flags."""
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


def chat_template_metadata(folder: Path) -> dict[str, Any]:
    """The folder's chat template (``chat_template.jinja``) as GGUF metadata; none when it has none."""
    template = folder / "chat_template.jinja"
    return {"tokenizer.chat_template": template.read_text()} if template.is_file() else {}


TYPE_NAMES = {name.lower(): kind for name, kind in GGMLQuantizationType.__members__.items()}


def _type(name: str) -> GGMLQuantizationType:
    try:
        kind = TYPE_NAMES[name.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"unknown GGUF type {name!r} (e.g. q4_0, q4_1, q8_0, f16, f32)") from None
    # The gguf package quantizes only some types (not the k-quants): found out here, not after reading the model.
    try:
        quantize(np.zeros((1, GGML_QUANT_SIZES[kind][0]), dtype=np.float32), kind)
    except NotImplementedError:
        raise argparse.ArgumentTypeError(f"GGUF type {name!r}: the gguf package cannot write it "
                                         "(e.g. q4_0, q4_1, q5_0, q8_0, f16, f32)") from None
    return kind


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a Hugging Face Llama/Qwen2 folder (safetensors)")
    parser.add_argument("out", type=Path, help="the GGUF file to write")
    parser.add_argument("--proj", type=_type, default=GGMLQuantizationType.Q4_0, help="decoder projections")
    parser.add_argument("--embd", type=_type, default=GGMLQuantizationType.Q4_0, help="the embedding")
    parser.add_argument("--output", type=_type, default=GGMLQuantizationType.Q8_0, help="the output matrix")
    parser.add_argument("--tokenizer", action="store_true", help="add the folder's tokenizer and chat template")
    args = parser.parse_args(argv)
    if not (args.source / "config.json").is_file():
        parser.error(f"{args.source} has no config.json: not a Hugging Face model folder")
    if args.out.exists():
        parser.error(f"{args.out} exists: give a new path")
    if not args.out.parent.is_dir():
        parser.error(f"{args.out.parent} is not a folder: the GGUF file goes into an existing one")
    extra = tokenizer_metadata(args.source) | chat_template_metadata(args.source) if args.tokenizer else None
    write_gguf(args.source, args.out, {"proj": args.proj, "embd": args.embd, "output": args.output}, extra)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e9:.2f} GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
