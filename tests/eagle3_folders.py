"""Random EAGLE-3 draft heads written the way published ones are (SafeAILab/EAGLE's layout):
``config.json`` with ``draft_vocab_size`` and no Dovetail field, ``model.safetensors`` with
exactly the published tensor names, no embedding (the target's is used). Written from
shapes alone, not through ``gpu_worker.eagle3``, so loading them tests the layout."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch


def published_state(hidden: int, target_hidden: int, heads: int, kv_heads: int, intermediate: int,
                    vocab: int, draft_ids: Sequence[int], seed: int) -> dict[str, torch.Tensor]:
    """The tensors of a published EAGLE-3 ``model.safetensors`` (random values)."""
    generator = torch.Generator().manual_seed(seed)
    head_dim = hidden // heads

    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=generator) * cols ** -0.5

    def norm() -> torch.Tensor:
        return 1 + 0.2 * torch.randn(hidden, generator=generator)

    ids = torch.tensor(sorted({int(i) for i in draft_ids}), dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return {
        "fc.weight": weight(hidden, 3 * target_hidden),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": weight(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": weight(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": weight(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": weight(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": weight(intermediate, hidden),
        "midlayer.mlp.up_proj.weight": weight(intermediate, hidden),
        "midlayer.mlp.down_proj.weight": weight(hidden, intermediate),
        "norm.weight": norm(),
        "lm_head.weight": weight(len(ids), hidden),
        # Draft id d is target id d + d2t[d]; t2d[t]: target id t is in the draft vocabulary.
        "d2t": ids - torch.arange(len(ids)),
        "t2d": t2d,
    }


def save_published_eagle3(folder: Path, target_dir: Path, draft_ids: Sequence[int], seed: int = 0,
                          aux_layers: Sequence[int] | None = None, heads: int | None = None,
                          extra_config: dict | None = None) -> Path:
    """A random EAGLE-3 head for the target in ``target_dir``, in the published layout.
    ``aux_layers``: written as ``eagle_aux_hidden_state_layer_ids`` (needed for shallow targets)."""
    from safetensors.torch import save_file

    target = json.loads((target_dir / "config.json").read_text())
    hidden = int(target["hidden_size"])
    heads = heads or int(target["num_attention_heads"])
    kv_heads = int(target.get("num_key_value_heads") or heads)
    intermediate = int(target["intermediate_size"])
    vocab = int(target["vocab_size"])
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": 1,
        "max_position_embeddings": int(target.get("max_position_embeddings", 2048)),
        "rms_norm_eps": float(target.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(target.get("rope_theta", 10000.0)),
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "vocab_size": vocab,
        "draft_vocab_size": len(set(draft_ids)),
        **(extra_config or {}),
    }
    if aux_layers is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(aux_layers)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = published_state(hidden, hidden, heads, kv_heads, intermediate, vocab, draft_ids, seed)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
