"""Ratios that cannot be: the signs that the machine's load, not a method, made a benchmark's figures.

    reasons, warnings = judge(results["plain"], results["methods"], verify_costs)
    # reasons: [] for a clean run; else one line per impossible figure, and the report names no winner
    # warnings: cells too small to judge that lie above their bound: reported, the verdict stands

A speculative method needs fewer target forwards than plain decoding, and each of its forwards verifies k
tokens at v(k) = cost(k) / cost(1) of a plain step (v(k) >= 1 on every engine measured here). So its decoding
is at most F_plain / F_method / v(k) times as fast as plain decoding's, whatever the drafter costs, where F
counts the forwards that set the time. Both also pay the same prefill, which tokens/s counts: that pulls a
measured ratio towards 1, so the bound on the measured speedup is max(1, r / v(k)) and speedup / r is at most
1, with r = `forward_ratio`. A measured ratio above either bound by more than TOLERANCE can only come from a
change of machine load between its timing and plain decoding's: the run is disturbed. So is a run whose plain
decoding, the same work each round, ran at tokens/s that differ by more than PLAIN_SPREAD between rounds (a
check that needs 2 rounds or more).

Which forwards set the time, at any batch size. A decode call (one batch) runs until its longest-running row
is done: its time follows the forwards of that row, not the rows' pooled tau. Row A writing 100 tokens at tau
4 (25 forwards) beside row B writing 30 at tau 1 (30 forwards) takes 30 forwards where plain decoding takes
100: 3.33x at a pooled tau of 2.36. So the benchmark records, per row of the report, the tokens and the
forwards of each call's longest row (`call_forwards`, summed over calls), for the method and for plain
decoding over the same rounds, and r = (tokens / call_forwards) / (plain_tokens / plain_call_forwards): the
forwards plain decoding needs per token over the method's. At batch 1 a call's forwards are its row's and
plain decoding's forwards are its tokens, so r is tau. Judging efficiency per row instead has nothing to
divide: a row of a batch has no time of its own (each waits for the call), only the call has one. A row
written before these counts is judged on its tau.

v(k) comes from the cost table the run already has (budget=auto's, measured at the run's batch size, or
dtype=auto's probe of k = 1 and 8), which may be a cached one measured under another load: a table whose
1-token step is more than STEP_MATCH times off this run's plain seconds per forward does not describe this
run's machine, and only the bound r is checked then.

The per-category cells are checked at temperature 0 only: there every lossless method emits plain decoding's
tokens exactly, while at T > 0 a category of one prompt may end at EOS earlier in one run than in another, and
tokens/s (which includes the prefill) then differs for a reason that is not load. And only cells large enough
to judge: a cell of one question, or of fewer than MIN_CELL_TOKENS tokens a round, is a few seconds of timing
(128 tokens is about 4 s of SmolLM2 on 2 cores), where one scheduling stall of a few hundred milliseconds in
plain decoding's call moves the ratio by more than TOLERANCE; one question is also one draw of its category's
acceptance. Such a cell above its bound is reported as a warning line, and the run's verdict stands (a
13-question run, one question a category at 32 tokens, lost its verdict to one 1.45x cell against a 1.24x
bound that way). 128 tokens is two questions of 64 tokens, the demo's cells, which are still judged. At
batch > 1 a category may fit one batch: its cell is then one decode call a round, as exposed to one stall as
a single question (a batch-4 run's cell of four summarization questions read 4.0x against a bound of 1.88 in one
round on a loaded machine), and is not judged either. The
whole run's rows pool every cell and are always judged.
"""

from __future__ import annotations

from collections.abc import Callable

from verify.plan.budget import interpolate_cost

TOLERANCE = 0.15  # a ratio 15% above its bound is not timing jitter of one run
PLAIN_SPREAD = 1.5  # max / min of plain decoding's tokens/s over rounds: the same work should not vary more
STEP_MATCH = 2.0  # a cost table's step against this run's plain seconds per forward (prefill included)
MIN_CELL_PROMPTS = 2  # a category cell of fewer questions is not judged (one question is its own noise)
MIN_CELL_TOKENS = 128  # nor one of fewer tokens a round: a few seconds, where one stall moves it past TOLERANCE
MIN_CELL_CALLS = 2  # nor one decoded in a single call a round (a batch holding the whole category): one stall

__all__ = [
    "MIN_CELL_CALLS",
    "MIN_CELL_PROMPTS",
    "MIN_CELL_TOKENS",
    "PLAIN_SPREAD",
    "STEP_MATCH",
    "TOLERANCE",
    "disturbed_note",
    "disturbed_reasons",
    "forward_ratio",
    "judge",
    "small_cell_note",
    "verify_ratio",
]

Costs = Callable[[dict], dict[int, float] | None]
COUNTS = ("tokens", "call_forwards", "plain_tokens", "plain_call_forwards")


def verify_ratio(
    costs: dict[int, float] | None,
    width: int | None,
    plain_tokens_per_s: float | None = None,
    tokens_per_forward: float = 1.0,
) -> float | None:
    """v(width) = cost(width) / cost(1) from a measured table {k: seconds}; None without a table or a width, or
    when the table's step is more than STEP_MATCH times off plain decoding's seconds per forward,
    tokens_per_forward / plain_tokens_per_s (measured under another load; a batch of b rows emits b tokens a
    forward). A width past the widest measured one takes that one's cost: a forward costs no less for more
    tokens, and continuing the slope of a short table (dtype=auto measures k = 1 and 8 only) would overstate
    it, and flag honest ratios."""
    if not costs or width is None:
        return None
    table = {int(k): float(s) for k, s in costs.items()}
    step = interpolate_cost(table, 1)
    if plain_tokens_per_s and not 1 / STEP_MATCH <= step * plain_tokens_per_s / tokens_per_forward <= STEP_MATCH:
        return None
    return interpolate_cost(table, min(width, max(table))) / step


def forward_ratio(figure: dict) -> float:
    """Plain decoding's forwards per token over the method's, counting in each decode call only its longest
    row's forwards (what the call's time follows): the speedup the forwards allow before verification costs.
    tau at batch 1; the figure's tau where it lacks the counts (results written before them)."""
    if not all(figure.get(k) for k in COUNTS):
        return figure["tau"]
    return (figure["tokens"] / figure["call_forwards"]) / (figure["plain_tokens"] / figure["plain_call_forwards"])


def _over(what: str, figure: dict, v: float | None) -> str | None:
    """A line when the figure's speedup exceeds r = forward_ratio or max(1, r / v), beyond TOLERANCE; else None."""
    speedup, r, tau = figure["speedup"], forward_ratio(figure), figure["tau"]
    at = f"tau {r:.2f}" if abs(r - tau) < 1e-9 else f"tau {r:.2f} by the longest rows' forwards (pooled tau {tau:.2f})"
    if speedup / r > 1 + TOLERANCE:
        return f"{what}: efficiency {speedup / r:.2f} > 1 (speedup {speedup:.2f}x at {at})"
    bound = None if v is None else max(1.0, r / v)
    if bound is not None and speedup > bound * (1 + TOLERANCE):
        return f"{what}: speedup {speedup:.2f}x above its bound {bound:.2f}x = max(1, {at} / verify cost {v:.2f})"
    return None


def too_small(cell: dict) -> str | None:
    """Why a per-category cell is too small to judge ('1 question', '32 tokens a round'), or None. A cell
    written without its counts is judged."""
    prompts, tokens, rounds = cell.get("prompts"), cell.get("tokens"), cell.get("rounds") or 1
    if prompts is not None and prompts < MIN_CELL_PROMPTS:
        return f"{prompts} question{'s' if prompts != 1 else ''}"
    if tokens is not None and tokens / rounds < MIN_CELL_TOKENS:
        return f"{tokens / rounds:.0f} tokens a round"
    if cell.get("calls") is not None and cell["calls"] / rounds < MIN_CELL_CALLS:
        return "one decode call a round"
    return None


def judge(plains: list[dict], rows: list[dict], verify_costs: Costs | None = None) -> tuple[list[str], list[str]]:
    """(reasons, warnings) for the benchmark's plain and method rows (results.json's `plain` and `methods`):
    one reason per impossible figure (the run is disturbed), one warning per category cell too small to judge
    that lies above its bound. `verify_costs(row)` gives the measured cost table of the row's setting, when the
    run has one, and each row's `verify_width` (tokens per verification forward) picks v from it."""
    reasons, warnings = [], []
    for p in plains:
        rates = p.get("tokens_per_s_rounds") or []
        if len(rates) >= 2 and max(rates) / min(rates) > PLAIN_SPREAD:
            reasons.append(
                f"plain {_where(p)}: tokens/s per round {min(rates):.1f} to {max(rates):.1f} "
                f"(max/min {max(rates) / min(rates):.2f} > {PLAIN_SPREAD})"
            )
    plain_of = {_where(p): p for p in plains}
    for row in rows:
        plain = plain_of.get(_where(row), {})
        per_forward = plain["tokens"] / plain["call_forwards"] if plain.get("call_forwards") else 1.0
        costs = verify_costs(row) if verify_costs else None
        v = verify_ratio(costs, row.get("verify_width"), plain.get("tokens_per_s"), per_forward)
        name = f"{row['name']} {_where(row)}"
        reasons.append(_over(name, row, v))
        if row["temperature"] != 0:
            continue
        for category, cell in (row.get("categories") or {}).items():
            line, small = _over(f"{name} on {category}", cell, v), too_small(cell)
            if line is not None and small is not None:
                warnings.append(f"{line}; not judged: {small}, too small to tell load from noise")
            elif line is not None:
                reasons.append(line)
    return [r for r in reasons if r is not None], warnings


def disturbed_reasons(plains: list[dict], rows: list[dict], verify_costs: Costs | None = None) -> list[str]:
    """`judge`'s reasons alone: [] for a clean run."""
    return judge(plains, rows, verify_costs)[0]


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
        f"1, by more than {100 * TOLERANCE:.0f}%, where at batch > 1 tau counts each batch's longest row's "
        f"forwards against plain decoding's; or plain decoding's own rate varied more than {PLAIN_SPREAD}x "
        "between rounds): the machine's load changed while it was timed. No winner is named; rerun on a quiet "
        f"machine.\n{lines}\n\n"
    )


def small_cell_note(warnings: list[str]) -> str:
    """The report's lines on cells too small to judge that lie above their bound: empty when none does."""
    if not warnings:
        return ""
    lines = "\n".join(f"- {w}" for w in warnings)
    return (
        f"Note: category cells of one question, one decode call or under {MIN_CELL_TOKENS} tokens a round are not "
        "judged for "
        "disturbance (a few seconds of timing; the verdict stands on the whole run). These lie above their "
        f"bound:\n{lines}\n\n"
    )
