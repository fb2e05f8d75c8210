"""Reading a training run's resumable state (``train_state.pt``).

The state is tensors, numbers, strings and dicts of them (the head's and optimizer's state dicts,
the settings, a generator's state), so it is read with torch's ``weights_only`` unpickler: a file
that pickles anything else (a foreign or tampered file would run its code under a plain pickle
load) is refused, as is a cut or corrupt one, in one line that says how to start over.
"""

from __future__ import annotations

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
