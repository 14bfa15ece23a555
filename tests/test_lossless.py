"""Statistical losslessness: speculative sampling must emit exactly the target's distribution.

Each trial is one row of a large batch (all rows share one prompt), so thousands of seeded trials run
in one call of the real loop. The empirical joint distribution of the first three emitted tokens is
compared with the exact target distribution (enumerated) by a chi-square goodness-of-fit test at
significance 0.001. The negative control (delta = 0.5, known to be biased) must be rejected by the
same test, so the test has the power to see a loss.
"""

import itertools
import math

import pytest
import torch

from prophet.drafter import ProphetDrafter
from prophet.model import Prophet
from tests.conftest import make_lm
from verify.backends.target import Target
from verify.drafters.draft_model import DraftModelDrafter
from verify.drafters.prompt_lookup import PromptLookupDrafter
from verify.loop.sampling import SamplingConfig, probs_from_logits
from verify.loop.speculative import SpecConfig, speculative_generate

VOCAB, NEW, TRIALS, PROMPT = 6, 3, 20_000, [1, 2, 3, 1, 2]
Z_999 = 3.0902  # standard normal quantile for significance 0.001


def sharp_lm(seed: int, scale: float = 2.0):
    # Random small weights give near-uniform distributions; sharpen them so p and q differ visibly
    # (measured: acceptance 0.3-0.5, 60-170 degrees of freedom after pooling).
    # A context of 16 (a prompt of 5 and 4 new tokens fit): the caches of 20,000 rows are sized by it.
    model = make_lm(num_tokens=VOCAB, dim=16, depth=1, seed=seed, max_seq_len=16)
    with torch.no_grad():
        model.to_logits.weight.mul_(scale)
    return model


def exact_joint(lm, sampling: SamplingConfig) -> dict[tuple, float]:
    """p(x1, x2, x3 | prompt) under the sampling transform, by enumerating every prefix in one forward."""
    prefixes = list(itertools.product(range(VOCAB), repeat=NEW - 1))
    logits = lm(torch.tensor([PROMPT + list(pre) for pre in prefixes]))[:, len(PROMPT) - 1 :]
    p = probs_from_logits(logits, sampling)  # (prefixes, NEW, V)
    joint = {}
    for row, pre in enumerate(prefixes):
        for last in range(VOCAB):
            seq = pre + (last,)
            joint[seq] = math.prod(float(p[row, i, t]) for i, t in enumerate(seq))
    return joint


def chi_square(samples: list[list[int]], joint: dict[tuple, float]) -> tuple[float, float]:
    """Chi-square statistic and its 0.001 critical value (Wilson-Hilferty), pooling cells with expected < 5."""
    counts = {}
    for s in samples:
        counts[tuple(s)] = counts.get(tuple(s), 0) + 1
    n = len(samples)
    stat, pooled_obs, pooled_exp, cells = 0.0, 0.0, 0.0, 0
    for cell, prob in joint.items():
        obs, exp = counts.get(cell, 0), prob * n
        if exp < 5:
            pooled_obs, pooled_exp = pooled_obs + obs, pooled_exp + exp
            continue
        stat, cells = stat + (obs - exp) ** 2 / exp, cells + 1
    if pooled_exp > 0:
        stat, cells = stat + (pooled_obs - pooled_exp) ** 2 / pooled_exp, cells + 1
    assert sum(counts.values()) == n and all(len(s) == NEW for s in samples)
    dof = cells - 1
    critical = dof * (1 - 2 / (9 * dof) + Z_999 * math.sqrt(2 / (9 * dof))) ** 3
    return stat, critical


def run(drafter, sampling: SamplingConfig, *, delta: float = 0.0, gamma: int = 2, seed: int = 0, dtype=torch.float32):
    target_lm = sharp_lm(0).to(dtype)
    target = Target(target_lm)
    out = speculative_generate(
        target,
        drafter,
        [PROMPT] * TRIALS,
        max_new_tokens=NEW + 1,  # the first step may draft gamma deep
        spec=SpecConfig(gamma=gamma, delta=delta),
        sampling=sampling,
        generator=torch.Generator().manual_seed(seed),
    )
    # fp32: the model's own forward; bf16: the target itself (its lean engine rounds otherwise than the module's
    # forward, and losslessness is relative to the target in the precision it decodes in)
    forward = target_lm if dtype == torch.float32 else (lambda x: Target(target_lm).prefill(x.tolist()).logits)
    return chi_square([t[:NEW] for t in out.tokens], exact_joint(forward, sampling)), out.stats


def eagle_prophet(seed: int):
    """EAGLE-1's draft layer (prophet/eagle.py) on a copy of the target, with weights drawn so its q is far from p."""
    prophet = Prophet.from_base(sharp_lm(0), arch="eagle", heads=4)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in prophet.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * param.shape[-1] ** -0.5 + (param.ndim == 1))
    return prophet.eval()


CASES = {
    "draft_model_t1": (lambda: DraftModelDrafter(sharp_lm(1)), SamplingConfig(temperature=1.0)),
    "draft_model_t07_topk4": (lambda: DraftModelDrafter(sharp_lm(1)), SamplingConfig(temperature=0.7, top_k=4)),
    "draft_model_topp": (lambda: DraftModelDrafter(sharp_lm(1)), SamplingConfig(temperature=1.0, top_p=0.9)),  # slow
    "deterministic_drafter": (lambda: PromptLookupDrafter(vocab_size=VOCAB), SamplingConfig(temperature=1.0)),
    "eagle_chain_t1": (lambda: ProphetDrafter(eagle_prophet(2), mode="chain"), SamplingConfig(temperature=1.0)),
    "eagle_tree_t1": (
        lambda: ProphetDrafter(eagle_prophet(3), mode="tree", top_k=2, depth=2, tree_nodes=4),
        SamplingConfig(temperature=1.0),
    ),
}


# Top-p in the slow tier: the fast tier keeps temperature with top-k through the same sampling transform.
SLOW = {"draft_model_topp"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if c in SLOW else []) for c in CASES])
def test_speculative_sampling_reproduces_the_target_distribution(case):
    make, sampling = CASES[case]
    (stat, critical), stats = run(make(), sampling)
    assert 0 < stats.alpha < 1  # both acceptance and rejection were exercised
    assert stat < critical, f"chi2 {stat:.1f} >= critical {critical:.1f}: the output is not the target's distribution"


# bf16's negative control (delta=0.5) is slow; the fast tier's is fp32's (test_negative_control_delta_is_detected)
@pytest.mark.parametrize("delta", [0.0, pytest.param(0.5, marks=pytest.mark.slow)])
def test_bf16_speculative_sampling_reproduces_the_bf16_target(delta):
    """dtype=bf16: the target and the drafter in bf16; the output must follow the bf16 target's distribution,
    and the biased rule (delta=0.5) must still be caught, in bf16 too."""
    drafter = DraftModelDrafter(sharp_lm(1).to(torch.bfloat16))
    (stat, critical), stats = run(drafter, SamplingConfig(temperature=1.0), delta=delta, dtype=torch.bfloat16)
    assert 0 < stats.alpha < 1
    assert (stat < critical) == (delta == 0.0), f"delta={delta}: chi2 {stat:.1f} vs critical {critical:.1f}"


def test_negative_control_delta_is_detected():
    make, sampling = CASES["draft_model_t1"]
    (stat, critical), _ = run(make(), sampling, delta=0.5)
    assert stat > critical, (
        f"the biased rule (delta=0.5) passed: chi2 {stat:.1f} < {critical:.1f}; the test has no power"
    )
