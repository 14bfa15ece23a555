"""Cost-aware draft budgets: pick the chain length or tree size that maximises predicted tokens/s.

A verification step emits E tokens (accepted drafts plus the target's own token) and costs

    seconds per step = C(k + 1) + draft seconds + fixed seconds

where C(n) is one target forward over n new tokens (the pending token plus k draft tokens), measured
on this machine (experiments/lib/methods/calibrate.py). Decoding N tokens takes N / E steps plus a prefill that
does not depend on the budget, so the budget with the most E / seconds-per-step decodes fastest.

Pure functions: no timing, no I/O. Units: seconds, tokens; k counts new tokens in one forward.
"""

from __future__ import annotations

import math


def _check_gamma(gamma: object, name: str = "gamma") -> int:
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"{name}={gamma!r}: must be an integer >= 1")
    return gamma


def _check_seconds(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}={value!r}: must be a finite number of seconds >= 0")
    return float(value)


def _check_acceptance(acceptance: list[float]) -> list[float]:
    if len(acceptance) == 0:
        raise ValueError("acceptance=[]: need P(accepted >= i + 1) for at least one position i")
    for i, a in enumerate(acceptance):
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1:
            raise ValueError(f"acceptance[{i}]={a!r}: must be a probability in [0, 1]")
    return [float(a) for a in acceptance]


def _check_costs(costs: dict[int, float]) -> dict[int, float]:
    if len(costs) == 0:
        raise ValueError("verify_cost={}: need the measured seconds of at least one forward size k")
    for k, s in costs.items():
        _check_gamma(k, "verify_cost key k")
        # A forward never takes zero time; a zero would make the predicted tokens/s infinite.
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
            raise ValueError(f"verify_cost[{k}]={s!r}: must be a finite number of seconds > 0")
    return {int(k): float(s) for k, s in sorted(costs.items())}


def extend_acceptance(acceptance: list[float], gamma: int) -> list[float]:
    """Cumulative acceptance (P(accepted >= i + 1) for i < gamma) from a measured prefix of it.

    Positions past the measured ones decay geometrically with the LAST measured conditional rate
    P(accepted >= n | accepted >= n - 1) = a[n-1] / a[n-2] (a[0] when one position was measured).
    That rate comes from the fewest samples, and it is an assumption that deeper positions are not
    easier than the deepest one measured; callers that can measure every position should."""
    a = _check_acceptance(acceptance)
    _check_gamma(gamma)
    if gamma <= len(a):
        return a[:gamma]
    if len(a) == 1:
        rate = a[0]
    else:
        rate = a[-1] / a[-2] if a[-2] > 0 else 0.0
    rate = min(max(rate, 0.0), 1.0)  # measured counts can be slightly non-monotone
    out = list(a)
    while len(out) < gamma:
        out.append(out[-1] * rate)
    return out


def expected_tokens_chain(acceptance: list[float], gamma: int) -> float:
    """Expected tokens per verification step of a chain of `gamma` drafts: 1 + sum_{i<gamma} a[i].

    acceptance[i] is the cumulative P(accepted >= i + 1), so its sum over positions is the expected
    number of accepted drafts; the 1 is the token the target adds. Positions past the measured ones
    are extrapolated by `extend_acceptance` (a geometric decay)."""
    return 1.0 + sum(extend_acceptance(acceptance, gamma))


def interpolate_cost(costs: dict[int, float], k: int) -> float:
    """Seconds of a target forward over k new tokens, from measured costs {k: seconds}.

    Linear between measured sizes. Below the smallest it is clamped (a smaller forward is not cheaper
    than fixed per-forward work); above the largest it continues the slope of the last two measured
    sizes, floored at 0 (timing noise can make that slope negative)."""
    table = _check_costs(costs)
    _check_gamma(k, "k")
    ks = list(table)
    if k in table:
        return table[k]
    if k < ks[0]:
        return table[ks[0]]
    if k > ks[-1]:
        if len(ks) == 1:
            return table[ks[0]]
        k0, k1 = ks[-2], ks[-1]
        slope = max((table[k1] - table[k0]) / (k1 - k0), 0.0)
        return table[k1] + slope * (k - k1)
    hi = next(i for i, kk in enumerate(ks) if kk > k)
    k0, k1 = ks[hi - 1], ks[hi]
    return table[k0] + (table[k1] - table[k0]) * (k - k0) / (k1 - k0)


def best_chain(
    acceptance: list[float],
    *,
    verify_cost: dict[int, float],
    draft_step_cost: float,
    draft_fixed_cost: float,
    max_gamma: int,
) -> tuple[int, list[dict]]:
    """The chain length g in 1..max_gamma with the most predicted tokens/s, and the table behind it.

    tokens/s(g) = expected_tokens_chain(acceptance, g) / (C(g + 1) + g * draft_step_cost + draft_fixed_cost)
    draft_step_cost: seconds per drafted token; draft_fixed_cost: seconds per step that do not grow
    with g (e.g. the loop's bookkeeping). Ties go to the shorter chain.
    Returns (gamma, rows), one row per g: {gamma, expected_tokens, seconds_per_step, tokens_per_s}."""
    _check_acceptance(acceptance)
    _check_costs(verify_cost)
    step = _check_seconds(draft_step_cost, "draft_step_cost")
    fixed = _check_seconds(draft_fixed_cost, "draft_fixed_cost")
    _check_gamma(max_gamma, "max_gamma")
    rows = []
    for g in range(1, max_gamma + 1):
        tokens = expected_tokens_chain(acceptance, g)
        seconds = interpolate_cost(verify_cost, g + 1) + g * step + fixed
        rows.append(
            {"gamma": g, "expected_tokens": tokens, "seconds_per_step": seconds, "tokens_per_s": tokens / seconds}
        )
    best = max(rows, key=lambda r: r["tokens_per_s"])  # max keeps the first of equal values
    return best["gamma"], rows


def best_tree(candidates: list[dict], *, verify_cost: dict[int, float]) -> tuple[int, list[dict]]:
    """The tree candidate with the most predicted tokens/s, and the table behind it.

    Each candidate has tree_nodes (draft nodes verified per step), tau (measured tokens per
    verification step), draft_seconds_per_step, and optionally overhead_seconds_per_step (0 if
    absent); other keys are copied into its row. Unlike a chain, a tree's tau is measured, not
    modelled: acceptance on a tree depends on its shape, not only on per-position rates.

    tokens/s = tau / (C(tree_nodes + 1) + draft_seconds_per_step + overhead_seconds_per_step)
    Returns (index into candidates, rows), one row per candidate with seconds_per_step and tokens_per_s
    added. Ties go to the earlier candidate."""
    if len(candidates) == 0:
        raise ValueError("candidates=[]: need at least one tree candidate")
    _check_costs(verify_cost)
    rows = []
    for i, c in enumerate(candidates):
        missing = [key for key in ("tree_nodes", "tau", "draft_seconds_per_step") if key not in c]
        if missing:
            raise ValueError(
                f"candidates[{i}] lacks {', '.join(missing)}: each needs tree_nodes, tau, draft_seconds_per_step"
            )
        nodes = _check_gamma(c["tree_nodes"], f"candidates[{i}].tree_nodes")
        tau = c["tau"]
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau <= 0:
            raise ValueError(f"candidates[{i}].tau={tau!r}: must be a finite number of tokens per step > 0")
        draft = _check_seconds(c["draft_seconds_per_step"], f"candidates[{i}].draft_seconds_per_step")
        overhead = _check_seconds(c.get("overhead_seconds_per_step", 0.0), f"candidates[{i}].overhead_seconds_per_step")
        seconds = interpolate_cost(verify_cost, nodes + 1) + draft + overhead
        rows.append({**c, "seconds_per_step": seconds, "tokens_per_s": float(tau) / seconds})
    best = max(range(len(rows)), key=lambda i: rows[i]["tokens_per_s"])
    return best, rows
