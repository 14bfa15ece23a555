"""Medusa heads: construction and initialisation, training signals on a frozen base, evaluation metrics,
static trees, and the drafter in the one loop (exact greedy, lossless sampling, state after rollback)."""

import json
from dataclasses import replace

import pytest
import torch

from experiments.lib.store.lm import build_lm
from experiments.lib.training.features import teacher_batch
from medusa import train
from medusa.drafter import MedusaDrafter, make_drafter
from medusa.heads import MedusaHeads, ResBlock
from medusa.trees import default_tree, node_table, tree_from_accuracies
from tests.test_lossless import run as run_lossless
from tests.test_lossless import sharp_lm
from tests.test_tree import check_sampled_siblings
from verify.backends.target import Target, TargetOutput
from verify.common.vocab import expand_probs, full_ids, subset_logits
from verify.loop.plain import plain_generate
from verify.loop.sampling import SamplingConfig, probs_from_logits
from verify.loop.speculative import SpecConfig, speculative_generate
from verify.loop.tree import sort_paths
from verify.training.features import FeatureBatch

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4]]
SMALL_TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0)]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from a second thread, and on a busy 2-core machine two threads spin
    against each other (measured: 60 training steps 0.2 s with one thread, up to 30 s with two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def freeze(base):
    """What the training loop does to the base: eval mode, no gradients."""
    base.eval()
    for p in base.parameters():
        p.requires_grad_(False)
    return base


def make_base(num_tokens: int = 97, seed: int = 0):
    torch.manual_seed(seed)
    return freeze(build_lm(num_tokens=num_tokens, dim=32, depth=2, heads=2, max_seq_len=96))


def perturb(heads: MedusaHeads, seed: int, scale: float = 0.2) -> MedusaHeads:
    """Random heads (a fresh head equals the base's projection, which drafts the pending token again)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return heads


def batch_of(base, tokens):
    """The frozen base's outputs with its whole distribution as the teacher (top_k = V)."""
    return teacher_batch(base, tokens, top_k=base.num_tokens)


def random_batch(base, b=3, t=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return batch_of(base, torch.randint(0, base.num_tokens, (b, t + 1), generator=g))


# ------------------------------------------------------------------------------------------- heads


def test_heads_and_blocks_are_separate_modules():
    heads = MedusaHeads.from_base(make_base(), num_heads=3, num_layers=2)
    blocks = [block for head in heads.blocks for block in head]
    assert len(heads.blocks) == 3 and len(blocks) == 6 and all(isinstance(b, ResBlock) for b in blocks)
    assert len({id(b) for b in blocks}) == 6 and len({id(p) for p in heads.projections}) == 3
    pointers = [p.data_ptr() for p in heads.parameters()]
    assert len(pointers) == len(set(pointers))  # no tied tensors anywhere
    assert all(torch.all(b.linear.weight == 0) and torch.all(b.linear.bias == 0) for b in blocks)


def test_random_init_is_the_ablation_of_medusa1s_init():
    base = make_base()
    batch = random_batch(base)
    torch.manual_seed(0)
    heads = train.build(base, num_heads=2, num_layers=1, init="random")
    assert all(not torch.equal(p.weight, base.to_logits.weight) for p in heads.projections)
    assert all(block.linear.weight.abs().sum() > 0 for head in heads.blocks for block in head)
    assert not torch.allclose(heads(batch.hidden)[:, :, 0], base.to_logits(batch.hidden))
    total, _ = train.loss(heads, base, batch)
    total.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in heads.parameters())
    for kwargs, match in (
        (dict(init="zero"), "init='zero'"),
        (dict(init="random", share_base_projection=True), "shared"),
    ):
        with pytest.raises(ValueError, match=match) as error:
            train.build(base, num_heads=2, **kwargs)
        assert "\n" not in str(error.value)


@pytest.mark.parametrize("share", [False, True])
def test_fresh_heads_predict_exactly_the_base_projection(share):
    base = make_base()
    heads = MedusaHeads.from_base(base, num_heads=3, num_layers=2, share_base_projection=share)
    hidden = random_batch(base).hidden
    out = heads(hidden)
    assert out.shape == (3, 24, 3, 97)
    for k in range(3):
        assert torch.equal(out[:, :, k], base.to_logits(hidden))  # zero blocks are the identity, projections copies
    vocab = torch.tensor([2, 5, 40, 96])
    assert torch.allclose(
        heads(hidden[0, 3], vocab), heads(hidden[0, 3])[:, vocab], atol=1e-6
    )  # (K, N): the subset columns


def test_only_head_parameters_get_gradients():
    base = make_base()
    heads = train.build(base, num_heads=3, num_layers=2)
    total, metrics = train.loss(heads, base, random_batch(base))
    total.backward()
    for name, p in heads.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert all(p.grad is None and not p.requires_grad for p in base.parameters())
    assert set(metrics) == {"loss", "head1_loss", "head2_loss", "head3_loss", "positions"}
    assert metrics["positions"] == 3 * (24 - 3)  # fewer than 2048 candidates: every position with all targets


def test_shared_base_projection_is_not_a_head_parameter():
    base = make_base()
    heads = train.build(base, num_heads=2, num_layers=1, share_base_projection=True)
    assert all(key.startswith("blocks.") for key in heads.state_dict())
    assert sum(p.numel() for p in heads.parameters()) == 2 * (32 * 32 + 32)
    assert all(p is not base.to_logits.weight for p in heads.parameters())
    train.loss(heads, base, random_batch(base))[0].backward()
    assert base.to_logits.weight.grad is None
    assert all(p.grad is not None for p in heads.parameters())
    rebuilt = train.build(base, num_heads=2, num_layers=1, share_base_projection=True)
    rebuilt.load_state_dict(heads.state_dict())  # a checkpoint of the heads rebuilds them exactly


# ------------------------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def trained():
    """Heads trained briefly on the random base's own greedy continuations of PROMPTS-like prompts."""
    base = make_base()
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, 97, (8, 6), generator=g).tolist()
    continuation = plain_generate(Target(base), prompts, max_new_tokens=40).tokens
    batch = batch_of(base, torch.tensor([p + c for p, c in zip(prompts, continuation)]))
    torch.manual_seed(0)
    heads = train.build(base, num_heads=3, num_layers=1)
    opt = torch.optim.AdamW(heads.parameters(), lr=1e-2)
    losses = []
    for _ in range(120):
        total, metrics = train.loss(heads, base, batch, weight=0.8, target="argmax")  # a floor of 0, unlike kl
        opt.zero_grad()
        total.backward()
        opt.step()
        losses.append(metrics["loss"])
    return base, heads, prompts, batch, losses


def test_loss_drops_on_a_small_batch(trained):
    base, heads, _, batch, losses = trained
    assert losses[-1] < 0.3 * losses[0], losses[::10]
    assert all(p.grad is None for p in base.parameters())
    metrics = train.evaluate(heads, base, batch)
    assert metrics["head1_top1"] > 0.8  # the base's own greedy text is easy to learn
    assert metrics["head1_agree"] > 0.8  # ... and on it the corpus token is the base's top-1


def test_distill_loss_is_the_teachers_entropy_when_heads_match_the_base():
    base = make_base()
    heads = train.build(base, num_heads=1, num_layers=1)  # fresh: head 1 at t = base projection at t
    hidden = torch.randn(2, 10, 32)
    logits = torch.randn(2, 10, 97)
    logits[:, 1:] = base.to_logits(hidden[:, :-1])  # the base at t + 1 equals head 1 at t
    logp = logits.log_softmax(-1)
    top = logp.topk(97, dim=-1)
    batch = FeatureBatch(tokens=torch.randint(0, 97, (2, 11)), hidden=hidden, top_ids=top.indices, top_logp=top.values)
    loss, _ = train.loss(heads, base, batch, positions=None)
    entropy = -(logp[:, 1:].exp() * logp[:, 1:]).sum(-1).mean()  # CE to itself: the minimum over heads
    assert abs(loss.item() - 0.8 * entropy.item()) < 1e-4
    worse, _ = train.loss(perturb(heads, seed=3), base, batch, positions=None)
    assert worse.item() > loss.item() + 1e-3


def test_argmax_target_is_the_base_top1_and_true_target_the_corpus_token():
    base = make_base()
    heads = perturb(train.build(base, num_heads=1, num_layers=1), seed=1)
    batch = random_batch(base)
    pred = heads(batch.hidden[:, :-1])[:, :, 0].log_softmax(-1)  # head 1 at t, for token t + 2
    argmax = -pred.gather(-1, batch.top_ids[:, 1:, :1]).mean()
    true = -pred.gather(-1, batch.tokens[:, 2:, None]).mean()
    assert (
        abs(train.loss(heads, base, batch, target="argmax", positions=None, weight=1)[0].item() - argmax.item()) < 1e-4
    )
    assert abs(train.loss(heads, base, batch, target="true", positions=None, weight=1)[0].item() - true.item()) < 1e-4


def test_positions_subsample_the_batch():
    base = make_base()
    heads = train.build(base, num_heads=2, num_layers=1)
    _, metrics = train.loss(heads, base, random_batch(base), positions=7)
    assert metrics["positions"] == 7


def test_ce_loss_weights_heads_by_powers_of_weight():
    base = make_base()
    heads = perturb(train.build(base, num_heads=2, num_layers=1), seed=0)
    total, m = train.loss(heads, base, random_batch(base), weight=0.5, target="true")
    assert abs(total.item() - (0.5 * m["head1_loss"] + 0.25 * m["head2_loss"])) < 1e-4


def test_evaluate_keys_and_ranges():
    base = make_base()
    heads = perturb(train.build(base, num_heads=2, num_layers=1), seed=0)
    metrics = train.evaluate(heads, base, random_batch(base))
    expected = {f"head{k}_{m}" for k in (1, 2) for m in ["agree", "top1", "top5", *[f"rank{r}" for r in range(10)]]}
    assert set(metrics) == expected | {"head1_mass", "head2_mass", "chain_tau", "chain_mass"}
    for chain in (metrics.pop("chain_tau"), metrics.pop("chain_mass")):
        assert 1 <= chain <= 3  # a chain of the 2 heads' drafts accepts 0 to 2 of them, plus the verify pass's token
    assert all(0 <= v <= 1 for v in metrics.values())
    for k in (1, 2):
        assert metrics[f"head{k}_top1"] <= metrics[f"head{k}_top5"]
        assert sum(metrics[f"head{k}_rank{r}"] for r in range(10)) <= 1 + 1e-6  # distinct ranks: one can match
        assert metrics[f"head{k}_agree"] == metrics[f"head{k}_rank0"]
    fresh = train.evaluate(train.build(base, num_heads=1, num_layers=1), base, random_batch(base))
    assert fresh["head1_rank0"] < 1  # a fresh head guesses t + 1 again, rarely the base's choice for t + 2
    tiny = make_base(num_tokens=6)
    got = len(train.evaluate(train.build(tiny, num_heads=1, num_layers=1), tiny, random_batch(tiny)))
    assert got == 3 + 6 + 1 + 2  # agree top1 top5, 6 ranks, mass; chain_tau, chain_mass
    vocab = torch.arange(0, 97, 2)  # a trimmed vocabulary: the heads' top-1 is an id of the subset
    trimmed = train.evaluate(heads, base, random_batch(base), vocab=vocab)
    assert 0 <= trimmed["head1_agree"] <= 1 and trimmed["head1_agree"] != metrics["head1_agree"]


# ------------------------------------------------------------------------------------------- trees


def test_default_and_measured_trees():
    tree = default_tree(4, 16)
    assert len(tree) == 16 and tree[0] == (0,) and max(map(len, tree)) <= 4 and sort_paths(tree) == tree
    metrics = {
        f"head{k}_rank{r}": v for k, row in enumerate([[0.6, 0.35], [0.5, 0.1], [0.2]], 1) for r, v in enumerate(row)
    }
    assert tree_from_accuracies(metrics, 3, 4) == [(0,), (1,), (0, 0), (1, 0)]  # 0.6, 0.35, 0.3, 0.175
    parents, head, rank = node_table(SMALL_TREE, 2)
    assert (
        parents.tolist() == [-1, -1, -1, 0, 0, 1]
        and head.tolist() == [0, 0, 0, 1, 1, 1]
        and rank.tolist() == [0, 1, 2, 0, 1, 0]
    )


def fake_prefill(b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TargetOutput(logits=torch.zeros(b, 3, 97), hidden=torch.randn(b, 3, 32, generator=g))


@pytest.mark.parametrize("gamma, depth", [(1, 1), (2, 2), (4, 2)])
def test_tree_nodes_are_ranked_head_guesses_pruned_by_gamma_and_heads(gamma, depth):
    heads = perturb(MedusaHeads.from_base(make_base(), num_heads=2, num_layers=1), seed=0)
    drafter = MedusaDrafter(heads, mode="tree", tree=[list(p) for p in SMALL_TREE])
    prefill = fake_prefill()
    drafter.begin([[1], [2]], prefill, torch.zeros(2, dtype=torch.long))
    draft = drafter.propose(gamma, SamplingConfig(), None)
    kept = [p for p in SMALL_TREE if len(p) <= depth]
    top = heads(prefill.hidden[:, -1:]).topk(3, dim=-1).indices[:, 0]  # (b, K, 3)
    assert draft.q is None and draft.parents.tolist() == node_table(SMALL_TREE, depth)[0].tolist()
    assert draft.tokens.tolist() == [[int(top[i, len(p) - 1, p[-1]]) for p in kept] for i in range(2)]
    chain = MedusaDrafter(heads, mode="chain")
    chain.begin([[1], [2]], prefill, torch.zeros(2, dtype=torch.long))
    assert torch.equal(chain.propose(gamma, SamplingConfig(), None).tokens, top[:, :depth, 0])


# ------------------------------------------------------------------------------------------- decoding


def plain(base, prompts, n):
    return plain_generate(Target(base), prompts, max_new_tokens=n).tokens


def spec(base, drafter, prompts, n, gamma, **kwargs):
    return speculative_generate(
        Target(base), drafter, prompts, max_new_tokens=n, spec=SpecConfig(gamma=gamma), **kwargs
    )


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("gamma", [1, 2, 3, 4])
def test_greedy_medusa_equals_plain_with_random_heads(mode, batch, gamma):
    base = make_base()
    heads = perturb(train.build(base, num_heads=3, num_layers=1), seed=gamma)
    prompts = PROMPTS[:batch]
    out = spec(base, make_drafter(heads, base, mode=mode, tree=None, tree_nodes=12), prompts, 20, gamma)
    assert out.tokens == plain(base, prompts, 20)


class HiddenSpy:
    """Wraps a Medusa drafter; before every proposal checks its hidden state against a from-scratch base
    forward over the true context (prompt + emitted tokens, without the pending one)."""

    def __init__(self, inner, base, n):
        self.inner, self.base, self.n, self.vocab_size, self.checked = inner, base, n, inner.vocab_size, 0

    def begin(self, prompts, prefill, pending):
        self.ctx = [p + [t] for p, t in zip(prompts, pending.tolist())]
        self.emitted = [1] * len(prompts)
        self.inner.begin(prompts, prefill, pending)

    def propose(self, gamma, sampling, generator):
        for i, ctx in enumerate(self.ctx):
            if self.emitted[i] < self.n:
                _, hidden = self.base(torch.tensor([ctx[:-1]]), return_logits_and_embeddings=True)
                assert torch.allclose(self.inner.hidden[i], hidden[0, -1], atol=1e-4), f"stale hidden state in row {i}"
                self.checked += 1
        return self.inner.propose(gamma, sampling, generator)

    def commit(self, verdict):
        for i, a in enumerate(verdict.accepted.tolist()):
            if self.emitted[i] < self.n:
                self.ctx[i] += verdict.tokens[i, : a + 1].tolist()
                self.emitted[i] += a + 1
        self.inner.commit(verdict)


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("gamma", [1, 2, 3, 4])
def test_trained_heads_accept_often_exactly_and_track_the_accepted_position(trained, mode, gamma):
    base, heads, prompts, batch, _ = trained
    # ragged: a training prompt, a shortened one (unseen), a prompt extended into its own continuation
    ragged = [prompts[0], prompts[1][2:], batch.tokens[2, :11].tolist()]
    spy = HiddenSpy(make_drafter(heads, base, mode=mode), base, 30)
    out = spec(base, spy, ragged, 30, gamma)
    assert out.tokens == plain(base, ragged, 30)
    assert out.stats.tau > 1.4 and spy.checked > 10


def test_tree_covering_every_rank_always_accepts_two_tokens():
    base = make_base(num_tokens=8)
    heads = perturb(MedusaHeads.from_base(base, num_heads=2, num_layers=1), seed=0)
    tree = [[i] for i in range(8)] + [[i, j] for i in range(8) for j in range(8)]  # every token at depth 1 and 2
    prompts = [[1, 2, 3], [4, 5, 6, 7, 1]]
    out = spec(base, MedusaDrafter(heads, mode="tree", tree=tree), prompts, 22, 2)
    assert out.tokens == plain(base, prompts, 22)
    assert out.stats.forwards.tolist() == [8, 8]  # prefill, then 7 steps of 3 tokens: 1 + 21 = 22


# (mode, tree candidates at T > 0, temperature) of the chi-square tests, Medusa's and the sequential heads'
LOSSLESS = {
    "chain": ("chain", "sampled", 1.0),
    "sampled_tree": ("tree", "sampled", 1.0),
    "sampled_tree_t07": ("tree", "sampled", 0.7),
    "ranked_tree": ("tree", "ranked", 1.0),
}
LOSSLESS_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0]]
# In the slow tier (the fast one keeps the sampled chain and tree at T = 1): the same rule at T = 0.7, and the
# ranked candidates that are no longer the default at T > 0.
SLOW_CASES = {"sampled_tree_t07", "ranked_tree"}


def lossless_cases(cases: dict, slow: set[str]) -> list:
    return [pytest.param(c, marks=pytest.mark.slow) if c in slow else c for c in cases]


@pytest.mark.parametrize("case", lossless_cases(LOSSLESS, SLOW_CASES))
def test_medusa_sampling_reproduces_the_target_distribution(case):
    # perturbed heads on the chi-square test's own target; their picks are accepted 30-45% of the time
    mode, candidates, temperature = LOSSLESS[case]
    heads = perturb(MedusaHeads.from_base(sharp_lm(0), num_heads=2, num_layers=1), seed=0, scale=0.3)
    tree = LOSSLESS_TREE if mode == "tree" else None
    drafter = MedusaDrafter(heads, mode=mode, tree=tree, candidates=candidates)
    (stat, critical), stats = run_lossless(drafter, SamplingConfig(temperature=temperature))
    assert 0.2 < stats.alpha < 1  # acceptance and rejection both exercised, at depth 1 and 2
    assert stat < critical, f"chi2 {stat:.1f} >= critical {critical:.1f}: Medusa {case} is not lossless"


@pytest.mark.parametrize("vocab", [None, torch.arange(1, 97, 3)])
def test_sampled_tree_keeps_its_shape_and_draws_children_from_the_next_head(vocab):
    """At T > 0 the static tree keeps its nodes and parents; each parent's children are distinct draws from
    head d's distribution (the sampling transform of its logits over the subset), without replacement in node
    order, with their q (tests/test_tree.py's check); at T = 0 the same drafter drafts the ranked guesses."""
    heads = perturb(MedusaHeads.from_base(make_base(), num_heads=2, num_layers=1), seed=0)
    drafter = MedusaDrafter(heads, mode="tree", tree=[list(p) for p in SMALL_TREE], vocab=vocab)
    prefill, sampling = fake_prefill(), SamplingConfig(temperature=0.7, top_k=40)
    drafter.begin([[1], [2]], prefill, torch.zeros(2, dtype=torch.long))
    draft = drafter.propose(4, sampling, torch.Generator().manual_seed(0))
    parents, head, _ = node_table(SMALL_TREE, 2)
    assert draft.parents.tolist() == parents.tolist()
    check_sampled_siblings(draft, 97, vocab)
    logits = heads(prefill.hidden[:, -1:])[:, 0]  # (b, K, V)
    probs = expand_probs(probs_from_logits(subset_logits(logits, vocab), sampling), vocab, 97)  # (b, K, V)
    first = [i for i, p in enumerate(parents.tolist()) if p not in parents.tolist()[:i]]  # each parent's first child
    torch.testing.assert_close(draft.q[:, first], probs[:, head[first]])
    ranked = drafter.propose(4, SamplingConfig(), None)
    top = subset_logits(logits, vocab).topk(3, dim=-1).indices  # (b, K, 3)
    kept = [p for p in SMALL_TREE if len(p) <= 2]
    assert ranked.q is None
    assert ranked.tokens.tolist() == [[int(full_ids(top[i, len(p) - 1, p[-1]], vocab)) for p in kept] for i in range(2)]


# ------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda b, h: MedusaHeads.from_base(b, num_heads=0, num_layers=1), "num_heads=0"),
        (lambda b, h: MedusaHeads.from_base(b, num_heads=2, num_layers=True), "num_layers=True"),
        (lambda b, h: MedusaHeads.from_base(b, num_heads="4", num_layers=1), "num_heads='4'"),
        (
            lambda b, h: MedusaHeads.from_base(b, num_heads=2, num_layers=1, share_base_projection="no"),
            "share_base_projection='no'",
        ),
        (lambda b, h: MedusaHeads(projection=b.token_emb.emb, num_heads=2, num_layers=1), "projection is a Embedding"),
        (lambda b, h: MedusaDrafter(h, mode="beam"), "mode='beam'"),
        (lambda b, h: MedusaDrafter(h, tree_nodes=0), "tree_nodes=0"),
        (lambda b, h: MedusaDrafter(h, tree=[]), r"tree=\[\]"),
        (lambda b, h: MedusaDrafter(h, tree=[[0], [1, 0]]), r"prefix \(1,\) is not in the tree"),
        (lambda b, h: MedusaDrafter(h, tree=[[97]]), "below the vocabulary size 97"),
        (lambda b, h: MedusaDrafter(h, tree=[[0.5]]), "must be integers"),
        (lambda b, h: MedusaDrafter(h, mode="chain", tree=[[0]]), "mode='chain'"),
        (lambda b, h: train.loss(h, b, random_batch(b), weight=0), "weight=0"),
        (lambda b, h: train.loss(h, b, random_batch(b), target="yes"), "target='yes'"),
        (lambda b, h: train.loss(h, b, random_batch(b), positions=0), "positions=0"),
        (lambda b, h: train.loss(h, b, random_batch(b, t=2)), "T=2"),
        (
            lambda b, h: train.evaluate(h, b, replace(random_batch(b), tokens=torch.zeros(3, 5, dtype=torch.long))),
            r"tokens \(3, 5\)",
        ),
        (lambda b, h: tree_from_accuracies({"head1_rank0": 0.5}, 2, 4), "no head2_rank0"),
        (lambda b, h: default_tree(2, 0), "tree_nodes=0"),
    ],
)
def test_bad_arguments_raise_one_line_errors(make, match):
    base = make_base()
    heads = train.build(base, num_heads=2, num_layers=1)
    with pytest.raises(ValueError, match=match) as error:
        make(base, heads)
    assert "\n" not in str(error.value)


def test_grow_tree_command_reads_measured_accuracies(tmp_path):
    """experiments.grow_tree: a Medusa checkpoint's head{k}_rank{r} metrics -> a tree of the budget."""
    import subprocess
    import sys

    from experiments.lib.store.checkpoint import save_checkpoint
    from verify.loop.tree import sort_paths

    base = build_lm(num_tokens=64, dim=16, depth=1, heads=2, max_seq_len=32)
    heads = MedusaHeads.from_base(base, num_heads=2, num_layers=1)
    metrics = {f"head{k}_rank{r}": (0.6 if k == 1 else 0.3) * 0.5**r for k in (1, 2) for r in range(10)}
    save_checkpoint(
        tmp_path / "ckpt",
        model=heads,
        tokenizer_json=None,
        step=1,
        model_config={"package": "medusa", "module": {"num_heads": 2, "num_layers": 1}},
        extra={"kind": "drafter", "metrics": metrics, "base_fingerprint": "x"},
    )
    out = subprocess.run(
        [sys.executable, "-m", "experiments.grow_tree", f"checkpoint={tmp_path / 'ckpt'}", "tree_nodes=4"],
        capture_output=True,
        text=True,
        check=True,
    )
    tree = [tuple(p) for p in json.loads(out.stdout.strip().splitlines()[-1])]
    # node values: (0,) 0.6, (1,) 0.3, (0, 0) 0.6 * 0.3, (2,) 0.15, then (0, 1) and (1, 0) at 0.09
    assert tree == sort_paths([(0,), (1,), (2,), (0, 0)]) == [(0,), (1,), (2,), (0, 0)]


def test_default_tree_grows_from_measured_accuracies():
    """With measured rank accuracies the default tree follows them (here: head 2 is sure, so the tree goes
    deep); without, it follows typical Medusa accuracies (wide at the first head)."""
    measured = [[0.9, 0.05, 0.01], [0.8, 0.1, 0.01]]
    assert default_tree(2, 3, accuracies=measured) == [(0,), (0, 0), (0, 1)]
    assert default_tree(2, 3) == [(0,), (1,), (0, 0)]
    base = make_base()
    drafter = MedusaDrafter(MedusaHeads.from_base(base, num_heads=2, num_layers=1), tree_nodes=3, accuracies=measured)
    assert drafter.paths == [(0,), (0, 0), (0, 1)]
    with pytest.raises(ValueError, match="accuracies for 1 heads: the tree needs all 2"):
        default_tree(2, 3, accuracies=measured[:1])
