"""Markdown tables for the tools' reports: every table is written the same way, by these three.

Long benchmarks print the header first and each row as it is measured (flushed), so a row and a
header are helpers of their own; ``markdown_table`` is both at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def markdown_cell(value: object) -> str:
    """str(value) with ``|`` escaped: a pipe inside a cell would split it into two columns."""
    return str(value).replace("|", "\\|")


def markdown_row(cells: Iterable[object]) -> str:
    """``| a | b |``; an empty cell is ``| |``, one space, as the hand-written tables had it."""
    return "|" + "".join(f" {text} |" if (text := markdown_cell(cell)) else " |" for cell in cells)


def markdown_header(header: Sequence[object]) -> str:
    """The header row and its ``|---|`` separator line."""
    return markdown_row(header) + "\n" + "|---" * len(header) + "|"


def markdown_table(header: Sequence[object], rows: Iterable[Iterable[object]]) -> str:
    """A whole table, cells str()-ed, lines joined by newlines (no newline at the end)."""
    return "\n".join([markdown_header(header), *map(markdown_row, rows)])
