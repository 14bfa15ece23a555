"""Plain decoding (the baseline and the reference) and the one sampling transform."""

import math

import pytest
import torch
from x_transformers import AutoregressiveWrapper

from verify.backends.target import Target
from verify.loop.plain import plain_generate
from verify.loop.sampling import SamplingConfig, probs_from_logits, sample_from_probs


def test_greedy_equals_x_transformers_generate(lm):
    prompt = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(3))
    ours = plain_generate(Target(lm), prompt.tolist(), max_new_tokens=40).tokens[0]
    ref = AutoregressiveWrapper(lm).generate(prompt, 40, temperature=0.0, cache_kv=True)[0].tolist()
    assert ours == ref


def test_ragged_batch_rows_equal_rows_alone(lm):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]
    batch = plain_generate(Target(lm), prompts, max_new_tokens=20).tokens
    alone = [plain_generate(Target(lm), [p], max_new_tokens=20).tokens[0] for p in prompts]
    assert batch == alone


def test_eos_stops_each_row_and_is_emitted(lm):
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    free = plain_generate(Target(lm), prompts, max_new_tokens=20).tokens
    eos = free[0][5]  # a token row 0 emits at step 6
    out = plain_generate(Target(lm), prompts, max_new_tokens=20, eos_id=eos)
    for row, full in zip(out.tokens, free):
        cut = full.index(eos) + 1 if eos in full else len(full)
        assert row == full[:cut]
    assert out.stats.tokens.tolist() == [len(r) for r in out.tokens]
    assert out.stats.tau == 1.0


def test_a_list_of_eos_ids_stops_each_row_at_its_first_one(lm):
    # transformers takes eos_token_id as an int or a list; a list used to be compared with == and ignored
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    free = plain_generate(Target(lm), prompts, max_new_tokens=20).tokens
    eos = [free[0][5], free[1][3]]
    out = plain_generate(Target(lm), prompts, max_new_tokens=20, eos_id=eos)
    for row, full in zip(out.tokens, free):
        cut = min([full.index(e) + 1 for e in eos if e in full], default=len(full))
        assert row == full[:cut]
    assert [len(r) for r in out.tokens] != [20, 20]
    assert out.stats.tokens.tolist() == [len(r) for r in out.tokens]
    assert (
        plain_generate(Target(lm), prompts, max_new_tokens=20, eos_id=(eos[0],)).tokens
        == plain_generate(Target(lm), prompts, max_new_tokens=20, eos_id=eos[0]).tokens
    )


@pytest.mark.parametrize("eos_id", [[], [1, 97], 97, -1, True, [True], "1", 1.0, [1, None], torch.tensor(1)], ids=repr)
def test_bad_eos_ids_are_one_line_errors_before_the_prefill(lm, eos_id):
    target = Target(lm)
    target.prefill = None  # a check after the prefill would fail here with a TypeError
    with pytest.raises(ValueError) as excinfo:
        plain_generate(target, [[1, 2, 3]], max_new_tokens=4, eos_id=eos_id)
    assert str(excinfo.value) == (
        f"eos_id={eos_id!r}: must be null, a token id or a non-empty list of token ids in [0, 97)"
    )
    assert "\n" not in str(excinfo.value)


@pytest.mark.parametrize("n", [1, 2])
def test_tiny_budgets(lm, n):
    out = plain_generate(Target(lm), [[1, 2, 3]], max_new_tokens=n)
    assert len(out.tokens[0]) == n
    assert int(out.stats.forwards[0]) == n


def test_budget_past_max_seq_len_is_rejected(lm):
    with pytest.raises(ValueError, match="max_seq_len"):
        plain_generate(Target(lm), [[1] * 90], max_new_tokens=7)  # 90 + 7 > 96
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        plain_generate(Target(lm), [[1]], max_new_tokens=0)


def test_sampling_is_seeded_and_varies(lm):
    cfg = SamplingConfig(temperature=1.0)
    run = lambda seed: plain_generate(  # noqa: E731
        Target(lm), [[1, 2, 3]], max_new_tokens=15, sampling=cfg, generator=torch.Generator().manual_seed(seed)
    ).tokens[0]
    assert run(0) == run(0)
    assert run(0) != run(1)


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    p = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([0.5, 0.2, 0, 0, 0]) / 0.7)
    p = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_p=0.8))  # 0.5+0.2 < 0.8 <= 0.85
    assert torch.allclose(p, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    p = probs_from_logits(logits, SamplingConfig(temperature=1.0, top_p=0.01))
    assert p.tolist() == [1.0, 0, 0, 0, 0]
    p = probs_from_logits(logits, SamplingConfig(temperature=0.0))
    assert p.tolist() == [1.0, 0, 0, 0, 0]
    hot = probs_from_logits(logits, SamplingConfig(temperature=2.0))
    assert torch.allclose(hot, torch.softmax(logits / 2, -1))


def test_sample_from_probs_matches_distribution():
    # 40k draws from a 5-token distribution; chi-square at significance 0.001 (4 dof: 18.47).
    p = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    draws = sample_from_probs(p.expand(40_000, 5), torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=5).double()
    expected = p.double() * 40_000
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.47
    assert not math.isnan(chi2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.1}, "temperature=-0.1"),
        ({"top_k": 0}, "top_k=0"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_p": 1.5}, "top_p=1.5"),
    ],
)
def test_bad_sampling_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)
