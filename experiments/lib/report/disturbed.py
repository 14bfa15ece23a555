"""Ratios that cannot be: the signs that the machine's load, not a method, made a benchmark's figures.

    reasons = disturbed_reasons(results["plain"], results["methods"], verify_costs)
    # [] for a clean run; else one line per impossible figure, and the report names no winner

A speculative method emits tau tokens per target forward, and each forward verifies k tokens at
v(k) = cost(k) / cost(1) of a plain step (v(k) >= 1 on every engine measured here). So its decoding is at most
tau / v(k) times as fast as plain decoding's, whatever the drafter costs. Both also pay the same prefill, which
tokens/s counts: that pulls a measured ratio towards 1, so the bound on the measured speedup is
max(1, tau / v(k)), and its efficiency (speedup / tau) is at most 1 (tau >= 1). A measured ratio above either
bound by more than TOLERANCE can only come from a change of machine load between its timing and plain
decoding's: the run is disturbed. So is a run whose plain decoding, the same work each round, ran at tokens/s
that differ by more than PLAIN_SPREAD between rounds (a check that needs 2 rounds or more).

v(k) comes from the cost table the run already has (budget=auto's, or dtype=auto's probe of k = 1 and 8),
which may be a cached one measured under another load: a table whose 1-token step is more than STEP_MATCH
times off this run's plain seconds per token does not describe this run's machine, and only the efficiency
bound is checked then.

The per-category cells are checked at temperature 0 only: there every lossless method emits plain decoding's
tokens exactly, while at T > 0 a category of one prompt may end at EOS earlier in one run than in another, and
tokens/s (which includes the prefill) then differs for a reason that is not load.
"""

from __future__ import annotations

from collections.abc import Callable

from verify.plan.budget import interpolate_cost

TOLERANCE = 0.15  # a ratio 15% above its bound is not timing jitter of one run
PLAIN_SPREAD = 1.5  # max / min of plain decoding's tokens/s over rounds: the same work should not vary more
STEP_MATCH = 2.0  # a cost table's step against this run's plain seconds per token (prefill included)

__all__ = ["PLAIN_SPREAD", "STEP_MATCH", "TOLERANCE", "disturbed_note", "disturbed_reasons", "verify_ratio"]


def verify_ratio(
    costs: dict[int, float] | None, width: int | None, plain_tokens_per_s: float | None = None
) -> float | None:
    """v(width) = cost(width) / cost(1) from a measured table {k: seconds}; None without a table or a width, or
    when the table's step is more than STEP_MATCH times off 1 / plain_tokens_per_s (measured under another load).
    A width past the widest measured one takes that one's cost: a forward costs no less for more tokens, and
    continuing the slope of a short table (dtype=auto measures k = 1 and 8 only) would overstate it, and
    flag honest ratios."""
    if not costs or width is None:
        return None
    table = {int(k): float(s) for k, s in costs.items()}
    step = interpolate_cost(table, 1)
    if plain_tokens_per_s and not 1 / STEP_MATCH <= step * plain_tokens_per_s <= STEP_MATCH:
        return None
    return interpolate_cost(table, min(width, max(table))) / step


def _check(what: str, speedup: float, tau: float, v: float | None) -> str | None:
    """A reason when speedup exceeds tau (efficiency > 1) or max(1, tau / v), beyond TOLERANCE; else None."""
    if speedup / tau > 1 + TOLERANCE:
        return f"{what}: efficiency {speedup / tau:.2f} > 1 (speedup {speedup:.2f}x at tau {tau:.2f})"
    bound = None if v is None else max(1.0, tau / v)
    if bound is not None and speedup > bound * (1 + TOLERANCE):
        return (
            f"{what}: speedup {speedup:.2f}x above its bound {bound:.2f}x = max(1, tau {tau:.2f} / verify cost {v:.2f})"
        )
    return None


def disturbed_reasons(
    plains: list[dict], rows: list[dict], verify_costs: Callable[[dict], dict[int, float] | None] | None = None
) -> list[str]:
    """One line per impossible figure of the benchmark's plain and method rows (results.json's `plain` and
    `methods`); `verify_costs(row)` gives the measured cost table of the row's setting, when the run has one,
    and each row's `verify_width` (tokens per verification forward) picks v from it."""
    reasons = []
    for p in plains:
        rates = p.get("tokens_per_s_rounds") or []
        if len(rates) >= 2 and max(rates) / min(rates) > PLAIN_SPREAD:
            reasons.append(
                f"plain {_where(p)}: tokens/s per round {min(rates):.1f} to {max(rates):.1f} "
                f"(max/min {max(rates) / min(rates):.2f} > {PLAIN_SPREAD})"
            )
    plain_rate = {_where(p): p.get("tokens_per_s") for p in plains}
    for row in rows:
        costs = verify_costs(row) if verify_costs else None
        v = verify_ratio(costs, row.get("verify_width"), plain_rate.get(_where(row)))
        name = f"{row['name']} {_where(row)}"
        reasons.append(_check(name, row["speedup"], row["tau"], v))
        if row["temperature"] == 0:
            for category, cell in (row.get("categories") or {}).items():
                reasons.append(_check(f"{name} on {category}", cell["speedup"], cell["tau"], v))
    return [r for r in reasons if r is not None]


def _where(row: dict) -> str:
    """'(eager 2t) at T=0': the setting and temperature a row was timed in."""
    compiled = row.get("compiled")
    mode = "graph" if compiled == "graph" else "compiled" if compiled else "eager"
    return f"({mode} {row.get('threads', '?')}t) at T={row['temperature']:g}"


def disturbed_note(reasons: list[str]) -> str:
    """The report's warning block: empty for a clean run."""
    if not reasons:
        return ""
    lines = "\n".join(f"- {r}" for r in reasons)
    return (
        "**DISTURBED RUN**: some figures cannot be (above the bound max(1, tau / verify cost) or an efficiency of "
        f"1, by more than {100 * TOLERANCE:.0f}%, or plain decoding's own rate varied more than {PLAIN_SPREAD}x "
        "between rounds): the machine's load changed while it was timed. No winner is named; rerun on a quiet "
        f"machine.\n{lines}\n\n"
    )
