"""Small shippable copies: a target stored in fp16 and a head in fp16 without the frozen
embedding/lm_head (they load from the target folder). Both loaders cast back to fp32 on
the CPU, so only storage shrinks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")


def export_target(target_dir: Path, out_dir: Path, dtype: torch.dtype = torch.float16) -> Path:
    """Rewrite every weight of the target in ``dtype`` (same tensor names) and copy its config
    (with torch_dtype/dtype updated) and tokenizer files."""
    from safetensors.torch import save_file

    from cpu_worker.model import read_tensors

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.to(dtype).contiguous() for name, tensor in read_tensors(target_dir).items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target_dir / "config.json").read_text())
    name = str(dtype).removeprefix("torch.")
    config["torch_dtype"] = name
    if "dtype" in config:
        config["dtype"] = name
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for file in TOKENIZER_FILES:
        if (target_dir / file).exists():
            shutil.copyfile(target_dir / file, out_dir / file)  # contents only: sources may be read-only
    for written in out_dir.iterdir():
        written.chmod(0o644)
    return out_dir


def export_head(draft_dir: Path, target_dir: Path, out_dir: Path, dtype: torch.dtype = torch.float16) -> Path:
    """A head folder rewritten in ``dtype`` without the frozen tensors."""
    from gpu_worker.checkpoint import load_head, save_head
    from gpu_worker.head import DraftHead

    head = load_head(draft_dir, target_dir)
    if not isinstance(head, DraftHead):
        raise ValueError(f"{draft_dir} is an EAGLE-3 head: dovetail-train writes those with its eagle3 recipes")
    save_head(head.to(dtype), out_dir, include_frozen=False)
    for file in out_dir.iterdir():
        file.chmod(0o644)
    return out_dir
