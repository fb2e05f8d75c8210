"""Draft head checkpoints: Dovetail's own (dgf, fc, eagle3, dgf-eagle3) and published
EAGLE-1/2 and EAGLE-3 folders.

A folder holds ``config.json`` (Llama-style fields; ``num_hidden_layers`` counts the
draft's layers; ``dovetail_fusion`` names the fusion) and the weights (``model.safetensors``
or ``pytorch_model.bin``, optionally sharded with an index). Published folders name no
fusion: ``midlayer.*`` keys mean EAGLE-3 (``gpu_worker.eagle3``), else ``fc.weight`` means
EAGLE-1/2's ``fc``. The frozen embedding (and, for EAGLE-1/2 and dgf heads, the lm_head)
comes from the draft folder where present, else from the target's folder (only those
tensors are read; a tied target head reuses the embedding). An EAGLE-3 head has its own
lm_head over a reduced draft vocabulary (``draft_vocab_size`` in its config) and the
``d2t``/``t2d`` maps between draft and target ids.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from cpu_worker.model import (
    LlamaSpec,
    ModelLoadError,
    fuse_projections,
    iter_tensors,
    keeps_stored_tables,
    release_freed_memory,
    tensor_shapes,
)
from cpu_worker.model import read_tensors as read_checkpoint_tensors
from cpu_worker.model.embedding import NARROW_FLOATS, BlockEmbedding, StoredEmbedding, table
from cpu_worker.model.hf_config import plain_config
from cpu_worker.model.model_dir import is_gguf, read_config

from .eagle3 import EAGLE3_FUSIONS, Eagle3Head
from .head import FUSIONS, DraftHead
from .head_formats import FUSION_WEIGHTS, quantize_projections
from .head_layout import FUSION_FIELD, MODEL_LAYER_PREFIX
from .head_placer import HeadPlacer

AnyHead = DraftHead | Eagle3Head

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# Buffers some published checkpoints carry that the head recomputes itself.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_TARGET_EMBED_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight")
_TARGET_HEAD_NAMES = ("lm_head.weight",)
_FROZEN = ("embed_tokens.weight", "lm_head.weight")


class DraftCheckpointError(ValueError):
    """A draft (or target) folder that cannot be loaded as asked, with what was found."""


# ---------------------------------------------------------------- reading weights

def read_tensors(folder: Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The shared checkpoint reader, with its errors reported as draft checkpoint errors."""
    try:
        return read_checkpoint_tensors(folder, names)
    except ModelLoadError as error:
        raise DraftCheckpointError(str(error)) from None


def read_shapes(folder: Path, names: set[str] | None = None) -> dict[str, tuple[int, ...]]:
    """The tensors' shapes without their data, errors reported as draft checkpoint errors."""
    try:
        return tensor_shapes(folder, names)
    except ModelLoadError as error:
        raise DraftCheckpointError(str(error)) from None


# ---------------------------------------------------------------- configs

def _hf_config(folder: Path) -> Any:
    """A transformers config for a Llama-style folder (AutoConfig; plain LlamaConfig when the
    file names no model_type, as some exported draft configs do); a GGUF target's config from its metadata."""
    if is_gguf(folder):
        return SimpleNamespace(**read_config(folder))
    path = folder / CONFIG_NAME
    if not path.exists():
        raise DraftCheckpointError(f"{folder} has no {CONFIG_NAME}")
    try:
        raw = json.loads(path.read_text())
        # Everything the head reads stated: no transformers import (seconds) to parse it.
        config: Any = plain_config(raw, model_type_default="llama") if isinstance(raw, dict) else None
        if config is None and "model_type" in raw:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(str(folder))
        elif config is None:
            from transformers import LlamaConfig

            config = LlamaConfig.from_dict(raw)
    except Exception as error:  # transformers' validation (a string size: StrictDataclass errors) was a traceback
        raise DraftCheckpointError(f"cannot parse {path}: {str(error).strip().splitlines()[-1].strip()}") from None
    if int(getattr(config, "num_hidden_layers", 1) or 0) < 1:  # was a ValueError from the head's constructor
        raise DraftCheckpointError(f"{path}: num_hidden_layers {config.num_hidden_layers}; a draft head needs at "
                                   "least one decoder layer")
    return config


def detect_fusion(raw_config: dict[str, Any], keys: Iterable[str]) -> str:
    """The config's ``dovetail_fusion`` if it names one, else guessed from the weight keys."""
    named = raw_config.get(FUSION_FIELD)
    supported = FUSIONS + EAGLE3_FUSIONS
    if named is not None:
        if named not in supported:
            raise DraftCheckpointError(f"unknown draft fusion {named!r} in config; supported: {', '.join(supported)}")
        return named
    present = set(keys)
    # Before fc: an EAGLE-3 head has an fc.weight too (over three target layers).
    if any(key.startswith("midlayer.") for key in present):
        return "dgf-eagle3" if {"W_1", "W_2", "W_z"} <= present else "eagle3"
    if "fc.weight" in present:
        return "fc"
    if {"W_1", "W_2", "W_z"} <= present:
        return "dgf"
    if any(key.startswith(MODEL_LAYER_PREFIX) for key in present):
        raise DraftCheckpointError(f"the weights are a whole model's ({MODEL_LAYER_PREFIX}*), not a draft head's: give "
                                   "a head trained for the target (dovetail-train train) or a published EAGLE head")
    raise DraftCheckpointError(
        f"cannot tell the draft's fusion: config names no {FUSION_FIELD!r} and the weights have "
        "neither midlayer.* (EAGLE-3), fc.weight (EAGLE fc) nor W_1/W_2/W_z (dgf)")


def _check_match(what: str, draft: int, target: int) -> None:
    """The head's config against the target's config."""
    if draft != target:
        raise DraftCheckpointError(f"draft head {what} {draft} (its config.json) does not match the target's "
                                   f"{what} {target}")


def _check_tensor(config_what: str, config_value: int, name: str, axis: str, found: int, source: str) -> None:
    """The head's config against a tensor's shape, naming where the tensor came from."""
    if config_value != found:
        raise DraftCheckpointError(f"draft head {config_what} {config_value} (its config.json) does not match "
                                   f"{name} in {source}, which has {found} {axis}")


# ---------------------------------------------------------------- load / save

def _target_frozen_sources(target_dir: Path) -> dict[str, str]:
    """{head name: the target's tensor name} for the embedding and lm_head (a tied head reads
    the embedding), without reading any data."""
    config = _hf_config(target_dir)
    present = read_shapes(target_dir, set(_TARGET_EMBED_NAMES + _TARGET_HEAD_NAMES))
    embed = next((name for name in _TARGET_EMBED_NAMES if name in present), None)
    head = next((name for name in _TARGET_HEAD_NAMES if name in present), None)
    if embed is None:
        raise DraftCheckpointError(f"target folder {target_dir} has no model.embed_tokens.weight")
    if head is None:
        if not getattr(config, "tie_word_embeddings", False):
            raise DraftCheckpointError(
                f"target folder {target_dir} has no lm_head.weight and does not tie it to the embedding")
        head = embed
    return {"embed_tokens.weight": embed, "lm_head.weight": head}


def load_target_frozen(target_dir: Path | str) -> dict[str, torch.Tensor]:
    """The target's embedding and lm_head, reading only those tensors (tied head -> embedding)."""
    sources = _target_frozen_sources(Path(target_dir))
    found = read_tensors(Path(target_dir), sorted(set(sources.values())))
    return {name: found[source] for name, source in sources.items()}


def head_spec(draft_dir: Path | str) -> LlamaSpec:
    """The draft's architecture from its config alone (no weights read)."""
    return LlamaSpec.from_hf_config(_hf_config(Path(draft_dir)))


def _spec_with_weight_biases(config: Any, names: Iterable[str], layer: str) -> LlamaSpec:
    """The head's spec with bias flags taken from its weights (``layer``: the first decoder
    layer's prefix): published heads differ (qwen-style qkv bias, no o/mlp bias)."""
    present = set(names)
    return dataclasses.replace(
        LlamaSpec.from_hf_config(config),
        qkv_bias=f"{layer}self_attn.q_proj.bias" in present,
        o_bias=f"{layer}self_attn.o_proj.bias" in present,
        mlp_bias=f"{layer}mlp.gate_proj.bias" in present,
        sliding_window=None,
    )


def draft_fusion(draft_dir: Path | str) -> str:
    """The head's fusion from its config and weight names alone (no weights read)."""
    draft_dir = Path(draft_dir)
    return detect_fusion(json.loads((draft_dir / CONFIG_NAME).read_text()), read_shapes(draft_dir).keys())


def load_head(draft_dir: Path | str, target_dir: Path | str | None = None,
              device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
              projections: str | None = None) -> AnyHead:
    """Build a head from a draft folder: a ``DraftHead`` (Dovetail or published EAGLE-1/2
    layout) or an ``Eagle3Head`` (Dovetail's or published EAGLE-3 layout).

    ``target_dir`` supplies the embedding/lm_head the draft folder lacks and is checked for
    matching hidden size and vocabulary. Tensors are read one at a time and converted to
    ``dtype`` on ``device`` as they come; ``projections`` (CPU, fp32: int8 or q4_0,
    ``head_formats``) quantizes every projection on the way, so the head never sits in memory in fp32.
    An EAGLE-3 head (one decoder layer) is read whole and quantised after loading.
    """
    draft_dir = Path(draft_dir)
    config = _hf_config(draft_dir)
    raw = json.loads((draft_dir / CONFIG_NAME).read_text())
    shapes = {name: shape for name, shape in read_shapes(draft_dir).items()
              if not name.endswith(_IGNORED_SUFFIXES)}
    fusion = detect_fusion(raw, shapes.keys())
    if fusion in EAGLE3_FUSIONS:
        state = {name: tensor for name, tensor in read_tensors(draft_dir).items()
                 if not name.endswith(_IGNORED_SUFFIXES)}
        return load_eagle3_head(draft_dir, config, raw, state, fusion, target_dir, device, dtype, projections)
    spec = _spec_with_weight_biases(config, shapes, "layers.0.")
    fc_bias = "fc.bias" in shapes  # the weights decide; a config's "bias": false agrees with them
    frozen_sources = _frozen_sources(draft_dir, target_dir, spec, shapes)
    with torch.device("meta"):  # no wasted random init: every tensor comes from the files
        head = DraftHead(spec, fusion=fusion, fc_bias=fc_bias)
    expected = {name: tuple(tensor.shape) for name, tensor in head.state_dict().items()}
    missing = sorted(expected.keys() - shapes.keys())
    unexpected = sorted(shapes.keys() - expected.keys())
    if missing or unexpected:
        raise DraftCheckpointError(
            f"draft weights in {draft_dir} do not fit a {spec.num_layers}-layer {fusion} head: "
            f"missing {missing or 'none'}, unexpected {unexpected or 'none'}")
    misshapen = [f"{name} {list(shapes[name])} (expected {list(shape)})"
                 for name, shape in expected.items() if tuple(shapes[name]) != shape]
    if misshapen:
        raise DraftCheckpointError(f"draft weights in {draft_dir} have the wrong shapes: {', '.join(misshapen)}")

    _place_head(head, draft_dir, target_dir, set(shapes.keys() - frozen_sources.keys()), frozen_sources,
                HeadPlacer(head, device, dtype, projections))
    release_freed_memory()
    head.embed_tokens.requires_grad_(False)
    if isinstance(head.lm_head, torch.nn.Linear):  # an int8 lm_head holds no float weight
        head.lm_head.weight.requires_grad_(False)
    return head.eval()


def _frozen_sources(draft_dir: Path, target_dir: Path | str | None, spec: LlamaSpec,
                    shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """{head name: the target's tensor name} for the embedding/lm_head the draft folder lacks
    (their shapes added to ``shapes``), every frozen tensor checked against the head's config."""
    frozen_sources: dict[str, str] = {}
    if target_dir is not None:
        target_dir = Path(target_dir)
        target_config = _hf_config(target_dir)
        _check_match("hidden size", spec.hidden_size, int(target_config.hidden_size))
        _check_match("vocab size", spec.vocab_size, int(target_config.vocab_size))
        missing_frozen = [name for name in _FROZEN if name not in shapes]
        if missing_frozen:
            sources = _target_frozen_sources(target_dir)
            target_shapes = read_shapes(target_dir, set(sources.values()))
            for name in missing_frozen:
                frozen_sources[name] = sources[name]
                shapes[name] = target_shapes[sources[name]]
    elif "lm_head.weight" not in shapes and "embed_tokens.weight" not in shapes:
        raise DraftCheckpointError(
            f"draft folder {draft_dir} has no embed_tokens/lm_head: pass the target's folder to take them from")
    elif "lm_head.weight" not in shapes:
        raise DraftCheckpointError(
            f"draft folder {draft_dir} has no lm_head.weight: pass the target's folder to take it from")

    for name in _FROZEN:
        if name in shapes:
            source = f"the target folder {target_dir}" if name in frozen_sources else f"the draft folder {draft_dir}"
            _check_tensor("vocab size", spec.vocab_size, name, "rows", int(shapes[name][0]), source)
            _check_tensor("hidden size", spec.hidden_size, name, "columns", int(shapes[name][1]), source)
    return frozen_sources


def _place_head(head: DraftHead, draft_dir: Path, target_dir: Path | str | None, names: set[str],
                frozen_sources: dict[str, str], placer: HeadPlacer) -> None:
    """Every tensor into ``head``: ``names`` from the draft folder, one at a time, then the
    frozen ones from the target's; the projections fused when quantized."""
    try:
        for name, tensor in iter_tensors(draft_dir, names):
            placer.place(name, tensor)
            del tensor
            release_freed_memory()  # the source and its fp32 copy, before the next one comes
        for name, source in frozen_sources.items():
            assert target_dir is not None
            # A quantized head keeps a GGUF target's table as the file stores it (not in fp32).
            stored = _stored_target_table(target_dir) if name == "embed_tokens.weight" and placer.keeps_tables else None
            if isinstance(stored, BlockEmbedding):
                placer.place_table("embed_tokens", stored)
            else:
                placer.place(name, stored.weight.detach() if isinstance(stored, StoredEmbedding)
                             else read_tensors(Path(target_dir), [source])[source])
            release_freed_memory()
    except ModelLoadError as error:
        raise DraftCheckpointError(str(error)) from None
    unplaced = placer.unplaced()
    if unplaced:  # a name listed in a header whose data never came (a broken index)
        raise DraftCheckpointError(f"draft weights in {draft_dir} lack data for {', '.join(unplaced)}")
    if placer.projections:
        fuse_projections(head)  # q/k/v and gate/up in one call each, the same bits
        head.projection_format = placer.projections


def load_target_embedding(target_dir: Path | str) -> torch.Tensor:
    """The target's embedding alone (an EAGLE-3 head has its own lm_head)."""
    found = read_tensors(Path(target_dir), list(_TARGET_EMBED_NAMES))
    embed = next((found[name] for name in _TARGET_EMBED_NAMES if name in found), None)
    if embed is None:
        raise DraftCheckpointError(f"target folder {target_dir} has no model.embed_tokens.weight")
    return embed


def _vocab_maps(draft_dir: Path, state: dict[str, torch.Tensor], vocab: int, draft_vocab: int) -> None:
    """Check ``d2t``/``t2d`` (or make them for a full vocabulary) in ``state``, in place: every
    draft id maps to a distinct target id, and t2d marks exactly those."""
    if "d2t" not in state:
        if draft_vocab != vocab:
            raise DraftCheckpointError(f"EAGLE-3 head {draft_dir} has a draft vocabulary of {draft_vocab} < {vocab} "
                                       "target ids but no d2t to map its ids to the target's")
        state["d2t"] = torch.zeros(draft_vocab, dtype=torch.int64)
    d2t = state["d2t"].to(torch.int64).reshape(-1)
    if d2t.numel() != draft_vocab:
        raise DraftCheckpointError(f"d2t in {draft_dir} has {d2t.numel()} entries, the head's draft_vocab_size "
                                   f"(its config.json) is {draft_vocab}")
    targets = torch.arange(draft_vocab) + d2t
    if bool((targets < 0).any()) or bool((targets >= vocab).any()) or targets.unique().numel() != draft_vocab:
        raise DraftCheckpointError(f"d2t in {draft_dir} does not map the {draft_vocab} draft ids to distinct target "
                                   f"ids in 0..{vocab - 1}")
    marked = torch.zeros(vocab, dtype=torch.bool)
    marked[targets] = True
    if "t2d" in state:
        t2d = state["t2d"].reshape(-1)
        if t2d.numel() != vocab:
            raise DraftCheckpointError(f"t2d in {draft_dir} has {t2d.numel()} entries, the target's vocabulary "
                                       f"{vocab}")
        if not torch.equal(t2d.to(torch.bool), marked):
            raise DraftCheckpointError(f"t2d in {draft_dir} does not mark exactly the target ids d2t maps to")
    state["d2t"], state["t2d"] = d2t, marked


def _eagle3_spec(draft_dir: Path, config: Any, state: dict[str, torch.Tensor]) -> LlamaSpec:
    """An EAGLE-3 head's spec: its bias flags and its decoder layers as its weights hold them."""
    spec = _spec_with_weight_biases(config, state, "midlayer.")
    # Published heads have one decoder layer whatever their config copied from the target; a
    # deeper Dovetail head's plain layers are post_layers.0.. (their count decides).
    post = {int(key.split(".")[1]) for key in state if key.startswith("post_layers.")}
    if post != set(range(len(post))):
        raise DraftCheckpointError(f"EAGLE-3 head {draft_dir}: post_layers {sorted(post)} are not numbered 0..")
    if spec.num_layers != 1 + len(post):
        if post:
            raise DraftCheckpointError(
                f"EAGLE-3 head {draft_dir}: config.json says num_hidden_layers {spec.num_layers}, its weights hold "
                f"{1 + len(post)} decoder layers (midlayer and post_layers.0-{len(post) - 1})")
        spec = dataclasses.replace(spec, num_layers=1)
    return spec


def load_eagle3_head(draft_dir: Path, config: Any, raw: dict[str, Any], state: dict[str, torch.Tensor],
                     fusion: str, target_dir: Path | str | None, device: torch.device | str,
                     dtype: torch.dtype, projections: str | None = None) -> Eagle3Head:
    """An ``Eagle3Head`` from a folder in the published EAGLE-3 layout (or Dovetail's own):
    config with ``draft_vocab_size`` (optional ``target_hidden_size``), weights ``fc``,
    ``midlayer.*``, ``norm``, ``lm_head`` [draft vocab, H], ``d2t``, ``t2d``; the embedding
    from the folder if it has one, else from the target's. ``projections`` (int8 or q4_0, on the CPU
    at fp32: ``head_formats``): every projection quantized, each widened to fp32 only as it is (the
    head never whole in fp32), and the embedding kept as stored (an fp16/bf16 table, a GGUF file's blocks).
    ``state`` is consumed (emptied once the head holds its tensors)."""
    spec = _eagle3_spec(draft_dir, config, state)
    for name in ("fc.weight", "lm_head.weight"):
        if name not in state:
            raise DraftCheckpointError(f"EAGLE-3 head {draft_dir} has no {name}")
    lm_rows = int(state["lm_head.weight"].shape[0])
    draft_vocab = int(raw.get("draft_vocab_size") or lm_rows)
    _check_tensor("draft_vocab_size", draft_vocab, "lm_head.weight", "rows", lm_rows, f"the draft folder {draft_dir}")
    target_hidden = int(raw.get("target_hidden_size") or spec.hidden_size)
    fc_columns = int(state["fc.weight"].shape[1])
    if fc_columns != 3 * target_hidden:
        raise DraftCheckpointError(
            f"fc.weight in {draft_dir} reads rows of {fc_columns} floats; an EAGLE-3 head reads 3 x the target's "
            f"hidden size {target_hidden} (config target_hidden_size, else hidden_size) = {3 * target_hidden}")
    if target_dir is not None:
        target_config = _hf_config(Path(target_dir))
        _check_match("vocab_size", spec.vocab_size, int(target_config.vocab_size))
        if target_hidden != int(target_config.hidden_size):
            raise DraftCheckpointError(
                f"draft head reads target rows of 3 x {target_hidden} (its config.json), the target's hidden size is "
                f"{int(target_config.hidden_size)}")
    keeps = keeps_stored_tables(projections is not None, dtype, device)
    block_table = _eagle3_embedding(draft_dir, target_dir, state, spec, keeps)
    _vocab_maps(draft_dir, state, spec.vocab_size, draft_vocab)
    try:
        with torch.device("meta"):  # every tensor comes from the files
            head = Eagle3Head(spec, target_hidden_size=target_hidden, draft_vocab_size=draft_vocab, fusion=fusion)
    except ValueError as error:
        raise DraftCheckpointError(f"EAGLE-3 head {draft_dir}: {error}") from None
    if block_table is not None:
        head.embed_tokens = block_table
    expected = set(head.state_dict().keys())
    missing = sorted(expected - state.keys())
    unexpected = sorted(state.keys() - expected)
    if missing or unexpected:
        raise DraftCheckpointError(
            f"draft weights in {draft_dir} do not fit a {fusion} head: "
            f"missing {missing or 'none'}, unexpected {unexpected or 'none'}")
    _assign_state(head, state, device, dtype, keeps)
    state.clear()  # the head holds the tensors now: each projection's source goes as it is quantized
    return (quantize_projections(head, projections) if projections else head).eval()


def _eagle3_embedding(draft_dir: Path, target_dir: Path | str | None, state: dict[str, torch.Tensor],
                      spec: LlamaSpec, stored_table: bool) -> torch.nn.Module | None:
    """The embedding an EAGLE-3 head reads: the draft folder's, else the target's, checked against the
    head's config. ``stored_table``: a GGUF target's table is taken as its file stores it, returned as
    a block module (``BlockEmbedding``), or put in ``state`` as fp16/bf16; else it comes in ``state``."""
    source = f"the draft folder {draft_dir}"
    block_table = None
    if "embed_tokens.weight" not in state:
        if target_dir is None:
            raise DraftCheckpointError(
                f"EAGLE-3 head {draft_dir} has no embed_tokens: pass the target's folder to take it from")
        source = f"the target folder {target_dir}"
        stored = _stored_target_table(target_dir) if stored_table else None
        if isinstance(stored, StoredEmbedding):
            state["embed_tokens.weight"] = stored.weight.detach()
        elif isinstance(stored, BlockEmbedding):
            block_table = stored
        else:
            state["embed_tokens.weight"] = load_target_embedding(target_dir)
    rows, columns = ((block_table.num_embeddings, block_table.hidden_size) if block_table is not None
                     else tuple(state["embed_tokens.weight"].shape))
    _check_tensor("vocab_size", spec.vocab_size, "embed_tokens.weight", "rows", int(rows), source)
    _check_tensor("hidden_size", spec.hidden_size, "embed_tokens.weight", "columns", int(columns), source)
    return block_table


def _stored_target_table(target_dir: Path | str) -> torch.nn.Module | None:
    """A GGUF target's embedding as its file stores it (``gguf_loading.gguf_stored_table``); None for a
    folder (its fp16/bf16 tensors are kept as read) or an F32 table."""
    if not is_gguf(Path(target_dir)):
        return None
    from cpu_worker.model.gguf_loading import gguf_stored_table  # imports gguf: only for a GGUF target

    try:
        return gguf_stored_table(target_dir)
    except ModelLoadError as error:
        raise DraftCheckpointError(str(error)) from None


def _assign_state(head: Eagle3Head, state: dict[str, torch.Tensor], device: torch.device | str, dtype: torch.dtype,
                  keeps: bool) -> None:
    """``state`` into ``head`` in ``dtype`` on ``device``; ids and flags keep their dtypes. A head whose
    projections are quantized next on the CPU at fp32 (``keeps``: ``keeps_stored_tables``) keeps their
    weights as read, since the quantizer widens each to fp32 in turn: never a whole fp32 copy next to the
    fp16 one (a 7B-wide q4_0 head's peak RSS 3.1-3.4 -> 1.4-1.7 GB, with the read tensors dropped as they
    are quantized), the same fp32 values, so the same bits. It keeps an fp16/bf16 embedding as a
    ``StoredEmbedding``. A head given a block table already (``_eagle3_embedding``) finds no embedding in
    ``state``."""
    kept = {"d2t", "t2d"}
    if keeps:
        kept |= _projection_weights(head)
    embed = state.get("embed_tokens.weight")
    narrow = keeps and embed is not None and embed.dtype in NARROW_FLOATS
    if narrow:
        kept.add("embed_tokens.weight")
    state = {name: tensor.to(device=device) if name in kept else tensor.to(device=device, dtype=dtype)
             for name, tensor in state.items()}
    head.load_state_dict(state, assign=True, strict=True)
    if narrow:
        head.embed_tokens = StoredEmbedding(table(head.embed_tokens))
    head.embed_tokens.requires_grad_(False)


def _projection_weights(head: Eagle3Head) -> set[str]:
    """The state names of every weight ``quantize_projections`` replaces: each linear layer's weight
    (not its bias) and DGF's W_1/W_2/W_z."""
    names = {f"{name}.weight" for name, module in head.named_modules() if isinstance(module, torch.nn.Linear)}
    return names | {name for name in FUSION_WEIGHTS if isinstance(getattr(head, name, None), torch.nn.Parameter)}


def head_config(head: DraftHead) -> dict[str, Any]:
    """config.json fields describing ``head`` (readable by transformers and by EAGLE tools)."""
    spec = head.spec
    scaling = dict(spec.rope_scaling)
    rope_scaling = None if scaling.get("rope_type", "default") == "default" else scaling
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": spec.model_type,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": spec.max_position_embeddings,
        "attention_bias": spec.qkv_bias,
        "mlp_bias": spec.mlp_bias,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        FUSION_FIELD: head.fusion,
    }
    if head.fusion == "fc":
        config["bias"] = head.fc_bias
    return config


def save_head(head: DraftHead, folder: Path | str, include_frozen: bool = True) -> Path:
    """Write ``config.json`` + ``model.safetensors``. ``include_frozen=False`` leaves out the
    embedding and lm_head (large at 13B size); loading then needs the target's folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().contiguous().cpu() for name, tensor in head.state_dict().items()
             if include_frozen or name not in _FROZEN}
    (folder / CONFIG_NAME).write_text(json.dumps(head_config(head), indent=2) + "\n")
    save_file(state, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
    return folder
