"""EAGLE-3 head folders: ``config.json`` + ``model.safetensors`` in the published layout.

The config holds the head's Llama fields (``num_hidden_layers`` 1 as published, more for
Dovetail's deeper heads, whose plain layers are ``post_layers.*``), ``draft_vocab_size``,
``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids`` (vLLM's key: the target layers the
rows come from) and, for Dovetail's own heads, ``dovetail_fusion``. The weights are
``Eagle3Head.file_state_dict()``: no embedding (it is the target's).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from cpu_worker.model.model_dir import read_config
from gpu_worker.checkpoint import load_head
from gpu_worker.eagle3 import AUX_LAYERS_KEY, Eagle3Head

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# rope_parameters: where transformers 5 keeps RoPE's theta (a head without it would run at 10000).
_SPEC_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
                "max_position_embeddings", "attention_bias", "mlp_bias", "hidden_act", "bos_token_id", "eos_token_id")


def is_eagle3_folder(folder: Path | str) -> bool:
    """A head folder in the EAGLE-3 layout (its config names a draft vocabulary)."""
    path = Path(folder) / CONFIG_NAME
    return path.exists() and "draft_vocab_size" in json.loads(path.read_text())


def head_config(head: Eagle3Head, target_config: dict[str, Any], aux_layers: tuple[int, ...]) -> dict[str, Any]:
    config = {key: target_config[key] for key in _SPEC_FIELDS if key in target_config}
    config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=head.spec.num_layers,
                  hidden_size=head.hidden_size, vocab_size=head.vocab_size,
                  draft_vocab_size=head.draft_vocab_size, target_hidden_size=head.feature_size // 3,
                  tie_word_embeddings=False, dovetail_fusion=head.fusion)
    config[AUX_LAYERS_KEY] = list(aux_layers)
    return config


def save_eagle3_head(head: Eagle3Head, out_dir: Path, target_dir: Path, aux_layers: tuple[int, ...],
                     dtype: torch.dtype = torch.float32) -> Path:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {name: (t.to(dtype) if t.is_floating_point() else t).detach().cpu().contiguous()
             for name, t in head.file_state_dict().items()}
    save_file(state, str(out_dir / WEIGHTS_NAME), metadata={"format": "pt"})
    target_config = read_config(Path(target_dir))  # a folder's config.json, or a GGUF's metadata as one
    config = head_config(head, target_config, aux_layers)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def load_eagle3_head(folder: Path | str, target_dir: Path | str, device: torch.device | str = "cpu",
                     dtype: torch.dtype = torch.float32) -> tuple[Eagle3Head, tuple[int, ...] | None]:
    """(head with the target's embedding, the config's aux layers or None for EAGLE's rule),
    loaded by the runtime's own loader (``gpu_worker.checkpoint.load_head``) so that training,
    eval and serving read a folder alike."""
    folder = Path(folder)
    head = load_head(folder, target_dir, device=device, dtype=dtype)
    if not isinstance(head, Eagle3Head):
        raise ValueError(f"{folder}: not an EAGLE-3 head (no midlayer.* weights)")
    layers = json.loads((folder / CONFIG_NAME).read_text()).get(AUX_LAYERS_KEY)
    return head.eval(), tuple(int(x) for x in layers) if layers is not None else None
