"""Whether a target fits this machine's memory at a precision, before a worker tries to load it.

Why: a model folder runs at fp32 unless told otherwise, and a 7B folder at fp32 needs ~27 GB. On a
smaller machine the cpu_worker used to load for minutes and then vanish (the kernel's out-of-memory
killer: "exited with code -9" and nothing else). Estimated from the config instead (the sums the
loaders make: the token table in fp32 or bf16, at the integer precisions as stored; projections in
the precision's blocks; an output matrix of its own at the integer precisions; the process's own),
the coordinator can pick a precision that fits for ``--target-dtype auto`` and say what would fit
when the one asked for cannot. The KV cache is left out: its pages are committed only as sequences
fill them (``KVCache``), and the running requests' share is budgeted apart (``--kv-memory``).

``auto`` follows the machine's installed memory, not what happens to be free at the moment, so a
machine always picks the same precision for a model (and the same tokens); it steps down from fp32
only where fp32 would take nearly all of it. Inside a container "the machine" is its memory limit
(cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``), which psutil does not see.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

# Bytes per projection weight as the kernels hold it (a block of 32 weights and its scale(s)).
BYTES_PER_WEIGHT = {"fp32": 4.0, "bf16": 2.0, "int8": 34 / 32, "q8_0": 34 / 32, "int8-row": 1.0,
                    "q4_0": 18 / 32, "int4": 18 / 32, "q4_0-a16": 18 / 32, "q4_1": 20 / 32, "q4_1-a16": 20 / 32}
OUTPUT_BYTES_PER_WEIGHT = 34 / 32  # the integer precisions' output matrix (q8_0 blocks)
STORED_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}  # config.json's (torch_)dtype
PROCESS_BYTES = 600 * 2 ** 20  # the worker's own: torch, the native library, buffers
AUTO_SHARE = 0.9  # --target-dtype auto takes a precision whose estimate is at most this share of RAM
# What --target-dtype auto tries for a model folder, most precise first: fp32 (exact against the
# checkpoint), int8 (keeps a real model's text: docs/performance.md), then 4-bit.
AUTO_LADDER = ("fp32", "int8", "q4_0")


CGROUP_ROOT = Path("/sys/fs/cgroup")
# (limit, usage) files of cgroup v2 and v1; a limit of "max" or one past the host's memory is none.
CGROUP_FILES = (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"))


def _read_bytes(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):  # absent, unreadable, or "max"
        return None


def machine_memory(root: Path | None = None) -> tuple[int, int]:
    """(installed, available now) bytes for this process: psutil's, within its container's limit
    (the cgroup files under ``root``, ``CGROUP_ROOT`` by default)."""
    root = CGROUP_ROOT if root is None else root
    memory = psutil.virtual_memory()
    total, available = int(memory.total), int(memory.available)
    for limit_name, usage_name in CGROUP_FILES:
        limit = _read_bytes(root / limit_name)
        if limit is not None and limit < total:
            usage = _read_bytes(root / usage_name)
            return limit, min(available, max(limit - (usage or 0), 0))
    return total, available


@dataclass(frozen=True)
class TargetSize:
    """A target's shape as its config gives it, in the sums the loaders make."""

    vocab: int
    hidden: int
    projections: int  # weights of every decoder layer's linear layers
    tied: bool
    stored_bytes: int = 4  # a weight's bytes in the checkpoint (the integer precisions keep its token table so)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TargetSize:
        hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        heads = int(config.get("num_attention_heads", 1))
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        inner = int(config.get("intermediate_size", 4 * hidden))
        per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inner
        stored = STORED_BYTES.get(str(config.get("dtype") or config.get("torch_dtype") or "float32"), 4)
        return cls(int(config.get("vocab_size", 32000)), hidden, layers * per_layer,
                   bool(config.get("tie_word_embeddings", False)), stored)

    def weight_bytes(self, precision: str) -> int:
        table = self.vocab * self.hidden
        if precision in ("fp32", "bf16"):
            width = BYTES_PER_WEIGHT[precision]
            return int((self.projections + table * (1 if self.tied else 2)) * width)
        # The token table stays as stored, the output matrix gets q8_0 blocks.
        table_bytes = table * (self.stored_bytes + OUTPUT_BYTES_PER_WEIGHT)
        return int(self.projections * BYTES_PER_WEIGHT[precision] + table_bytes)

    def need_bytes(self, precision: str) -> int:
        """The worker's memory at ``precision`` once loaded, before any KV page is committed."""
        return self.weight_bytes(precision) + PROCESS_BYTES


def gguf_need_bytes(file: Path, size: TargetSize, precision: str) -> int:
    """A GGUF target: at its blocks, the file's bytes (they load as stored, the token table too) and
    at most an output matrix of its own in q8_0 blocks (a tied one's copy, or one requantized); at
    fp32 or bf16, dequantized, a folder's sums."""
    if precision in ("fp32", "bf16"):
        return size.need_bytes(precision)
    output = int(size.vocab * size.hidden * OUTPUT_BYTES_PER_WEIGHT)
    return file.stat().st_size + output + PROCESS_BYTES


def auto_precision(size: TargetSize, total_bytes: int | None = None) -> str:
    """--target-dtype auto for a model folder: the most precise of ``AUTO_LADDER`` whose estimate
    takes at most ``AUTO_SHARE`` of the installed memory (the last one when none does)."""
    total = machine_memory()[0] if total_bytes is None else total_bytes
    for precision in AUTO_LADDER:
        if size.need_bytes(precision) <= AUTO_SHARE * total:
            return precision
    return AUTO_LADDER[-1]


def shortfall(need: int, precision: str, size: TargetSize | None, available_bytes: int | None = None) -> str | None:
    """A warning when ``need`` bytes exceed the memory available now, naming the precisions that
    would fit (None when it fits)."""
    available = machine_memory()[1] if available_bytes is None else available_bytes
    if need <= available:
        return None
    fitting = [] if size is None else [f"{other} ~{size.need_bytes(other) / 1e9:.1f} GB" for other in AUTO_LADDER[1:]
                                       if other != precision and size.need_bytes(other) <= available]
    hint = f"; --target-dtype {fitting[0].split()[0]} would fit ({', '.join(fitting)})" if fitting else ""
    return (f"the target at {precision} needs about {need / 1e9:.1f} GB and {available / 1e9:.1f} GB of memory is "
            f"available now: loading may fail, or the system may kill the worker{hint}")
