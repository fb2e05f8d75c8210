"""Option types the commands share beyond click's own."""

from __future__ import annotations

import math
from typing import Any

import click


class FiniteFloatRange(click.FloatRange):
    """click's FloatRange without NaN and the infinities: a NaN fails no comparison, so ``nan`` passed
    every bound (``--temperature nan`` loaded the models, then failed deep inside; ``--worker-timeout
    nan`` turned hang detection off) and ``inf`` passed every unbounded one."""

    def __init__(self, *args: Any, infinity: bool = False, **kwargs: Any):
        """``infinity``: +-inf may pass its bounds (a limit that means none); NaN never does."""
        super().__init__(*args, **kwargs)
        self.infinity = infinity

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if math.isnan(number) or (math.isinf(number) and not self.infinity):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number
