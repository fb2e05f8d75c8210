"""What the tools share to refuse bad input in one line, before any model loads or worker starts
(not in a traceback minutes into a run): click callbacks for comma lists (``--temperatures 0,0.7``,
``--streams 1,2,4``), argparse types for counts and lists, and a decorator for their mains that
turns a folder that is no model into the loader's one-line error."""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import click

Parser = Callable[[click.Context, click.Parameter, str], list]
Main = TypeVar("Main", bound=Callable[..., Any])


def comma_list(kind: type[int] | type[float], minimum: float | None = None) -> Parser:
    """A callback turning ``"a,b,c"`` into ``[kind(a), kind(b), kind(c)]`` (blank items skipped),
    each finite and at least ``minimum``; at least one item."""
    noun = "a whole number" if kind is int else "a number"

    def parse(_context: click.Context, _parameter: click.Parameter, text: str) -> list:
        values = []
        for part in filter(None, (item.strip() for item in text.split(","))):
            try:
                value = kind(part)
            except ValueError:
                raise click.BadParameter(f"{part!r} is not {noun} (expected a comma list, e.g. {text_example(kind)})"
                                         ) from None
            if not math.isfinite(value):
                raise click.BadParameter(f"{part!r} is not a finite number")
            if minimum is not None and value < minimum:
                raise click.BadParameter(f"{part!r}: each value must be at least {minimum:g}")
            values.append(value)
        if not values:
            raise click.BadParameter("give at least one value")
        return values

    return parse


def text_example(kind: type[int] | type[float]) -> str:
    return "1,2,4" if kind is int else "0,0.7"


def positive_int(text: str) -> int:
    """argparse ``type=`` for counts and sizes: a whole number >= 1 (argparse turns the error into
    a usage line naming the option)."""
    return whole_number(text, least=1)


def non_negative_int(text: str) -> int:
    """argparse ``type=`` for a count that may be 0 (warm-up rounds, accepted drafts)."""
    return whole_number(text, least=0)


def whole_number(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{value} is below {least}")
    return value


def int_list(text: str) -> list[int]:
    """argparse ``type=`` for a comma list of whole numbers >= 1 (``--contexts 256,1024``)."""
    values = [positive_int(part.strip()) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError("give at least one value")
    return values


def name_list(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """argparse ``type=`` for a comma list of names out of ``allowed`` (``--precisions q4_0,int8``): a typo
    is a usage line, not an error minutes later in a child or after the model loaded."""

    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"{', '.join(unknown) or 'none given'}: expected some of "
                                             f"{', '.join(allowed)}")
        return names

    return parse


def load_errors_in_one_line(main: Main) -> Main:
    """Decorate a tool's ``main``: a folder that is no model (no config.json, no tokenizer, not a draft head)
    ends the run as ``Error: <the loader's one line>``, exit 1, as dovetail-run says it, not in a traceback."""
    from cpu_worker.model.model_dir import ModelLoadError
    from dovetail_runtime.tokenizer import TokenizerLoadError
    from gpu_worker.checkpoint import DraftCheckpointError

    @functools.wraps(main)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return main(*args, **kwargs)
        except (ModelLoadError, TokenizerLoadError, DraftCheckpointError) as error:
            raise SystemExit(f"Error: {error}") from None

    return cast(Main, run)
