"""Load a Llama-family checkpoint from a local Hugging Face folder into ``LlamaDecoder``."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from .llama import LlamaDecoder, LlamaSpec, ModelConfigError

log = logging.getLogger(__name__)

_PREFIXES = ("model.",)


class ModelLoadError(ValueError):
    """A model folder that cannot be loaded, with what was found there."""


def resolve_model_dir(path_or_id: str | Path) -> Path:
    """A local folder, or a hub id resolved from the local Hugging Face cache only (offline)."""
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelLoadError(f"{path} is a file; expected a model folder with config.json")
    text = str(path_or_id)
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(text, local_files_only=True))
        except Exception as error:  # noqa: BLE001 - any failure means "not in the local cache"
            raise ModelLoadError(
                f"model {text!r} is neither a local folder nor in the local Hugging Face cache "
                f"(nothing is downloaded): {type(error).__name__}"
            ) from None
    raise ModelLoadError(f"model folder {path} does not exist")


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files: safetensors (single or sharded) before pytorch .bin."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = model_dir / index_name
        if index.exists():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            missing = [name for name in shards if not (model_dir / name).exists()]
            if missing:
                raise ModelLoadError(f"{index} names shards that are missing: {', '.join(missing)}")
            return [model_dir / name for name in shards]
    for pattern in ("model.safetensors", "model-*.safetensors", "pytorch_model.bin", "pytorch_model-*.bin"):
        found = sorted(model_dir.glob(pattern))
        if found:
            return found
    present = sorted(p.name for p in model_dir.iterdir())
    raise ModelLoadError(
        f"no weights in {model_dir}: expected model.safetensors, sharded safetensors with an index, "
        f"or pytorch_model*.bin; found {present or 'an empty folder'}"
    )


def iter_tensors(files: list[Path], wanted: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) from every file; ``wanted`` limits safetensors reads to those names."""
    for file in files:
        if file.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    if wanted is None or name in wanted:
                        yield name, handle.get_tensor(name)
        else:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            for name, tensor in state.items():
                if wanted is None or name in wanted:
                    yield name, tensor


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
    files = weight_files(model_dir)
    with torch.device("meta"):
        model = LlamaDecoder(spec)
    expected = set(model.state_dict().keys())
    state: dict[str, torch.Tensor] = {}
    for name, tensor in iter_tensors(files):
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
