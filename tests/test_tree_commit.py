"""A tree's rollback in the speculative loop: where every row's kept nodes come first in the tree's node order, the
target's cache is rewound like a chain's (no gather and scatter over its buffers); otherwise the kept entries move.
Either way the output equals plain greedy decoding and the cache ends as plain decoding leaves it, and the loop
learns which commit to make with the host read it makes anyway."""

from __future__ import annotations

import pytest
import torch

from medusa import train
from medusa.drafter import MedusaDrafter
from tests.test_host_reads import counted  # noqa: F401  (a fixture: counts every read of a value to the host)
from tests.test_medusa import make_base, perturb
from tests.test_tree import DEEP, PROMPTS, TREE, OracleTreeStub
from verify.backends.cache import keeps_prefix
from verify.backends.target import Target
from verify.loop.plain import plain_generate
from verify.loop.speculative import SpecConfig, speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 24
WRONG = 9  # a rank no node has: every node at that depth is wrong


class FixedRanks:
    """Stands in for OracleTreeStub's random source: the right rank at each depth is ranks(row, step) (a list,
    WRONG past its end). The stub draws 8 ranks per row, rows in order, once per step."""

    def __init__(self, batch: int, ranks):
        self.batch, self.ranks, self.calls = batch, ranks, 0

    def randrange(self, n: int) -> int:
        draw, depth = divmod(self.calls, 8)
        step, row = divmod(draw, self.batch)
        self.calls += 1
        ranks = self.ranks(row, step)
        return ranks[depth] if depth < len(ranks) else WRONG


def stub(ref: list[list[int]], paths, ranks) -> OracleTreeStub:
    drafter = OracleTreeStub(ref, paths)
    drafter.rng = FixedRanks(len(ref), ranks)
    return drafter


@pytest.fixture
def commits(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, bool]]:
    """Every rollback the loop makes, as (prefix it passed, whether keep is a prefix of every row)."""
    calls: list[tuple[bool, bool]] = []
    real = Target.commit

    def spy(self, keep, *, prefix=False):
        calls.append((prefix, bool(keeps_prefix(keep))))
        return real(self, keep, prefix=prefix)

    monkeypatch.setattr(Target, "commit", spy)
    return calls


def decode(lm, prompts, drafter, gamma: int = 3):
    """Speculative and plain greedy decoding; checks the outputs and the caches they end with, and returns the
    speculative result."""
    plain_target, target = Target(lm), Target(lm)
    ref = plain_generate(plain_target, prompts, max_new_tokens=NEW).tokens
    out = speculative_generate(target, drafter, prompts, max_new_tokens=NEW, spec=SpecConfig(gamma=gamma))
    assert out.tokens == ref
    # Every row's cache holds its prompt and all its tokens but the last (pending) one, as plain decoding's does:
    # the last step's rollback was made when the loop ended.
    want = torch.tensor([len(p) + len(t) - 1 for p, t in zip(prompts, ref)])
    assert target.cache.lengths.tolist() == want.tolist() == plain_target.cache.lengths.tolist()
    for spec_buf, plain_buf in zip(target.cache.k + target.cache.v, plain_target.cache.k + plain_target.cache.v):
        for row, n in enumerate(want.tolist()):
            torch.testing.assert_close(spec_buf[row, :, :n], plain_buf[row, :, :n], atol=1e-5, rtol=1e-5)
    return out


def test_keeps_prefix():
    rows = lambda *r: torch.tensor(r, dtype=torch.bool)  # noqa: E731
    assert bool(keeps_prefix(rows([1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1])))
    assert not bool(keeps_prefix(rows([1, 1, 0, 0], [1, 0, 1, 0])))
    assert not bool(keeps_prefix(rows([0, 1, 0, 0])))
    assert bool(keeps_prefix(torch.zeros(2, 0, dtype=torch.bool)))


@pytest.mark.parametrize(
    "paths, right",
    [
        (TREE, [0]),  # the first root child, none of its children: nodes 0, 1
        (TREE, []),  # nothing beyond the root
        (DEEP, [0, 0, 0, 0]),  # a chain as a tree, every node right
    ],
    ids=["first-child", "root-only", "deep"],
)
def test_a_tree_that_keeps_a_prefix_of_its_nodes_is_rewound(lm, commits, paths, right):
    ref = plain_generate(Target(lm), PROMPTS, max_new_tokens=NEW).tokens
    out = decode(lm, PROMPTS, stub(ref, paths, lambda row, step: right))
    assert int(out.stats.forwards.max()) > 5
    assert commits and all(prefix for prefix, _ in commits), "a tree that keeps a prefix moved its cache entries"


@pytest.mark.parametrize("right", [[1], [0, 0], [0, 1, 0]], ids=["second-child", "grandchild", "deeper"])
def test_a_tree_that_keeps_other_nodes_moves_them(lm, commits, right):
    ref = plain_generate(Target(lm), PROMPTS, max_new_tokens=NEW).tokens
    decode(lm, PROMPTS, stub(ref, TREE, lambda row, step: right))
    assert all(prefix == is_prefix for prefix, is_prefix in commits)
    assert any(not prefix for prefix, _ in commits), "kept nodes that are not a prefix were rewound over"


def test_a_batch_of_both_kinds_moves_the_entries_and_stays_exact(lm, commits):
    ref = plain_generate(Target(lm), PROMPTS, max_new_tokens=NEW).tokens
    kinds = [[0], [1], [], [0, 0]]  # rows 0 and 2 keep prefixes, rows 1 and 3 do not
    decode(lm, PROMPTS, stub(ref, TREE, lambda row, step: kinds[row]))
    assert commits[0] == (False, False), "a batch with a non-prefix row was rewound"
    assert all(prefix == is_prefix for prefix, is_prefix in commits)  # the last steps' rows left may keep prefixes
    # Alone, each row of the first kind is rewound, each of the second moves its entries.
    for row, prompt in enumerate(PROMPTS):
        commits.clear()
        decode(lm, [prompt], stub([ref[row]], TREE, lambda _, step, row=row: kinds[row]))
        assert all(prefix == is_prefix for prefix, is_prefix in commits)
        assert any(not prefix for prefix, _ in commits) == (row in (1, 3))


def test_steps_of_both_kinds_alternate(lm, commits):
    """Both commits in one run, a prefix step after a moving one and the reverse: each step's commit is decided
    on its own kept nodes (a stale flag from the step before would show here)."""
    ref = plain_generate(Target(lm), PROMPTS, max_new_tokens=NEW).tokens
    decode(lm, PROMPTS, stub(ref, TREE, lambda row, step: [0] if step % 2 else [(row + step) % 3, 1]))
    assert all(prefix == is_prefix for prefix, is_prefix in commits)
    assert {prefix for prefix, _ in commits} == {True, False}


def test_a_tree_cycle_adds_no_host_read(counted):  # noqa: F811
    """The prefix flag travels in the loop's one read per cycle: a tree cycle at T = 0 reads the host twice (that
    read, and the greedy walk's depth), whichever commit it makes; tests/test_host_reads.py bounds every read."""
    model = make_base()
    drafter = MedusaDrafter(perturb(train.build(model, num_heads=3, num_layers=1), seed=1), mode="tree", tree_nodes=6)
    target, prompts = Target(model), [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10]]
    run = lambda new: speculative_generate(target, drafter, prompts, max_new_tokens=new, spec=SpecConfig(gamma=3))  # noqa: E731
    run(2)  # builds the engine (its one-time check against the model reads a few values)
    counted.clear()
    out = run(40)
    counts = dict(counted)  # before the assertions below read anything themselves
    cycles = int(out.stats.forwards.max()) - 1  # verification forwards after the prefill
    assert cycles >= 10
    # Lists: the loop's read per cycle and its last one, then the tokens handed back (2). Ints: the greedy walk's
    # depth per cycle, and the cache's exact length now and then (see tests/test_host_reads.py). Nothing else.
    assert counts.pop("tolist", 0) == cycles + 1 + 2, counts
    assert counts.pop("__int__", 0) <= cycles + cycles // 4 + 3, counts
    assert not counts, counts
