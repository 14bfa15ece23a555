"""The one speculative loop: exact against plain greedy for every drafter, gamma, batch shape, EOS and
budget edge case; exact step counts with stub drafters that are never, always or sometimes right."""

import pytest
import torch

from tests.conftest import make_lm
from verify.backends.target import Target
from verify.drafters.draft_model import DraftModelDrafter
from verify.drafters.prompt_lookup import PromptLookupDrafter
from verify.loop.drafter import Draft
from verify.loop.plain import plain_generate
from verify.loop.sampling import SamplingConfig
from verify.loop.speculative import SpecConfig, speculative_generate

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4], [9, 9, 9]]
GAMMAS = [1, 2, 3, 5, 8]


class OracleStub:
    """Knows the plain greedy continuation; right for the first `right(row, step)` draft tokens of a step."""

    def __init__(self, continuation, right, vocab_size=97):
        self.cont, self.right, self.vocab_size = continuation, right, vocab_size

    def begin(self, prompts, prefill, pending):
        self.pos = [1] * len(prompts)  # tokens emitted so far per row
        self.step = 0

    def propose(self, gamma, sampling, generator):
        rows = []
        for i, cont in enumerate(self.cont):
            guess = [cont[j] if j < len(cont) else 0 for j in range(self.pos[i], self.pos[i] + gamma)]
            n_right = self.right(i, self.step)
            rows.append([t if j < n_right else (t + 1) % self.vocab_size for j, t in enumerate(guess)])
        return Draft(tokens=torch.tensor(rows))

    def commit(self, verdict):
        for i, a in enumerate(verdict.accepted.tolist()):
            self.pos[i] += a + 1
        self.step += 1


def plain(lm, prompts, n, eos=None):
    return plain_generate(Target(lm), prompts, max_new_tokens=n, eos_id=eos).tokens


def spec(lm, drafter, prompts, n, gamma, eos=None, **kwargs):
    return speculative_generate(
        Target(lm), drafter, prompts, max_new_tokens=n, spec=SpecConfig(gamma=gamma, **kwargs), eos_id=eos
    )


@pytest.mark.parametrize("gamma", GAMMAS)
def test_never_right_emits_one_token_per_forward(lm, gamma):
    ref = plain(lm, PROMPTS[:1], 20)
    out = spec(lm, OracleStub(ref, lambda i, s: 0), PROMPTS[:1], 20, gamma)
    assert out.tokens == ref
    assert int(out.stats.forwards[0]) == 20 and out.stats.accepted.sum() == 0 and out.stats.tau == 1.0


@pytest.mark.parametrize("gamma", GAMMAS)
def test_always_right_emits_gamma_plus_one_per_forward(lm, gamma):
    n = 25
    ref = plain(lm, PROMPTS[:1], n)
    out = spec(lm, OracleStub(ref, lambda i, s: 99), PROMPTS[:1], n, gamma)
    assert out.tokens == ref
    # prefill gives token 1; each step then emits min(gamma + 1, tokens left)
    assert int(out.stats.forwards[0]) == 1 + -(-(n - 1) // (gamma + 1))
    assert out.stats.alpha == 1.0


@pytest.mark.parametrize("gamma", GAMMAS)
def test_sometimes_right_ragged_batch(lm, gamma):
    n = 30
    ref = plain(lm, PROMPTS, n)
    right = lambda i, s: (i + 2 * s) % (gamma + 1)  # noqa: E731  rows accept different counts each step
    out = spec(lm, OracleStub(ref, right), PROMPTS, n, gamma)
    assert out.tokens == ref
    alone = [
        spec(lm, OracleStub([r], lambda _, s, i=i: right(i, s)), [p], n, gamma).tokens[0]
        for i, (p, r) in enumerate(zip(PROMPTS, ref))
    ]
    assert alone == ref


def drafters(lm):
    return {
        "draft_model": lambda: DraftModelDrafter(make_lm(dim=16, depth=1, seed=1)),
        "draft_model_self": lambda: DraftModelDrafter(make_lm()),  # the target itself: always right
        "prompt_lookup": lambda: PromptLookupDrafter(vocab_size=97),
    }


@pytest.mark.parametrize("name", ["draft_model", "draft_model_self", "prompt_lookup"])
@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_speculative_equals_plain(lm, name, gamma, batch):
    prompts = PROMPTS[:batch]
    ref = plain(lm, prompts, 24)
    out = spec(lm, drafters(lm)[name](), prompts, 24, gamma)
    assert out.tokens == ref
    if name == "draft_model_self":
        assert out.stats.alpha == 1.0


@pytest.mark.parametrize("name", ["draft_model", "draft_model_self", "prompt_lookup"])
def test_eos_mid_draft(lm, name):
    free = plain(lm, PROMPTS, 30)
    eos = free[0][9]  # row 0 meets it at its 10th token: inside some draft for every gamma used
    ref = plain(lm, PROMPTS, 30, eos=eos)
    assert len(ref[0]) <= 10
    for gamma in (3, 5):
        out = spec(lm, drafters(lm)[name](), PROMPTS, 30, gamma, eos=eos)
        assert out.tokens == ref
        assert out.stats.tokens.tolist() == [len(r) for r in ref]


@pytest.mark.parametrize("kind", ["chain", "chain_stub", "tree"])
def test_a_list_of_eos_ids_inside_accepted_drafts(lm, kind):
    from tests.test_tree import TREE, OracleTreeStub

    free = plain(lm, PROMPTS, 30)
    eos = [free[0][8], free[2][8]]  # row 0 meets the first at its 9th token, row 2 the second
    ref = plain(lm, PROMPTS, 30, eos=eos)
    # rows stop at different ids of the list, and rows that meet none run to the budget
    assert ref[0][-1] == eos[0] != ref[2][-1] == eos[1] and len(ref[0]) <= 9 and len(ref[2]) <= 9
    for row, full in zip(ref, free):
        assert row == full[: min([full.index(e) + 1 for e in eos if e in full], default=30)]
    make = {
        "chain": lambda: drafters(lm)["draft_model_self"](),  # always right: every EOS is inside an accepted draft
        "chain_stub": lambda: OracleStub(free, lambda i, s: (i + 2 * s) % 4),
        "tree": lambda: OracleTreeStub(free, TREE),
    }[kind]
    for gamma in (2, 5):
        out = spec(lm, make(), PROMPTS, 30, gamma, eos=eos)
        assert out.tokens == ref
        assert out.stats.tokens.tolist() == [len(r) for r in ref]
        if kind == "chain":
            assert out.stats.alpha == 1.0


@pytest.mark.parametrize("eos_id", [[], [0, 97], -1, [False]], ids=repr)
def test_bad_eos_ids_are_one_line_errors_before_the_prefill(lm, eos_id):
    target = Target(lm)
    target.prefill = None  # a check after the prefill would fail here with a TypeError
    with pytest.raises(ValueError) as excinfo:
        speculative_generate(target, PromptLookupDrafter(vocab_size=97), [[1, 2]], max_new_tokens=4, eos_id=eos_id)
    assert str(excinfo.value) == (
        f"eos_id={eos_id!r}: must be null, a token id or a non-empty list of token ids in [0, 97)"
    )


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("gamma", [1, 8])
def test_tiny_budgets_and_gamma_larger_than_tokens_left(lm, n, gamma):
    ref = plain(lm, PROMPTS, n)
    out = spec(lm, drafters(lm)["draft_model_self"](), PROMPTS, n, gamma)
    assert out.tokens == ref
    assert all(len(r) == n for r in out.tokens)


def test_adaptive_gamma_grows_and_stays_exact(lm):
    ref = plain(lm, PROMPTS, 40)
    out = spec(lm, drafters(lm)["draft_model_self"](), PROMPTS, 40, 2, adaptive_gamma=True, max_gamma=8)
    assert out.tokens == ref
    assert len(out.stats.acceptance_by_position) > 2  # gamma grew past its start
    assert int(out.stats.forwards.max()) < int(
        spec(lm, drafters(lm)["draft_model_self"](), PROMPTS, 40, 2).stats.forwards.max()
    )


def test_budget_never_passes_max_seq_len(lm):
    prompt = [[1] * 80]  # max_seq_len 96: 80 + 16 fits exactly
    target = Target(lm)
    lengths = []
    original = target.extend

    def spy(tokens, **kw):
        out = original(tokens, **kw)
        lengths.append(int(target.row_lengths.max()))
        return out

    target.extend = spy
    out = speculative_generate(
        target, DraftModelDrafter(make_lm()), prompt, max_new_tokens=16, spec=SpecConfig(gamma=8)
    )
    assert out.tokens == plain(lm, prompt, 16)
    assert max(lengths) <= 96


def test_typical_acceptance_at_temperature_zero_equals_greedy(lm):
    ref = plain(lm, PROMPTS, 20)
    out = spec(lm, drafters(lm)["draft_model"](), PROMPTS, 20, 3, rule="typical")
    assert out.tokens == ref


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: SpecConfig(gamma=0), "gamma=0"),
        (lambda: SpecConfig(gamma=-2), "gamma=-2"),
        (lambda: SamplingConfig(temperature=-1.0), "temperature=-1.0"),
        (lambda: SamplingConfig(top_p=1.2), "top_p=1.2"),
        (lambda: SamplingConfig(top_k=0), "top_k=0"),
    ],
)
def test_bad_settings_raise_before_work(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    "kwargs, match",
    [({"delta": 1.5}, "delta=1.5"), ({"delta": -0.1}, "delta=-0.1"), ({"rule": "magic"}, "rule='magic'")],
)
def test_bad_rule_options_raise_before_work(lm, kwargs, match):
    target = Target(lm)
    with pytest.raises(ValueError, match=match):
        speculative_generate(
            target, PromptLookupDrafter(vocab_size=97), PROMPTS, max_new_tokens=5, spec=SpecConfig(**kwargs)
        )
    assert target.cache is None  # nothing ran


def test_drafter_with_another_vocabulary_is_rejected(lm):
    target = Target(lm)
    with pytest.raises(ValueError, match="vocabulary size 50 differs from the target's 97"):
        speculative_generate(target, DraftModelDrafter(make_lm(num_tokens=50)), PROMPTS, max_new_tokens=5)
    assert target.cache is None


class ContextSpy:
    """Wraps a drafter; tracks the true context from the verdicts and checks every proposal against
    `reference(context, gamma)`, a from-scratch computation on that context."""

    def __init__(self, inner, reference):
        self.inner, self.reference, self.vocab_size, self.checked = inner, reference, inner.vocab_size, 0

    def begin(self, prompts, prefill, pending):
        self.ctx = [p + [t] for p, t in zip(prompts, pending.tolist())]
        self.inner.begin(prompts, prefill, pending)

    def propose(self, gamma, sampling, generator):
        draft = self.inner.propose(gamma, sampling, generator)
        for i, ctx in enumerate(self.ctx):
            assert draft.tokens[i].tolist() == self.reference(ctx, gamma), f"stale drafter state in row {i}"
            self.checked += 1
        return draft

    def commit(self, verdict):
        for i, a in enumerate(verdict.accepted.tolist()):
            self.ctx[i] += verdict.tokens[i, : a + 1].tolist()
        self.inner.commit(verdict)


def naive_lookup(ctx, gamma, max_n=3, min_n=1):
    for n in range(max_n, min_n - 1, -1):
        if len(ctx) <= n:
            continue
        suffix = ctx[-n:]
        for i in range(len(ctx) - n - 1, -1, -1):
            if ctx[i : i + n] == suffix:
                start = i + n
                return [ctx[min(start + j, len(ctx) - 1)] for j in range(gamma)]
    return [ctx[-1]] * gamma


@pytest.mark.parametrize("gamma", [2, 5])
def test_draft_model_cache_follows_the_accepted_context(lm, gamma):
    draft_lm = make_lm(dim=16, depth=1, seed=1)
    reference = lambda ctx, g: plain(draft_lm, [ctx], g)[0]  # noqa: E731  a fresh draft LM on the true context
    spy = ContextSpy(DraftModelDrafter(draft_lm), reference)
    out = spec(lm, spy, PROMPTS, 24, gamma)
    assert out.tokens == plain(lm, PROMPTS, 24)
    assert spy.checked > 10 and 0 < out.stats.alpha < 1  # rejections happened and were checked


@pytest.mark.parametrize("gamma", [2, 5])
def test_prompt_lookup_follows_the_accepted_context(lm, gamma):
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 4, 5, 6, 4, 5], [7, 8, 9], [3, 3, 3, 3]]
    spy = ContextSpy(PromptLookupDrafter(vocab_size=97), naive_lookup)
    out = spec(lm, spy, prompts, 30, gamma)
    assert out.tokens == plain(lm, prompts, 30)
    assert spy.checked > 10
