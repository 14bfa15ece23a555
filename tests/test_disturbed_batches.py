"""The disturbed-run rule at every batch size and on small cells, through the benchmark's own rounds with
run_once faked (no model): a batched run whose time follows its longest rows is not flagged, one question per
category does not withhold the verdict (its cell only warns), a doctored speedup is flagged; and every figure
of a row comes from the rounds its median speedup takes (experiments/lib/methods/rounds.py middle_rounds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, OmegaConf

from experiments import benchmark as bench_mod
from experiments.lib.methods.rounds import middle_rounds
from experiments.lib.report.disturbed import MIN_CELL_TOKENS, forward_ratio, judge, too_small
from experiments.lib.report.results import write_report
from verify.loop.plain import Generation
from verify.loop.speculative import SpecConfig
from verify.loop.stats import DecodeStats

STEP = 0.01  # seconds of one target forward of the fake machine, whatever its width (v(k) = 1)
FLAT = {1: STEP, 8: STEP}  # the cost table such a machine measures


def batch_generation(tokens: list[int], forwards: list[int], seconds: float) -> Generation:
    """One decode call of len(tokens) rows: row r emits tokens[r] in forwards[r] target forwards."""
    stats = DecodeStats.zeros(len(tokens), torch.device("cpu"))
    stats.tokens += torch.tensor(tokens)
    stats.forwards += torch.tensor(forwards)
    stats.time_total = stats.time_target = seconds
    return Generation(tokens=[[7] * n for n in tokens], stats=stats)


def cfg_of(repeats: int) -> DictConfig:
    decode = dict(top_k=None, top_p=1.0, rule="auto", delta=0.0, max_new_tokens=128)
    return OmegaConf.create(dict(decode=decode, repeats=repeats, seed=3, budget="fixed"))


def setup_of(*names: str) -> dict:
    factories = {}
    for name in names:
        factories[name] = lambda: None
        factories[name].name = name
    target = type("FakeTarget", (), {"device": torch.device("cpu")})()
    return dict(threads=2, compiled=False, target=target, spec=SpecConfig(gamma=3), methods=factories)


def run(monkeypatch, fake, batches, labels, *, repeats=2, temperatures=(0.0,), names=("prompt_lookup",)):
    monkeypatch.setattr(bench_mod, "run_once", fake)
    cfg = cfg_of(repeats)
    return bench_mod.bench_temperatures(cfg, [setup_of(*names)], batches, list(temperatures), None, labels)


# ------------------------------------------------------------------------------------------ batch size > 1


def batched(speed: float = 1.0):
    """Rows of a batch write prompt[0] tokens each; the method drafts a 100-token row at tau 4 and any other at
    tau 1 (the brief's rows A and B). A call takes STEP per forward of its longest row; the method's forwards
    cost `speed` times as much (1.0: what the forwards allow, no drafting cost; below: impossible)."""

    def fake(target, factory, batch, *, sampling, spec, cfg, generator, eos_id):
        tokens = [p[0] for p in batch]
        if factory is None:
            return batch_generation(tokens, tokens, STEP * max(tokens))
        forwards = [n // 4 if n == 100 else n for n in tokens]
        return batch_generation(tokens, forwards, speed * STEP * max(forwards))

    return fake


BATCHES = [[[100], [30]], [[100], [30]], [[100], [30]], [[100], [30]]]  # batch_size 2, two categories
LABELS = ["coding", "coding", "qa", "qa"]


def test_a_batched_run_timed_by_its_longest_rows_is_not_disturbed(monkeypatch) -> None:
    """Plain decoding takes 100 forwards a batch, the method 30 (row B's): 3.33x at a pooled tau of 2.36, an
    efficiency of 1.41 over the pooled tau. By the longest rows' forwards it is exactly what they allow."""
    plains, rows = run(monkeypatch, batched(), BATCHES, LABELS)
    (row,) = rows
    assert row["speedup"] == pytest.approx(100 / 30) and row["tau"] == pytest.approx(130 / 55)
    assert row["speedup"] / row["tau"] > 1.4  # what the old rule called impossible
    assert (row["call_forwards"], row["plain_call_forwards"]) == (2 * 4 * 30, 2 * 4 * 100)  # 2 rounds x 4 calls
    assert forward_ratio(row) == pytest.approx(100 / 30)
    qa = row["categories"]["qa"]
    assert (qa["prompts"], qa["tokens"], qa["rounds"], qa["call_forwards"]) == (4, 2 * 260, 2, 2 * 2 * 30)
    assert judge(plains, rows, lambda r: FLAT) == ([], [])
    assert plains[0]["tokens"] / plains[0]["call_forwards"] == pytest.approx(1.3)  # the step check per forward


def test_the_report_compares_a_batch_verification_with_a_plain_step_not_a_token(monkeypatch, tmp_path) -> None:
    """verify/step: the method's target seconds per step over plain decoding's per step of the batch (1.3
    tokens a step here), not per token: 30 forwards in 29 steps at one plain step each, 1.03, not 1.34."""
    plains, rows = run(monkeypatch, batched(), BATCHES, LABELS)
    for r in plains + rows:
        r |= dict(repeat4=0.1, warmup_s=0.1)
    rows[0] |= dict(rule="greedy", lossless=True, exact=True, alpha=0.5, acceptance_by_position=[0.5])
    write_report({"cpu": "AMD EPYC", "plain": plains, "methods": rows, "disturbed": []}, tmp_path)
    line = next(x for x in (tmp_path / "results.md").read_text().splitlines() if x.startswith("| prompt_lookup"))
    assert line.split("|")[12].strip() == f"{30 / 29:.2f}"


def test_a_doctored_batched_speedup_is_flagged(monkeypatch) -> None:
    """The same method timed at half what its forwards allow (6.67x where 3.33x is the most): disturbed."""
    plains, rows = run(monkeypatch, batched(speed=0.5), BATCHES, LABELS)
    reasons, warnings = judge(plains, rows, lambda r: FLAT)
    assert reasons[0] == (
        "prompt_lookup (eager 2t) at T=0: efficiency 2.00 > 1 (speedup 6.67x at tau 3.33 by the longest rows' "
        "forwards (pooled tau 2.36))"
    )
    assert len(reasons) == 3 and warnings == []  # the run, and each category (4 questions, 260 tokens a round)


def test_with_a_cost_table_the_bound_divides_the_forward_ratio_by_the_verify_cost(monkeypatch) -> None:
    """A 4-token verification that costs 2 steps (a table measured at the run's batch size): at most 1.67x."""
    costs = {1: STEP, 4: 2 * STEP}
    plains, rows = run(monkeypatch, batched(), BATCHES, LABELS)
    rows = [{**r, "verify_width": 4} for r in rows]
    reasons, _ = judge(plains, rows, lambda r: costs)
    assert reasons[0] == (
        "prompt_lookup (eager 2t) at T=0: speedup 3.33x above its bound 1.67x = max(1, tau 3.33 by the longest "
        "rows' forwards (pooled tau 2.36) / verify cost 2.00)"
    )


# ----------------------------------------------------------------------------- one question per category

CATEGORIES = [f"c{i}" for i in range(12)] + ["qa"]


def one_per_category(stall: float):
    """13 questions, one per category, 32 tokens each, batch 1: the method at tau 2 with drafting at 0.6 of a
    step (1.25x); plain decoding's call on qa stalled `stall` times (a scheduler stall, on a quiet machine)."""

    def fake(target, factory, batch, *, sampling, spec, cfg, generator, eos_id):
        category = CATEGORIES[batch[0][0]]
        if factory is None:
            return batch_generation([32], [32], 32 * STEP * (stall if category == "qa" else 1.0))
        return batch_generation([32], [16], 16 * 1.6 * STEP)

    return fake


def test_one_question_per_category_warns_but_keeps_the_verdict(monkeypatch, tmp_path: Path) -> None:
    batches, labels = [[[i]] for i in range(13)], CATEGORIES
    plains, rows = run(monkeypatch, one_per_category(stall=2.5), batches, labels)
    (row,) = rows
    qa = row["categories"]["qa"]
    assert qa["speedup"] == pytest.approx(3.125) and qa["prompts"] == 1 and too_small(qa) == "1 question"
    reasons, warnings = judge(plains, rows, lambda r: FLAT)
    assert reasons == []  # the run's own figure, 1.39x at tau 2, is sound
    assert warnings == [
        "prompt_lookup (eager 2t) at T=0 on qa: efficiency 1.56 > 1 (speedup 3.12x at tau 2.00); not judged: "
        "1 question, too small to tell load from noise"
    ]
    results = {"cpu": "AMD EPYC", "plain": plains, "methods": rows, "disturbed": reasons}
    results["disturbed_warnings"] = warnings
    for r in plains + rows:
        r |= dict(repeat4=0.1, warmup_s=0.1)
    rows[0] |= dict(rule="greedy", lossless=True, exact=True, alpha=0.5, acceptance_by_position=[0.5])
    write_report(results, tmp_path)
    text = (tmp_path / "results.md").read_text()
    assert "DISTURBED" not in text and f"under {MIN_CELL_TOKENS} tokens a round are not judged" in text
    verdict = next(line for line in text.splitlines() if line.startswith("Verdict:"))
    assert verdict.startswith("Verdict: at T=0 prompt_lookup (eager 2t) at 1.39x [")
    assert json.loads((tmp_path / "results.json").read_text())["disturbed_warnings"] == warnings


def test_a_cell_under_the_token_threshold_only_warns_and_a_large_one_is_judged() -> None:
    cell = dict(speedup=3.0, tau=2.0, prompts=4, tokens=2 * 100, rounds=2)  # 100 tokens a round
    row = dict(name="m", temperature=0.0, threads=2, compiled=False, speedup=1.2, tau=2.0, categories={"x": cell})
    plain = dict(temperature=0.0, threads=2, compiled=False)
    reasons, (warning,) = judge([plain], [row])
    assert reasons == [] and warning.endswith("not judged: 100 tokens a round, too small to tell load from noise")
    big = {**cell, "tokens": 2 * MIN_CELL_TOKENS}
    (reason,) = judge([plain], [{**row, "categories": {"x": big}}])[0]
    assert reason == "m (eager 2t) at T=0 on x: efficiency 1.50 > 1 (speedup 3.00x at tau 2.00)"


def test_a_cell_decoded_in_one_call_a_round_only_warns_and_two_calls_are_judged() -> None:
    """At batch 4 a category of four questions is one batch: one call a round, as exposed to a stall as one
    question (seen: 4.0x against a bound of 1.88 in one round of a loaded batch-4 run)."""
    cell = dict(speedup=3.0, tau=2.0, prompts=4, tokens=2 * 4 * 64, rounds=2, calls=2)  # one call a round
    row = dict(name="m", temperature=0.0, threads=2, compiled=False, speedup=1.2, tau=2.0, categories={"x": cell})
    plain = dict(temperature=0.0, threads=2, compiled=False)
    reasons, (warning,) = judge([plain], [row])
    assert reasons == [] and "not judged: one decode call a round" in warning
    (reason,) = judge([plain], [{**row, "categories": {"x": {**cell, "calls": 4}}}])[0]
    assert reason.startswith("m (eager 2t) at T=0 on x: efficiency 1.50 > 1")


# ------------------------------------------------------------------------------ the rounds a row comes from


def test_middle_rounds_are_the_rounds_the_median_takes() -> None:
    assert middle_rounds([3.0]) == [0]
    assert middle_rounds([2.0, 1.0, 3.0]) == [0]
    assert middle_rounds([4.0, 1.0, 3.0, 2.0]) == [2, 3]  # the median 2.5 is the mean of rounds 3 and 2
    assert middle_rounds([1.0, 2.0]) == [0, 1]
    with pytest.raises(ValueError, match=r"values=\[\]: a median needs at least one round"):
        middle_rounds([])


def by_round(target, factory, batch, *, sampling, spec, cfg, generator, eos_id):
    """Round r (seed 3 + r) drafts at tau 2 + 2r: 16 tokens in 8, 4, 2 forwards; plain decoding 16 in 16."""
    r = generator.initial_seed() - 3
    if factory is None:
        return batch_generation([16], [16], 16 * STEP)
    forwards = 16 // (2 + 2 * r)
    return batch_generation([16], [forwards], forwards * STEP)


@pytest.mark.parametrize(("repeats", "tau"), [(2, 32 / 12), (3, 4.0)])
def test_speedup_and_tau_come_from_the_same_rounds(monkeypatch, repeats: int, tau: float) -> None:
    """Two rounds at tau 2 and 4 (2x and 4x): the speedup 3.0 is their mean, so the tau is theirs pooled (32
    tokens in 12 forwards), not one round's. Three rounds: the middle round's, tau 4 at 4x."""
    _, (row,) = run(monkeypatch, by_round, [[[0]]], ["x"], repeats=repeats, temperatures=(1.0,))
    assert row["speedup"] == pytest.approx(3.0 if repeats == 2 else 4.0)
    assert row["tau"] == pytest.approx(tau) and row["efficiency"] == pytest.approx(row["speedup"] / tau)
    assert row["rounds"] == (2 if repeats == 2 else 1) and row["tokens"] == 16 * row["rounds"]
