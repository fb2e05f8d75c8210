"""Checks of dovetail-run's settings that need no model, run before anything loads: a typo
costs a second and one line of error, not a model load followed by a traceback.

Torch-free (the coordinator never imports torch), so the CUDA check reads what the driver
exposes; where that cannot be known for sure (WSL, ROCm), it is left to the draft worker.
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path
from typing import Any

from cpu_worker.model.model_dir import ModelLoadError, is_gguf, read_config, resolve_model_dir
from gpu_worker.head_layout import AUX_LAYERS_KEY, FUSION_FIELD, MODEL_LAYER_PREFIX, is_eagle3, safetensors_keys

from .coordinator import RuntimeSettings

_CUDA_DEVICE = re.compile(r"cuda(?::(\d+))?")


class PreflightError(ValueError):
    """A setting that cannot work; the message is one line naming the flag."""


def check_settings(settings: RuntimeSettings) -> None:
    """Everything below, in flag order; PreflightError on the first problem."""
    if settings.cpu_cores:
        check_cores(settings.cpu_cores, "--cpu-cores")
    if settings.draft is not None:
        check_draft_dir(settings.draft)
        check_pair(settings.target, settings.draft)
        if settings.draft_cores:
            check_cores(settings.draft_cores, "--draft-cores")
        check_draft_device(settings.draft_device, settings.draft_dtype)


def _ranges(cores: list[int]) -> str:
    parts: list[str] = []
    for core in cores:
        if parts and core == int(parts[-1].rpartition("-")[2]) + 1:
            parts[-1] = f"{parts[-1].partition('-')[0]}-{core}"
        else:
            parts.append(str(core))
    return ",".join(parts)


def check_cores(cores: list[int], flag: str) -> None:
    available = sorted(os.sched_getaffinity(0))
    missing = [core for core in cores if core not in available]
    if missing:
        raise PreflightError(f"{flag}: cores {_ranges(missing)} are not available to this process "
                             f"(available: {_ranges(available)})")


def check_draft_dir(draft: str) -> None:
    """A local folder, or a hub id in the local Hugging Face cache (as --target), with a config.json."""
    if Path(draft).expanduser().is_file():  # a GGUF is a target's format; a head is a folder
        raise PreflightError(f"--draft: {draft} is a file; a draft head is a folder with config.json (a Dovetail, "
                             "EAGLE or EAGLE-3 head)")
    try:
        folder = resolve_model_dir(draft)
    except ModelLoadError as error:
        raise PreflightError(f"--draft: {str(error).replace('model folder', 'draft head folder')}") from None
    if not (folder / "config.json").is_file():
        raise PreflightError(f"--draft: {folder} has no config.json (not a draft head folder)")
    if not is_draft_head(folder) and any(key.startswith(MODEL_LAYER_PREFIX) for key in safetensors_keys(folder)):
        # Was found only by the gpu_worker, after the target had loaded ("cannot tell the draft's fusion").
        raise PreflightError(f"--draft {draft} is a model folder, not a draft head: pass the head trained for the "
                             "target (dovetail-train train makes one), and the model as --target")


def check_target(target: str) -> None:
    """--target names a model that exists, and not a draft head (whose folder has no tokenizer,
    so the coordinator's advice would be to make one: the wrong fix)."""
    try:
        folder = resolve_model_dir(target)
    except ModelLoadError as error:
        raise PreflightError(f"--target: {error}") from None
    if not is_gguf(folder) and is_draft_head(folder):
        raise PreflightError(f"--target {target} is a draft head folder, not a model: pass it as --draft, "
                             "and the model it was trained for as --target")


# Weights only a draft head has: EAGLE's fc, Dovetail's dgf fusion, an EAGLE-3 midlayer.
_HEAD_KEYS = ("fc.weight", "W_1", "W_z")


def is_draft_head(folder: Path) -> bool:
    """Whether a folder holds a draft head: its config names a draft fusion or vocabulary, or
    its weights are a head's."""
    try:
        config = read_config(folder)
    except ModelLoadError:
        return False
    if FUSION_FIELD in config or "draft_vocab_size" in config:
        return True
    keys = safetensors_keys(folder)
    return any(key in keys for key in _HEAD_KEYS) or any(key.startswith("midlayer.") for key in keys)


def check_pair(target: str, draft: str) -> None:
    """The head was trained for this target: the same hidden size and vocabulary, and an EAGLE-3
    head's layer ids inside it. Every mismatch named at once; a folder that cannot be read is
    left to the worker that loads it."""
    try:
        target_config = read_config(resolve_model_dir(target))
        draft_dir = resolve_model_dir(draft)
        head_config = read_config(draft_dir)
    except ModelLoadError:
        return
    mismatches = head_mismatches(head_config, is_eagle3(head_config, safetensors_keys(draft_dir)), target_config)
    if mismatches:
        raise PreflightError(f"--draft {draft} was trained for a different target than {target}: "
                             f"{'; '.join(mismatches)}. Pass the head trained for this target (or train one: "
                             "dovetail-train)")


def head_mismatches(head: dict[str, Any], eagle3: bool, target: dict[str, Any]) -> list[str]:
    """What in a head's config.json does not fit the target's, one phrase each."""
    hidden = head.get("target_hidden_size") or head.get("hidden_size") if eagle3 else head.get("hidden_size")
    found: list[str] = []
    for what, mine, theirs in (("hidden size", hidden, target.get("hidden_size")),
                               ("vocab size", head.get("vocab_size"), target.get("vocab_size"))):
        if isinstance(mine, int) and isinstance(theirs, int) and mine != theirs:
            found.append(f"its {what} is {mine}, the target's {theirs}")
    layers, ids = target.get("num_hidden_layers"), head.get(AUX_LAYERS_KEY)
    if eagle3 and isinstance(layers, int) and isinstance(ids, list) and all(isinstance(i, int) for i in ids) \
            and ids and max(ids) >= layers:
        found.append(f"it reads target layers {ids}, the target has {layers} layers")
    return found


def check_chat_template(target: str) -> None:
    """--chat needs the target's chat template: said before the models load, not per prompt after."""
    from .chat_template import ChatTemplate

    try:
        folder = resolve_model_dir(target)
    except ModelLoadError:
        return  # named by the coordinator
    problem = ChatTemplate.from_dir(folder, {}).problem
    if problem:
        raise PreflightError(f"--chat: {problem} (leave out --chat)")


def cuda_device_count() -> int | None:
    """CUDA devices this process may use, as far as can be told without torch; None: unknown."""
    if os.path.exists("/dev/dxg") or os.path.exists("/dev/kfd"):
        return None  # WSL's or ROCm's GPUs: only torch can tell
    present = len(glob.glob("/proc/driver/nvidia/gpus/*")) or len(glob.glob("/dev/nvidia[0-9]*"))
    if not present:
        return None if os.path.exists("/proc/driver/nvidia") else 0  # 0: no NVIDIA driver at all
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return present
    listed = 0
    for entry in visible.split(","):  # CUDA stops at the first invalid entry ("-1" hides everything)
        if not entry.strip() or entry.strip().startswith("-"):
            break
        listed += 1
    return min(listed, present)


def shared_cores_warning(settings: RuntimeSettings) -> str | None:
    """A CPU draft pinned (or left) on cores the user gave the target: the two workers then take
    turns on them and each draft step delays verification. Said only where the user named a
    placement: by default both workers use every core (the draft worker's threads sleep when idle)."""
    if settings.draft is None or not (settings.cpu_cores or settings.draft_cores):
        return None
    device = settings.draft_device
    if not (device == "cpu" or (device == "auto" and cuda_device_count() == 0)):
        return None
    available = sorted(os.sched_getaffinity(0))
    target, draft = set(settings.cpu_cores or available), set(settings.draft_cores or available)
    shared = sorted(target & draft)
    if not shared:
        return None
    free = [core for core in available if core not in target]
    fix = (f"give the draft other cores, e.g. --draft-cores {_ranges(free)}" if free else
           "give the target fewer --cpu-cores and the draft the rest with --draft-cores")
    cores = f"core{'s' if len(shared) > 1 else ''} {_ranges(shared)}"
    return (f"the CPU draft runs on {cores}, which the target uses too (--cpu-cores {_ranges(sorted(target))}, "
            f"--draft-cores {_ranges(sorted(draft))}): they slow each other; {fix}")


def crowded_threads_warnings(settings: RuntimeSettings) -> list[str]:
    """More intra-op threads than the cores they may run on: OpenMP threads that share a core wait
    for each other at every parallel step (SmolLM2 decoding on one core: 4 threads 2.7x slower than 1)."""
    available = sorted(os.sched_getaffinity(0))
    workers = [(settings.cpu_threads, settings.cpu_cores, "--cpu-threads", "--cpu-cores")]
    if settings.draft is not None:
        workers.append((settings.draft_threads, settings.draft_cores, "--draft-threads", "--draft-cores"))
    found = []
    for threads, cores, threads_flag, cores_flag in workers:
        allowed = cores or available
        if threads is not None and threads > len(allowed):
            where = f"{cores_flag} {_ranges(allowed)}" if cores else f"all this process may use: {_ranges(allowed)}"
            found.append(f"{threads_flag} {threads} on {len(allowed)} core{'s' if len(allowed) > 1 else ''} ({where}): "
                         f"threads sharing a core wait for each other at every step, several times slower; give "
                         f"{threads_flag} {len(allowed)} or fewer")
    return found


def placement_warnings(settings: RuntimeSettings) -> list[str]:
    """What dovetail-run warns about the workers' placement before they start."""
    shared = shared_cores_warning(settings)
    return ([shared] if shared else []) + crowded_threads_warnings(settings)


def check_draft_device(device: str, dtype: str) -> None:
    if device in ("auto", "cpu"):
        # auto picks the CPU where no CUDA device is: said now, not after the models loaded (an audit's finding).
        if dtype in ("fp16", "bf16") and (device == "cpu" or cuda_device_count() == 0):
            where = "" if device == "cpu" else " and there is no CUDA device here (--draft-device auto takes the CPU)"
            raise PreflightError(f"--draft-dtype {dtype} needs CUDA{where}; on the CPU use fp32, int8, q4_0 or auto")
        return
    match = _CUDA_DEVICE.fullmatch(device)
    if match is None:
        raise PreflightError(f"--draft-device {device!r}: use auto, cpu, cuda or cuda:N")
    if dtype in ("int8", "q4_0"):
        raise PreflightError(f"--draft-dtype {dtype} runs on the CPU only: use --draft-device cpu, or fp16/bf16 on "
                             "CUDA")
    count = cuda_device_count()
    if count is None:
        return
    index = int(match.group(1) or 0)
    if count == 0:
        raise PreflightError(f"--draft-device {device}: no CUDA device is available here "
                             f"(use --draft-device cpu or auto)")
    if index >= count:
        raise PreflightError(f"--draft-device {device}: only {count} CUDA device(s) available (cuda:0"
                             f"{f'..cuda:{count - 1}' if count > 1 else ''})")
