"""How far a speedup can be trusted: a paired bootstrap interval of the benchmark's ratio.

    method = cell_times(entry_cells)                  # (tokens, seconds), each (rounds, batches)
    plains = [cell_times(c) for c in plain_cells]     # every setting's plain decoding, same cells
    lo, hi, n = speedup_interval(method, plains)      # over every batch
    lo, hi, n = speedup_interval(method, plains, batches=[0, 3])   # one category's batches

A cell is one batch decoded in one round. The benchmark times every entry on a cell back to back
(experiments/lib/methods/rounds.py), so a cell's method time and its plain times met the same machine load:
the bootstrap resamples cells, never method and plain times apart (a paired bootstrap).

The statistic is the benchmark's own speedup: per round, the method's tokens over its seconds on the cells
of that round, over the FASTEST plain setting's tokens/s on the same cells; then the median over rounds.
Each of RESAMPLES resamples draws n cells with replacement from the n cells (rounds and batches together)
and recomputes it over the rounds it drew (a round it drew no cell of is left out); the interval is the
central LEVEL share of those values (percentile interval), with a fixed seed, so the same timings give the
same interval. With one cell there is nothing to resample: no interval (the report says n=1).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from verify.loop.plain import Generation

RESAMPLES = 2000
LEVEL = 0.95
SEED = 0

# (tokens, seconds), each a (rounds, batches) array: one entry's cells
CellTimes = tuple[np.ndarray, np.ndarray]

__all__ = [
    "LEVEL",
    "RESAMPLES",
    "SEED",
    "cell_times",
    "format_ratio",
    "point_speedup",
    "speedup_interval",
    "spread_note",
]


def cell_times(cells: Sequence[Sequence[Generation]]) -> CellTimes:
    """cells[round][batch] Generations of one entry -> (tokens, seconds), each of shape (rounds, batches)."""
    tokens = np.array([[g.stats.total_tokens for g in row] for row in cells], dtype=float)
    seconds = np.array([[g.stats.time_total for g in row] for row in cells], dtype=float)
    return tokens, seconds


def _statistic(counts: np.ndarray, rounds: np.ndarray, method: CellTimes, plains: list[CellTimes]) -> np.ndarray:
    """counts (S, n): how often each of the n cells was drawn in each of S resamples; rounds (n,) each cell's
    round. Returns (S,) medians over the drawn rounds of method tokens/s over the fastest plain tokens/s."""
    n_rounds = int(rounds.max()) + 1
    onehot = (rounds[:, None] == np.arange(n_rounds)[None, :]).astype(float)  # (n, R)

    def rate(times: CellTimes) -> np.ndarray:  # (S, R) tokens/s per round over the drawn cells
        tokens, seconds = (counts @ (onehot * t[:, None]) for t in times)
        with np.errstate(invalid="ignore", divide="ignore"):
            return tokens / seconds

    fastest = np.max(np.stack([rate(p) for p in plains]), axis=0)  # (S, R)
    drawn = counts @ onehot > 0  # (S, R): the rounds each resample holds a cell of
    ratio = np.where(drawn, rate(method) / np.where(drawn, fastest, 1.0), np.nan)
    return np.nanmedian(ratio, axis=1)


def speedup_interval(
    method: CellTimes,
    plains: list[CellTimes],
    *,
    batches: Sequence[int] | None = None,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = SEED,
) -> tuple[float | None, float | None, int]:
    """(lo, hi, n): the `level` percentile interval of the speedup of `method` over the fastest of `plains`
    from `resamples` paired resamples of the n cells (the rounds x `batches`, default every batch); lo and
    hi are None when n < 2 (one cell has no spread)."""
    if not plains:
        raise ValueError("plains=[]: a speedup needs plain decoding's times on the same cells")
    if not 0 < level < 1:
        raise ValueError(f"level={level!r}: must be a share strictly between 0 and 1, e.g. 0.95")
    columns = list(range(method[0].shape[1])) if batches is None else list(batches)
    pick = lambda times: tuple(t[:, columns].reshape(-1) for t in times)  # noqa: E731  rows: round-major
    m, ps = pick(method), [pick(p) for p in plains]
    n = m[0].shape[0]
    if n < 2:
        return None, None, n
    rounds = np.repeat(np.arange(method[0].shape[0]), len(columns))  # (n,)
    counts = np.random.default_rng(seed).multinomial(n, np.full(n, 1.0 / n), size=resamples)  # (S, n)
    values = _statistic(counts, rounds, m, ps)
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(values, [tail, 100 - tail])
    return float(lo), float(hi), n


def point_speedup(method: CellTimes, plains: list[CellTimes], *, batches: Sequence[int] | None = None) -> float:
    """The statistic on every cell once: the median over rounds of method over fastest plain tokens/s."""
    columns = list(range(method[0].shape[1])) if batches is None else list(batches)
    pick = lambda times: tuple(t[:, columns].reshape(-1) for t in times)  # noqa: E731
    rounds = np.repeat(np.arange(method[0].shape[0]), len(columns))
    counts = np.ones((1, rounds.shape[0]))
    return float(_statistic(counts, rounds, pick(method), [pick(p) for p in plains])[0])


def format_ratio(speedup: float, lo: float | None, hi: float | None, n: int | None = None) -> str:
    """'1.14x [1.02, 1.27]'; one cell: '1.14x n=1'; a figure written before intervals: '1.14x'."""
    if lo is not None and hi is not None:
        return f"{speedup:.2f}x [{lo:.2f}, {hi:.2f}]"
    return f"{speedup:.2f}x n={n}" if n is not None else f"{speedup:.2f}x"


def spread_note(resamples: int = RESAMPLES, level: float = LEVEL, seed: int = SEED) -> str:
    """The report's sentence on what the brackets mean."""
    return (
        f"speedup [lo, hi]: the {100 * level:.0f}% percentile interval of a paired bootstrap ({resamples} "
        f"resamples, seed {seed}) over the (round, batch) cells: each resample draws cells with replacement, "
        "keeping a cell's method and plain timings together (they ran back to back), and recomputes the "
        "median over rounds of the method's tokens/s over the fastest plain decoding's; n=1: a single cell, "
        "no spread."
    )
