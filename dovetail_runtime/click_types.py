"""Option types the commands share beyond click's own."""

from __future__ import annotations

import math
from typing import Any

import click


class FiniteFloatRange(click.FloatRange):
    """click's FloatRange without NaN and the infinities: a NaN fails no comparison, so ``nan`` passed
    every bound (``--temperature nan`` loaded the models, then failed deep inside; ``--worker-timeout
    nan`` turned hang detection off) and ``inf`` passed every unbounded one."""

    name = "finite float range"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number
