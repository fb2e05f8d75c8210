"""Feature shards on disk: safetensors files plus a JSON manifest.

Each shard holds whole windows: ``tokens`` int32 [N], ``features`` fp16/fp32 [N, d] (the
target's last hidden states after the final norm), ``loss_mask`` uint8 [N] and
``window_offsets`` int64 [W + 1] (window w is rows offsets[w]:offsets[w + 1]), and with
``--aux-layers`` ``aux`` [N, 3d] (EAGLE-3: the residual streams entering three target layers,
listed in the manifest's ``aux_layers``). The
manifest lists the finished shards with a digest of their tokens, so an interrupted run
resumes by skipping shards whose digest still matches the planned one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def tokens_digest(windows: list[np.ndarray]) -> str:
    """sha1 over the shard's windows (lengths and ids): identifies the planned content."""
    digest = hashlib.sha1()
    for window in windows:
        digest.update(np.int64(len(window)).tobytes())
        digest.update(np.ascontiguousarray(window, dtype=np.int32).tobytes())
    return digest.hexdigest()


def write_json_atomic(path: Path, data: Any) -> None:
    """Write to a temporary name then rename: a kill never leaves a half-written manifest."""
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(temporary, path)


def write_shard(path: Path, tokens: np.ndarray, features: torch.Tensor, loss_mask: np.ndarray,
                offsets: np.ndarray, aux: torch.Tensor | None = None) -> None:
    from safetensors.torch import save_file

    temporary = path.with_suffix(".tmp")
    extra = {} if aux is None else {"aux": aux.contiguous()}
    save_file(extra | {
        "tokens": torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int32)),
        "features": features.contiguous(),
        "loss_mask": torch.from_numpy(np.ascontiguousarray(loss_mask, dtype=np.uint8)),
        "window_offsets": torch.from_numpy(np.ascontiguousarray(offsets, dtype=np.int64)),
    }, str(temporary))
    os.replace(temporary, path)


def read_manifest(folder: Path) -> dict[str, Any] | None:
    path = folder / MANIFEST
    return json.loads(path.read_text()) if path.exists() else None


@dataclass
class FeatureSet:
    """All windows of a feature folder in memory (features stay in their stored dtype)."""

    tokens: torch.Tensor  # int64 [N]
    features: torch.Tensor  # [N, d]
    loss_mask: torch.Tensor  # bool [N]
    offsets: torch.Tensor  # int64 [W + 1]
    aux: torch.Tensor | None = None  # [N, 3d] EAGLE-3 rows (residual streams entering aux_layers)
    aux_layers: tuple[int, ...] | None = None

    @property
    def num_windows(self) -> int:
        return int(self.offsets.numel() - 1)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def window(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        begin, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return self.tokens[begin:end], self.features[begin:end], self.loss_mask[begin:end]

    def feature_rms(self, sample: int = 65536) -> float:
        """RMS of the stored features over (up to) the first ``sample`` rows."""
        rows = self.features[:sample].float()
        return float(rows.pow(2).mean().sqrt())


def features_on_device(data: FeatureSet, device: str, share: float = 0.5) -> FeatureSet:
    """``data`` moved to a CUDA ``device`` when it takes at most ``share`` of the memory free
    there, else ``data`` itself. Cutting each step's batch on the host (fp16 rows widened to fp32,
    then copied over) held an H200 to ~10 steps/s; on the GPU it costs a few small copies. The
    window offsets stay on the host: batches index with them in Python."""
    if not device.startswith("cuda"):
        return data
    stored = [data.tokens, data.features, data.loss_mask] + ([data.aux] if data.aux is not None else [])
    size = sum(tensor.numel() * tensor.element_size() for tensor in stored)
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    if size > share * free:
        return data
    return dataclasses.replace(data, tokens=data.tokens.to(device), features=data.features.to(device),
                               loss_mask=data.loss_mask.to(device),
                               aux=None if data.aux is None else data.aux.to(device))


def check_token_ids(data: FeatureSet, vocab_size: int, folder: Path | str | None) -> None:
    """Token ids the target's vocabulary holds: features of another target with the same hidden
    size (which the CLI's check lets through) failed with an IndexError in the first step."""
    top = int(data.tokens.max()) if data.num_tokens else -1
    if top >= vocab_size:
        raise ValueError(f"{folder} holds token ids up to {top}, past the target's vocabulary of {vocab_size}: "
                         "its features come from another target; extract them with this --target")


def open_shard(path: Path) -> Any:
    """safetensors' reader of one shard; a missing or damaged one (deleted, cut by a full disk) is a
    ValueError saying how to redo it, not a FileNotFoundError/SafetensorError traceback."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt")
    except (OSError, SafetensorError) as error:
        raise ValueError(f"{path} cannot be read ({error}): rerun the `dovetail-train features` command that made "
                         "the folder, after deleting the file if it is there (missing shards are redone)") from None


def load_features(folder: Path | str, max_tokens: int | None = None, cap_name: str = "max_tokens") -> FeatureSet:
    """Load the finished shards of a complete feature folder (in shard order), optionally
    only the first windows that fit ``max_tokens`` (``cap_name``: the setting that asked for it,
    named when it keeps no window). The result is allocated once and filled
    shard by shard, so loading peaks at the data plus one shard (concatenating the loaded
    shards peaked at twice the data: 15.5 GB for 4M three-layer tokens)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None:
        raise FileNotFoundError(f"{folder} has no {MANIFEST}: run `dovetail-train features` first")
    if not manifest.get("complete"):
        raise ValueError(f"{folder}: feature extraction did not finish; rerun the same features command to resume")
    aux_layers = manifest.get("aux_layers")
    plan: list[tuple[Path, int]] = []  # (shard, rows kept)
    offsets, total = [np.zeros(1, dtype=np.int64)], 0
    for entry in manifest["shards"]:
        path = folder / entry["file"]
        with open_shard(path) as shard:
            stored_offsets = shard.get_tensor("window_offsets").numpy()
        shard_offsets = stored_offsets
        if max_tokens is not None:
            keep = int(np.searchsorted(shard_offsets, max_tokens - total, side="right")) - 1
            shard_offsets = shard_offsets[:keep + 1]
        end = int(shard_offsets[-1])
        if end == 0:  # the cap is shorter than the next window
            if not plan:  # said with the setting to change (was "no windows (max_tokens N)" for --eval-tokens too)
                raise ValueError(f"{folder}: {cap_name} {max_tokens} keeps no window (its first has "
                                 f"{int(stored_offsets[1])} tokens)")
            break
        plan.append((path, end))
        offsets.append(shard_offsets[1:] + total)
        total += end
        if max_tokens is not None and total >= max_tokens - 1:
            break
    if not plan:
        raise ValueError(f"{folder}: no windows (max_tokens {max_tokens})")
    with open_shard(plan[0][0]) as shard:
        feature_row = shard.get_slice("features")[:1]
        aux_row = shard.get_slice("aux")[:1] if aux_layers is not None else None
    tokens = torch.empty(total, dtype=torch.int64)
    features = torch.empty(total, feature_row.shape[1], dtype=feature_row.dtype)
    masks = torch.empty(total, dtype=torch.bool)
    aux = None if aux_row is None else torch.empty(total, aux_row.shape[1], dtype=aux_row.dtype)
    position = 0
    for path, end in plan:
        rows = slice(position, position + end)
        with open_shard(path) as shard:
            tokens[rows] = shard.get_slice("tokens")[:end]
            features[rows] = shard.get_slice("features")[:end]
            masks[rows] = shard.get_slice("loss_mask")[:end]
            if aux is not None:
                aux[rows] = shard.get_slice("aux")[:end]
        position += end
    return FeatureSet(tokens, features, masks, torch.from_numpy(np.concatenate(offsets)), aux,
                      tuple(aux_layers) if aux_layers is not None else None)
