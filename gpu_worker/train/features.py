"""Run the target over a corpus and store token ids + last hidden states in shards.

Documents are cut into windows of ``window`` tokens; each window is prefilled from an empty
cache (position 0), as the testbed was trained on 512-token windows. The whole corpus is
tokenized first (cheap next to the target), so the shard plan, the progress total and the
resume check are all known before the target runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from cpu_worker.model import KVCache, RotaryTable
from ipc.dtypes import torch_dtype

from .corpus import Document
from .shards import FORMAT_VERSION, MANIFEST, read_manifest, shard_name, tokens_digest, write_json_atomic, write_shard


@dataclass
class Window:
    tokens: np.ndarray  # int32 [n]
    loss_mask: np.ndarray  # bool [n]


@dataclass
class ShardPlan:
    index: int
    windows: list[Window] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(w.tokens) for w in self.windows)

    def digest(self) -> str:
        return tokens_digest([w.tokens for w in self.windows])


def cut_windows(documents: Iterable[Document], window: int, max_tokens: int | None = None) -> list[Window]:
    """Consecutive windows of ``window`` tokens per document (the last one shorter); windows
    under 2 tokens hold no (feature, next feature) pair and are dropped. ``max_tokens`` cuts
    the stream (the last window shortened to fit)."""
    windows: list[Window] = []
    total = 0
    for document in documents:
        ids = np.asarray(document.token_ids, dtype=np.int32)
        mask = np.asarray(document.loss_mask, dtype=bool)
        for begin in range(0, len(ids), window):
            piece = ids[begin:begin + window]
            if max_tokens is not None:
                piece = piece[:max_tokens - total]
            if len(piece) < 2:
                continue
            windows.append(Window(piece, mask[begin:begin + len(piece)]))
            total += len(piece)
            if max_tokens is not None and total >= max_tokens:
                return windows
    return windows


def plan_shards(windows: list[Window], shard_tokens: int) -> list[ShardPlan]:
    """Group whole windows into shards of about ``shard_tokens`` tokens."""
    shards = [ShardPlan(0)]
    for window in windows:
        if shards[-1].windows and shards[-1].num_tokens + len(window.tokens) > shard_tokens:
            shards.append(ShardPlan(len(shards)))
        shards[-1].windows.append(window)
    return [shard for shard in shards if shard.windows]


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


@torch.inference_mode()
def window_forward(target: Any, tokens: torch.Tensor, aux_layers: tuple[int, ...] = (),
                   rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One window from position 0 without a KV cache, on the model's device and dtype.

    Returns (last hidden states after the final norm [n, d], aux rows [n, 3d] or None): an aux
    row is the residual stream entering each of ``aux_layers`` (before that layer's input
    norm), concatenated in the order given."""
    last, aux = windows_forward(target, tokens.unsqueeze(0), aux_layers, rotary)
    return last[0], None if aux is None else aux[0]


def windows_forward(target: Any, tokens: torch.Tensor, aux_layers: tuple[int, ...] = (),
                    rotary: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``window_forward`` of B windows at once, tokens [B, n]: rows [B, n, d] and aux [B, n, 3d].
    Windows of unequal length go right-padded: attention is causal, so a window's rows never see
    the padding after them."""
    device = target.embed_tokens.weight.device
    x = target.embed_tokens(tokens.to(device))
    n = x.shape[1]
    if rotary is None:
        table = RotaryTable(target.spec, n, x.dtype, device)
        rotary = (table.cos, table.sin)
    cos, sin = rotary[0][:n], rotary[1][:n]
    taken = {}
    for index, layer in enumerate(target.layers):
        if index in aux_layers:
            taken[index] = x
        x = layer(x, cos, sin)  # no cache: causal within the window
    aux = torch.cat([taken[index] for index in aux_layers], dim=-1) if aux_layers else None
    return target.norm(x), aux


class PrefillRows:
    """A window's last-layer rows as ``TargetEngine.prefill`` computes them (CPU, fp32): the
    decoder's own forward from position 0 over a KV cache of ``max_len`` slots, the same calls
    and so the same bits, without the engine."""

    def __init__(self, target: Any, max_len: int):
        spec = target.spec
        limit = spec.context_limit
        if not 1 <= max_len <= limit:
            raise ValueError(f"max_len must be in 1..{limit} for this model, got {max_len}")
        self.target = target
        self.cache = KVCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, max_len, torch.float32)
        self.rotary = RotaryTable(spec, max_len, torch.float32)

    @torch.inference_mode()
    def __call__(self, tokens: list[int]) -> torch.Tensor:
        count = len(tokens)
        features, _ = self.target(torch.as_tensor(tokens, dtype=torch.long), torch.arange(count), self.cache,
                                  self.rotary, 0, None, logits_rows=slice(count - 1, count))
        return features


class WindowRows:
    """(last-layer rows, aux rows or None) of a window, stored in ``store_dtype`` on the CPU. The
    default path (CPU, fp32, last layer only) runs as the inference engine's prefill
    (``PrefillRows``); the others use the cache-free window forward, which runs on any device
    and dtype."""

    def __init__(self, target: Any, max_len: int, aux_layers: tuple[int, ...] | None, store_dtype: torch.dtype):
        weight = target.embed_tokens.weight
        on_cpu_fp32 = weight.device.type == "cpu" and weight.dtype == torch.float32
        self.target = target
        self.aux_layers = aux_layers or ()
        self.store_dtype = store_dtype
        self.prefill = PrefillRows(target, max_len) if aux_layers is None and on_cpu_fp32 else None
        self.rotary = None
        if self.prefill is None:
            table = RotaryTable(target.spec, max_len, weight.dtype, weight.device)
            self.rotary = (table.cos, table.sin)

    def __call__(self, tokens: np.ndarray) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.prefill is not None:
            return self.prefill(tokens.tolist()).to(self.store_dtype), None
        last, aux = window_forward(self.target, torch.from_numpy(tokens).long(), self.aux_layers, self.rotary)
        stored = None if aux is None else aux.to(device="cpu", dtype=self.store_dtype)
        return last.to(device="cpu", dtype=self.store_dtype), stored

    @property
    def batched(self) -> bool:
        """On a GPU windows go through in batches: one window at a time is all launch overhead
        there. (The CPU keeps one at a time: the engine's own prefill, and no padding work.)"""
        return self.target.embed_tokens.weight.device.type != "cpu"

    def many(self, windows: list[np.ndarray]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """``self(w)`` for each window, in one right-padded batch."""
        lengths = [len(w) for w in windows]
        tokens = torch.zeros(len(windows), max(lengths), dtype=torch.long)
        for row, window in enumerate(windows):
            tokens[row, :len(window)] = torch.from_numpy(window)
        last, aux = windows_forward(self.target, tokens, self.aux_layers, self.rotary)
        last = last.to(device="cpu", dtype=self.store_dtype)
        aux = None if aux is None else aux.to(device="cpu", dtype=self.store_dtype)
        return [(last[row, :n], None if aux is None else aux[row, :n]) for row, n in enumerate(lengths)]


# Windows per batch on a GPU: 64 windows of 512 tokens of a 7B model's rows fit easily.
GPU_WINDOW_BATCH = 64


def extract_features(target: Any, windows: list[Window], out_dir: Path, config: dict[str, Any],
                     dtype: str = "fp16", shard_tokens: int = 131072, overwrite: bool = False,
                     on_shard: Callable[[int], None] | None = None, progress: bool = True,
                     aux_layers: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Write (or finish writing) the shards for ``windows`` under ``out_dir``.

    ``target``: a loaded ``LlamaDecoder`` (on any device, in fp32 or bf16). ``config``: what
    produced the windows (inputs, window size, split, ...); a rerun must pass the same config
    to resume. ``on_shard`` is called with each shard index after it is stored (tests use it to
    interrupt a run). ``aux_layers``: also store per token the residual streams entering these
    target layers (EAGLE-3's three-layer rows, ``aux`` [N, 3d]). ``dtype`` "bf16" stores bf16
    (the target then runs in bf16 too). Returns the manifest.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    plans = plan_shards(windows, shard_tokens)
    full_config = dict(config, dtype=dtype, shard_tokens=shard_tokens, version=FORMAT_VERSION)
    if aux_layers is not None:
        full_config["aux_layers"] = list(aux_layers)
    manifest = _open_manifest(out_dir, full_config, int(target.spec.hidden_size), aux_layers, overwrite)
    todo = _keep_finished(manifest, plans, out_dir)
    write_json_atomic(out_dir / MANIFEST, manifest)

    total_tokens = sum(p.num_tokens for p in plans)
    skipped = sum(entry["tokens"] for entry in manifest["shards"])
    rows = WindowRows(target, max((len(w.tokens) for w in windows), default=1), aux_layers, torch_dtype(dtype))
    started = time.perf_counter()
    bar = tqdm(total=total_tokens, initial=skipped, unit="tok", unit_scale=True, desc="features",
               disable=None if progress else True, dynamic_ncols=True)  # off where stderr is no terminal
    try:
        for plan in todo:
            _write_shard(plan, rows, out_dir, bar)
            manifest["shards"].append({"index": plan.index, "file": shard_name(plan.index),
                                       "windows": len(plan.windows), "tokens": plan.num_tokens,
                                       "digest": plan.digest()})
            manifest["shards"].sort(key=lambda entry: entry["index"])
            write_json_atomic(out_dir / MANIFEST, manifest)
            if on_shard is not None:
                on_shard(plan.index)
    finally:
        bar.close()
    manifest.update(complete=True, tokens=total_tokens, windows=len(windows),
                    loss_tokens=int(sum(w.loss_mask.sum() for w in windows)),
                    seconds_this_run=round(time.perf_counter() - started, 1))
    write_json_atomic(out_dir / MANIFEST, manifest)
    return manifest


def _open_manifest(out_dir: Path, full_config: dict[str, Any], hidden_size: int,
                   aux_layers: tuple[int, ...] | None, overwrite: bool) -> dict[str, Any]:
    """The folder's manifest to resume, or a new one (stale shards removed) when there is none
    or, with ``overwrite``, when it was written with other settings."""
    manifest = _own_manifest(out_dir)
    if manifest is not None and manifest["config"] != full_config:
        if not overwrite:
            raise ValueError(f"{out_dir / MANIFEST} was written with different settings; use another folder "
                             f"or --overwrite.\n  stored: {manifest['config']}\n  now:    {full_config}")
        manifest = None
    if manifest is None:
        # Half-written shards too (shard-N.tmp: a run stopped while saving), up to a GB each at 7B width.
        for stale in [*out_dir.glob("shard-*.safetensors"), *out_dir.glob("shard-*.tmp")]:
            stale.unlink()
        manifest = {"config": full_config, "hidden_size": hidden_size, "shards": [], "complete": False}
        if aux_layers is not None:
            manifest["aux_layers"] = list(aux_layers)
    return manifest


def _own_manifest(out_dir: Path) -> dict[str, Any] | None:
    """The folder's manifest when this tool wrote it, None when there is none; another program's
    manifest.json (a web extension's, say) is refused, never overwritten (was a KeyError/JSON traceback)."""
    try:
        manifest: Any = read_manifest(out_dir)
    except ValueError:  # not JSON
        manifest = False
    if manifest is not None and not (isinstance(manifest, dict) and isinstance(manifest.get("config"), dict)):
        raise ValueError(f"{out_dir / MANIFEST} was not written by dovetail-train features: use another folder")
    return manifest


def _keep_finished(manifest: dict[str, Any], plans: list[ShardPlan], out_dir: Path) -> list[ShardPlan]:
    """Keep in ``manifest`` only finished shards whose file is there and whose planned content is
    unchanged; returns the plans still to run."""
    done = {entry["index"]: entry for entry in manifest["shards"]}
    todo = []
    kept = []
    for plan in plans:
        entry = done.get(plan.index)
        if entry and entry["digest"] == plan.digest() and (out_dir / entry["file"]).exists():
            kept.append(entry)
        else:
            todo.append(plan)
    manifest["shards"] = kept
    manifest["complete"] = False
    return todo


def _write_shard(plan: ShardPlan, rows: WindowRows, out_dir: Path, bar: Any) -> None:
    features, aux_rows = [], []
    step = GPU_WINDOW_BATCH if rows.batched else 1
    for begin in range(0, len(plan.windows), step):
        group = [w.tokens for w in plan.windows[begin:begin + step]]
        for tokens, (last, aux) in zip(group, rows.many(group) if rows.batched else [rows(group[0])], strict=True):
            features.append(last)
            if aux is not None:
                aux_rows.append(aux)
            bar.update(len(tokens))
    lengths = [len(w.tokens) for w in plan.windows]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    write_shard(out_dir / shard_name(plan.index), np.concatenate([w.tokens for w in plan.windows]),
                torch.cat(features), np.concatenate([w.loss_mask for w in plan.windows]), offsets,
                aux=torch.cat(aux_rows) if aux_rows else None)
