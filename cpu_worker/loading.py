"""Load a Llama-family checkpoint from a local Hugging Face folder into ``LlamaDecoder``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from .llama import LlamaDecoder, LlamaSpec, ModelConfigError
from .model_dir import ModelLoadError, resolve_model_dir

log = logging.getLogger(__name__)

_PREFIXES = ("model.",)


def _index(model_dir: Path) -> dict[str, Path] | None:
    """{tensor name: shard file} from a sharded checkpoint's index, or None when unsharded."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = model_dir / index_name
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            missing = sorted({name for name in weight_map.values() if not (model_dir / name).exists()})
            if missing:
                raise ModelLoadError(f"{index} names shards that are missing: {', '.join(missing)}")
            return {tensor: model_dir / name for tensor, name in weight_map.items()}
    return None


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files: safetensors (single or sharded) before pytorch .bin."""
    index = _index(model_dir)
    if index is not None:
        return sorted(set(index.values()))
    for pattern in ("model.safetensors", "model-*.safetensors", "pytorch_model.bin", "pytorch_model-*.bin"):
        found = sorted(model_dir.glob(pattern))
        if found:
            return found
    present = sorted(p.name for p in model_dir.iterdir()) if model_dir.is_dir() else []
    raise ModelLoadError(
        f"no weights in {model_dir}: expected model.safetensors, sharded safetensors with an index, "
        f"or pytorch_model*.bin; found {present or 'an empty folder'}"
    )


def _read_file(file: Path, names: set[str] | None) -> dict[str, torch.Tensor]:
    """The named tensors present in one file (all when ``names`` is None); safetensors reads
    only those, .bin files are memory-mapped so a large shard is not read whole."""
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as handle:
            return {
                name: handle.get_tensor(name)
                for name in handle.keys()  # noqa: SIM118 - safe_open has keys() but is not iterable
                if names is None or name in names
            }
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # legacy (non-zip) serialisation cannot be memory-mapped
        state = torch.load(file, map_location="cpu", weights_only=True)
    return {name: tensor for name, tensor in state.items() if names is None or name in names}


def read_tensors(model_dir: Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The named tensors (all when ``names`` is None) of a checkpoint folder; names it lacks
    are absent from the result. With an index, only the shards holding them are opened."""
    wanted = None if names is None else set(names)
    index = _index(model_dir)
    if index is not None and wanted is not None:
        files = sorted({index[name] for name in wanted if name in index})
    else:
        files = weight_files(model_dir)
    found: dict[str, torch.Tensor] = {}
    for file in files:
        found.update(_read_file(file, wanted))
    return found


def load_spec(model_dir: Path) -> LlamaSpec:
    if not (model_dir / "config.json").exists():
        raise ModelLoadError(f"{model_dir} has no config.json")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (ValueError, KeyError, OSError) as error:
        raw = json.loads((model_dir / "config.json").read_text())
        raise ModelLoadError(
            f"cannot parse {model_dir / 'config.json'} (model_type {raw.get('model_type')!r}): {error}"
        ) from None
    try:
        return LlamaSpec.from_hf_config(config)
    except ModelConfigError as error:
        raise ModelLoadError(f"{model_dir}: {error}") from None


def load_target_model(path_or_id: str | Path) -> LlamaDecoder:
    """Build the decoder in fp32 and fill it from the checkpoint; every weight must be present."""
    model_dir = resolve_model_dir(path_or_id)
    spec = load_spec(model_dir)
    with torch.device("meta"):
        model = LlamaDecoder(spec)
    expected = set(model.state_dict().keys())
    state: dict[str, torch.Tensor] = {}
    for name, tensor in read_tensors(model_dir).items():
        for prefix in _PREFIXES:
            name = name.removeprefix(prefix)
        if name in expected:
            state[name] = tensor.to(torch.float32)
    if "lm_head.weight" not in state and spec.tie_word_embeddings and "embed_tokens.weight" in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    missing = sorted(expected - state.keys())
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(f"{model_dir}: checkpoint lacks {len(missing)} weights: {shown}")
    model.load_state_dict(state, assign=True, strict=True)
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    log.info("loaded %s: %s, %d layers, hidden %d, %.1fM parameters", model_dir, spec.model_type,
             spec.num_layers, spec.hidden_size, sum(p.numel() for p in model.parameters()) / 1e6)
    return model.eval().requires_grad_(False)
