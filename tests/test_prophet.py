"""The prophet drafter: training touches only the prophet; cached, tree and unrolled forwards equal their
from-scratch counterparts; the drafter's state always follows the accepted context (a stale-state test
with negative controls); greedy output equals plain decoding; dynamic trees are valid trees; sampling
stays lossless (chi-square). Fusion of the base's layer states (fuse_layers): the states are
x-transformers' residual stream after each block; a fresh fused prophet is the unfused one; a fused
drafter follows the accepted context, layer states included, and stays exact."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from einops import repeat
from omegaconf import OmegaConf

import prophet.drafter as drafter_module
from experiments.lib.store.lm import build_lm
from experiments.lib.training.features import teacher_batch
from prophet import train
from prophet.drafter import ProphetDrafter, _settled, make_drafter
from prophet.model import Prophet, base_features
from tests.test_lossless import run, sharp_lm
from tests.test_medusa import lossless_cases
from tests.test_tree import check_sampled_siblings
from verify.backends.cache import tree_attention
from verify.backends.target import Target
from verify.loop.plain import plain_generate
from verify.loop.sampling import SamplingConfig
from verify.loop.speculative import SpecConfig, speculative_generate
from verify.loop.tree import verify_parents

V = 97
CONF = Path(__file__).resolve().parents[1] / "conf" / "drafter" / "prophet.yaml"
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4]]


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_base(seed: int = 0):
    torch.manual_seed(seed)
    return build_lm(num_tokens=V, dim=32, depth=2, heads=2, max_seq_len=96).eval()


def batch(base, b: int = 8, t: int = 16, seed: int = 1):
    """A fixed batch and the frozen base's outputs for tokens[:, :-1], as the training loop provides them."""
    tokens = torch.randint(0, V, (b, t + 1), generator=torch.Generator().manual_seed(seed))
    return teacher_batch(base, tokens, top_k=V)  # the whole distribution as the teacher


def fit(base, prophet, data, steps: int, unroll: int = 1, lr: float = 1e-2) -> list[float]:
    opt = torch.optim.AdamW(prophet.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss, _ = train.loss(prophet, base, data, unroll=unroll)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def trained():
    """A prophet trained briefly on the random base's own outputs: it drafts well enough to be accepted."""
    base = tiny_base()
    torch.manual_seed(0)
    prophet = train.build(base, dim=32, depth=1, heads=2)
    fit(base, prophet, batch(base, b=16, t=32), steps=60)
    return base, prophet.eval()


# ---------------------------------------------------------------- training


def test_gradients_reach_the_prophet_only():
    base = tiny_base()  # parameters still require grad: the prophet must detach them itself
    prophet = train.build(base, dim=32, depth=2, heads=2)
    loss, metrics = train.loss(prophet, base, batch(base), unroll=2)
    loss.backward()
    assert {"step1_feature", "step1_ce", "step1_agree", "step2_feature", "loss"} <= set(metrics)
    for name, p in prophet.named_parameters():
        assert p.grad is not None and bool(p.grad.abs().sum() > 0), name
    assert all(p.grad is None for p in base.parameters())
    base_tensors = {base.token_emb.emb.weight.data_ptr(), base.to_logits.weight.data_ptr()}
    state = prophet.state_dict()
    assert not any("token_emb" in k or "to_logits" in k or k.startswith("head") for k in state)
    assert not base_tensors & {v.data_ptr() for v in state.values()}
    assert not base_tensors & {p.data_ptr() for p in prophet.parameters()}


@pytest.mark.parametrize("unroll", [1, 2])
def test_loss_drops(unroll):
    base = tiny_base()
    torch.manual_seed(0)
    prophet = train.build(base, dim=32, depth=1, heads=2)
    data = batch(base)
    first, _ = train.loss(prophet, base, data, unroll=unroll)
    losses = fit(base, prophet, data, steps=60, unroll=unroll)
    assert losses[-1] < 0.7 * first.item(), (first.item(), losses[-1])
    before = train.evaluate(train.build(base, dim=32, depth=1, heads=2), base, data, eval_steps=3)
    after = train.evaluate(prophet, base, data, eval_steps=3)
    assert list(after) == [f"step{j}_{m}" for j in (1, 2, 3) for m in ("agree", "mass")] + ["chain_tau", "chain_mass"]
    assert after["step1_agree"] > before["step1_agree"] + 0.2
    assert after["chain_tau"] > before["chain_tau"] and 1 <= before["chain_tau"] <= after["chain_tau"] <= 4
    assert after["step1_mass"] > before["step1_mass"] and 1 <= after["chain_mass"] <= 4  # T = 1 acceptance too


# ---------------------------------------------------------------- forwards


def test_cached_and_tree_forwards_equal_full_forwards():
    base = tiny_base()
    prophet = train.build(base, dim=32, depth=2, heads=2).eval()
    data = batch(base, b=2, t=10)
    hidden, nxt = data.hidden, data.tokens[:, 1:]
    with torch.no_grad():
        full = prophet(hidden, nxt)
        cache = prophet.new_cache(2, 4)  # too small on purpose: the cache grows
        parts = [prophet.step(hidden[:, a:b], nxt[:, a:b], cache) for a, b in [(0, 4), (4, 5), (5, 10)]]
        assert torch.allclose(torch.cat(parts, 1), full, atol=1e-5)
        # a tree of new entries in one forward: every node equals its path run alone
        cache.commit(torch.zeros(2, 5, dtype=torch.bool))  # roll back to the first 5 entries
        feats, toks = torch.randn(2, 4, hidden.shape[-1]), torch.randint(0, V, (2, 4))
        parents = torch.tensor([[-1, 0, -1, 1]] * 2)
        ancestors, depth = tree_attention(parents)
        tree = prophet.step(feats, toks, cache, allow=ancestors, pos=5 + depth)
        for node, path in [(0, [0]), (1, [0, 1]), (2, [2]), (3, [0, 1, 3])]:
            alone = prophet(torch.cat((hidden[:, :5], feats[:, path]), 1), torch.cat((nxt[:, :5], toks[:, path]), 1))
            assert torch.allclose(tree[:, node], alone[:, -1], atol=1e-5)


def test_unroll_step_j_is_a_draft_chain():
    """Step j at index t = true entries up to t - j + 1, then j - 1 entries fed the prophet's own predictions."""
    base = tiny_base()
    prophet = train.build(base, dim=32, depth=2, heads=2).eval()
    data = batch(base, b=2, t=10)
    hidden, nxt = data.hidden, data.tokens[:, 1:]
    with torch.no_grad():
        steps = prophet.unroll(hidden, nxt, 3)
        assert torch.equal(steps[0], prophet(hidden, nxt))
        for j in (2, 3):
            for t in (j - 1, 5, 9):
                cache = prophet.new_cache(2, 16)
                out = prophet.step(hidden[:, : t - j + 2], nxt[:, : t - j + 2], cache)[:, -1:]
                for i in range(t - j + 2, t + 1):
                    out = prophet.step(out, nxt[:, i : i + 1], cache)
                assert torch.allclose(steps[j - 1][:, t], out[:, 0], atol=1e-5), (j, t)


# ---------------------------------------------------------------- drafting follows the accepted context


def true_features(base, prophet, x):
    """The base's features of x (1, n) as the prophet reads them (mixed with the layer states when it fuses)."""
    hidden, _, layers = base_features(base, x, prophet.fuse_layers)
    return prophet.seed(hidden, layers)


def seeded_forward(prophet, feats, toks):
    """The prophet's forward on features already seeded: true ones mixed, predicted ones as they are."""
    return prophet.out(prophet.decoder(prophet.fused(feats, toks)))


def chain_reference(base, prophet):
    """From scratch on the true context: the base's features, then the prophet autoregressively."""

    def reference(ctx, gamma):
        x = torch.tensor([ctx])
        feats, toks, out = (
            true_features(base, prophet, x)[:, :-1],
            x[:, 1:],
            [],
        )  # the pending token's feature is not known yet
        for _ in range(gamma):
            f = seeded_forward(prophet, feats, toks)[:, -1:]
            d = prophet.logits(f).argmax(-1)
            feats, toks = torch.cat((feats, f), 1), torch.cat((toks, d), 1)
            out.append(int(d))
        return out

    return reference


def tree_reference(base, prophet, *, top_k, depth, tree_nodes):
    """EAGLE-2's dynamic tree, naively: every node's feature from a full forward of its own path."""

    def reference(ctx, gamma):
        x = torch.tensor([ctx])
        true = true_features(base, prophet, x)

        def children(path):  # top-k (log-prob, token) after the pending token and `path`
            feats, toks = true[:, :-1], x[:, 1:]
            f = seeded_forward(prophet, feats, toks)[:, -1:]
            for tok in path:
                feats, toks = torch.cat((feats, f), 1), torch.cat((toks, torch.tensor([[tok]])), 1)
                f = seeded_forward(prophet, feats, toks)[:, -1:]
            s, t = prophet.logits(f[0, 0]).log_softmax(-1).topk(top_k)
            return zip(s.tolist(), t.tolist())

        pool = [(s, t, -1, [t]) for s, t in children([])]  # (score, token, parent, path)
        frontier = list(range(len(pool)))
        for _ in range(min(depth, gamma) - 1):
            cands = []
            for node in frontier:
                for s, t in children(pool[node][3]):
                    pool.append((pool[node][0] + s, t, node, pool[node][3] + [t]))
                    cands.append(len(pool) - 1)
            frontier = [cands[i] for i in torch.tensor([pool[c][0] for c in cands]).topk(top_k).indices.tolist()]
        best = sorted(sorted(range(len(pool)), key=lambda i: -pool[i][0])[:tree_nodes])
        where = {node: i for i, node in enumerate(best)}
        return [(pool[i][1], where.get(pool[i][2], -1)) for i in best]

    return reference


class Spy:
    """Like tests/test_speculative.py's ContextSpy, for chains and trees (a tree row is compared as its
    (token, parent) pairs), checking only rows still within their budget: a finished row's verdicts
    carry placeholder tokens that the target never took."""

    def __init__(self, inner, reference, max_new_tokens):
        self.inner, self.reference, self.vocab_size, self.checked = inner, reference, inner.vocab_size, 0
        self.target_layers = inner.target_layers  # a fused prophet reads the target's layer states
        self.max_new_tokens = max_new_tokens

    def begin(self, prompts, prefill, pending):
        self.ctx = [p + [t] for p, t in zip(prompts, pending.tolist())]
        self.left = [self.max_new_tokens - 1] * len(prompts)
        self.inner.begin(prompts, prefill, pending)

    def propose(self, gamma, sampling, generator):
        draft = self.inner.propose(gamma, sampling, generator)
        for i, ctx in enumerate(self.ctx):
            if self.left[i] <= 0:
                continue
            got = draft.tokens[i].tolist()
            if draft.parents is not None:
                got = list(zip(got, draft.parents[i].tolist()))
            assert got == self.reference(ctx, gamma), f"stale drafter state in row {i}"
            self.checked += 1
        return draft

    def commit(self, verdict):
        for i, a in enumerate(verdict.accepted.tolist()):
            if self.left[i] > 0:
                self.ctx[i] += verdict.tokens[i, : a + 1].tolist()
                self.left[i] -= a + 1
        self.inner.commit(verdict)


TREE = dict(top_k=3, depth=3, tree_nodes=8)  # grows every level
PRUNED = dict(top_k=3, depth=4, tree_nodes=4)  # often stops growing early (`_settled`): must give the same tree


def run_spy(base, drafter, reference, gamma):
    spy = Spy(drafter, reference, max_new_tokens=20)
    with torch.no_grad():
        out = speculative_generate(Target(base), spy, PROMPTS, max_new_tokens=20, spec=SpecConfig(gamma=gamma))
    return out, spy


@pytest.mark.parametrize(
    "mode, gamma, tree",
    [("chain", 2, None), ("chain", 4, None), ("tree", 2, TREE), ("tree", 4, TREE), ("tree", 4, PRUNED)],
)
def test_drafter_follows_the_accepted_context(trained, monkeypatch, mode, gamma, tree):
    base, prophet = trained
    settled = []
    monkeypatch.setattr(drafter_module, "_settled", lambda *a: settled.append(_settled(*a)) or settled[-1])
    if mode == "chain":
        drafter, reference = ProphetDrafter(prophet, mode="chain"), chain_reference(base, prophet)
    else:
        drafter, reference = ProphetDrafter(prophet, mode="tree", **tree), tree_reference(base, prophet, **tree)
    out, spy = run_spy(base, drafter, reference, gamma)
    assert out.tokens == plain_generate(Target(base), PROMPTS, max_new_tokens=20).tokens
    assert spy.checked > 10 and 0 < out.stats.alpha < 1 and len(set(out.stats.accepted.tolist())) > 1
    assert any(settled) == (tree is PRUNED)


class StaleFeatures(ProphetDrafter):
    """Negative control: re-seeds from its own previous prediction instead of the base's verified features."""

    def _seed_features(self, verdict):
        return repeat(self.feature, "b d -> b n d", n=verdict.path.shape[1])


class KeepsDrafts(ProphetDrafter):
    """Negative control: never removes the entries it drafted from predicted features."""

    def commit(self, verdict):
        self.drafted = 0
        super().commit(verdict)


@pytest.mark.parametrize("stale", [StaleFeatures, KeepsDrafts])
def test_stale_state_is_detected(trained, stale):
    base, prophet = trained
    with pytest.raises(AssertionError, match="stale drafter state"):
        run_spy(base, stale(prophet, mode="chain"), chain_reference(base, prophet), 3)


# ---------------------------------------------------------------- decoding


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_equals_plain(trained, mode, gamma, rows):
    base, prophet = trained
    prompts = PROMPTS[-rows:]
    ref = plain_generate(Target(base), prompts, max_new_tokens=24).tokens
    out = speculative_generate(
        Target(base), ProphetDrafter(prophet, mode=mode), prompts, max_new_tokens=24, spec=SpecConfig(gamma=gamma)
    )
    assert out.tokens == ref


@pytest.mark.parametrize(
    "mode, tree, temperature",
    [("chain", {}, 0.0), ("tree", TREE, 0.0), ("tree", PRUNED, 0.0), ("tree", TREE, 1.0), ("tree", PRUNED, 1.0)],
)
def test_compiled_steps_take_one_shape_each(trained, monkeypatch, mode, tree, temperature):
    """Compiled, every commit is padded to the widest block a propose planned and every tree level's window to
    the deepest level's: one program per kind of step, so a shorter block (a tree that stopped early, a budget's
    last step) never compiles inside a timed run; sampled trees (T > 0) take the same shapes. Run on the eager
    step with the shapes recorded, the padded decode must still equal plain decoding, batched and ragged."""
    base, prophet = trained
    shapes, step = set(), prophet.step

    def recording(features, next_tokens, cache, *, allow=None, pos=None, compile=False):
        shapes.add((next_tokens.shape[1], None if allow is None else allow.shape[-1]))
        return step(features, next_tokens, cache, allow=allow, pos=pos)  # eager

    monkeypatch.setattr(prophet, "step", recording)
    ref = plain_generate(Target(base), PROMPTS, max_new_tokens=23).tokens
    drafter = ProphetDrafter(prophet, mode=mode, compile=True, **tree)
    sampling, gen = SamplingConfig(temperature=temperature), torch.Generator().manual_seed(0)
    out = speculative_generate(
        Target(base), drafter, PROMPTS, max_new_tokens=23, spec=SpecConfig(gamma=4), sampling=sampling, generator=gen
    )
    assert out.tokens == ref or temperature > 0
    shapes.discard((max(len(p) for p in PROMPTS), None))  # `begin` runs eagerly, at the prompts' width
    if mode == "chain":
        assert shapes == {(1, None), (5, None)}  # draft steps; commits of gamma + 1
    else:
        depth, k = tree["depth"], tree["top_k"]
        assert shapes == {(k, (depth - 1) * k), (depth + 1, None)}  # tree levels; commits of depth + 1


@pytest.mark.parametrize("mode, gamma, least", [("chain", 3, 1.2), ("tree", 4, 1.5)])
def test_trained_prophet_is_accepted(trained, mode, gamma, least):
    base, prophet = trained
    out = speculative_generate(
        Target(base), ProphetDrafter(prophet, mode=mode), PROMPTS, max_new_tokens=30, spec=SpecConfig(gamma=gamma)
    )
    assert out.stats.tau > least, out.stats.tau


class TreeChecker:
    """Wraps a drafter and checks every tree it proposes."""

    def __init__(self, inner, tree_nodes):
        self.inner, self.tree_nodes, self.vocab_size, self.depths = inner, tree_nodes, inner.vocab_size, []
        self.begin, self.commit = inner.begin, inner.commit

    def propose(self, gamma, sampling, generator):
        draft = self.inner.propose(gamma, sampling, generator)
        b, n = draft.tokens.shape
        assert draft.parents.shape == (b, n) and 1 <= n <= self.tree_nodes and draft.q is None
        node = torch.arange(n)
        assert bool(((draft.parents >= -1) & (draft.parents < node)).all()), "a parent after its child"
        _, depth = tree_attention(verify_parents(draft.parents))
        assert int(depth.max()) <= gamma
        self.depths.append(int(depth.max()))
        same_parent = draft.parents[:, :, None] == draft.parents[:, None, :]
        same_token = draft.tokens[:, :, None] == draft.tokens[:, None, :]
        assert not bool((same_parent & same_token & ~torch.eye(n, dtype=torch.bool)).any()), "duplicate siblings"
        return draft


@pytest.mark.parametrize("top_k, depth, tree_nodes", [(4, 5, 16), (2, 4, 16), (3, 6, 10), (1, 3, 2)])
def test_dynamic_trees_are_valid(trained, top_k, depth, tree_nodes):
    base, prophet = trained
    checker = TreeChecker(
        ProphetDrafter(prophet, mode="tree", top_k=top_k, depth=depth, tree_nodes=tree_nodes), tree_nodes
    )
    for gamma in (1, 3, 6):
        out = speculative_generate(Target(base), checker, PROMPTS, max_new_tokens=16, spec=SpecConfig(gamma=gamma))
        assert out.tokens == plain_generate(Target(base), PROMPTS, max_new_tokens=16).tokens
    if top_k == 2:  # a pool of 2 + 4 + 4 + 4 nodes fits the budget: the whole grown tree is kept
        assert max(checker.depths) == 4


# ---------------------------------------------------------------- losslessness


# (mode, tree candidates at T > 0, temperature, tree, gamma): a sampled tree of 3 children per node, cut to
# 8 of its 12 nodes (there, recording every sibling with its parent's whole q gave chi2 328 against a
# critical 173), to 4 (a cut that looks at the sampled tokens gave 885, see below), and 3 levels deep.
LOSSLESS = {
    "chain": ("chain", "sampled", 1.0, {}, 2),
    "sampled_tree": ("tree", "sampled", 1.0, dict(top_k=3, depth=2, tree_nodes=8), 2),
    "sampled_tree_cut_t07": ("tree", "sampled", 0.7, dict(top_k=3, depth=2, tree_nodes=4), 2),
    "sampled_tree_deep": ("tree", "sampled", 1.0, dict(top_k=3, depth=3, tree_nodes=6), 3),
    "ranked_tree": ("tree", "ranked", 1.0, dict(top_k=2, depth=2, tree_nodes=4), 2),
}


def lossless_prophet(mode: str, candidates: str, tree: dict) -> ProphetDrafter:
    torch.manual_seed(0)
    prophet = Prophet.from_base(sharp_lm(0), dim=16, depth=1, heads=2)  # sharp_lm(0) is the target `run` builds
    return ProphetDrafter(prophet, mode=mode, candidates=candidates, **tree)


# In the slow tier (the fast one keeps the chain and the sampled tree cut to 8 of 12 nodes at T = 1): the cut
# to 4 at T = 0.7, the 3-level tree, and the ranked candidates that are no longer the default at T > 0.
SLOW_CASES = {"sampled_tree_cut_t07", "sampled_tree_deep", "ranked_tree"}


@pytest.mark.parametrize("case", lossless_cases(LOSSLESS, SLOW_CASES))
def test_sampling_reproduces_the_target_distribution(case):
    mode, candidates, temperature, tree, gamma = LOSSLESS[case]
    (stat, critical), stats = run(
        lossless_prophet(mode, candidates, tree), SamplingConfig(temperature=temperature), gamma=gamma
    )
    assert 0 < stats.alpha < 1
    assert stat < critical, f"chi2 {stat:.1f} >= critical {critical:.1f}"


@pytest.mark.slow
def test_negative_control_a_cut_by_the_sampled_tokens_is_detected(monkeypatch):
    """Keeping the sampled nodes whose own tokens are likeliest (value = score, which reads the drawn token's
    log q, as EAGLE-2 ranks its candidates) makes the kept ones likelier than their q says: the test rejects it
    (measured: chi2 885 against a critical 173)."""
    children = ProphetDrafter._children

    def token_valued(self, logits, parent, sampling, generator):
        _, score, tokens, q = children(self, logits, parent, sampling, generator)
        return score, score, tokens, q

    monkeypatch.setattr(ProphetDrafter, "_children", token_valued)
    _, _, _, tree, gamma = LOSSLESS["sampled_tree_cut_t07"]  # the cut to 4 of 12 nodes, here at T = 1
    (stat, critical), _ = run(lossless_prophet("tree", "sampled", tree), SamplingConfig(temperature=1.0), gamma=gamma)
    assert stat > critical, f"a cut by the sampled tokens passed: chi2 {stat:.1f} < {critical:.1f}"


@pytest.mark.parametrize("vocab", [None, torch.arange(1, V, 3)])
def test_sampled_trees_draw_distinct_siblings_with_their_q(trained, vocab):
    """At T > 0 every node's children are distinct draws in node order with their q (tests/test_tree.py's
    check), within the budget, and the cut keeps a node's earlier siblings whenever it keeps the node: each
    parent's first kept child is its first draw, whose q is the parent's whole distribution (positive on the
    whole subset at T = 0.8), not one with a dropped draw's token removed."""
    base, prophet = trained
    drafter = ProphetDrafter(prophet, mode="tree", top_k=3, depth=4, tree_nodes=10, vocab=vocab)
    inside = torch.arange(V) if vocab is None else vocab
    drafter.begin(PROMPTS, Target(base).prefill(PROMPTS), torch.tensor([4, 60, 7]))
    sampling, gen = SamplingConfig(temperature=0.8), torch.Generator().manual_seed(0)
    shapes = set()
    for _ in range(10):  # proposals from the same state: only the draws differ
        draft = drafter.propose(4, sampling, gen)
        drafter.cache.commit(torch.zeros(3, drafter.drafted, dtype=torch.bool))  # drop the drafted entries
        assert draft.tokens.shape == (3, 10) and bool((draft.parents < torch.arange(10)).all())
        check_sampled_siblings(draft, V, vocab)
        earlier = draft.parents[:, :, None] == draft.parents[:, None, :]  # (b, i, j) siblings
        first = ~(earlier & torch.ones(10, 10, dtype=torch.bool).tril(-1)).any(-1)  # (b, n) no earlier sibling
        assert bool((draft.q[..., inside][first] > 0).all()), "a first kept child whose earlier draw was cut"
        shapes.add(tuple(draft.parents.flatten().tolist()))
    assert len(shapes) > 1  # the trees differ in shape: which parents grow children depends on the draws
    assert drafter.propose(4, SamplingConfig(), None).q is None


# ---------------------------------------------------------------- config and arguments


def test_config_drives_the_four_functions():
    cfg = OmegaConf.to_container(OmegaConf.load(CONF))
    assert cfg["package"] == "prophet" and set(cfg) == {"package", "batch_size", "module", "loss", "decode"}
    base = tiny_base()
    module = train.build(base, **cfg["module"])
    data = batch(base, b=2, t=8)
    loss, metrics = train.loss(module, base, data, **cfg["loss"])
    steps = range(1, cfg["loss"]["unroll"] + 1)
    assert torch.isfinite(loss) and set(metrics) == {
        f"step{j}_{m}" for j in steps for m in ("feature", "ce", "agree")
    } | {"loss"}
    per_step = {f"step{j}_{m}" for j in range(1, 6) for m in ("agree", "mass")}
    assert set(train.evaluate(module, base, data)) == per_step | {"chain_tau", "chain_mass"}
    drafter = make_drafter(module, base, **cfg["decode"])
    out = speculative_generate(Target(base), drafter, PROMPTS, max_new_tokens=8, spec=SpecConfig(gamma=5))
    assert out.tokens == plain_generate(Target(base), PROMPTS, max_new_tokens=8).tokens


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda b, p: ProphetDrafter(p, mode="beam"), "mode='beam'"),
        (lambda b, p: ProphetDrafter(p, top_k=0), "top_k=0"),
        (lambda b, p: ProphetDrafter(p, top_k=V + 1), f"top_k={V + 1}"),
        (lambda b, p: ProphetDrafter(p, depth=0), "depth=0"),
        (lambda b, p: ProphetDrafter(p, tree_nodes=1.5), "tree_nodes=1.5"),
        (lambda b, p: ProphetDrafter(p).propose(0, SamplingConfig(), None), "gamma=0"),
        (lambda b, p: train.build(b, dim=30, heads=4), "dim=30 is not divisible by heads=4"),
        (lambda b, p: train.build(b, dim=32, depth=0), "depth=0"),
        (lambda b, p: train.loss(p, b, batch(b), unroll=0), "unroll=0"),
        (lambda b, p: train.loss(p, b, batch(b), ce_weight=-1), "ce_weight=-1"),
        (lambda b, p: train.loss(p, b, batch(b, t=3), unroll=3), "unroll=3 needs sequences of at least 4"),
        (lambda b, p: train.evaluate(p, b, batch(b, t=4), eval_steps=5), "eval_steps=5 needs"),
        (lambda b, p: train.loss(p, tiny_base(1), batch(b)), "built on another base"),
        (lambda b, p: make_drafter(p, b, mode="x"), "mode='x'"),
    ],
)
def test_bad_arguments_raise_one_line_errors(make, match):
    base = tiny_base()
    prophet = train.build(base, dim=32, depth=1, heads=2)
    with pytest.raises(ValueError, match=match) as err:
        make(base, prophet)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- fusion of the base's layer states (fuse_layers)


def deep_base(seed: int = 0):
    """Three blocks: two layer states below the final hidden state."""
    torch.manual_seed(seed)
    return build_lm(num_tokens=V, dim=32, depth=3, heads=2, max_seq_len=96).eval()


def test_layer_states_are_the_residual_stream_after_each_block():
    """base_features' layer i = the input of block i + 1's pre-norm (the residual stream after block i), caught
    by hooks on the x-transformers modules; index 2i of layer_hiddens; hidden and logits as the plain forward."""
    base = deep_base()
    tokens = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    seen = {}
    hooks = [
        base.attn_layers.layers[2 * i][0][0].register_forward_pre_hook(lambda m, args, i=i: seen.setdefault(i, args[0]))
        for i in (1, 2)
    ]  # the norm before block i + 1's attention reads the stream after block i
    try:
        hidden, logits, states = base_features(base, tokens, [2, 1])
    finally:
        for hook in hooks:
            hook.remove()
    assert states.shape == (2, 9, 2, 32) and states.dtype == hidden.dtype == logits.dtype == torch.float32
    assert torch.equal(states[:, :, 0], seen[2]) and torch.equal(states[:, :, 1], seen[1])
    with torch.no_grad():
        ref_logits, ref_hidden = base(tokens, return_logits_and_embeddings=True)
        _, inter = base(tokens, return_intermediates=True)
    assert torch.equal(hidden, ref_hidden) and torch.equal(logits, ref_logits)
    assert len(inter.layer_hiddens) == 2 * 3 + 1 and torch.equal(inter.layer_hiddens[0], base.token_emb(tokens))
    assert torch.allclose(base.attn_layers.final_norm(inter.layer_hiddens[6]), hidden, atol=1e-6)  # layer 3 = depth
    assert base_features(base, tokens)[2] is None
    assert torch.equal(base_features(base, tokens)[0], hidden)


def test_fresh_fused_prophet_is_the_unfused_one():
    base = deep_base()
    data = batch(base, b=2, t=10)
    hidden, nxt = data.hidden, data.tokens[:, 1:]
    _, _, layers = base_features(base, data.tokens[:, :-1], (1, 2))
    torch.manual_seed(0)
    plain = Prophet.from_base(base, dim=32, depth=2, heads=2)
    torch.manual_seed(0)
    fused = Prophet.from_base(base, dim=32, depth=2, heads=2, fuse_layers=[1, 2])
    assert set(fused.state_dict()) - set(plain.state_dict()) == {"mix.weight", "mix.bias"}
    assert all(torch.equal(v, fused.state_dict()[k]) for k, v in plain.state_dict().items())
    with torch.no_grad():
        assert torch.equal(fused.seed(hidden, layers), hidden)
        assert torch.equal(fused(hidden, nxt, layers), plain(hidden, nxt))
        for a, b in zip(fused.unroll(hidden, nxt, 3, layers=layers), plain.unroll(hidden, nxt, 3), strict=True):
            assert torch.equal(a, b)
        fused.mix.weight[:, :64].normal_(0, 0.1, generator=torch.Generator().manual_seed(1))  # the layer-state columns
        moved = fused.unroll(hidden, nxt, 3, layers=layers)
        assert all((a - b).abs().max() > 1e-3 for a, b in zip(moved, plain.unroll(hidden, nxt, 3)))
        # the filler and the true prefix of every step read the mixed features; predictions stay unmixed
        assert torch.equal(moved[0], fused(hidden, nxt, layers))


def test_fused_prophet_rebuilds_from_json_kwargs():
    base = deep_base()
    kwargs = json.loads(json.dumps(dict(dim=32, depth=1, heads=2, fuse_layers=[2, 1])))  # as a checkpoint saves them
    fused = Prophet.from_base(base, **kwargs)
    assert fused.fuse_layers == (2, 1) and fused.mix.in_features == 3 * 32
    Prophet.from_base(base, **kwargs).load_state_dict(fused.state_dict(), strict=True)
    assert Prophet.from_base(base, dim=32, depth=1, heads=2, fuse_layers=(2, 1)).fuse_layers == (2, 1)
    plain = Prophet.from_base(base, dim=32, depth=1, heads=2, fuse_layers=None)
    assert plain.fuse_layers == () and not hasattr(plain, "mix")
    Prophet.from_base(base, dim=32, depth=1, heads=2).load_state_dict(plain.state_dict(), strict=True)
    with pytest.raises(RuntimeError, match="mix"):
        plain.load_state_dict(fused.state_dict(), strict=True)


FUSE = [1, 2]


def fit_fused(base, prophet, steps: int = 60) -> None:
    """Teacher forcing on the base's own outputs, as prophet/train.py does (feature SmoothL1 + 0.1 CE)."""
    data = batch(base, b=16, t=32)
    hidden, logits, layers = base_features(base, data.tokens[:, :-1], prophet.fuse_layers)
    nxt = data.tokens[:, 1:]
    opt = torch.optim.AdamW(prophet.parameters(), lr=1e-2)
    for _ in range(steps):
        pred = prophet(hidden, nxt, layers)[:, :-1]
        ce = -(logits[:, 1:].softmax(-1) * prophet.logits(pred).log_softmax(-1)).sum(-1).mean()
        loss = F.smooth_l1_loss(pred, hidden[:, 1:]) + 0.1 * ce
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.fixture(scope="module")
def fused_trained():
    """A prophet fusing blocks 1 and 2 of a 3-block base, trained briefly: drafts get accepted, and the
    layer states matter (the mix left its identity start)."""
    base = deep_base()
    torch.manual_seed(0)
    prophet = Prophet.from_base(base, dim=32, depth=1, heads=2, fuse_layers=FUSE)
    fit_fused(base, prophet)
    assert prophet.mix.weight[:, : 2 * 32].abs().max() > 1e-2  # training reached the layer-state columns
    return base, prophet.eval()


class UnmixedFeatures(ProphetDrafter):
    """Negative control: seeds from the final hidden states alone, as an unfused prophet would."""

    def _seed_features(self, verdict):
        hidden = verdict.target.hidden
        return hidden.gather(1, repeat(verdict.path, "b n -> b n d", d=hidden.shape[-1]))


class LayersOffPath(ProphetDrafter):
    """Negative control: mixes in the layer states of the old pending token at every accepted node."""

    def _seed_features(self, verdict):
        out = verdict.target
        layers = repeat(out.layers[:, 0], "b s d -> b n s d", n=out.layers.shape[1])
        return super()._seed_features(replace(verdict, target=replace(out, layers=layers)))


@pytest.mark.parametrize("mode, gamma", [("chain", 3), ("tree", 4)])
def test_fused_drafter_follows_the_accepted_context(fused_trained, mode, gamma):
    base, prophet = fused_trained
    if mode == "chain":
        drafter, reference = ProphetDrafter(prophet, mode="chain"), chain_reference(base, prophet)
    else:
        drafter, reference = ProphetDrafter(prophet, mode="tree", **TREE), tree_reference(base, prophet, **TREE)
    assert drafter.target_layers == (1, 2)
    out, spy = run_spy(base, drafter, reference, gamma)
    assert out.tokens == plain_generate(Target(base), PROMPTS, max_new_tokens=20).tokens
    assert spy.checked > 10 and 0 < out.stats.alpha < 1 and len(set(out.stats.accepted.tolist())) > 1


@pytest.mark.parametrize("wrong", [UnmixedFeatures, LayersOffPath])
def test_wrong_layer_states_are_detected(fused_trained, wrong):
    base, prophet = fused_trained
    with pytest.raises(AssertionError, match="stale drafter state"):
        run_spy(base, wrong(prophet, mode="chain"), chain_reference(base, prophet), 3)


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_fused_greedy_equals_plain(fused_trained, mode, gamma):
    base, prophet = fused_trained
    target = Target(base)
    ref = plain_generate(target, PROMPTS, max_new_tokens=24).tokens
    out = speculative_generate(
        target, ProphetDrafter(prophet, mode=mode), PROMPTS, max_new_tokens=24, spec=SpecConfig(gamma=gamma)
    )
    assert out.tokens == ref and out.stats.alpha > 0
    assert target.layers == (1, 2)
    plain_generate(target, PROMPTS, max_new_tokens=2)  # the same target, reused: plain decoding asks for no layers
    assert target.layers == () and target.prefill(PROMPTS).layers is None


def test_a_wrapper_that_hides_target_layers_gets_a_one_line_error(fused_trained):
    base, prophet = fused_trained

    class Wrapper:  # like a recording wrapper that forwards begin/propose/commit but not target_layers
        def __init__(self, inner):
            self.vocab_size, self.begin, self.propose, self.commit = (
                inner.vocab_size,
                inner.begin,
                inner.propose,
                inner.commit,
            )

    with pytest.raises(ValueError, match="returned no layer states") as err:
        speculative_generate(Target(base), Wrapper(ProphetDrafter(prophet)), PROMPTS, max_new_tokens=8)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "fuse_layers, match",
    [
        ([0], r"fuse_layers=\[0\]: 0 is not a block index in \[1, 2\]"),
        ([3], r"fuse_layers=\[3\]: 3 is not a block index in \[1, 2\]"),  # 3 = depth: the final hidden state
        ([-1], r"-1 is not a block index"),
        ([1.5], r"1.5 is not a block index"),
        ([True], r"True is not a block index"),
        (["1"], r"'1' is not a block index"),
        ([2, 2], r"fuse_layers=\[2, 2\]: each block at most once"),
        ([], r"fuse_layers=\[\]: name at least one block"),
        (2, r"fuse_layers=2: must be a list"),
    ],
)
def test_bad_fuse_layers_raise_one_line_errors(fuse_layers, match):
    with pytest.raises(ValueError, match=match) as err:
        Prophet.from_base(deep_base(), dim=32, heads=2, fuse_layers=fuse_layers)
    assert "\n" not in str(err.value)


def test_missing_or_mismatched_layer_states_raise_one_line_errors():
    base = deep_base()
    fused = Prophet.from_base(base, dim=32, heads=2, fuse_layers=[1])
    hidden, _, layers = base_features(base, torch.tensor([[1, 2, 3]]), (1, 2))
    for bad in (None, layers):  # missing; two states for one fused block
        with pytest.raises(ValueError, match=r"fuses blocks \[1\] and needs their states \(1, 3, 1, 32\)") as err:
            fused.unroll(hidden, torch.tensor([[2, 3, 4]]), 2, layers=bad)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"layers=\[0\]: 0 is not a block index"):
        base_features(base, torch.tensor([[1, 2, 3]]), [0])
    with pytest.raises(ValueError, match="single block"):
        Prophet.from_base(
            build_lm(num_tokens=V, dim=32, depth=1, heads=2, max_seq_len=32), dim=32, heads=2, fuse_layers=[1]
        )
