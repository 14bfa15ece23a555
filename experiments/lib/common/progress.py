"""Progress of long work, on a terminal and in a job's log.

On a terminal a rich bar shows it; elsewhere (a job's log, nohup, CI, a pipe) the bar draws nothing, so a long loop
would write nothing for minutes. `track` gives a loop both: the bar where there is a terminal, and otherwise a log
line every LOG_EVERY seconds with what is done of the total, the rate and the time left (ProgressLog), and one
when the work ends. `generation_bar` is the bar of a long generation (answers, self questions), with live fields.

    with track("features", total=windows, unit="windows", console=console, logger=log) as progress:
        for rows in work:
            ...
            progress.advance(len(rows))
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

LOG_EVERY = 30.0  # seconds between progress lines outside a terminal: minutes of silence read as a hung job
CLOCK: Callable[[], float] = time.monotonic  # what ProgressLog reads when given no clock (a test replaces it)
log = logging.getLogger(__name__)


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


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


class ProgressLog:
    """Progress as log lines: `label: done/total unit, rate, about T left`, at most one every `every` seconds.

    The rate counts only the work done here: work found already done (a resumed cache's shards) is `skip`ped, so
    it moves the count but not the rate or the time left."""

    def __init__(
        self,
        label: str,
        total: int,
        *,
        unit: str = "",
        every: float = LOG_EVERY,
        clock: Callable[[], float] | None = None,
        logger: logging.Logger | None = None,
        done: int = 0,
    ) -> None:
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ValueError(f"progress total={total!r}: must be an integer >= 0")
        if not every > 0:
            raise ValueError(f"progress every={every!r}: must be a positive number of seconds")
        self.label, self.total, self.unit, self.every = label, total, f" {unit}" if unit else "", every
        self.clock, self.logger = clock or CLOCK, logger or log
        self.done = self.skipped = done
        self.started = self.logged = self.clock()

    def skip(self, n: int) -> None:
        """`n` more found done already: counted, not timed."""
        self.done += n
        self.skipped += n

    def advance(self, n: int = 1) -> bool:
        """`n` more done; logs a line when `every` seconds passed since the last one. True when it logged."""
        self.done += n
        now = self.clock()
        if now - self.logged < self.every:
            return False
        self.logged = now
        self.logger.info("%s", self.line(now))
        return True

    def line(self, now: float) -> str:
        elapsed, timed = now - self.started, self.done - self.skipped
        rate = timed / elapsed if elapsed > 0 else 0.0
        text = f"{self.label}: {self.done}/{self.total}{self.unit}"
        if rate > 0:
            left = max(self.total - self.done, 0) / rate
            text += f", {rate:.3g}{self.unit}/s, about {_minutes(left)} left"
        return text

    def finish(self) -> None:
        """The closing line: what was done and how long it took."""
        elapsed = self.clock() - self.started
        self.logger.info("%s: %d/%d%s in %s", self.label, self.done, self.total, self.unit, _minutes(elapsed))


class Tracker:
    """What `track` yields: advance / skip move the bar on a terminal, and the log lines elsewhere."""

    def __init__(self, bar: Progress, task, lines: ProgressLog | None) -> None:
        self.bar, self.task, self.lines = bar, task, lines

    def advance(self, n: int = 1) -> None:
        self.bar.update(self.task, advance=n)
        if self.lines is not None:
            self.lines.advance(n)

    def skip(self, n: int) -> None:
        self.bar.update(self.task, advance=n)
        if self.lines is not None:
            self.lines.skip(n)


@contextmanager
def track(
    label: str,
    total: int,
    *,
    unit: str = "",
    console: Console | None = None,
    logger: logging.Logger | None = None,
    every: float = LOG_EVERY,
    clock: Callable[[], float] | None = None,
) -> Iterator[Tracker]:
    """Progress of a long loop over `total` units: a rich bar on a terminal (console: stderr's by default), a log
    line every `every` seconds otherwise, and a closing one when the loop ends without an error."""
    console = console or Console(stderr=True)
    bar = Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not console.is_terminal,
    )
    lines = None
    if not console.is_terminal:
        lines = ProgressLog(label, total, unit=unit, every=every, clock=clock, logger=logger)
    with bar:
        tracker = Tracker(bar, bar.add_task(label, total=total), lines)
        yield tracker
    if lines is not None:
        lines.finish()
