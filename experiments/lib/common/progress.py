"""The rich progress bar of a long generation (answers, self questions): count, a line of live fields, time left."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def generation_bar(console: Console, label: str, fields: str) -> Progress:
    """A bar named `label`, then `fields` (a rich format string over the task's fields, e.g. its tokens/s);
    drawn only on a terminal (a job's log gets its own lines instead)."""
    return Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(fields),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not console.is_terminal,
    )
