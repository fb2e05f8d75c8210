"""Which target rows a draft head reads, told from its folder without torch.

The coordinator (which never imports torch) sizes the shared-memory rings and tells the
cpu_worker what to return before either worker has loaded anything, so it needs this from
the files alone:

- EAGLE-1/2 and Dovetail's own dgf/fc heads read the target's last hidden state after the
  final norm: one row of Ht floats per position.
- EAGLE-3 heads (``gpu_worker.eagle3``) read ``[h_a; h_b; h_c]``, the residual stream
  entering target layers a < b < c: 3 * Ht floats per row. The layers are the head config's
  ``eagle_aux_hidden_state_layer_ids`` (vLLM's key) or EAGLE's rule {2, L//2, L-3}.

A folder is EAGLE-3 when its config names a ``dovetail_fusion`` of ``eagle3``/``dgf-eagle3``,
or (published heads name no fusion) has ``draft_vocab_size``, or its safetensors weights hold
``midlayer.*`` keys. The gpu_worker checks the loaded head against what was decided here.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cpu_worker.model.model_dir import ModelLoadError, read_config, read_safetensors_header

# Torch-free, so the coordinator can read a head's layout; gpu_worker.eagle3 re-exports these
# names and the layer rule below (its only copy).
AUX_LAYERS_KEY = "eagle_aux_hidden_state_layer_ids"
EAGLE3_FUSIONS = ("eagle3", "dgf-eagle3")
FUSION_FIELD = "dovetail_fusion"
# Where a Hugging Face model's decoder layers live: a folder with these is a target, not a head.
MODEL_LAYER_PREFIX = "model.layers."


class HeadLayoutError(ValueError):
    """A head whose target rows cannot be told, or that does not fit the target."""


@dataclass(frozen=True)
class FeatureLayout:
    """What each target row holds: the last layer after the final norm (``aux_layers`` None),
    or the residual streams entering ``aux_layers`` concatenated in that order."""

    target_hidden_size: int
    aux_layers: tuple[int, ...] | None = None

    @property
    def row_width(self) -> int:
        """Floats per row in the rings."""
        return self.target_hidden_size * (len(self.aux_layers) if self.aux_layers else 1)

    def describe(self) -> str:
        if not self.aux_layers:
            return f"last-layer rows of {self.row_width}"
        return f"rows of {self.row_width} = the inputs of target layers {list(self.aux_layers)}"


def resolve_aux_layers(num_target_layers: int, override: Sequence[int] | None = None,
                       option: str = AUX_LAYERS_KEY) -> tuple[int, int, int]:
    """EAGLE-3's three target layers: ``override`` (the head config's ``AUX_LAYERS_KEY``, or a
    command-line option named by ``option`` in errors) or EAGLE's rule {2, L//2, L-3}; three
    distinct, increasing layers of the target, or an error that says which and how to fix it.
    The one copy of the rule: ``gpu_worker.eagle3`` and training use it too."""
    if override is not None:
        if isinstance(override, (str, bytes)) or not all(isinstance(layer, int) for layer in override):
            raise HeadLayoutError(f"{option} must be a list of three integers, got {override!r}")
        layers = tuple(int(layer) for layer in override)
        where = f"{option} {list(layers)}"
    else:
        layers = (2, num_target_layers // 2, num_target_layers - 3)
        where = f"EAGLE's rule {{2, L//2, L-3}} gives {list(layers)}"
    if len(layers) != 3:
        raise HeadLayoutError(f"{where}: EAGLE-3 takes exactly three target layers")
    increasing = all(b > a for a, b in zip(layers, layers[1:], strict=False))
    if not increasing or layers[0] < 0 or layers[-1] >= num_target_layers:
        name_them = (f"{AUX_LAYERS_KEY!r} in the head's config.json" if option == AUX_LAYERS_KEY
                     else f"{option} (config key {AUX_LAYERS_KEY!r})")
        hint = "" if override is not None else (
            f"; the target is too shallow for the rule: name three distinct layers with {name_them}")
        raise HeadLayoutError(f"{where} for a {num_target_layers}-layer target: the layers must be distinct, "
                              f"increasing and in 0..{num_target_layers - 1}{hint}")
    return (layers[0], layers[1], layers[2])


def safetensors_keys(folder: Path) -> set[str]:
    """Tensor names of a folder's safetensors weights, read from the file headers (no torch);
    empty when the weights are not safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            return set(json.loads(index.read_text())["weight_map"])
        except (OSError, ValueError, KeyError, TypeError):
            return set()
    keys: set[str] = set()
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with file.open("rb") as handle:
                header, _ = read_safetensors_header(handle)
        except (OSError, ValueError, struct.error):
            continue
        keys.update(name for name in header if name != "__metadata__")
    return keys


def is_eagle3(config: dict[str, Any], keys: set[str]) -> bool:
    named = config.get(FUSION_FIELD)
    if named is not None:
        return named in EAGLE3_FUSIONS
    return "draft_vocab_size" in config or any(key.startswith("midlayer.") for key in keys)


def feature_layout(draft_dir: Path, target_config: dict[str, Any]) -> FeatureLayout:
    """The rows the head in ``draft_dir`` reads from a target with ``target_config``."""
    try:
        config = read_config(draft_dir, missing_hint=" (not a draft head folder)")
    except ModelLoadError as error:
        raise HeadLayoutError(str(error)) from None
    hidden = int(target_config["hidden_size"])
    if not is_eagle3(config, safetensors_keys(draft_dir)):
        return FeatureLayout(hidden)
    layers = int(target_config["num_hidden_layers"])
    try:
        aux = resolve_aux_layers(layers, config.get(AUX_LAYERS_KEY))
    except HeadLayoutError as error:
        raise HeadLayoutError(f"EAGLE-3 head {draft_dir}: {error}") from None
    return FeatureLayout(hidden, aux)
