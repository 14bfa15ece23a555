"""Trimmed drafter vocabularies and Medusa's stacked heads.

The subset helpers on hand-made numbers; every drafter with a subset: greedy output identical to plain
decoding, drafts and q never outside the subset, the same drafts as the untrimmed drafter with the
logits outside the subset masked away; chi-square losslessness at temperature 1 with a subset that
leaves out tokens the target gives most of its probability, and a negative control (q not zero outside
the subset) that the same test rejects. Stacked Medusa heads equal the heads' own forward.
"""

import pytest
import torch
from torch import nn

from experiments.lib.data.id_cache import PreparedData
from experiments.lib.data.pipeline import token_counts
from medusa import drafter as medusa_drafter
from medusa import train as medusa_train
from medusa.drafter import MedusaDrafter
from medusa.heads import MedusaHeads
from prophet import block_drafter, block_train
from prophet import drafter as prophet_drafter
from prophet.drafter import ProphetDrafter
from prophet.model import Prophet
from tests.conftest import make_lm
from tests.test_lossless import PROMPT, VOCAB, sharp_lm
from tests.test_lossless import run as run_lossless
from verify.backends.target import Target, TargetOutput
from verify.common.vocab import check_vocab, expand_probs, frequent_tokens, full_ids, subset_logits, trim_linear
from verify.drafters.draft_model import DraftModelDrafter
from verify.loop.drafter import Draft
from verify.loop.plain import plain_generate
from verify.loop.sampling import SamplingConfig, probs_from_logits, sample_from_probs
from verify.loop.speculative import SpecConfig, speculative_generate

V = 97
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4]]
EVEN = torch.arange(0, V, 2)  # a subset that misses about half of what the models would draft
SMALL_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------- helpers


def test_frequent_tokens_picks_the_most_frequent_ids_sorted():
    counts = torch.tensor([5, 0, 9, 9, 1, 3])
    assert frequent_tokens(counts, 3).tolist() == [0, 2, 3]
    assert frequent_tokens(counts, 4).tolist() == [0, 2, 3, 5]
    assert frequent_tokens(torch.tensor([2, 2, 2, 1]), 2).tolist() == [0, 1]  # ties: the lower ids
    assert (
        frequent_tokens(counts, None) is None
        and frequent_tokens(counts, 6) is None
        and frequent_tokens(counts, 99) is None
    )


@pytest.mark.parametrize("n", [0, -3, 2.5, True, "4"])
def test_frequent_tokens_rejects_bad_sizes_in_one_line(n):
    with pytest.raises(ValueError, match=f"n={n!r}") as err:
        frequent_tokens(torch.tensor([1, 2, 3]), n)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "ids, match",
    [
        (torch.tensor([3, 1]), "sorted and distinct"),
        (torch.tensor([1, 1]), "sorted and distinct"),
        (torch.tensor([0, 6]), r"span \[0, 6\]: must lie in \[0, 6\)"),
        (torch.tensor([-1, 2]), "span"),
        (torch.tensor([], dtype=torch.long), "non-empty"),
        (torch.tensor([0.0, 1.0]), "non-empty 1-D tensor of token ids"),
        ([0, 1], "non-empty 1-D tensor"),
    ],
)
def test_check_vocab_rejects_bad_subsets_in_one_line(ids, match):
    with pytest.raises(ValueError, match=match) as err:
        check_vocab(ids, 6)
    assert "\n" not in str(err.value)


def test_trim_expand_and_map_back():
    layer = nn.Linear(4, 6)
    ids = torch.tensor([1, 4, 5])
    weight, bias = trim_linear(layer, ids)
    x = torch.randn(2, 4)
    assert weight.shape == (3, 4) and bias.shape == (3,) and weight.is_contiguous()
    assert torch.allclose(nn.functional.linear(x, weight, bias), subset_logits(layer(x), ids), atol=1e-6)
    assert trim_linear(nn.Linear(4, 6, bias=False), ids)[1] is None
    q = torch.tensor([[0.25, 0.25, 0.5]])
    assert expand_probs(q, ids, 6).tolist() == [[0, 0.25, 0, 0, 0.25, 0.5]]
    assert full_ids(torch.tensor([[2, 0], [1, 1]]), ids).tolist() == [[5, 1], [4, 4]]
    assert expand_probs(q, None, 6) is q and full_ids(ids, None) is ids and subset_logits(x, None) is x


def test_token_counts_count_the_training_split_only():
    data = PreparedData(
        tokenizer=None,
        train_ids=torch.tensor([0, 3, 3, 5, 0, 3]),
        val_ids=torch.tensor([1, 1, 1]),
        train_bytes=6,
        val_bytes=3,
        eos_id=0,
        vocab_size=7,
        val_files=[],
        cache_key="x",
    )
    assert token_counts(data, 7).tolist() == [2, 0, 0, 3, 0, 1, 0]
    assert frequent_tokens(token_counts(data, 7), 2).tolist() == [0, 3]
    with pytest.raises(ValueError, match="vocab_size=5: must exceed the largest training id 5"):
        token_counts(data, 5)


# ------------------------------------------------------------------------------------------- stacked Medusa heads


def perturb(module: nn.Module, seed: int, scale: float = 0.2) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return module


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("vocab", [None, EVEN])
def test_stacked_heads_equal_the_heads_forward(share, layers, bias, vocab):
    torch.manual_seed(0)
    projection = perturb(nn.Linear(32, V, bias=bias), seed=5)
    heads = perturb(
        MedusaHeads(projection=projection, num_heads=3, num_layers=layers, share_base_projection=share), seed=1
    )
    stacked = heads.stacked(vocab)
    assert stacked.block_weight.shape == (3, layers, 32, 32) and stacked.block_bias.shape == (3, layers, 32)
    n = V if vocab is None else len(vocab)
    assert stacked.proj_weight.shape == ((n, 32) if share else (3, n, 32))
    hidden = torch.randn(5, 32)
    expected = heads(hidden[:, None])[:, 0]  # (b, K, V)
    if vocab is not None:
        expected = expected[..., vocab]
    got = stacked(hidden)
    assert got.shape == (5, 3, n)
    assert (got - expected).abs().max() < 1e-5


def test_stacked_heads_load_from_a_checkpoint_of_the_heads():
    base = make_lm(dim=32)
    heads = perturb(MedusaHeads.from_base(base, num_heads=2, num_layers=1), seed=0)
    rebuilt = MedusaHeads.from_base(base, num_heads=2, num_layers=1)
    rebuilt.load_state_dict(heads.state_dict())  # the format is unchanged
    hidden = torch.randn(3, 32)
    assert torch.equal(rebuilt.stacked()(hidden), heads.stacked()(hidden))


# ------------------------------------------------------------------------------------------- drafters with a subset


class SubsetSpy:
    """Wraps a drafter: checks that every proposal stays inside the subset (tokens and q) and records it."""

    def __init__(self, inner, ids):
        self.inner, self.vocab_size, self.drafts = inner, inner.vocab_size, []
        self.inside = torch.zeros(inner.vocab_size, dtype=torch.bool)
        self.inside[ids] = True
        self.begin, self.commit = inner.begin, inner.commit

    def propose(self, gamma, sampling, generator):
        draft = self.inner.propose(gamma, sampling, generator)
        assert bool(self.inside[draft.tokens].all()), "a draft token outside the subset"
        if draft.q is not None:
            assert draft.q.shape == (*draft.tokens.shape, self.vocab_size)
            assert bool((draft.q[..., ~self.inside] == 0).all()), "q is not zero outside the subset"
            assert torch.allclose(draft.q.sum(-1), torch.ones(draft.tokens.shape))
        self.drafts.append((draft.tokens.tolist(), None if draft.parents is None else draft.parents.tolist()))
        return draft


def masked(drafter, ids):
    """An untrimmed drafter whose logits outside the subset are -inf: it must draft exactly what the
    trimmed one drafts (argmax / top-k over the subset, mapped back to the right full ids)."""
    outside = torch.ones(drafter.vocab_size, dtype=torch.bool)
    outside[ids] = False
    if isinstance(drafter, DraftModelDrafter):
        extend = drafter.lm.extend

        def masked_extend(*args, **kwargs):
            out = extend(*args, **kwargs)
            return TargetOutput(out.logits.masked_fill(outside, -torch.inf), out.hidden)

        drafter.lm.extend = masked_extend
    elif isinstance(drafter, MedusaDrafter):
        stacked = drafter.stacked
        drafter.stacked = lambda hidden: stacked(hidden).masked_fill(outside, -torch.inf)
    else:
        logits = drafter._logits
        drafter._logits = lambda features: logits(features).masked_fill(outside, -torch.inf)
    return drafter


def tiny_prophet(base):
    torch.manual_seed(3)
    return perturb(Prophet.from_base(base, dim=32, depth=1, heads=2), seed=3, scale=0.05)


NAMES = [
    "draft_model",
    "draft_model_self",
    "medusa_chain",
    "medusa_tree",
    "prophet_chain",
    "prophet_tree",
    "prophet_block_chain",
    "prophet_block_tree",
]


def drafter_factory(name: str, base):
    """vocab -> a fresh drafter of kind `name` on `base`; every call shares the same random weights."""
    if name == "draft_model":
        return lambda vocab: DraftModelDrafter(make_lm(dim=16, depth=1, seed=1), vocab=vocab)
    if name == "draft_model_self":  # the target itself: right exactly when the target's choice is in the subset
        return lambda vocab: DraftModelDrafter(make_lm(), vocab=vocab)
    if name.startswith("medusa"):
        heads = perturb(medusa_train.build(base, num_heads=3, num_layers=1), seed=2)
        tree = dict(mode="chain") if name == "medusa_chain" else dict(mode="tree", tree=SMALL_TREE)
        return lambda vocab: medusa_drafter.make_drafter(heads, base, **tree, vocab=vocab)
    if name.startswith("prophet_block"):
        torch.manual_seed(3)
        block = perturb(block_train.build(base, dim=32, depth=1, heads=2, block=3), seed=3, scale=0.05)
        tree = dict(mode="chain") if name == "prophet_block_chain" else dict(mode="tree", tree=SMALL_TREE)
        return lambda vocab: block_drafter.make_drafter(block, base, **tree, vocab=vocab)
    prophet = tiny_prophet(base)
    tree = dict(mode="chain") if name == "prophet_chain" else dict(mode="tree", top_k=3, depth=3, tree_nodes=8)
    return lambda vocab: prophet_drafter.make_drafter(prophet, base, **tree, vocab=vocab)


def generate(base, drafter, n=20, gamma=3, sampling=SamplingConfig()):
    return speculative_generate(
        Target(base),
        drafter,
        PROMPTS,
        max_new_tokens=n,
        spec=SpecConfig(gamma=gamma),
        sampling=sampling,
        generator=torch.Generator().manual_seed(0),
    )


@pytest.mark.parametrize("name", NAMES)
def test_greedy_with_a_subset_equals_plain_and_drafts_only_subset_tokens(name):
    base = make_lm()
    make = drafter_factory(name, base)
    plain = plain_generate(Target(base), PROMPTS, max_new_tokens=20).tokens
    assert {t % 2 for row in plain for t in row} == {0, 1}  # the target emits tokens outside the subset too
    trimmed = SubsetSpy(make(EVEN), EVEN)
    out = generate(base, trimmed)
    assert out.tokens == plain
    reference = SubsetSpy(masked(make(None), EVEN), EVEN)
    assert generate(base, reference).tokens == plain
    assert trimmed.drafts == reference.drafts and len(trimmed.drafts) > 5
    if name == "draft_model_self":  # accepted and rejected drafts both happened
        assert 0 < out.stats.alpha < 1


@pytest.mark.parametrize("name", NAMES)
def test_sampled_drafts_and_q_stay_in_the_subset(name):
    base = make_lm()
    spy = SubsetSpy(drafter_factory(name, base)(EVEN), EVEN)
    out = generate(base, spy, sampling=SamplingConfig(temperature=1.0, top_k=20))
    assert all(len(row) == 20 for row in out.tokens) and len(spy.drafts) > 5


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda b: MedusaDrafter(
                MedusaHeads.from_base(b, num_heads=2, num_layers=1), tree=[[4]], vocab=torch.arange(4)
            ),
            "ranks must be below the vocabulary size 4",
        ),
        (
            lambda b: ProphetDrafter(Prophet.from_base(b, dim=16, heads=2), top_k=5, vocab=torch.arange(4)),
            "top_k=5: must be at most the vocabulary size 4",
        ),
        (lambda b: DraftModelDrafter(b, vocab=torch.tensor([3, V])), rf"span \[3, {V}\]"),
        (
            lambda b: MedusaHeads.from_base(b, num_heads=1, num_layers=1).stacked(torch.tensor([2, 1])),
            "sorted and distinct",
        ),
    ],
)
def test_subsets_that_cannot_work_raise_one_line_errors(make, match):
    with pytest.raises(ValueError, match=match) as err:
        make(make_lm())
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------- losslessness

# The target (sharp_lm(0)) puts 0.78 of its first-token probability on token 1 and 0.14 on token 0:
# a subset without them makes every error in q outside the subset show.
LOSSLESS_SUBSET = torch.tensor([2, 3, 4, 5])


class ForgetsTheSubset(DraftModelDrafter):
    """Negative control: samples from the subset but reports the untrimmed distribution as q."""

    def propose(self, gamma, sampling, generator):
        x, tokens, qs = self.uncached, [], []
        for _ in range(gamma):
            out = self.lm.extend(x)  # logits (b, 1, N) over the subset, hidden (b, 1, d)
            logits = self.lm.model.to_logits(out.hidden[:, -1])  # (b, V): the untrimmed head
            token = self.vocab[sample_from_probs(probs_from_logits(out.logits[:, -1], sampling), generator)]
            tokens.append(token)
            qs.append(probs_from_logits(logits, sampling))  # the bug: not zero outside the subset
            x = token[:, None]
        self.fed = self.uncached.shape[1] + gamma - 1
        return Draft(tokens=torch.stack(tokens, dim=1), q=torch.stack(qs, dim=1))


def test_the_subset_leaves_out_most_of_the_targets_probability():
    with torch.no_grad():
        p = sharp_lm(0)(torch.tensor([PROMPT]))[0, -1].softmax(-1)
    assert float(p[LOSSLESS_SUBSET].sum()) < 0.2 and VOCAB == 6


# The draft model's case (17 s) is in the slow tier; the prophet chain's, through the same trimmed sampling
# transform (verify.loop.sampling.draft_from_logits with a subset), stays fast.
@pytest.mark.parametrize("name", [pytest.param("draft_model", marks=pytest.mark.slow), "prophet_chain"])
def test_trimmed_sampling_reproduces_the_target_distribution(name):
    if name == "draft_model":
        drafter = DraftModelDrafter(sharp_lm(1), vocab=LOSSLESS_SUBSET)
    else:
        torch.manual_seed(0)
        drafter = ProphetDrafter(
            Prophet.from_base(sharp_lm(0), dim=16, depth=1, heads=2), mode="chain", vocab=LOSSLESS_SUBSET
        )
    (stat, critical), stats = run_lossless(drafter, SamplingConfig(temperature=1.0))
    assert 0 < stats.alpha < 1
    assert stat < critical, f"chi2 {stat:.1f} >= critical {critical:.1f}: the output is not the target's distribution"


def test_negative_control_q_outside_the_subset_is_detected():
    (stat, critical), _ = run_lossless(
        ForgetsTheSubset(sharp_lm(1), vocab=LOSSLESS_SUBSET), SamplingConfig(temperature=1.0)
    )
    assert stat > critical, (
        f"q nonzero outside the subset passed: chi2 {stat:.1f} < {critical:.1f}; the test has no power"
    )
