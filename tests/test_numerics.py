"""No silent garbage: NaN or inf in what decoding uses stops it in one line naming the step and the row
(plain decoding, a chain, a tree, a drafter's q), only for what was used; bad sampling and rule settings
fail in one line before any work.

A poisoned embedding row makes NaN logits only in the rows that feed that token to the target, from the
step that first feeds it (computed from a clean run) on; the other rows stay clean.

Perf note (a measurement, not a test), 2 shared cores, one thread, eager, the demo-sized base
(conf/base/tiny.yaml with random weights, vocab 8192), batch 1, 64-token prompt, 128 new tokens, T=0:
plain decoding with and without the check (the previous verify/loop/plain.py loaded beside this one),
alternated call by call in one process, 40 rounds, 3 runs, medians: 539.8 tok/s without, 540.9 with
(wall; per CPU second 547.3 and 542.3): no difference beyond the machine's noise (+-5 % between runs
under load). In isolation the check adds 2.3 us per step (one row max into a preallocated row) and
15 us per call (the read after the loop), about 0.15 % of a 1.8 ms step. The speculative loop adds
about 50 us per step at gamma 4 with a q (a few small ops, read with the loop's own per-step read);
a draft-model chain at T=1 measured 167.3 against 166.7 tok/s per CPU second (median of 3 runs).
"""

import pytest
import torch

from medusa.drafter import MedusaDrafter
from medusa.heads import MedusaHeads
from tests.conftest import make_lm
from verify.backends.target import Target
from verify.common.numerics import NonFiniteError
from verify.drafters.draft_model import DraftModelDrafter
from verify.loop.drafter import Draft
from verify.loop.plain import plain_generate
from verify.loop.sampling import SamplingConfig
from verify.loop.speculative import SpecConfig, speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4]]
CHECKED_AT_BUILD = {57, 82, 25, 87, 55, 60}  # the 6 tokens the lean engine's build-time check feeds (V = 97)
NEW = 16


def poisoned(token: int, value: float = float("nan")):
    """make_lm() whose embedding of `token` is NaN (or inf): logits are NaN wherever the token is fed."""
    lm = make_lm()
    with torch.no_grad():
        lm.token_emb.emb.weight[token] = value
    return lm


class Recorder:
    """Wraps a drafter and records every step's draft tokens (b, k) and accepted counts (b,)."""

    def __init__(self, inner):
        self.inner, self.vocab_size, self.drafts, self.accepted = inner, inner.vocab_size, [], []

    def begin(self, prompts, prefill, pending):
        self.inner.begin(prompts, prefill, pending)

    def propose(self, gamma, sampling, generator):
        draft = self.inner.propose(gamma, sampling, generator)
        self.drafts.append(draft.tokens.tolist())
        return draft

    def commit(self, verdict):
        self.accepted.append(verdict.accepted.tolist())
        self.inner.commit(verdict)


def step_feeding(accepted: list[list[int]], row: int, j: int) -> int:
    """The decode step whose target forward takes emitted token j of `row` at a kept position: step s runs
    the pending token (emitted index c - 1) and keeps it and the a accepted drafts after it."""
    c = 1  # tokens emitted before step 1: the prefill's
    for s, acc in enumerate(accepted, start=1):
        if j <= c - 1 + acc[row]:
            return s
        c += acc[row] + 1
    raise AssertionError(f"token {j} of row {row} was never fed")


def a_poison(clean: list[list[int]], first: int = 1) -> tuple[int, int]:
    """(token, j): row 1 emits `token` as its j-th token (j >= first) and nothing else ever feeds it: not
    row 0, not row 1 before j, not the build-time check."""
    for j in range(first, NEW - 1):
        x = clean[1][j]
        if x not in CHECKED_AT_BUILD and x not in PROMPTS[0] + clean[0] and x not in PROMPTS[1] + clean[1][:j]:
            return x, j
    raise AssertionError("no usable token: change PROMPTS")


def draft_model_chain(lm):
    """A draft model near the target (its weights plus noise): it is right about half the time."""
    draft = make_lm()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    return DraftModelDrafter(draft)


def medusa_tree(lm):
    """Medusa heads near fresh ones (which guess the base's own next token again): right now and then."""
    heads = MedusaHeads.from_base(lm, num_heads=3, num_layers=1)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return MedusaDrafter(heads, mode="tree", tree=[[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0]])


def test_plain_names_the_step_and_the_row():
    clean = plain_generate(Target(make_lm()), PROMPTS, max_new_tokens=NEW).tokens
    x, j = a_poison(clean)
    # emitted token j is sampled at step j and fed at step j + 1; row 0 decodes on, clean
    with pytest.raises(
        NonFiniteError, match=rf"^non-finite target logits at decode step {j + 1} \(0 = the prefill\), row 1 \(NaN\): "
    ):
        plain_generate(Target(poisoned(x)), PROMPTS, max_new_tokens=NEW)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_poisoned_prompt_fails_at_the_prefill(temperature):
    x = next(t for t in PROMPTS[1] if t not in PROMPTS[0] and t not in CHECKED_AT_BUILD)
    sampling = SamplingConfig(temperature=temperature)
    with pytest.raises(NonFiniteError, match=r"decode step 0 \(0 = the prefill\), row 1 \(NaN\)"):
        plain_generate(Target(poisoned(x)), PROMPTS, max_new_tokens=NEW, sampling=sampling)
    drafter = DraftModelDrafter(make_lm(dim=16, depth=1, seed=1))
    with pytest.raises(NonFiniteError, match=r"decode step 0 \(0 = the prefill\), row 1 \(NaN\)"):
        speculative_generate(Target(poisoned(x)), drafter, PROMPTS, max_new_tokens=NEW, sampling=sampling)


def test_plain_ignores_rows_that_already_stopped():
    """After its EOS a row still runs (its samples are discarded): NaN there is not used, not an error."""
    free = plain_generate(Target(make_lm()), PROMPTS, max_new_tokens=NEW).tokens
    eos = free[0][3]
    stopped = plain_generate(Target(make_lm()), PROMPTS, max_new_tokens=NEW, eos_id=eos).tokens
    assert len(stopped[0]) == 4 and len(stopped[1]) == NEW
    # a token row 0 would feed after its EOS, and nothing else feeds
    x = next(t for t in free[0][4:] if t not in CHECKED_AT_BUILD | set(PROMPTS[0] + PROMPTS[1] + free[1] + free[0][:4]))
    assert plain_generate(Target(poisoned(x)), PROMPTS, max_new_tokens=NEW, eos_id=eos).tokens == stopped


@pytest.mark.parametrize("make", [draft_model_chain, medusa_tree])
def test_speculative_names_the_step_and_the_row(make):
    spy = Recorder(make(make_lm()))
    clean = speculative_generate(Target(make_lm()), spy, PROMPTS, max_new_tokens=NEW, spec=SpecConfig(gamma=3)).tokens
    assert clean == plain_generate(Target(make_lm()), PROMPTS, max_new_tokens=NEW).tokens
    assert any(a[1] > 0 for a in spy.accepted)  # drafts were accepted: the steps are not plain decoding's
    x, j = a_poison(clean, first=2)
    step = step_feeding(spy.accepted, 1, j)
    # Not drafted (and rejected) before: the target attends over its whole cache buffer, masked weights are
    # 0 and 0 * NaN is NaN, so a rejected NaN-making draft token would break its row from that step on.
    assert all(x not in d[1] for d in spy.drafts[: step - 1])
    lm = poisoned(x)
    with pytest.raises(
        NonFiniteError, match=rf"^non-finite target logits at decode step {step} \(0 = the prefill\), row 1 \(NaN\)"
    ):
        speculative_generate(Target(lm), make(lm), PROMPTS, max_new_tokens=NEW, spec=SpecConfig(gamma=3))


class Hopeless:
    """A chain drafter that always proposes `token`, twice, with q one-hot on it (and `bad` at node `at`, or
    nowhere): when the target's p is zero there, node 0 is always rejected and node 1 never compared."""

    def __init__(self, token, bad=None, at=0):
        self.token, self.bad, self.at, self.vocab_size = token, bad, at, 97

    def begin(self, prompts, prefill, pending):
        self.b = len(prompts)

    def propose(self, gamma, sampling, generator):
        tokens = torch.full((self.b, gamma), self.token)
        q = torch.nn.functional.one_hot(tokens, 97).float()  # (b, k, V)
        if self.bad is not None and self.at < gamma:
            q[:, self.at, 7] = self.bad
        return Draft(tokens=tokens, q=q)

    def commit(self, verdict):
        pass


def test_only_the_q_a_rule_compared_is_checked():
    """top_k=1 makes p one-hot on the argmax: a token the target never picks is always rejected at node 0,
    so inf in node 1's q is never used (decoding equals greedy) while inf in node 0's q is."""
    greedy = plain_generate(Target(make_lm()), PROMPTS, max_new_tokens=NEW).tokens
    x = next(t for t in range(97) if t not in sum(greedy, []))
    sampling = SamplingConfig(temperature=1.0, top_k=1)
    run = lambda drafter: speculative_generate(  # noqa: E731
        Target(make_lm()),
        drafter,
        PROMPTS,
        max_new_tokens=NEW,
        spec=SpecConfig(gamma=2),
        sampling=sampling,
        generator=torch.Generator().manual_seed(0),
    )
    assert run(Hopeless(x, float("inf"), at=1)).tokens == greedy
    with pytest.raises(
        NonFiniteError, match=r"non-finite drafter q at decode step 1 \(0 = the prefill\), row 0 \(inf\)"
    ):
        run(Hopeless(x, float("inf"), at=0))


class PoisonQ:
    """Wraps a sampling drafter: at step `at`, one entry of row `row`'s q at draft node 0 becomes `value`."""

    def __init__(self, inner, *, at, row, value):
        self.inner, self.vocab_size, self.at, self.row, self.value, self.steps = (
            inner,
            inner.vocab_size,
            at,
            row,
            value,
            0,
        )

    def begin(self, prompts, prefill, pending):
        self.inner.begin(prompts, prefill, pending)

    def propose(self, gamma, sampling, generator):
        draft = self.inner.propose(gamma, sampling, generator)
        self.steps += 1
        if self.steps == self.at:
            draft.q = draft.q.clone()
            draft.q[self.row, 0, 7] = self.value  # node 0 hangs from the root: its q is always compared
        return draft

    def commit(self, verdict):
        self.inner.commit(verdict)


@pytest.mark.parametrize("value, kind", [(float("inf"), "inf"), (float("nan"), "NaN")])
def test_a_drafters_bad_q_names_the_step_and_the_row(value, kind):
    drafter = PoisonQ(DraftModelDrafter(make_lm(dim=16, depth=1, seed=1)), at=2, row=1, value=value)
    with pytest.raises(
        NonFiniteError,
        match=rf"^non-finite drafter q at decode step 2 \(0 = the prefill\), row 1 \({kind}\): the drafter's",
    ):
        speculative_generate(
            Target(make_lm()),
            drafter,
            PROMPTS,
            max_new_tokens=NEW,
            sampling=SamplingConfig(temperature=1.0),
            generator=torch.Generator().manual_seed(0),
        )


def test_nan_weights_fail_at_build_and_the_error_is_one_line():
    lm = make_lm()
    with torch.no_grad():
        lm.attn_layers.layers[0][1].to_q.weight.fill_(float("nan"))
    with pytest.raises(NonFiniteError, match="weights hold NaN/inf") as e:
        Target(lm)  # was: "differs from the model's own forward by nan: the model uses an option it does not implement"
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": float("nan")}, "temperature=nan: must be a number >= 0, finite"),
        ({"temperature": float("inf")}, "temperature=inf: must be a number >= 0, finite"),
        ({"temperature": -1.0}, "temperature=-1.0: must be a number >= 0, finite"),
        ({"temperature": 1e-30}, "temperature=1e-30: must be a number >= 0, and 0 or at least 1e-06"),
        ({"temperature": True}, "temperature=True"),
        ({"top_p": float("nan")}, r"top_p=nan: must be a number in \(0, 1\]"),
        ({"top_p": 0.0}, r"top_p=0.0: must be a number in \(0, 1\]"),
        ({"top_p": 1.01}, r"top_p=1.01: must be a number in \(0, 1\]"),
        ({"top_k": 0}, "top_k=0: must be an integer >= 1"),
        ({"top_k": 2.5}, "top_k=2.5: must be an integer >= 1"),
        ({"top_k": True}, "top_k=True: must be an integer >= 1"),
    ],
)
def test_bad_sampling_settings_fail_in_one_line(kwargs, match):
    with pytest.raises(ValueError, match=f"^{match}") as e:
        SamplingConfig(**kwargs)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"delta": float("nan")}, r"delta=nan: must be a number in \[0, 1\]"),
        ({"delta": float("inf")}, r"delta=inf: must be a number in \[0, 1\]"),
        ({"delta": -0.1}, r"delta=-0.1: must be a number in \[0, 1\]"),
        ({"delta": 1.5}, r"delta=1.5: must be a number in \[0, 1\]"),
        ({"delta": True}, r"delta=True: must be a number in \[0, 1\]"),
        ({"typical_epsilon": 0.0}, r"typical_epsilon=0.0: must be a number in \(0, 1\]"),
        ({"typical_epsilon": 1.5}, r"typical_epsilon=1.5: must be a number in \(0, 1\]"),
        ({"typical_epsilon": float("nan")}, r"typical_epsilon=nan: must be a number in \(0, 1\]"),
        ({"typical_alpha": 0.0}, "typical_alpha=0.0: must be a finite number > 0"),
        ({"typical_alpha": -1.0}, "typical_alpha=-1.0: must be a finite number > 0"),
        ({"typical_alpha": float("inf")}, "typical_alpha=inf: must be a finite number > 0"),
        ({"typical_alpha": float("nan")}, "typical_alpha=nan: must be a finite number > 0"),
    ],
)
def test_bad_rule_options_fail_in_one_line(kwargs, match):
    with pytest.raises(ValueError, match=f"^{match}") as e:
        SpecConfig(**kwargs)
    assert "\n" not in str(e.value)


def test_a_tree_drafters_bad_q_names_the_step_and_the_row():
    from tests.test_lossless import PROMPT, sharp_lm
    from tests.test_tree import RandomTreeStub

    class PoisonTreeQ(RandomTreeStub):
        def propose(self, gamma, sampling, generator):
            draft = super().propose(gamma, sampling, generator)
            self.steps = getattr(self, "steps", 0) + 1
            if self.steps == 2:
                draft.q[1, 0, 3] = float("inf")  # node 0 hangs from the root: its q is always compared
            return draft

    with pytest.raises(
        NonFiniteError, match=r"^non-finite drafter q at decode step 2 \(0 = the prefill\), row 1 \(inf\)"
    ):
        speculative_generate(
            Target(sharp_lm(0)),
            PoisonTreeQ(True),
            [PROMPT] * 3,
            max_new_tokens=8,
            spec=SpecConfig(gamma=2),
            sampling=SamplingConfig(temperature=1.0),
            generator=torch.Generator().manual_seed(0),
        )
