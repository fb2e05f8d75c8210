"""Checks of dovetail-run's settings that need no model, run before anything loads: a typo
costs a second and one line of error, not a model load followed by a traceback.

Torch-free (the coordinator never imports torch), so the CUDA check reads what the driver
exposes; where that cannot be known for sure (WSL, ROCm), it is left to the draft worker.
"""

from __future__ import annotations

import glob
import os
import re

from cpu_worker.model.model_dir import ModelLoadError, resolve_model_dir

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
    try:
        folder = resolve_model_dir(draft)
    except ModelLoadError as error:
        raise PreflightError(f"--draft: {str(error).replace('model folder', 'draft head folder')}") from None
    if not (folder / "config.json").is_file():
        raise PreflightError(f"--draft: {folder} has no config.json (not a draft head folder)")


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


def check_draft_device(device: str, dtype: str) -> None:
    if device in ("auto", "cpu"):
        if device == "cpu" and dtype in ("fp16", "bf16"):
            raise PreflightError(f"--draft-dtype {dtype} needs CUDA; on the CPU use fp32, int8 or auto")
        return
    match = _CUDA_DEVICE.fullmatch(device)
    if match is None:
        raise PreflightError(f"--draft-device {device!r}: use auto, cpu, cuda or cuda:N")
    if dtype == "int8":
        raise PreflightError("--draft-dtype int8 runs on the CPU only: use --draft-device cpu, or fp16/bf16 on CUDA")
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
