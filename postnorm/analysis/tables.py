"""Markdown tables, the one writer every summary uses."""

from collections.abc import Sequence


def cell(value: object, spec: str = ".4g") -> str:
    """A table cell: "–" for None, yes/no for a bool, a float in ``spec``, a list or tuple as
    its cells joined by commas, anything else as ``str``."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list | tuple):
        return ", ".join(cell(v, spec) for v in value)
    return format(value, spec) if isinstance(value, float) else str(value)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The lines of a markdown table of ``rows`` (cells already formatted) under ``header``."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]
