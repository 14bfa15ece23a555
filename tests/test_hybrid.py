"""The hybrid drafter (verify/drafters/hybrid.py): prompt lookup where the context repeats, a learned drafter
elsewhere. Exact at T=0 against plain decoding (chains and trees, batches whose rows choose differently),
lossless at T=1 (chi-square, both sides exercised in one batch), the merge of two drafts, and bad settings."""

import pytest
import torch

from prophet.drafter import ProphetDrafter
from prophet.model import Prophet
from tests.conftest import make_lm
from tests.test_lossless import eagle_prophet, sharp_lm
from tests.test_lossless import run as run_lossless
from tests.test_tree import medusa_tree_on, prophet_tree_on
from verify.backends.target import Target
from verify.drafters.draft_model import DraftModelDrafter
from verify.drafters.hybrid import HybridDrafter, merge_rows
from verify.loop.drafter import Draft
from verify.loop.plain import plain_generate
from verify.loop.sampling import SamplingConfig
from verify.loop.speculative import SpecConfig, speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")

# Rows that repeat themselves (lookup copies) beside rows that do not (the learned drafter drafts)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4], [9, 9, 9]]


def prophet_chain_on(base, seed: int = 0) -> ProphetDrafter:
    torch.manual_seed(seed)
    return ProphetDrafter(Prophet.from_base(base, dim=16, depth=1, heads=2), mode="chain")


LEARNED = {
    "prophet_chain": prophet_chain_on,
    "medusa_tree": lambda lm: medusa_tree_on(lm, candidates="ranked"),
    "prophet_tree": lambda lm: prophet_tree_on(lm, candidates="ranked"),
}


class NeverCalled:
    """A learned drafter that must not draft: every row copies."""

    vocab_size = 97

    def begin(self, prompts, prefill, pending):
        self.commits = 0

    def propose(self, gamma, sampling, generator):
        raise AssertionError("the learned drafter drafted although every row copies")

    def commit(self, verdict):
        self.commits += 1


class FixedChain:
    """A learned drafter proposing tokens 40, 41, .. with a fixed q, counting its calls."""

    vocab_size = 97

    def __init__(self, tree: bool = False):
        self.tree, self.calls = tree, []

    def begin(self, prompts, prefill, pending):
        self.b = len(prompts)

    def propose(self, gamma, sampling, generator):
        self.calls.append(gamma)
        tokens = torch.arange(40, 40 + gamma).expand(self.b, -1)
        q = torch.softmax(torch.randn(self.b, gamma, self.vocab_size, generator=torch.Generator().manual_seed(0)), -1)
        parents = torch.tensor([-1] + [0] * (gamma - 1)) if self.tree else None  # a star: the root's child, then its
        return Draft(tokens=tokens, q=q, parents=parents)  # children

    def commit(self, verdict):
        pass


@pytest.mark.parametrize("learned", list(LEARNED))
@pytest.mark.parametrize("gamma", [1, 4])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("branches", [False, True])
def test_greedy_hybrid_equals_plain(lm, learned, gamma, batch, branches):
    """Batches of 4 copy on any repeated last token (min_match 1: rows choose differently nearly every cycle); a
    batch of 1 on a repeated pair. The learned side capped below the loop's gamma of 4."""
    prompts = PROMPTS[:batch] if batch > 1 else PROMPTS[1:2]
    want = plain_generate(Target(lm), prompts, max_new_tokens=24).tokens
    cap = 2 if gamma > 2 else None
    min_match = 1 if batch > 1 else 2
    drafter = HybridDrafter(LEARNED[learned](lm), min_match=min_match, learned_gamma=cap, branches=branches)
    got = speculative_generate(Target(lm), drafter, prompts, max_new_tokens=24, spec=SpecConfig(gamma=gamma))
    assert got.tokens == want
    assert drafter.learned_rows > 0  # the learned side drafted (and lookup followed its verdicts)
    assert (got.stats.copied, got.stats.chosen) == (drafter.copied_rows, drafter.copied_rows + drafter.learned_rows)
    if batch > 1:  # a repeated last token is common in 24 tokens of a 97-token vocabulary
        assert drafter.copied_rows > 0


def test_rows_that_all_copy_never_run_the_learned_drafter():
    drafter = HybridDrafter(NeverCalled(), min_match=2)
    drafter.begin([[1, 2, 3, 1, 2], [7, 8, 7, 8]], None, torch.tensor([3, 7]))  # contexts ..1 2 3 and ..8 7
    draft = drafter.propose(3, SamplingConfig(), None)
    # what followed the earlier 1 2 and 7 8 7, to the end of the context (then its last token again)
    assert draft.tokens.tolist() == [[1, 2, 3], [8, 7, 7]] and draft.q is None and draft.parents is None
    assert (drafter.copied_rows, drafter.learned_rows) == (2, 0)


@pytest.mark.parametrize("tree", [False, True])
def test_rows_that_differ_get_one_merged_draft(tree):
    learned = FixedChain(tree=tree)
    drafter = HybridDrafter(learned, min_match=2, learned_gamma=2)
    drafter.begin([[1, 2, 3, 1, 2], [10, 11, 12]], None, torch.tensor([3, 13]))
    draft = drafter.propose(4, SamplingConfig(temperature=1.0), None)
    assert learned.calls == [2]  # capped at learned_gamma
    assert draft.tokens.tolist()[0] == [1, 2, 3, 3]  # the copy, to the end of its context, then its last token
    if tree:  # the learned star (40; 41 under it) and extra root children carrying 40; the copy a chain
        assert draft.tokens.tolist()[1] == [40, 41, 40, 40]
        assert draft.parents.tolist() == [[-1, 0, 1, 2], [-1, 0, -1, -1]]
    else:  # the learned chain continued by repeats of its last token
        assert draft.tokens.tolist()[1] == [40, 41, 41, 41] and draft.parents is None
    one_hot = torch.nn.functional.one_hot(draft.tokens, 97).float()
    assert torch.equal(draft.q[0], one_hot[0])  # the copied row: deterministic
    assert torch.equal(draft.q[1, 2:], one_hot[1, 2:])  # padded nodes: deterministic
    assert not torch.equal(draft.q[1, :2], one_hot[1, :2])  # the learned nodes keep their q


@pytest.mark.parametrize("tree", [False, True])
def test_branches_put_the_copy_beside_the_learned_draft(tree):
    """A copying row: the copy first (a chain from the pending token), then the learned nodes shifted past it; the
    other row: the learned nodes, then pad children of the pending token. Even when every row copies, the learned
    drafter drafts."""
    learned = FixedChain(tree=tree)
    drafter = HybridDrafter(learned, min_match=2, learned_gamma=2, branches=True)
    drafter.begin([[1, 2, 3, 1, 2], [10, 11, 12]], None, torch.tensor([3, 13]))
    draft = drafter.propose(3, SamplingConfig(temperature=1.0), None)
    assert learned.calls == [2]
    assert draft.tokens.tolist() == [[1, 2, 3, 40, 41], [40, 41, 40, 40, 40]]
    own = [-1, 0]  # the learned two nodes' parents, a star's as a chain's
    assert draft.parents.tolist() == [[-1, 0, 1, own[0], 3 + own[1]], [*own, -1, -1, -1]]
    one_hot = torch.nn.functional.one_hot(draft.tokens, 97).float()
    assert torch.equal(draft.q[0, :3], one_hot[0, :3]) and torch.equal(draft.q[1, 2:], one_hot[1, 2:])
    assert not torch.equal(draft.q[0, 3:], one_hot[0, 3:]) and not torch.equal(draft.q[1, :2], one_hot[1, :2])
    both = HybridDrafter(FixedChain(), min_match=2, branches=True)
    both.begin([[1, 2, 3, 1, 2]], None, torch.tensor([3]))
    assert both.propose(2, SamplingConfig(), None).parents.tolist() == [[-1, 0, -1, 2]]


def test_merge_keeps_a_longer_learned_tree_and_pads_the_copy():
    learned = Draft(tokens=torch.tensor([[20, 21, 22, 23, 24]] * 2), parents=torch.tensor([-1, -1, 0, 0, 1]))
    merged = merge_rows(learned, torch.tensor([[5, 6], [7, 8]]), torch.tensor([True, False]), 97)
    assert merged.tokens.tolist() == [[5, 6, 5, 5, 5], [20, 21, 22, 23, 24]]
    assert merged.parents.tolist() == [[-1, 0, -1, -1, -1], [-1, -1, 0, 0, 1]]
    assert merged.q is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(min_match=0), "min_match=0: must be an integer >= 1"),
        (dict(min_match=4, max_ngram=3), "min_match=4: must be at most max_ngram=3"),
        (dict(max_ngram=True), "max_ngram=True: must be an integer >= 1"),
        (dict(learned_gamma=0), "learned_gamma=0: must be an integer >= 1, or null"),
        (dict(branches=1), "branches=1: must be true or false"),
    ],
)
def test_bad_settings_are_one_line_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HybridDrafter(NeverCalled(), **kwargs)


# Two of the four in the slow tier (6 s each): the fast tier keeps a merged chain and a branched sampled tree
@pytest.mark.parametrize(
    "mode, branches",
    [
        ("chain", False),
        ("tree", True),
        pytest.param("tree", False, marks=pytest.mark.slow),
        pytest.param("chain", True, marks=pytest.mark.slow),
    ],
)
def test_hybrid_sampling_reproduces_the_target_distribution(mode, branches):
    """20,000 rows of one prompt whose suffix recurs: rows copy or draft by what they sampled, in the same batch;
    with branches the copy is a deterministic sibling tried before the learned draft's sampled ones."""
    if mode == "chain":
        drafter = HybridDrafter(ProphetDrafter(eagle_prophet(2), mode="chain"), min_match=2, branches=branches)
    else:
        drafter = HybridDrafter(medusa_tree_on(sharp_lm(0), candidates="sampled"), min_match=2, branches=branches)
    (stat, critical), stats = run_lossless(drafter, SamplingConfig(temperature=1.0))
    assert 0 < stats.alpha < 1
    assert drafter.copied_rows > 500 and drafter.learned_rows > 500, (drafter.copied_rows, drafter.learned_rows)
    assert stat < critical, f"chi2 {stat:.1f} >= critical {critical:.1f}: the output is not the target's distribution"


def test_a_drafter_that_keeps_its_own_draft_is_refused(lm):
    """A draft model's commit keeps its own drafted entries up to the accepted count: after a copy they would be
    another text's. One line, before any decoding."""
    with pytest.raises(ValueError, match="DraftModelDrafter keeps its own drafted tokens in its cache"):
        HybridDrafter(DraftModelDrafter(make_lm(dim=16, depth=1, seed=1)))


def test_a_compiled_prophet_commits_a_copy_wider_than_its_own_drafts(lm):
    """A compiled prophet pads every commit to the widest block it drafted; a copied chain (gamma 4) is wider than
    its own drafts (learned_gamma 2) and than anything it drafted before the first cycle: the block widens."""
    drafter = prophet_chain_on(lm)
    drafter.compile = True  # the padding compile=true does; its steps run eagerly here (no torch.compile)
    drafter._step = lambda f, t, c, **a: drafter.prophet.step(f, t, c, compile=False, **a)
    hybrid = HybridDrafter(drafter, min_match=1, learned_gamma=2)
    prompt = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
    want = plain_generate(Target(lm), prompt, max_new_tokens=20).tokens
    got = speculative_generate(Target(lm), hybrid, prompt, max_new_tokens=20, spec=SpecConfig(gamma=4))
    assert got.tokens == want and hybrid.copied_rows > 0 and drafter.commit_width == 5
