"""Resuming a training run: its state (``train_state.pt``) and its log.

The state is tensors, numbers, strings and dicts of them (the head's and optimizer's state dicts,
the settings, a generator's state), so it is read with torch's ``weights_only`` unpickler: a file
that pickles anything else (a foreign or tampered file would run its code under a plain pickle
load) is refused, as is a cut or corrupt one, in one line that says how to start over.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


class TrainStateError(ValueError):
    """A ``train_state.pt`` that cannot be resumed from."""


def read_train_state(path: Path, map_location: str | torch.device | None = None) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:  # UnpicklingError (not tensors), EOFError / RuntimeError (cut, corrupt)
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise TrainStateError(f"{path} cannot be resumed from ({type(error).__name__}: {reason[:200]}): "
                              "not a training state of this program, or damaged; use --restart to start "
                              "over, or another --out") from None
    if not isinstance(state, dict) or not {"config", "head", "optimizer", "step"} <= state.keys():
        raise TrainStateError(f"{path} is not a training state of this program; use --restart to start over, "
                              "or another --out")
    return state


def trim_log(path: Path, step: int) -> None:
    """Drop the log's records of steps after ``step`` (the state resumed from): the run does those
    steps again, and their records were written twice (a resumed log repeated every step since the
    last checkpoint). Records without a step, or that cannot be read, stay."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not (isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step):
            kept.append(line)
    path.write_text("".join(kept), encoding="utf-8")
