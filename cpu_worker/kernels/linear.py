"""What the engine asks of a linear layer: whether a row's result depends on its call-mates.

Why: a tree verification runs T rows through each linear layer at once, a decode one row. Only
where every linear gives a row the same bits whatever shares its call can a tree node's logits
equal its decode's bit for bit, and only then is exact tree attention worth its cost
(``TargetEngine.exact_tree``). Each kernel says so itself (``row_invariant``), so a new kernel is
one class and the engine keeps no list of types. ``F.linear`` (``nn.Linear``) does not promise it:
fp32 differs by batch size, and oneDNN's bf16 kernels matched row by row on some runs and not on
others (first calls).
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn


class LinearKernel(nn.Module):
    """A linear layer ``y = x W^T + b`` on one of our kernels (int8 W8A8, fp32 rows, packed fp32)."""

    row_invariant: ClassVar[bool] = False  # a row's result never depends on the other rows of its call
    in_features: int
    out_features: int


def is_linear(module: nn.Module) -> bool:
    """A linear layer: torch's or one of ours."""
    return isinstance(module, (nn.Linear, LinearKernel))


def row_invariant(module: nn.Module) -> bool:
    """Whether ``module`` (a linear layer) declares its rows independent of their call-mates."""
    return isinstance(module, LinearKernel) and module.row_invariant


def row_invariant_linears(model: nn.Module) -> bool:
    """True when ``model`` has linear layers and every one of them is row-invariant."""
    layers = [module for module in model.modules() if is_linear(module)]
    return bool(layers) and all(row_invariant(module) for module in layers)
