"""Finding a model folder and reading its config.json and safetensors headers, without torch.

The coordinator (which never imports torch) and both workers resolve ``--target`` and
``--draft`` the same way: a local folder, a GGUF file (``gguf_file``), or a hub id found in the
local Hugging Face cache (never downloaded).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, BinaryIO


class ModelLoadError(ValueError):
    """A model folder that cannot be loaded, with what was found there."""


GGUF_MAGIC = b"GGUF"


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a file named *.gguf or starting with GGUF's magic number."""
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == GGUF_MAGIC
    except OSError:
        return False


def resolve_model_dir(path_or_id: str | Path) -> Path:
    """A local folder or GGUF file, or a hub id resolved from the local Hugging Face cache only (offline)."""
    path = Path(path_or_id).expanduser()
    if path.is_dir() or is_gguf(path):
        return path
    if path.exists():
        raise ModelLoadError(f"{path} is a file, but not a GGUF file; expected a model folder with config.json "
                             f"or a .gguf file")
    text = str(path_or_id)
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(text, local_files_only=True))
        except Exception as error:  # any failure here means "not in the local cache"
            raise ModelLoadError(
                f"model {text!r} is neither a local folder nor in the local Hugging Face cache "
                f"(nothing is downloaded): {type(error).__name__}"
            ) from None
    raise ModelLoadError(f"model folder {path} does not exist")


def read_config(model_dir: Path, missing_hint: str = "") -> dict[str, Any]:
    """config.json as a dict (a GGUF file's: what its metadata says, in config.json's keys);
    ModelLoadError when it is missing (the message ends with ``missing_hint``) or not JSON."""
    if is_gguf(model_dir):
        from cpu_worker.model.gguf_file import GGUFFile
        from cpu_worker.model.gguf_model import checked_config

        with GGUFFile(model_dir) as file:
            return checked_config(file)
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{model_dir} has no config.json{missing_hint}{_gguf_hint(model_dir)}") from None
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"cannot read {path}: {error}") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return config


def _gguf_hint(folder: Path) -> str:
    """A folder that holds GGUF files (a download folder given as --target) names them: the file is
    what a GGUF target is, and "has no config.json" alone sent users looking for one."""
    found = sorted(path.name for path in folder.glob("*.gguf"))[:3] if folder.is_dir() else []
    return f"; it holds {', '.join(found)}: give the .gguf file itself" if found else ""


def context_limit(config: dict[str, Any]) -> int:
    """The longest context the target engine serves for this config: its
    max_position_embeddings, or Mistral's sliding window when smaller (sliding-window
    attention is not implemented, so longer contexts are refused)."""
    limit = int(config.get("max_position_embeddings") or 2048)
    window = config.get("sliding_window")
    windowed = config.get("model_type") == "mistral" or config.get("use_sliding_window", False)
    return min(limit, int(window)) if window and windowed else limit


def read_safetensors_header(handle: BinaryIO) -> tuple[dict[str, Any], int]:
    """A safetensors file's header ({tensor name: dtype, shape, data_offsets}, and
    ``__metadata__``) read from ``handle`` at its start, and the offset where the data begins.
    A file that is not one (a header size past the file's end read garbage into a MemoryError,
    a short file a struct.error) is a ModelLoadError naming it."""
    name, size = getattr(handle, "name", "a safetensors file"), os.fstat(handle.fileno()).st_size
    prefix = handle.read(8)
    if len(prefix) < 8:
        raise ModelLoadError(f"{name} is not a valid safetensors file: {size} bytes, too short for a header")
    (header_size,) = struct.unpack("<Q", prefix)
    if header_size > size - 8:
        raise ModelLoadError(f"{name} is not a valid safetensors file: its header would be {header_size:,} bytes, "
                             f"the file has {size:,} (truncated or corrupt)")
    try:
        header = json.loads(handle.read(header_size))
    except ValueError as error:
        raise ModelLoadError(f"{name} is not a valid safetensors file: its header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{name} is not a valid safetensors file: its header is not a JSON object")
    return header, 8 + header_size
