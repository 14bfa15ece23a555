"""The block prophet (prophet/block.py, block_train.py, block_drafter.py): its training forward equals
from-scratch forwards of each block; training reaches the prophet only and raises agreement at every
position; the drafter's state always follows the accepted context (a stale-state spy, with negative
controls that keep the slots, let them see padding, or misplace them); greedy output equals plain
decoding, batched and ragged, chain and tree, eager and with padded (compiled-shape) commits; sampling
stays lossless (chi-square); bad settings get one-line errors."""

import pytest
import torch

import prophet.block_drafter as block_drafter
from experiments.lib.training.features import teacher_batch
from medusa.trees import node_table
from prophet import block_train
from prophet.block import BlockProphet, block_attention
from prophet.block_drafter import BlockProphetDrafter, commit_attention, make_drafter
from tests.test_lossless import run, sharp_lm
from tests.test_prophet import PROMPTS, V, batch, deep_base, tiny_base, true_features
from verify.backends.target import Target
from verify.loop.plain import plain_generate
from verify.loop.sampling import SamplingConfig
from verify.loop.speculative import SpecConfig, speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")
K = 4


def fit(base, prophet, data, steps: int, lr: float = 1e-2) -> list[float]:
    opt = torch.optim.AdamW(prophet.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss, _ = block_train.loss(prophet, base, data)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def trained():
    """A block prophet trained briefly on the random base's own outputs: its drafts get accepted."""
    base = tiny_base()
    torch.manual_seed(0)
    prophet = block_train.build(base, dim=32, depth=1, heads=2, block=K)
    fit(base, prophet, batch(base, b=16, t=32), steps=80)
    return base, prophet.eval()


# ---------------------------------------------------------------- training


def scratch(prophet, feats, toks, slots: int):
    """Plain causal forward of context entries (1, n) and then `slots` slots at the next positions."""
    x = torch.cat((prophet.fused(feats, toks), prophet.slot_inputs(feats.shape[0])[:, :slots]), dim=1)
    return prophet.out(prophet.decoder(x))


def test_block_forward_equals_a_forward_per_block():
    base = tiny_base()
    prophet = block_train.build(base, dim=32, depth=2, heads=2, block=K).eval()
    data = batch(base, b=2, t=12)
    hidden, nxt = data.hidden, data.tokens[:, 1:]
    starts = torch.tensor([0, 3, 7])
    with torch.no_grad():
        context, slots = prophet.block_forward(hidden, nxt, starts)
        torch.testing.assert_close(context, prophet(hidden, nxt), atol=1e-5, rtol=1e-5)
        for n, s in enumerate(starts.tolist()):
            want = scratch(prophet, hidden[:, : s + 1], nxt[:, : s + 1], K - 1)[:, s + 1 :]
            torch.testing.assert_close(slots[:, n], want, atol=1e-5, rtol=1e-5)


def test_block_attention_follows_its_rule():
    bias, pos = block_attention(torch.tensor([1, 4]), 6, 2)
    seen = bias[0, 0] == 0  # (6 + 4, 6 + 4)
    assert pos.tolist() == [0, 1, 2, 3, 4, 5, 2, 3, 5, 6]
    assert seen[:6, :6].equal(torch.ones(6, 6, dtype=torch.bool).tril()) and not seen[:6, 6:].any()
    assert seen[6].tolist() == [1, 1, 0, 0, 0, 0, 1, 0, 0, 0]  # block after entry 1, slot 1
    assert seen[7].tolist() == [1, 1, 0, 0, 0, 0, 1, 1, 0, 0]  # slot 2 sees slot 1 too
    assert seen[9].tolist() == [1, 1, 1, 1, 1, 0, 0, 0, 1, 1]  # block after entry 4: not the other block


def test_gradients_reach_the_prophet_only():
    base = tiny_base()
    prophet = block_train.build(base, dim=32, depth=1, heads=2, block=K)
    loss, metrics = block_train.loss(prophet, base, batch(base))
    loss.backward()
    assert {f"pos{j}_agree" for j in range(1, K + 1)} | {"loss", "starts"} <= set(metrics)
    assert metrics["starts"] == 16 // (2 * (K - 1))  # T // (2 (K - 1)) starts by default
    for name, p in prophet.named_parameters():
        assert p.grad is not None and bool(p.grad.abs().sum() > 0), name
    assert all(p.grad is None for p in base.parameters())
    assert "slots" in prophet.state_dict() and not any("to_logits" in k for k in prophet.state_dict())


def test_loss_drops_and_every_position_learns():
    base = tiny_base()
    torch.manual_seed(0)
    prophet = block_train.build(base, dim=32, depth=1, heads=2, block=K)
    data = batch(base, b=16, t=32)
    before = block_train.evaluate(prophet, base, data)
    first, _ = block_train.loss(prophet, base, data)
    losses = fit(base, prophet, data, steps=80)
    after = block_train.evaluate(prophet, base, data)
    assert losses[-1] < 0.75 * first.item(), (first.item(), losses[-1])
    assert [k for k in after if k.endswith("_agree")] == [f"head{j}_agree" for j in range(1, K + 1)]
    assert all(after[f"head{j}_rank0"] == after[f"head{j}_agree"] for j in range(1, K + 1))
    for j in range(1, K + 1):  # the slots learn too, not only the context's own prediction
        assert after[f"head{j}_agree"] > before[f"head{j}_agree"] + 0.05, (j, before, after)


# ---------------------------------------------------------------- drafting follows the accepted context


def block_reference(base, prophet, paths=None):
    """From scratch on the true context: the base's features, one forward over the context and the slots, then
    each position's top-1 (a chain) or the static tree's ranks (token, parent)."""

    def reference(ctx, gamma):
        x = torch.tensor([ctx])
        feats = true_features(base, prophet, x)[:, :-1]  # the pending token's feature is not known yet
        out = scratch(prophet, feats, x[:, 1:], K - 1)[:, -K:]  # (1, K, d): the context's last output, the slots
        logits = prophet.logits(out)[0]
        depth = min(gamma, K)
        if paths is None:
            return logits.argmax(-1)[:depth].tolist()
        parents, head, rank = node_table(paths, depth)
        top = logits.topk(int(rank.max()) + 1, dim=-1).indices
        return list(zip(top[head, rank].tolist(), parents.tolist()))

    return reference


def refined_reference(base, prophet, refine: int):
    """A refined chain from scratch at T = 0: the block's features, then `refine` passes, each one forward of the
    whole context followed by the entries (feature j, guess j), then the draw rule of the module docstring."""

    def reference(ctx, gamma):
        x = torch.tensor([ctx])
        feats = true_features(base, prophet, x)[:, :-1]
        features = scratch(prophet, feats, x[:, 1:], K - 1)[:, -K:]  # (1, K, d)
        first = logits = prophet.logits(features)[0]
        for _ in range(refine):
            guess = logits.argmax(-1)
            inputs = torch.cat((feats, features[:, :-1]), dim=1), torch.cat((x[:, 1:], guess[None, :-1]), dim=1)
            out = prophet.out(prophet.decoder(prophet.fused(*inputs)))[:, -(K - 1) :]
            features = torch.cat((features[:, :1], out), dim=1)
            logits = prophet.logits(features)[0]
        tokens, match = [], True
        for i in range(min(gamma, K)):
            tokens.append(int((logits[i] if match else first[i]).argmax()))
            match = match and tokens[-1] == int(guess[i])
        return tokens

    return reference


class Spy:
    """Compares each row's draft with the from-scratch reference on its accepted context, while the row is
    within its budget (a finished row's verdicts carry placeholders)."""

    def __init__(self, inner, reference, max_new_tokens):
        self.inner, self.reference, self.vocab_size, self.checked = inner, reference, inner.vocab_size, 0
        self.target_layers, self.max_new_tokens = inner.target_layers, max_new_tokens

    def begin(self, prompts, prefill, pending):
        self.ctx = [p + [t] for p, t in zip(prompts, pending.tolist())]
        self.left = [self.max_new_tokens - 1] * len(prompts)
        self.inner.begin(prompts, prefill, pending)

    def propose(self, gamma, sampling, generator):
        draft = self.inner.propose(gamma, sampling, generator)
        for i, ctx in enumerate(self.ctx):
            if self.left[i] > 0:
                got = draft.tokens[i].tolist()
                if draft.parents is not None:
                    got = list(zip(got, draft.parents.tolist()))
                assert got == self.reference(ctx, gamma), f"stale drafter state in row {i}"
                self.checked += 1
        return draft

    def commit(self, verdict):
        for i, a in enumerate(verdict.accepted.tolist()):
            if self.left[i] > 0:
                self.ctx[i] += verdict.tokens[i, : a + 1].tolist()
                self.left[i] -= a + 1
        self.inner.commit(verdict)


def run_spy(base, drafter, reference, gamma):
    spy = Spy(drafter, reference, max_new_tokens=20)
    with torch.no_grad():
        out = speculative_generate(Target(base), spy, PROMPTS, max_new_tokens=20, spec=SpecConfig(gamma=gamma))
    return out, spy


@pytest.mark.parametrize("mode, gamma", [("chain", 2), ("chain", 4), ("chain", 6), ("tree", 3), ("tree", 4)])
def test_drafter_follows_the_accepted_context(trained, mode, gamma):
    base, prophet = trained
    drafter = BlockProphetDrafter(prophet, mode=mode, tree_nodes=8)
    out, spy = run_spy(base, drafter, block_reference(base, prophet, drafter.paths or None), gamma)
    assert out.tokens == plain_generate(Target(base), PROMPTS, max_new_tokens=20).tokens
    assert spy.checked > 10 and 0 < out.stats.alpha < 1 and len(set(out.stats.accepted.tolist())) > 1


def slots_see_padding(accepted, width, slots, lengths):
    """Negative control: slots see every path entry, the padding of rows that accepted fewer too."""
    allow, pos = commit_attention(accepted, width, slots, lengths)
    allow[:, width:, :width] = True
    return allow, pos


def slots_after_padding(accepted, width, slots, lengths):
    """Negative control: slots placed after the padded block instead of after each row's accepted entries."""
    allow, pos = commit_attention(accepted, width, slots, lengths)
    pos[:, width:] = lengths[:, None] + width - 1 + torch.arange(1, slots + 1)
    return allow, pos


@pytest.mark.parametrize("refine, gamma", [(1, 3), (1, 4), (2, 4)])
def test_refined_chain_follows_the_accepted_context(trained, refine, gamma):
    base, prophet = trained
    drafter = BlockProphetDrafter(prophet, mode="chain", refine=refine)
    out, spy = run_spy(base, drafter, refined_reference(base, prophet, refine), gamma)
    assert out.tokens == plain_generate(Target(base), PROMPTS, max_new_tokens=20).tokens
    assert spy.checked > 10 and 0 < out.stats.alpha < 1


class KeepsSlots(BlockProphetDrafter):
    def commit(self, verdict):
        commit = self.cache.commit
        # keeps the slots too (not a prefix any more, so the real commit must compact: `prefix` is dropped)
        self.cache.commit = lambda keep, prefix=False: commit(
            keep | (torch.arange(keep.shape[1]) >= keep.shape[1] - K + 1)
        )
        try:
            super().commit(verdict)
        finally:
            self.cache.commit = commit


@pytest.mark.parametrize("wrong", [slots_see_padding, slots_after_padding, "keeps_slots"])
def test_stale_state_is_detected(trained, monkeypatch, wrong):
    base, prophet = trained
    drafter = (
        KeepsSlots(prophet, mode="chain") if wrong == "keeps_slots" else BlockProphetDrafter(prophet, mode="chain")
    )
    if wrong != "keeps_slots":
        monkeypatch.setattr(block_drafter, "commit_attention", wrong)
    with pytest.raises(AssertionError, match="stale drafter state"):
        run_spy(base, drafter, block_reference(base, prophet), 3)


# ---------------------------------------------------------------- decoding


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("gamma", [1, 3, 6])
@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_equals_plain(trained, mode, gamma, rows):
    base, prophet = trained
    prompts = PROMPTS[-rows:]
    ref = plain_generate(Target(base), prompts, max_new_tokens=24).tokens
    drafter = make_drafter(prophet, base, mode=mode)
    out = speculative_generate(Target(base), drafter, prompts, max_new_tokens=24, spec=SpecConfig(gamma=gamma))
    assert out.tokens == ref


@pytest.mark.parametrize(
    "mode, temperature, refine",
    [("chain", 0.0, 0), ("tree", 0.0, 0), ("chain", 1.0, 0), ("tree", 1.0, 0), ("chain", 0.0, 1)],
)
def test_compiled_steps_take_one_shape_each(trained, monkeypatch, mode, temperature, refine):
    """Compiled, every commit is padded to K + 1 path entries and K - 1 slots, and the slots after the prefill
    are one more program: two shapes in all, whatever each row accepts. Run eagerly with the shapes recorded,
    the padded decode must still equal plain decoding, batched and ragged."""
    base, prophet = trained
    shapes, decode = set(), prophet.decode

    def recording(x, cache, *, allow=None, pos=None, compile=False):
        if compile:
            shapes.add((x.shape[1], None if allow is None else allow.shape[-1]))
        return decode(x, cache, allow=allow, pos=pos)  # eager

    monkeypatch.setattr(prophet, "decode", recording)
    ref = plain_generate(Target(base), PROMPTS, max_new_tokens=23).tokens
    drafter = BlockProphetDrafter(prophet, mode=mode, compile=True, tree_nodes=8, refine=refine)
    sampling, gen = SamplingConfig(temperature=temperature), torch.Generator().manual_seed(0)
    out = speculative_generate(
        Target(base), drafter, PROMPTS, max_new_tokens=23, spec=SpecConfig(gamma=3), sampling=sampling, generator=gen
    )
    assert out.tokens == ref or temperature > 0
    assert shapes == {(K - 1, None), (2 * K, 2 * K)}  # a refinement pass is K - 1 entries too


@pytest.mark.parametrize("mode, least", [("chain", 1.2), ("tree", 1.4)])
def test_trained_block_prophet_is_accepted(trained, mode, least):
    base, prophet = trained
    out = speculative_generate(
        Target(base), make_drafter(prophet, base, mode=mode), PROMPTS, max_new_tokens=30, spec=SpecConfig(gamma=K)
    )
    assert out.stats.tau > least, out.stats.tau


def test_commit_attention_is_per_row():
    allow, pos = commit_attention(torch.tensor([0, 2]), 3, 2, torch.tensor([5, 9]))
    assert pos.tolist() == [[5, 6, 7, 6, 7], [9, 10, 11, 12, 13]]
    assert allow[0, 3].tolist() == [True, False, False, True, False]  # row 0 accepted nothing: sees entry 0 only
    assert allow[1, 4].tolist() == [True, True, True, True, True]
    assert not allow[:, :3, 3:].any()  # path entries never see slots


# ---------------------------------------------------------------- sampling stays lossless


# The fast tier keeps the block's chain at T = 1. Its tree and refined chain are in the slow tier: the tree draws
# through PositionDrafter's sampled tree, whose chi-square case stays fast in tests/test_medusa.py.
@pytest.mark.parametrize(
    "mode, refine",
    [("chain", 0), pytest.param("tree", 0, marks=pytest.mark.slow), pytest.param("chain", 1, marks=pytest.mark.slow)],
)
def test_sampling_reproduces_the_target_distribution(mode, refine):
    torch.manual_seed(0)
    prophet = BlockProphet.from_base(sharp_lm(0), dim=16, depth=1, heads=2, block=3)  # the target `run` builds
    with torch.no_grad():
        prophet.slots.mul_(8)  # slots far from the context: their q differs visibly from the target's p
    tree = [[0], [1], [2], [0, 0], [0, 1], [1, 0]] if mode == "tree" else None
    drafter = BlockProphetDrafter(prophet, mode=mode, tree=tree, refine=refine)
    (stat, critical), stats = run(drafter, SamplingConfig(temperature=1.0), gamma=2)
    assert 0 < stats.alpha < 1
    assert stat < critical, f"chi2 {stat:.1f} >= critical {critical:.1f}"


# ---------------------------------------------------------------- bad settings


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda b, p: block_train.build(b, dim=32, heads=2, block=1), "block=1"),
        (lambda b, p: block_train.build(b, dim=32, heads=2, block=2.5), "block=2.5"),
        (lambda b, p: block_train.loss(p, b, batch(b), starts=0), "starts=0"),
        (lambda b, p: block_train.loss(p, b, batch(b), decay=-1), "decay=-1"),
        (lambda b, p: block_train.loss(p, b, batch(b), target="x"), "target='x'"),
        (lambda b, p: block_train.loss(p, b, batch(b, t=4)), "block=4 needs sequences of at least 5"),
        (lambda b, p: block_train.evaluate(p, tiny_base(1), batch(b)), "built on another base"),
        (lambda b, p: make_drafter(p, b, mode="x"), "mode='x'"),
        (lambda b, p: make_drafter(p, b, tree_nodes=0), "tree_nodes=0"),
        (lambda b, p: make_drafter(p, b, mode="chain", tree=[[0]]), "tree is given but mode='chain'"),
        (lambda b, p: make_drafter(p, b, tree=[[V]]), "ranks must be below"),
        (lambda b, p: make_drafter(p, b, mode="chain", refine=-1), "refine=-1"),
    ],
)
def test_bad_arguments_raise_one_line_errors(make, match):
    base = tiny_base()
    prophet = block_train.build(base, dim=32, depth=1, heads=2, block=K)
    with pytest.raises(ValueError, match=match) as err:
        make(base, prophet)
    assert "\n" not in str(err.value)


def test_starts_are_capped_at_every_usable_one():
    base = tiny_base()
    prophet = block_train.build(base, dim=32, depth=1, heads=2, block=K)
    _, metrics = block_train.loss(prophet, base, batch(base, t=12), starts=100)
    assert metrics["starts"] == 12 - K  # starts 0 .. T - 1 - K: every slot has a target


def test_fused_block_prophet_follows_the_accepted_context():
    base = deep_base()
    torch.manual_seed(0)
    prophet = block_train.build(base, dim=32, depth=1, heads=2, block=K, fuse_layers=[1, 2])
    tokens = torch.randint(0, V, (16, 33), generator=torch.Generator().manual_seed(1))
    data = teacher_batch(base, tokens, layers=(1, 2), top_k=V)
    opt = torch.optim.AdamW(prophet.parameters(), lr=1e-2)
    for _ in range(40):
        loss, _ = block_train.loss(prophet, base, data)
        opt.zero_grad()
        loss.backward()
        opt.step()
    prophet.eval()
    assert prophet.mix.weight[:, : 2 * 32].abs().max() > 1e-2  # training reached the layer-state columns
    drafter = BlockProphetDrafter(prophet, mode="chain")
    assert drafter.target_layers == (1, 2)
    out, spy = run_spy(base, drafter, block_reference(base, prophet), 4)
    assert out.tokens == plain_generate(Target(base), PROMPTS, max_new_tokens=20).tokens
    assert spy.checked > 10
