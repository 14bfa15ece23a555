"""Cost-aware draft budgets: the pure model (verify/budget.py) on hand-computed numbers."""

import pytest

from verify.budget import best_chain, best_tree, expected_tokens_chain, extend_acceptance, interpolate_cost

ACCEPTANCE = [0.8, 0.6, 0.4, 0.2]  # cumulative: P(accepted >= 1), P(accepted >= 2), ...
FLAT = {1: 1.0, 64: 1.0}  # a forward costs 1 s whatever its width


def test_expected_tokens_chain_sums_cumulative_acceptance():
    assert expected_tokens_chain(ACCEPTANCE, 1) == pytest.approx(1.8)
    assert expected_tokens_chain(ACCEPTANCE, 2) == pytest.approx(2.4)
    assert expected_tokens_chain(ACCEPTANCE, 4) == pytest.approx(3.0)


def test_expected_tokens_chain_extrapolates_with_the_last_conditional_rate():
    # last conditional rate 0.4 / 0.8 = 0.5: positions 3 and 4 get 0.2 and 0.1
    assert extend_acceptance([0.8, 0.4], 4) == pytest.approx([0.8, 0.4, 0.2, 0.1])
    assert expected_tokens_chain([0.8, 0.4], 4) == pytest.approx(2.5)
    assert extend_acceptance([0.5], 3) == pytest.approx([0.5, 0.25, 0.125])  # one position: its own rate
    assert extend_acceptance([0.5, 0.0], 3) == [0.5, 0.0, 0.0]
    assert extend_acceptance([0.3, 0.4], 3) == pytest.approx([0.3, 0.4, 0.4])  # non-monotone noise: rate capped at 1


def test_cheap_drafting_picks_a_long_chain():
    gamma, table = best_chain(ACCEPTANCE, verify_cost=FLAT, draft_step_cost=0.01, draft_fixed_cost=0.0, max_gamma=4)
    assert gamma == 4
    assert [r["gamma"] for r in table] == [1, 2, 3, 4]
    assert table[3]["expected_tokens"] == pytest.approx(3.0)
    assert table[3]["seconds_per_step"] == pytest.approx(1.04)
    assert table[3]["tokens_per_s"] == pytest.approx(3.0 / 1.04)
    assert table[0]["tokens_per_s"] == pytest.approx(1.8 / 1.01)


def test_expensive_drafting_picks_gamma_one():
    gamma, table = best_chain(ACCEPTANCE, verify_cost=FLAT, draft_step_cost=1.0, draft_fixed_cost=0.0, max_gamma=4)
    assert gamma == 1
    assert table[0]["tokens_per_s"] == pytest.approx(0.9)  # 1.8 tokens / (1 s forward + 1 s draft)
    assert [r["tokens_per_s"] for r in table] == pytest.approx([0.9, 0.8, 0.7, 0.6])


def test_verify_cost_and_fixed_cost_shift_the_choice():
    # forwards grow steeply with width: C(k) = k seconds -> g = 1 (1.8 / 2 = 0.9 beats 2.4 / 3 = 0.8)
    steep = {1: 1.0, 2: 2.0}
    assert best_chain(ACCEPTANCE, verify_cost=steep, draft_step_cost=0.0, draft_fixed_cost=0.0, max_gamma=4)[0] == 1
    # a large fixed cost per step makes every step dearer, so the longest chain wins again
    gamma, table = best_chain(ACCEPTANCE, verify_cost=steep, draft_step_cost=0.0, draft_fixed_cost=100.0, max_gamma=4)
    assert gamma == 4 and table[3]["seconds_per_step"] == pytest.approx(105.0)


def test_interpolate_cost():
    costs = {2: 1.0, 4: 3.0, 8: 5.0}
    assert interpolate_cost(costs, 2) == 1.0
    assert interpolate_cost(costs, 3) == pytest.approx(2.0)
    assert interpolate_cost(costs, 6) == pytest.approx(4.0)
    assert interpolate_cost(costs, 1) == 1.0  # clamped below
    assert interpolate_cost(costs, 12) == pytest.approx(7.0)  # the last slope (0.5 s per token) continued
    assert interpolate_cost({1: 2.0, 2: 1.0}, 5) == 1.0  # a negative last slope is floored at 0
    assert interpolate_cost({3: 2.0}, 9) == 2.0  # one measurement: constant


def test_best_tree():
    cost = {1: 1.0, 5: 1.0, 17: 2.0}
    small = {"tree_nodes": 4, "depth": 3, "tau": 2.0, "draft_seconds_per_step": 0.5}
    large = {"tree_nodes": 16, "depth": 5, "tau": 3.0, "draft_seconds_per_step": 0.5}
    index, table = best_tree([small, large], verify_cost=cost)
    assert index == 0
    assert table[0]["tokens_per_s"] == pytest.approx(2.0 / 1.5)
    assert table[1]["tokens_per_s"] == pytest.approx(3.0 / 2.5)
    assert table[1]["depth"] == 5 and table[1]["seconds_per_step"] == pytest.approx(2.5)
    # a large overhead per step favours the tree that emits more tokens per step
    index, table = best_tree([{**small, "overhead_seconds_per_step": 10.0}, {**large, "overhead_seconds_per_step": 10.0}], verify_cost=cost)
    assert index == 1 and table[1]["tokens_per_s"] == pytest.approx(3.0 / 12.5)


@pytest.mark.parametrize("call, message", [
    (lambda: expected_tokens_chain([], 2), r"acceptance=\[\]"),
    (lambda: expected_tokens_chain([0.5], 0), "gamma=0: must be an integer >= 1"),
    (lambda: expected_tokens_chain([0.5, 1.5], 2), r"acceptance\[1\]=1.5"),
    (lambda: interpolate_cost({}, 2), "verify_cost={}"),
    (lambda: interpolate_cost({1: -0.1}, 2), r"verify_cost\[1\]=-0.1: must be .* > 0"),
    (lambda: interpolate_cost({0: 1.0}, 2), "verify_cost key k=0"),
    (lambda: interpolate_cost({1: 1.0}, 0), "k=0"),
    (lambda: best_chain([0.5], verify_cost=FLAT, draft_step_cost=-1.0, draft_fixed_cost=0.0, max_gamma=2), "draft_step_cost=-1.0"),
    (lambda: best_chain([0.5], verify_cost=FLAT, draft_step_cost=0.0, draft_fixed_cost=-1, max_gamma=2), "draft_fixed_cost=-1"),
    (lambda: best_chain([0.5], verify_cost=FLAT, draft_step_cost=0.0, draft_fixed_cost=0.0, max_gamma=0), "max_gamma=0"),
    (lambda: best_tree([], verify_cost=FLAT), r"candidates=\[\]"),
    (lambda: best_tree([{"tree_nodes": 4}], verify_cost=FLAT), r"candidates\[0\] lacks tau, draft_seconds_per_step"),
    (lambda: best_tree([{"tree_nodes": 0, "tau": 1.0, "draft_seconds_per_step": 0.0}], verify_cost=FLAT), "tree_nodes=0"),
    (lambda: best_tree([{"tree_nodes": 2, "tau": 0.0, "draft_seconds_per_step": 0.0}], verify_cost=FLAT), r"tau=0.0"),
    (lambda: best_tree([{"tree_nodes": 2, "tau": 1.0, "draft_seconds_per_step": -2.0}], verify_cost=FLAT), "draft_seconds_per_step=-2.0"),
])
def test_bad_inputs_raise_one_line_errors(call, message):
    with pytest.raises(ValueError, match=message) as info:
        call()
    assert "\n" not in str(info.value)
