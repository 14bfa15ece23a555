"""The benchmark's timing and its noise, with fakes (no model): plain decoding and every method interleaved
batch by batch in a rotating order, the paired bootstrap interval of each speedup, the verdict that names a
winner only above 1.0, the disturbed-run checks, the report's text and the progress lines."""

from __future__ import annotations

import io
import itertools
import json
import logging
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import DictConfig, OmegaConf

from experiments import benchmark as bench_mod
from experiments.lib.methods import rounds
from experiments.lib.methods.rounds import RoundsProgress, interleaved_rounds, williams_row
from experiments.lib.report.disturbed import disturbed_reasons, verify_ratio
from experiments.lib.report.results import verdict, write_report
from experiments.lib.report.spread import point_speedup, speedup_interval
from verify.loop.plain import Generation
from verify.loop.speculative import SpecConfig
from verify.loop.stats import DecodeStats


def generation(tokens: int, seconds: float, forwards: int | None = None) -> Generation:
    """One row of `tokens` new tokens (all 7s) decoded in `seconds` with `forwards` target forwards."""
    stats = DecodeStats.zeros(1, torch.device("cpu"))
    stats.tokens += tokens
    stats.forwards += forwards or tokens
    stats.time_total = stats.time_target = seconds
    return Generation(tokens=[[7] * tokens], stats=stats)


# ------------------------------------------------------------------------------------ interleaving order


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 11])
def test_williams_rows_balance_positions_and_predecessors(n: int) -> None:
    period = n if n % 2 == 0 else 2 * n
    rows = [williams_row(n, r) for r in range(period)]
    assert all(sorted(row) == list(range(n)) for row in rows)
    assert williams_row(n, period) == rows[0]  # the design repeats
    positions = Counter((pos, e) for row in rows for pos, e in enumerate(row))
    assert set(positions.values()) == {period // n}  # every entry at every position equally often
    follows = Counter((a, b) for row in rows for a, b in itertools.pairwise(row))
    if n > 1:  # every entry right after every other equally often (once for even n, twice for odd)
        assert len(follows) == n * (n - 1) and set(follows.values()) == {period // n}


def test_williams_row_refuses_a_bad_count() -> None:
    with pytest.raises(ValueError, match=r"n=0: must be an integer >= 1"):
        williams_row(0, 0)


def test_every_batch_is_decoded_by_every_entry_before_the_next_batch() -> None:
    """Warm-up of each entry on batch 0, then per round, per batch, every entry back to back in a rotating
    order; one generator per entry and round, seeded seed + round and carried from batch to batch."""
    calls = []

    def decode(i: int, batch: list[list[int]], generator: torch.Generator) -> Generation:
        calls.append((i, batch[0][0], id(generator), generator.initial_seed()))
        return generation(4, 0.1)

    batches = [[[b]] for b in range(4)]
    cells, warmup_s = interleaved_rounds(decode, 3, batches, repeats=2, seed=10)
    assert [c[:2] for c in calls[:3]] == [(0, 0), (1, 0), (2, 0)] and len(warmup_s) == 3
    timed = calls[3:]
    assert len(timed) == 2 * 4 * 3
    for t, group in enumerate(timed[i : i + 3] for i in range(0, len(timed), 3)):
        assert {batch for _, batch, _, _ in group} == {t % 4}  # one batch at a time, every entry on it
        assert [i for i, *_ in group] == williams_row(3, t)
    orders = [tuple(i for i, *_ in timed[k : k + 3]) for k in range(0, len(timed), 3)]
    assert len(set(orders)) > 1  # the order rotates: no entry always runs right after the same one
    for i in range(3):  # per entry and round: one generator over the round's batches, seed + round
        for r in range(2):
            mine = [c for c in timed[12 * r : 12 * (r + 1)] if c[0] == i]
            assert len({gen for *_, gen, _ in mine}) == 1 and {seed for *_, seed in mine} == {10 + r}
    assert [[len(cells[i][r]) for r in range(2)] for i in range(3)] == [[4, 4]] * 3


def bench_cfg(repeats: int = 2) -> DictConfig:
    decode = dict(top_k=None, top_p=1.0, rule="auto", delta=0.0, max_new_tokens=8)
    return OmegaConf.create(dict(decode=decode, repeats=repeats, seed=3, budget="fixed"))


def test_the_benchmark_interleaves_and_gives_each_ratio_its_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the benchmark's own bench_temperatures, with run_once faked: each batch is decoded by plain and
    every method, at both temperatures, back to back; the machine's load (x1 to x4 by batch) lands on all of
    them, so a method always twice as fast as plain has the interval [2.00, 2.00], and the rows carry
    speedup_lo/hi and cells."""
    load = {0: 1.0, 1: 4.0, 2: 2.0, 3: 3.0}  # seconds multiplier of each batch (a busy machine, then a quiet one)
    speed = {"plain": 1.0, "prompt_lookup": 0.5, "draft_model": 1.25}  # seconds per batch at load 1
    order = []

    def fake_run_once(target, factory, batch, *, sampling, spec, cfg, generator, eos_id):
        name = "plain" if factory is None else factory.name
        order.append((name, sampling.temperature, batch[0][0]))
        tau = {"plain": 1, "prompt_lookup": 4, "draft_model": 2}[name]
        return generation(8, speed[name] * load[batch[0][0]], forwards=8 // tau)

    monkeypatch.setattr(bench_mod, "run_once", fake_run_once)
    factories = {}
    for name in ("prompt_lookup", "draft_model"):
        factories[name] = lambda: None
        factories[name].name = name
    target = type("FakeTarget", (), {"device": torch.device("cpu")})()
    setup = dict(
        threads=torch.get_num_threads(), compiled=False, target=target, spec=SpecConfig(gamma=3), methods=factories
    )
    batches, labels = [[[b]] for b in range(4)], ["x", "x", "y", "z"]
    plains, rows = bench_mod.bench_temperatures(bench_cfg(), [setup], batches, [0.0, 1.0], None, labels)
    timed = order[6:]  # after one warm-up call of each of the 6 entries (3 per temperature)
    for k in range(0, len(timed), 6):  # six entries on one batch, then the next batch
        assert len({batch for *_, batch in timed[k : k + 6]}) == 1
        assert sorted(entry for *entry, _ in timed[k : k + 6]) == sorted([n, t] for n in speed for t in (0.0, 1.0))
    assert [batch for *_, batch in timed[::6]] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [p["temperature"] for p in plains] == [0.0, 1.0]
    plain = plains[0]
    assert (plain["speedup"], plain["speedup_lo"], plain["speedup_hi"], plain["cells"]) == (1.0, 1.0, 1.0, 8)
    assert [(r["name"], r["temperature"]) for r in rows] == [(n, t) for t in (0.0, 1.0) for n in factories]
    lookup, draft = rows[:2]
    assert (lookup["speedup"], lookup["speedup_lo"], lookup["speedup_hi"]) == pytest.approx((2.0, 2.0, 2.0))
    assert (draft["speedup"], draft["speedup_lo"], draft["speedup_hi"]) == pytest.approx((0.8, 0.8, 0.8))
    assert lookup["verify_width"] == 4 and lookup["exact"] is True
    x, y = lookup["categories"]["x"], lookup["categories"]["y"]
    assert (x["cells"], y["cells"]) == (4, 2) and x["speedup_lo"] == pytest.approx(2.0)


# ------------------------------------------------------------------------------------------ the interval


def times(tokens: list[list[float]], seconds: list[list[float]]) -> tuple[np.ndarray, np.ndarray]:
    return np.array(tokens, dtype=float), np.array(seconds, dtype=float)


def test_two_cells_give_the_interval_between_their_ratios() -> None:
    """One round, two cells: a resample holds cell A twice (1/4), B twice (1/4) or one each (1/2), so the
    2.5% and 97.5% percentiles are the speedups of A alone (1.5) and of B alone (3.0)."""
    method = times([[30, 30]], [[2, 1]])  # 15 and 30 tokens/s
    plain = times([[10, 10]], [[1, 1]])  # 10 tokens/s on both
    assert speedup_interval(method, [plain]) == (pytest.approx(1.5), pytest.approx(3.0), 2)
    assert point_speedup(method, [plain]) == pytest.approx(2.0)  # 60 tokens in 3 s over 20 in 2 s


def test_the_bootstrap_is_paired_a_load_change_on_both_adds_no_spread() -> None:
    """Cells 1x to 8x slower (the machine's load) for method and plain alike: the ratio is 2 in every cell, so
    every resample gives 2, where resampling method and plain times apart would spread from 0.25 to 16."""
    load = [1, 8, 2, 5, 3, 1]
    method = times([[10] * 6] * 2, [[0.5 * x for x in load]] * 2)
    plain = times([[10] * 6] * 2, [[1.0 * x for x in load]] * 2)
    lo, hi, n = speedup_interval(method, [plain])
    assert (lo, hi, n) == (pytest.approx(2.0), pytest.approx(2.0), 12)


def test_against_the_fastest_plain_and_reproducible() -> None:
    rng = np.random.default_rng(1)
    seconds = rng.uniform(0.5, 1.5, size=(3, 5))
    method = times([[10] * 5] * 3, seconds.tolist())
    slow, fast = times([[10] * 5] * 3, [[2.0] * 5] * 3), times([[10] * 5] * 3, [[1.0] * 5] * 3)
    both = speedup_interval(method, [slow, fast])
    assert both == speedup_interval(method, [fast])  # the slower plain setting changes nothing
    assert both == speedup_interval(method, [fast, slow])  # and the same timings give the same interval
    lo, hi, n = both
    assert n == 15 and lo < point_speedup(method, [fast]) < hi
    per_round = [np.sum(10 * np.ones(5)) / np.sum(s) / 10 for s in seconds]  # the benchmark's own statistic
    assert point_speedup(method, [fast]) == pytest.approx(float(np.median(per_round)))
    assert speedup_interval(method, [fast], seed=1) != both  # the seed is what fixes it


def test_one_cell_has_no_spread_and_bad_settings_are_refused() -> None:
    method, plain = times([[10, 10]], [[1, 2]]), times([[10, 10]], [[1, 1]])
    assert speedup_interval(method, [plain], batches=[1]) == (None, None, 1)
    with pytest.raises(ValueError, match="plains=\\[\\]"):
        speedup_interval(method, [])
    with pytest.raises(ValueError, match="level=1.5: must be a share strictly between 0 and 1"):
        speedup_interval(method, [plain], level=1.5)


# --------------------------------------------------------------------------------------------- the verdict


def row(name: str, t: float, speedup: float, lo: float | None, hi: float | None, tau: float = 2.0, **more) -> dict:
    return dict(
        name=name, temperature=t, speedup=speedup, speedup_lo=lo, speedup_hi=hi, tau=tau, lossless=True, threads=2,
        compiled=False, **more,
    )  # fmt: skip


def plain_rows() -> list[dict]:
    return [dict(temperature=t, threads=2, compiled=False, repeat4=0.1, speedup=1.0) for t in (0.0, 1.0)]


def test_no_winner_where_the_interval_includes_one() -> None:
    methods = [row("a", 0.0, 1.20, 0.95, 1.40), row("b", 0.0, 1.05, 0.90, 1.20), row("a", 1.0, 0.9, 0.8, 1.0)]
    line = verdict({"plain": plain_rows(), "methods": methods})
    assert "at T=0 no method measurably faster (highest: a (eager 2t) at 1.20x [0.95, 1.40]" in line
    assert "at T=1 no method measurably faster" in line and "the fastest plain decoding" not in line


def test_a_winner_where_the_interval_lies_above_one() -> None:
    methods = [row("a", 0.0, 1.30, 1.02, 1.50), row("b", 0.0, 1.40, 0.98, 1.90), row("c", 0.0, 1.1, 1.01, 1.2)]
    line = verdict({"plain": plain_rows(), "methods": methods})
    # b's point figure is higher, but its interval reaches below 1.0: a is the winner, c also above 1.0
    assert "at T=0 a (eager 2t) at 1.30x [1.02, 1.50] the fastest plain decoding (tau 2.00" in line
    assert line.rstrip().endswith("; also above 1.0: c.")


def test_a_disturbed_run_names_no_winner() -> None:
    methods = [row("a", 0.0, 9.85, 9.0, 10.5, tau=1.05)]
    line = verdict({"plain": plain_rows(), "methods": methods, "disturbed": ["a: efficiency 9.38 > 1"]})
    assert "at T=0 no winner named, the run was disturbed (highest: a (eager 2t) at 9.85x [9.00, 10.50]" in line
    assert "the fastest plain decoding" not in line


# ------------------------------------------------------------------------------------- disturbed detection


def test_efficiency_above_one_marks_the_run_disturbed() -> None:
    """The held-out run's figures: 9.85x at tau 1.05, and a category at 26.93x."""
    bad = row("medusa_chain", 0.0, 9.85, 9.0, 10.5, tau=1.05, categories={"qa": {"speedup": 26.93, "tau": 1.1}})
    reasons = disturbed_reasons(plain_rows(), [bad])
    assert reasons == [
        "medusa_chain (eager 2t) at T=0: efficiency 9.38 > 1 (speedup 9.85x at tau 1.05)",
        "medusa_chain (eager 2t) at T=0 on qa: efficiency 24.48 > 1 (speedup 26.93x at tau 1.10)",
    ]


def test_a_clean_run_is_not_disturbed_and_the_tolerance_is_stated() -> None:
    fine = [row("a", 0.0, 1.4, 1.2, 1.6, tau=1.5), row("b", 1.0, 1.1, 1.0, 1.2, tau=1.0)]  # 1.1 / 1.0 within 15%
    assert disturbed_reasons(plain_rows(), fine) == []
    assert disturbed_reasons(plain_rows(), [row("b", 1.0, 1.2, 1.1, 1.3, tau=1.0)]) != []  # 20% above: not jitter


def test_a_ratio_above_tau_over_the_verify_cost_marks_the_run_disturbed() -> None:
    """tau 2, verifying 5 tokens costs 1.72 steps: at most 1.16x; 1.5x is 29% above, beyond the tolerance."""
    costs = {1: 0.010, 8: 0.0226}  # v(5) = (0.010 + 4/7 * 0.0126) / 0.010 = 1.72
    plains = [{**p, "tokens_per_s": 80.0} for p in plain_rows()]  # 12.5 ms a token, prefill included: the table fits
    fast = row("a", 0.0, 1.5, 1.3, 1.7, tau=2.0, verify_width=5)
    (reason,) = disturbed_reasons(plains, [fast], lambda r: costs)
    assert reason == "a (eager 2t) at T=0: speedup 1.50x above its bound 1.16x = max(1, tau 2.00 / verify cost 1.72)"
    assert disturbed_reasons(plains, [fast], lambda r: None) == []  # no table: only efficiency <= 1
    # past k = 8 the table's widest cost: v(17) = v(8) = 2.26 (its slope would say 3.88, and flag this 1.2x)
    tree = row("t", 0.0, 1.2, 1.1, 1.3, tau=2.5, verify_width=17)
    assert verify_ratio(costs, 17) == pytest.approx(2.26) and disturbed_reasons(plains, [tree], lambda r: costs) == []


def test_the_prefill_pulls_slow_methods_towards_one_and_a_stale_table_is_not_used() -> None:
    """A method slower than plain (tau / v = 0.58) measured at 0.9x: the shared prefill lifts it towards 1, not
    a disturbance. A table whose step is 10x this run's plain seconds per token (cached under another load)
    gives no v: only efficiency is checked."""
    costs = {1: 0.010, 8: 0.0226}
    plains = [{**p, "tokens_per_s": 80.0} for p in plain_rows()]
    slow = row("s", 0.0, 0.9, 0.8, 1.0, tau=1.0, verify_width=5)
    assert disturbed_reasons(plains, [slow], lambda r: costs) == []
    assert verify_ratio(costs, 5, plain_tokens_per_s=8.0) is None and verify_ratio(costs, 5, 80.0) == pytest.approx(
        1.72
    )
    fast = row("a", 0.0, 1.5, 1.3, 1.7, tau=2.0, verify_width=5)
    stale = [{**p, "tokens_per_s": 8.0} for p in plain_rows()]  # 125 ms a token against the table's 10 ms
    assert disturbed_reasons(stale, [fast], lambda r: costs) == []


def test_categories_are_checked_at_t0_only_and_plain_spread_counts() -> None:
    t1 = row("a", 1.0, 1.0, 0.9, 1.1, tau=1.5, categories={"qa": {"speedup": 3.0, "tau": 1.2}})
    assert disturbed_reasons(plain_rows(), [t1]) == []  # a T=1 category may end at EOS early: not load
    plains = [{**plain_rows()[0], "tokens_per_s_rounds": [20.0, 12.0, 18.0]}]
    (reason,) = disturbed_reasons(plains, [])
    assert reason == "plain (eager 2t) at T=0: tokens/s per round 12.0 to 20.0 (max/min 1.67 > 1.5)"


# ------------------------------------------------------------------------------------------ the report


def report_results(disturbed: list[str]) -> dict:
    plain = [
        {**p, "tokens_per_s": 10.0, "speedup_lo": 1.0, "speedup_hi": 1.0, "cells": 6, "warmup_s": 1.0}
        for p in plain_rows()
    ]
    extra = dict(rule="greedy", repeat4=0.1, alpha=0.5, exact=True, tokens_per_s=11.4, efficiency=0.57, gamma=4)
    extra |= dict(draft_share=0.1, target_share=0.8, draft_seconds_per_step=0.01, target_seconds_per_step=0.1)
    extra |= dict(acceptance_by_position=[0.5], cells=6)
    categories = {
        "qa": {"speedup": 1.3, "speedup_lo": None, "speedup_hi": None, "cells": 1, "tau": 2.1},
        "rag": {"speedup": 1.1, "speedup_lo": 0.9, "speedup_hi": 1.4, "cells": 5, "tau": 1.9},
    }
    methods = [row("prompt_lookup", 0.0, 1.14, 1.02, 1.27, categories=categories, **extra)]
    methods.append(row("prompt_lookup", 1.0, 0.95, 0.85, 1.05, categories=categories, **extra))
    return {"cpu": "AMD EPYC", "plain": plain, "methods": methods, "disturbed": disturbed}


def test_the_report_shows_every_spread_and_what_it_means(tmp_path: Path) -> None:
    write_report(report_results([]), tmp_path)
    text = (tmp_path / "results.md").read_text()
    assert "paired bootstrap (2000 resamples, seed 0) over the (round, batch) cells" in text
    assert "| prompt_lookup | eager 2t | 0 | greedy | yes | 2.00 | 0.10 | 0.50 | 11.4 | 1.14x [1.02, 1.27] |" in text
    assert "| 1.30x n=1 (2.10) | 1.10x [0.90, 1.40] (1.90) |" in text  # per category: one cell says n=1
    assert "Verdict: at T=0 prompt_lookup (eager 2t) at 1.14x [1.02, 1.27] the fastest plain decoding" in text
    assert "at T=1 no method measurably faster" in text and "DISTURBED" not in text
    assert "T > 0" in text  # why plain decoding is slower when it samples
    assert json.loads((tmp_path / "results.json").read_text())["disturbed"] == []


def test_a_disturbed_report_says_so_in_its_header(tmp_path: Path) -> None:
    reason = "prompt_lookup (eager 2t) at T=0: efficiency 1.30 > 1 (speedup 2.60x at tau 2.00)"
    write_report(report_results([reason]), tmp_path)
    lines = (tmp_path / "results.md").read_text().splitlines()
    assert lines[0] == "CPU: AMD EPYC"  # the header's first line stays what readers parse
    assert lines[2].startswith("**DISTURBED RUN**") and lines[3] == f"- {reason}"
    verdict_line = next(line for line in lines if line.startswith("Verdict:"))
    assert "no winner named, the run was disturbed" in verdict_line


# ------------------------------------------------------------------------------------------- progress


def test_progress_logs_a_line_every_30_seconds_off_a_terminal(caplog: pytest.LogCaptureFixture) -> None:
    from rich.console import Console

    now = [0.0]
    console = Console(file=io.StringIO(), force_terminal=False)  # not a terminal: log lines instead of a bar
    caplog.set_level(logging.INFO, logger=rounds.__name__)
    with RoundsProgress(4, console=console, clock=lambda: now[0]) as progress:
        for seconds in (10.0, 25.0, 31.0, 70.0):
            now[0] = seconds
            progress.done("medusa_chain (eager 2t, T=0)", "round 1/1 batch 2/6", generation(8, 0.5))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2  # at 31 s and at 70 s (>= 30 s after the last line), none before
    assert lines[0] == (
        "benchmark: 3/4 calls, round 1/1 batch 2/6 · medusa_chain (eager 2t, T=0) 16.0 tok/s, about 0 min left"
    )
