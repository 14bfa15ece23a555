"""The benchmark's timing schedule: plain decoding and every method timed batch by batch, interleaved.

    cells, warmup_s = interleaved_rounds(decode, len(entries), batches, repeats=2, seed=0, device=device)
    cells[i][r][b]  # entry i's Generation of batch b in round r

Why batch by batch: a method timed over the whole prompt set after plain decoding meets whatever load the
shared machine has by then; a burst that lands on some methods and not on plain decoding makes ratios that
cannot be (a 9.85x speedup at tau 1.05 was printed that way). Here each batch is decoded by every entry
(every setting's plain decoding and every method) back to back, so a change of load lands on all of them
within seconds, and the bootstrap (experiments/lib/report/spread.py) can pair each batch's method time with
plain decoding's time of the same batch and round.

Why the order changes: an entry that always runs right after another inherits its caches, allocator
state and turbo budget. Batch t runs the entries in row t of a Williams design (`williams_row`): over a
full cycle of rows every entry runs at every position and right after every other entry equally often.

Seeds as before the interleaving: entry i decodes round r's batches, in prompt order, with ONE generator
seeded `seed + r`, carried from batch to batch; so every entry samples with the same seeds in a round, and
at temperature 0 lossless methods can be compared token for token with plain decoding.

Which rounds a row's figures come from (`middle_rounds`): its speedup is the median over rounds, which with an
even number of rounds is the mean of the two middle ones; its tau, alpha and time split are pooled over exactly
those rounds, so that every figure of a row (and the bound experiments/lib/report/disturbed.py checks it
against) describes the same decoding. Taking tau from one round while the speedup averages two compared a
speedup with a tau it was not measured at, at T > 0 where rounds sample differently.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from verify.loop.plain import Generation

log = logging.getLogger(__name__)

LOG_EVERY = 30.0  # seconds between progress lines when stderr is not a terminal (a run under nohup, CI, a pipe)

# decode(entry index, batch of prompts, generator) -> that entry's Generation of the batch
Decode = Callable[[int, list[list[int]], torch.Generator], Generation]


def williams_row(n: int, row: int) -> list[int]:
    """Row `row` of a Williams design for n entries: a permutation of 0..n-1.

    The first row is 0, 1, n-1, 2, n-2, ...; row r adds r to every entry (mod n). For even n the n rows put
    every entry at every position once and right after every other entry once; for odd n that takes 2n rows,
    rows n..2n-1 being rows 0..n-1 reversed. Rows repeat with that period."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r}: must be an integer >= 1 (the number of entries to order)")
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    r = row % (n if n % 2 == 0 else 2 * n)
    order = [(x + r) % n for x in first]
    return order if r < n else order[::-1]


def middle_rounds(values: list[float]) -> list[int]:
    """The rounds whose values `statistics.median(values)` takes: the middle one of an odd count, the two middle
    ones of an even count (the median is their mean), in round order. Ties keep the earlier round first."""
    if not values:
        raise ValueError("values=[]: a median needs at least one round")
    order = sorted(range(len(values)), key=values.__getitem__)
    half = len(values) // 2
    return sorted(order[half - 1 : half + 1] if len(values) % 2 == 0 else order[half : half + 1])


def interleaved_rounds(
    decode: Decode,
    n_entries: int,
    batches: list[list[list[int]]],
    *,
    repeats: int,
    seed: int,
    device: torch.device | str = "cpu",
    progress: RoundsProgress | None = None,
    names: list[str] | None = None,
) -> tuple[list[list[list[Generation]]], list[float]]:
    """Warm every entry up on the first batch (timed apart, never in tokens/s), then `repeats` rounds of every
    batch decoded by every entry in `williams_row` order. Returns (cells[entry][round][batch], warm-up seconds
    per entry). `names` label the progress bar (default: the entry's index)."""
    if not batches:
        raise ValueError("batches=[]: the benchmark needs at least one batch of prompts")
    names = names or [str(i) for i in range(n_entries)]
    warmup_s = []
    for i in range(n_entries):  # allocator, lazy inits, compilation: before any timed call
        start = time.perf_counter()
        out = decode(i, batches[0], torch.Generator(device=device).manual_seed(seed))
        warmup_s.append(time.perf_counter() - start)
        if progress is not None:
            progress.done(names[i], "warm-up", out)
    cells: list[list[list[Generation]]] = [[[] for _ in range(repeats)] for _ in range(n_entries)]
    for r in range(repeats):
        generators = [torch.Generator(device=device).manual_seed(seed + r) for _ in range(n_entries)]
        for b, batch in enumerate(batches):
            for i in williams_row(n_entries, r * len(batches) + b):
                out = decode(i, batch, generators[i])
                cells[i][r].append(out)
                if progress is not None:
                    progress.done(names[i], f"round {r + 1}/{repeats} batch {b + 1}/{len(batches)}", out)
    return cells, warmup_s


class RoundsProgress:
    """A rich progress bar over every decode call of a benchmark (warm-ups included): which method, which
    round and batch, and the tokens/s of the call that just ended. When stderr is not a terminal, a log line
    every LOG_EVERY seconds instead, so a run under nohup or in CI is never silent for minutes."""

    def __init__(self, total: int, *, console: Console | None = None, clock: Callable[[], float] = time.perf_counter):
        self.console = console or Console(stderr=True)
        self.clock, self.total, self.calls = clock, total, 0
        self.started = self.logged = clock()
        self.bar = Progress(
            TextColumn("[bold]benchmark"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("calls · {task.fields[what]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.console.is_terminal,
        )
        self.task = self.bar.add_task("benchmark", total=total, what="starting")

    def __enter__(self) -> RoundsProgress:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.__exit__(*exc)

    def done(self, name: str, where: str, out: Generation) -> None:
        """One decode call ended: `name` (plain or a method, with its setting) decoded `out` at `where`."""
        self.calls += 1
        rate = out.stats.total_tokens / max(out.stats.time_total, 1e-9)
        what = f"{where} · {name} {rate:.1f} tok/s"
        self.bar.update(self.task, advance=1, what=what)
        now = self.clock()
        if not self.console.is_terminal and now - self.logged >= LOG_EVERY:
            left = (self.total - self.calls) * (now - self.started) / max(self.calls, 1)
            log.info("benchmark: %d/%d calls, %s, about %.0f min left", self.calls, self.total, what, left / 60)
            self.logged = now
