"""Progress bars for the long silent parts of starting (a 7B target loads for 20-55 s).

On stderr, and only when stderr is a terminal (tqdm's ``disable=None``): logs, pipes and tests
see nothing. A worker process inherits the coordinator's stderr, so its bar reaches the
user's terminal; ``leave=False`` clears it once done, leaving the log lines around it.
"""

from __future__ import annotations

import sys

from tqdm import tqdm


def progress_bar(total: int, desc: str, unit: str) -> tqdm:
    """A bar for ``total`` steps; its updates cost microseconds (redrawn at most twice a second)."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=None, leave=False, dynamic_ncols=True,
                mininterval=0.5)
