"""The walk of `tree_sampling_accept`, tested directly on many rows at once (vectorised, seconds).

A row's walk stops for good once every child of its node is rejected: the token it adds then follows
the residual left by those rejections, never a residual reduced again by trying the same children at
the next depth. These tests have the power to see that: a chain of 3 as a tree, with p = [0.2, 0.5, 0.3]
and q = [0.6, 0.2, 0.2] at every node, must add norm(max(0, p - q)) = [0, 0.75, 0.25] after a rejection
at every depth (a walk that retries gives [0, 0.92, 0.08] at depth 2 and [0, 1, 0] at depth 3).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.test_tree import random_tree
from verify.loop.acceptance import speculative_accept
from verify.loop.tree import tree_sampling_accept

Z_999 = 3.0902  # standard normal quantile for significance 0.001


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pooled chi-square of observed counts against expected probabilities (each (groups, V)), cells with
    expected count < 5 pooled into one, and its 0.001 critical value (Wilson-Hilferty). A cell of
    probability 0 must be empty: one token there is a failure whatever the statistic."""
    assert not bool(((probs == 0) & (counts > 0)).any()), "a token of probability 0 was emitted"
    expected = probs * counts.sum(-1, keepdim=True)
    big = expected >= 5
    stat = float(((counts - expected) ** 2 / expected.clamp(min=1e-12))[big].sum())
    cells = int(big.sum()) - int((big.sum(-1) > 0).sum())  # one degree of freedom lost per group
    small_obs, small_exp = float(counts[~big].sum()), float(expected[~big].sum())
    if small_exp > 0:
        stat, cells = stat + (small_obs - small_exp) ** 2 / small_exp, cells + 1
    dof = max(cells, 1)
    return stat, dof * (1 - 2 / (9 * dof) + Z_999 * math.sqrt(2 / (9 * dof))) ** 3


def residual(p: torch.Tensor, q: torch.Tensor, times: int) -> torch.Tensor:
    """The test's oracle: norm(max(0, r - q)) applied `times` times to p (the rule after `times` rejections
    of candidates drawn from q)."""
    for _ in range(times):
        left = (p - q).clamp(min=0)
        p = left / left.sum() if float(left.sum()) > 0 else p
    return p


def is_walk(path: torch.Tensor, parents: torch.Tensor, accepted: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """(b,) True where path (b, D + 1) starts at the root, each step goes to a child of the previous node
    or repeats it, never moves again once it repeats, and ends at depth `accepted`."""
    prev, nxt = path[:, :-1], path[:, 1:]
    repeat = nxt == prev
    child = parents.gather(1, nxt) == prev
    stopped_before = torch.cumsum(repeat.long(), dim=1) - repeat.long() > 0  # a repeat came earlier
    steps_ok = ((repeat | child) & ~(stopped_before & ~repeat)).all(1)
    return (path[:, 0] == 0) & steps_ok & (depth.gather(1, path[:, -1:]).squeeze(1) == accepted)


P3, Q3 = torch.tensor([0.2, 0.5, 0.3]), torch.tensor([0.6, 0.2, 0.2])


def chain_as_tree(depth: int, rows: int, *, delta: float = 0.0, seed: int = 0):
    """The issue's reproduction: draft token 0 at every depth, p = P3 and q = Q3 at every node."""
    p = P3.expand(rows, depth + 1, 3).contiguous()
    q = Q3.expand(rows, depth + 1, 3).contiguous()
    tokens = torch.zeros(rows, depth + 1, dtype=torch.long)
    parents = torch.arange(-1, depth).expand(rows, -1)
    gen = torch.Generator().manual_seed(seed)
    return tree_sampling_accept(p, tokens, parents, q, gen, delta=delta)


def test_residual_after_a_rejection_at_each_depth_of_a_chain():
    """200,000 rows: after a rejection at depth 1, 2 or 3 the next token follows [0, 0.75, 0.25]; after
    a full acceptance, p. Each draft is accepted with probability 0.2 / 0.6 = 1/3 at every depth."""
    accepted, path, nxt = chain_as_tree(3, 200_000)
    for a in range(4):
        want = residual(P3, Q3, 1) if a < 3 else P3
        counts = torch.bincount(nxt[accepted == a], minlength=3).float()
        stat, critical = chi_square(counts[None], want[None])
        assert stat < critical, (a, counts / counts.sum(), want, stat, critical)
    share = torch.bincount(accepted, minlength=4).float() / accepted.numel()
    want = torch.tensor([2 / 3, 2 / 9, 2 / 27, 1 / 27])
    stat, critical = chi_square((share * accepted.numel())[None], want[None])
    assert stat < critical, (share, want)


def test_a_depth_one_tree_is_speculative_accept():
    """One child under the root draws the same random numbers in the same order as a chain of one."""
    gen = torch.Generator().manual_seed(1)
    b, vocab = 5000, 7
    p = torch.softmax(2 * torch.randn(b, 2, vocab, generator=gen), -1)
    q = torch.softmax(2 * torch.randn(b, 1, vocab, generator=gen), -1)
    draft = torch.multinomial(q[:, 0], 1, generator=gen)  # (b, 1)
    for delta in (0.0, 0.3):
        for q_ in (q, None):
            want = speculative_accept(p, q_, draft, delta=delta, generator=torch.Generator().manual_seed(2))
            tokens = torch.cat((torch.zeros_like(draft), draft), dim=1)
            q_tree = None if q_ is None else torch.cat((torch.zeros_like(q), q), dim=1)
            parents = torch.tensor([-1, 0]).expand(b, -1)
            accepted, path, nxt = tree_sampling_accept(
                p, tokens, parents, q_tree, torch.Generator().manual_seed(2), delta=delta
            )
            assert torch.equal(accepted, want[0]) and torch.equal(nxt, want[1]), (delta, q_ is None)
            assert torch.equal(path[:, 1], accepted)  # node 1 when accepted, else the root repeated


# A branching tree (verify indexing): root 0 -> 1, 2, 3; 1 -> 4, 5; 2 -> 6; 4 -> 7, 8; 6 -> 9; 7 -> 10.
BRANCHING = torch.tensor([-1, 0, 0, 0, 1, 1, 2, 4, 4, 6, 7])


def sampled_tree(rows: int, *, seed: int, vocab: int = 4, delta: float = 0.0):
    """Every node's children drawn i.i.d. from one q per parent (SpecInfer's multi-candidate case); p and q
    the same for every row, so each node's emitted-token counts pool over rows."""
    gen = torch.Generator().manual_seed(seed)
    n = BRANCHING.shape[0]
    p_node = torch.softmax(1.5 * torch.randn(n, vocab, generator=gen), -1)  # (n, V) the target after each node
    q_node = torch.softmax(1.5 * torch.randn(n, vocab, generator=gen), -1)  # (n, V) what each node's children follow
    q_child = q_node[BRANCHING.clamp(min=0)]  # (n, V) the q each node was drawn from (root: unused)
    tokens = torch.multinomial(q_child, rows, replacement=True, generator=gen).T  # (rows, n)
    tokens[:, 0] = 0
    parents = BRANCHING.expand(rows, -1)
    p = p_node.expand(rows, -1, -1).contiguous()
    q = q_child.expand(rows, -1, -1).contiguous()
    out = tree_sampling_accept(p, tokens, parents, q, torch.Generator().manual_seed(seed + 1), delta=delta)
    return out, tokens, p_node, q_node


@pytest.mark.parametrize("seed", [0, 1])
def test_sampled_branching_tree_stops_where_its_walk_stops(seed):
    """Where the walk ends at node X, the next token follows p_X reduced once per child of X (all of them
    rejected), however deep X is; and the token after every reached node follows p_X (lossless)."""
    (accepted, path, nxt), tokens, p_node, q_node = sampled_tree(200_000, seed=seed)
    end = path[:, -1]
    n, vocab = p_node.shape
    children = torch.bincount(BRANCHING[1:], minlength=n)
    stopped = torch.stack([torch.bincount(nxt[end == x], minlength=vocab) for x in range(n)]).float()
    want = torch.stack([residual(p_node[x], q_node[x], int(children[x])) for x in range(n)])
    stat, critical = chi_square(stopped, want)
    assert stat < critical, f"after a stop: chi2 {stat:.1f} >= {critical:.1f}"
    depth = torch.tensor([0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4])
    assert len(set(depth[stopped.sum(-1) >= 100].tolist())) == 5  # walks stop at every depth, 100s of times

    # the token emitted after node x: its accepted child's token, or nxt where the walk ends at x
    emitted = torch.zeros(n, vocab)
    for d in range(path.shape[1]):
        at, reached = path[:, d], accepted >= d
        after = torch.where(accepted > d, tokens.gather(1, path[:, min(d + 1, path.shape[1] - 1)][:, None])[:, 0], nxt)
        emitted.index_put_((at[reached], after[reached]), torch.ones(int(reached.sum())), accumulate=True)
    assert bool((depth[end] == accepted).all())
    stat, critical = chi_square(emitted, p_node)
    assert stat < critical, f"emitted after each node: chi2 {stat:.1f} >= {critical:.1f}"


@pytest.mark.parametrize("delta", [0.0, 0.3])
@pytest.mark.parametrize("sampled", [True, False])
def test_every_returned_path_is_a_walk(delta, sampled):
    """On random trees (batched, ragged: each row its own shape) the path is a walk from the root that
    repeats its last node once it stops, and `accepted` is that node's depth, for every delta."""
    from verify.backends.cache import tree_attention

    gen = torch.Generator().manual_seed(3)
    for trial in range(30):
        b, n, vocab = 64, int(torch.randint(2, 14, (1,), generator=gen)), 3
        parents = torch.stack([random_tree(gen, n) for _ in range(b)])
        p = torch.softmax(2 * torch.randn(b, n, vocab, generator=gen), -1)
        q = torch.softmax(2 * torch.randn(b, n, vocab, generator=gen), -1) if sampled else None
        tokens = torch.randint(0, vocab, (b, n), generator=gen)  # siblings often share a token
        accepted, path, nxt = tree_sampling_accept(p, tokens, parents, q, gen, delta=delta)
        _, depth = tree_attention(parents)
        ok = is_walk(path, parents, accepted, depth)
        assert bool(ok.all()), (trial, parents[~ok][0], path[~ok][0], accepted[~ok][0])
        assert bool(((nxt >= 0) & (nxt < vocab)).all())


def test_chain_paths_are_walks_with_leniency():
    """The issue's probe: delta = 0.3 on a chain of 3 returned [0, 0, 1, 1] (a rejected node accepted on the
    retry) in a quarter of the rows; every path must be a prefix walk."""
    accepted, path, _ = chain_as_tree(3, 20_000, delta=0.3)
    depth = torch.arange(4).expand(20_000, -1)
    assert bool(is_walk(path, torch.arange(-1, 3).expand(20_000, -1), accepted, depth).all())
    assert torch.equal(path, torch.minimum(torch.arange(4), accepted[:, None]))


def test_deterministic_candidates_match_one_hot_q():
    """q = None means q one-hot on each candidate: the same walk, bit for bit, as passing that one-hot."""
    gen = torch.Generator().manual_seed(4)
    b, vocab = 2000, 5
    parents = BRANCHING.expand(b, -1)
    n = parents.shape[1]
    p = torch.softmax(2 * torch.randn(b, n, vocab, generator=gen), -1)
    tokens = torch.randint(0, vocab, (b, n), generator=gen)
    got = tree_sampling_accept(p, tokens, parents, None, torch.Generator().manual_seed(5))
    want = tree_sampling_accept(p, tokens, parents, F.one_hot(tokens, vocab).float(), torch.Generator().manual_seed(5))
    for g, w in zip(got, want):
        assert torch.equal(g, w)


# ------------------------------------------------------------------ siblings drawn without replacement


def test_sibling_draws_are_distinct_successive_draws_with_their_q():
    """sample_siblings: 200,000 rows of 3 draws from p over 5 ids (one of probability 0). The draws are
    distinct, draw j's q is p without draws < j, renormalised, and the pairs (x0, x1) follow
    p(x0) p(x1) / (1 - p(x0)) (chi-square); the id of probability 0 is never drawn while others are left."""
    from verify.loop.sampling import sample_siblings

    p = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    rows = 200_000
    index, q = sample_siblings(p.expand(rows, -1), 3, torch.Generator().manual_seed(0))
    assert index.shape == (rows, 3) and q.shape == (rows, 3, 5)
    assert bool((index.sort(-1).values.diff(dim=-1) > 0).all())  # distinct
    assert not bool((index == 4).any())
    want = p.expand(rows, 3, -1).clone()
    for j in range(1, 3):
        want[:, j:].scatter_(2, index[:, j - 1, None, None].expand(-1, 3 - j, 1), 0.0)
    torch.testing.assert_close(q, want / want.sum(-1, keepdim=True))
    pairs = torch.bincount(index[:, 0] * 5 + index[:, 1], minlength=25).float().reshape(5, 5)
    expected = p[:, None] * p[None, :] / (1 - p[:, None])
    expected.fill_diagonal_(0)
    stat, critical = chi_square(pairs.flatten()[None], expected.flatten()[None])
    assert stat < critical, (stat, critical)


def test_draws_past_the_mass_are_deterministic_with_one_hot_q():
    """Fewer ids with probability than draws (a top-k transform, a trimmed vocabulary): the draws past them are
    the remaining ids in id order, each with q one-hot on itself (a deterministic pick), never a q of no mass."""
    from verify.loop.sampling import sample_siblings

    p = torch.tensor([0.0, 0.7, 0.0, 0.3, 0.0])
    index, q = sample_siblings(p.expand(1000, -1), 4, torch.Generator().manual_seed(1))
    assert set(map(tuple, index[:, :2].sort(-1).values.tolist())) == {(1, 3)}
    assert index[:, 2:].tolist() == [[0, 2]] * 1000
    torch.testing.assert_close(q[:, 2:], F.one_hot(index[:, 2:], 5).float())
    torch.testing.assert_close(q.sum(-1), torch.ones(1000, 4))


def siblings_at_the_root(rows: int, *, seed: int, wrong_q: bool):
    """One parent, three children drawn without replacement from q; returns the token the rule emits after the
    root. wrong_q records every sibling's q as the undepleted q (the draws' real law ignored)."""
    from verify.loop.sampling import sample_siblings

    gen = torch.Generator().manual_seed(seed)
    vocab = 5
    p_root = torch.softmax(1.5 * torch.randn(vocab, generator=gen), -1)
    q_root = torch.softmax(1.5 * torch.randn(vocab, generator=gen), -1)
    index, q = sample_siblings(q_root.expand(rows, -1), 3, gen)  # (rows, 3), (rows, 3, V)
    if wrong_q:
        q = q_root.expand(rows, 3, -1)
    tokens = torch.cat((torch.zeros(rows, 1, dtype=torch.long), index), dim=1)
    parents = torch.tensor([-1, 0, 0, 0]).expand(rows, -1)
    p = p_root.expand(rows, 4, -1).contiguous()  # p after a child is never used: every child is a leaf
    q = torch.cat((torch.zeros(rows, 1, vocab), q), dim=1)
    accepted, path, nxt = tree_sampling_accept(p, tokens, parents, q, torch.Generator().manual_seed(seed + 1))
    first = torch.where(accepted > 0, tokens.gather(1, path[:, 1:2])[:, 0], nxt)
    return torch.bincount(first, minlength=vocab).float(), p_root, accepted


@pytest.mark.parametrize("seed", [0, 1])
def test_siblings_without_replacement_are_lossless_and_a_wrong_q_is_caught(seed):
    """200,000 rows: the first emitted token follows p with sibling draws without replacement and their q;
    recording the undepleted q for every sibling (the bug this guards against) is rejected by the same test."""
    counts, p_root, accepted = siblings_at_the_root(200_000, seed=seed, wrong_q=False)
    stat, critical = chi_square(counts[None], p_root[None])
    assert stat < critical, (counts / counts.sum(), p_root, stat, critical)
    assert 0.2 < float((accepted > 0).float().mean()) < 1
    counts, p_root, _ = siblings_at_the_root(200_000, seed=seed, wrong_q=True)
    stat, critical = chi_square(counts[None], p_root[None])
    assert stat > critical, f"a wrong q passed: chi2 {stat:.1f} < {critical:.1f}; the test has no power"
