"""Figures per prompt category, as Spec-Bench reports them: speedup and tau of every method on each category
(coding, summarization, qa, ...) beside the whole set, and the mean over categories.

Acceptance depends on the task (a summary copies its source, free prose does not), so a single figure over a
mix hides where a drafter pays. A category's speedup is computed like the whole set's: per timing round, the
method's tokens/s on that category's prompts over the fastest plain decoding's tokens/s on the same prompts
in the same round, then the median over rounds (and its tau pooled over the rounds that median takes).
Batches never mix categories (`category_batches`), so each batch's statistics belong to one category. The
benchmark adds to each figure the bootstrap interval over the category's own (round, batch) cells
(experiments/lib/report/spread.py); a category of one prompt timed in one round is a single cell, shown as
n=1: one prompt says nothing about its category's spread.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from experiments.lib.methods.rounds import middle_rounds
from experiments.lib.report.spread import format_ratio

__all__ = ["category_batches", "category_figures", "category_table", "per_category", "pooled"]


def category_batches(
    ids: list[list[int]], categories: list[str], batch_size: int
) -> tuple[list[list[list[int]]], list[str]]:
    """(batches of at most batch_size prompts, each batch's category): prompts grouped by category (categories
    in order of first appearance, prompts in order within each), then cut into batches."""
    groups: dict[str, list[list[int]]] = {}
    for prompt, category in zip(ids, categories):
        groups.setdefault(category, []).append(prompt)
    batches, labels = [], []
    for category, prompts in groups.items():
        for i in range(0, len(prompts), batch_size):
            batches.append(prompts[i : i + batch_size])
            labels.append(category)
    return batches, labels


def per_category(stats: list, labels: list[str], summarize: Callable[[list], dict]) -> dict[str, dict]:
    """One round's `summarize` of each category's batches; {} when the prompts have a single category."""
    categories = list(dict.fromkeys(labels))
    if len(categories) < 2:
        return {}
    return {c: summarize([s for s, label in zip(stats, labels) if label == c]) for c in categories}


def category_figures(entry: dict, plains: list[dict]) -> dict[str, dict[str, float]]:
    """{category: {speedup, tau, tokens_per_s, ...}} of one entry (a method or plain decoding in one setting)
    from its rounds' per-category summaries (`entry["category_rounds"]`), against the fastest of `plains` per
    round. tau is pooled over the rounds the median speedup takes (`middle_rounds`); where the summaries
    count tokens and forwards, the figure also carries them over those rounds, with plain decoding's of the
    entry's setting (the counts experiments/lib/report/disturbed.py bounds a speedup with) and `rounds`."""
    rounds = entry["category_rounds"]
    setting = entry.get("setup")  # plain decoding of the entry's own setting: the same work, timed beside it
    own = next((p for p in plains if setting is not None and p.get("setup") is setting), plains[0] if plains else {})
    out = {}
    for category in rounds[0] if rounds else {}:
        fastest = [max(p["category_rounds"][r][category]["tokens_per_s"] for p in plains) for r in range(len(rounds))]
        speedups = [m[category]["tokens_per_s"] / f for m, f in zip(rounds, fastest)]
        middle = middle_rounds(speedups)
        mine = pooled([rounds[r][category] for r in middle])
        out[category] = {
            "speedup": statistics.median(speedups),
            "tau": mine.pop("tau"),
            "tokens_per_s": statistics.median(m[category]["tokens_per_s"] for m in rounds),
        }
        if mine:  # the counts: the same rounds of plain decoding beside them
            plain = pooled([own["category_rounds"][r][category] for r in middle])
            out[category] |= mine | {"plain_tokens": plain["tokens"], "plain_call_forwards": plain["call_forwards"]}
    return out


def pooled(summaries: list[dict]) -> dict:
    """Rounds' summaries of one category as one: {tau} pooled (tokens over forwards) with the tokens, the
    call forwards (each call's longest row's) and the number of rounds, where the summaries count them; else
    {tau} as their mean (summaries without counts)."""
    if not all("forwards" in s for s in summaries):
        return {"tau": statistics.mean(s["tau"] for s in summaries)}
    tokens = sum(s["tokens"] for s in summaries)
    return {
        "tau": tokens / max(sum(s["forwards"] for s in summaries), 1),
        "tokens": tokens,
        "call_forwards": sum(s["call_forwards"] for s in summaries),
        "rounds": len(summaries),
    } | ({"calls": sum(s["calls"] for s in summaries)} if all("calls" in s for s in summaries) else {})


def _ratio(figure: dict) -> str:
    """'1.50x [1.20, 1.80]', '1.50x n=1' (one cell), or '1.50x' (a figure written before intervals)."""
    return format_ratio(figure["speedup"], figure.get("speedup_lo"), figure.get("speedup_hi"), figure.get("cells"))


def category_table(results: dict[str, Any], mode: Callable[[dict], str]) -> str:
    """Markdown: one row per method, setting and temperature; per category 'speedup (tau)'; then the mean
    over categories and the whole set's figure. Empty when the run had a single category."""
    rows = [r for r in results["methods"] if r.get("categories")]
    if not rows:
        return ""
    names = list(dict.fromkeys(c for r in rows for c in r["categories"]))  # rows of several runs may differ
    header = "| method | mode | T | " + " | ".join(names) + " | mean | overall |"
    spread = " [bootstrap interval] or n=1 (a single cell)" if any("cells" in r for r in rows) else ""
    lines = [
        f"\nSpeedup{spread} (tau) per category, as Spec-Bench reports; mean = the mean over categories, overall = "
        "the whole set:\n",
        header,
        "|" + "|".join(["---"] * (header.count("|") - 1)) + "|",
    ]
    for row in rows:
        figures = row["categories"]
        cells = [f"{_ratio(figures[c])} ({figures[c]['tau']:.2f})" if c in figures else "-" for c in names]
        mean = statistics.mean(f["speedup"] for f in figures.values())
        lines.append(
            f"| {row['name']} | {mode(row)} | {row['temperature']:g} | {' | '.join(cells)} | {mean:.2f}x "
            f"| {_ratio(row)} ({row['tau']:.2f}) |"
        )
    return "\n".join(lines) + "\n"
