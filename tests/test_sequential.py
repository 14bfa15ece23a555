"""Sequential (Hydra) heads: construction and initialisation, what each head reads, training signals on a
frozen base, evaluation metrics, tree and chain drafts against a node-by-node reference, and the drafter in
the one loop (exact greedy, lossless sampling, state after rollback)."""

from dataclasses import replace

import pytest
import torch
from torch import nn

from experiments.lib.families.sequential import build as family_build
from medusa import sequential_train as train
from medusa.heads import ResBlock
from medusa.sequential import SequentialHeads
from medusa.sequential_drafter import SequentialDrafter, make_drafter
from medusa.trees import node_table
from tests.test_lossless import run as run_lossless
from tests.test_lossless import sharp_lm
from tests.test_medusa import (
    LOSSLESS,
    LOSSLESS_TREE,
    PROMPTS,
    SLOW_CASES,
    SMALL_TREE,
    HiddenSpy,
    batch_of,
    fake_prefill,
    lossless_cases,
    make_base,
    perturb,
    plain,
    random_batch,
    spec,
)
from tests.test_tree import check_sampled_siblings
from verify.backends.target import Target
from verify.common.vocab import expand_probs
from verify.loop.plain import plain_generate
from verify.loop.sampling import SamplingConfig, probs_from_logits

pytestmark = pytest.mark.usefixtures("one_thread")


def heads_on(base, num_heads=3, num_layers=1, seed=None):
    """Fresh heads, or (seed) random ones whose guesses depend on the tokens they read: perturbed, and the
    token columns of their input mix scaled up (the base's embeddings are ~4x smaller than its hidden states,
    so perturbation alone leaves most guesses the same whatever the path)."""
    heads = SequentialHeads.from_base(base, num_heads=num_heads, num_layers=num_layers)
    return heads if seed is None else randomise(heads, seed)


def randomise(heads, seed):
    """Perturbed heads whose token columns of the input mix are scaled up, so their guesses depend on the path."""
    perturb(heads, seed=seed)
    with torch.no_grad():
        for mix in heads.mix:
            mix.weight[:, heads.dim :] *= 8
    return heads


# ------------------------------------------------------------------------------------------- heads


def test_heads_blocks_and_mixes_are_separate_modules_initialised_to_pass_h_through():
    heads = heads_on(make_base(), num_heads=3, num_layers=2)
    blocks = [block for head in heads.blocks for block in head]
    assert len(blocks) == 6 and all(isinstance(b, ResBlock) for b in blocks) and len({id(b) for b in blocks}) == 6
    assert len({id(m) for m in heads.mix}) == 3 and len({id(p) for p in heads.projections}) == 3
    pointers = [p.data_ptr() for p in heads.parameters()]
    assert len(pointers) == len(set(pointers))  # no tied tensors anywhere
    assert all(torch.all(b.linear.weight == 0) and torch.all(b.linear.bias == 0) for b in blocks)
    for k, mix in enumerate(heads.mix, start=1):  # [I, 0, .., 0]: reads h, ignores the k token embeddings
        assert mix.weight.shape == (32, 32 + k * 32)
        assert (
            torch.equal(mix.weight[:, :32], torch.eye(32))
            and torch.all(mix.weight[:, 32:] == 0)
            and torch.all(mix.bias == 0)
        )


def test_fresh_heads_predict_exactly_the_base_projection():
    base = make_base()
    heads = heads_on(base)
    batch = random_batch(base)
    tokens = train.following_tokens(batch.tokens, 3)
    out = heads(batch.hidden, tokens)
    assert out.shape == (3, 24, 3, 97)
    for k in range(3):
        assert torch.equal(out[:, :, k], base.to_logits(batch.hidden))  # identity mix, zero blocks, copied projections
    vocab = torch.tensor([2, 5, 40, 96])
    assert torch.allclose(heads(batch.hidden[0, 3], tokens[0, 3], vocab), out[0, 3][:, vocab], atol=1e-6)  # (K, N)


def test_head_k_reads_exactly_the_first_k_tokens():
    heads = heads_on(make_base(), num_heads=4, seed=0)
    g = torch.Generator().manual_seed(0)
    hidden, tokens = torch.randn(5, 32, generator=g), torch.randint(0, 97, (5, 4), generator=g)
    out = heads(hidden, tokens)  # (5, K, V)
    for j in range(4):  # change token x_{t+1+j} in every row: heads 1..j must not see it, heads j+1..K must
        changed = tokens.clone()
        changed[:, j] = (changed[:, j] + 1) % 97
        new = heads(hidden, changed)
        assert torch.equal(new[:, :j], out[:, :j]), f"a head before {j + 1} read token {j + 1}"
        assert (new[:, j:] - out[:, j:]).abs().amax(-1).min() > 1e-4, f"a head from {j + 1} on ignored token {j + 1}"
    for k in range(1, 5):  # the decoding path is the same computation
        assert torch.allclose(heads.head_logits(k, hidden, tokens[:, :k]), out[:, k - 1], atol=1e-6)


def test_only_head_parameters_get_gradients_and_the_embedding_is_borrowed():
    base = make_base()
    for p in base.parameters():  # trainable, so only the heads' detaching keeps gradients out of it
        p.requires_grad_(True)
    heads = train.build(base, num_heads=3, num_layers=2)
    total, metrics = train.loss(heads, base, random_batch(base))
    total.backward()
    for name, p in heads.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert all(p.grad is None for p in base.parameters())
    assert set(metrics) == {"loss", "head1_loss", "head2_loss", "head3_loss", "positions"}
    assert metrics["positions"] == 3 * (24 - 3)  # fewer than 2048 candidates: every position with all targets
    emb = base.token_emb.emb.weight
    assert all(p is not emb and p is not base.to_logits.weight for p in heads.parameters())
    assert all(key.split(".")[0] in ("mix", "blocks", "projections") for key in heads.state_dict())
    rebuilt = train.build(base, num_heads=3, num_layers=2)
    rebuilt.load_state_dict(heads.state_dict(), strict=True)  # a checkpoint of the heads rebuilds them exactly


# ------------------------------------------------------------------------------------------- training


def manual_head_logits(heads, batch, k):
    """Head k at every t < T - k, reading the true tokens t + 1 .. t + k, computed head by head: (B, T - k, V)."""
    t = batch.hidden.shape[1]
    reads = torch.stack([batch.tokens[:, 1 + j : 1 + j + t - k] for j in range(k)], dim=-1)  # (B, T - k, k)
    return heads.head_logits(k, batch.hidden[:, : t - k], reads)


@pytest.mark.parametrize("target", ["argmax", "true"])
def test_loss_aligns_head_k_with_tokens_up_to_t_plus_k_and_the_teacher_at_t_plus_k(target):
    base = make_base()
    heads = heads_on(base, num_heads=2, seed=1)
    batch = random_batch(base)
    _, metrics = train.loss(heads, base, batch, target=target, positions=None, weight=1)
    t = 24
    for k in (1, 2):
        logp = manual_head_logits(heads, batch, k)[:, : t - 2].log_softmax(-1)  # the loss keeps t < T - K
        ids = (
            batch.top_ids[:, k : k + t - 2, :1] if target == "argmax" else batch.tokens[:, k + 1 : k + 1 + t - 2, None]
        )
        assert abs(metrics[f"head{k}_loss"] + logp.gather(-1, ids).mean().item()) < 1e-4, k


def test_positions_subsample_and_heads_are_weighted_by_powers_of_weight():
    base = make_base()
    heads = heads_on(base, num_heads=2, seed=0)
    assert train.loss(heads, base, random_batch(base), positions=7)[1]["positions"] == 7
    total, m = train.loss(heads, base, random_batch(base), weight=0.5, target="true")
    assert abs(total.item() - (0.5 * m["head1_loss"] + 0.25 * m["head2_loss"])) < 1e-4


def test_evaluate_keys_ranges_and_alignment():
    base = make_base()
    heads = heads_on(base, num_heads=2, seed=0)
    batch = random_batch(base)
    metrics = train.evaluate(heads, base, batch)
    expected = {f"head{k}_{m}" for k in (1, 2) for m in ["agree", "top1", "top5", *[f"rank{r}" for r in range(10)]]}
    assert set(metrics) == expected | {"head1_mass", "head2_mass", "chain_tau", "chain_mass"}
    chain = metrics.pop("chain_tau")
    assert 1 <= metrics.pop("chain_mass") <= 3
    assert all(0 <= v <= 1 for v in metrics.values())
    # the chain from t: head 1's draft of token t + 2, then head 2's of t + 3, each the base's top-1 there or not
    t = batch.hidden.shape[1]
    hits = [(manual_head_logits(heads, batch, k).argmax(-1) == batch.top_ids[:, k:, 0])[:, : t - 2] for k in (1, 2)]
    assert abs(chain - (1 + (hits[0].float() + (hits[0] & hits[1]).float()).mean().item())) < 1e-6
    for k in (1, 2):
        assert metrics[f"head{k}_top1"] <= metrics[f"head{k}_top5"]
        assert metrics[f"head{k}_agree"] == metrics[f"head{k}_rank0"]
        top = manual_head_logits(heads, batch, k).topk(3, dim=-1).indices  # (B, T - k, 3)
        for r in range(3):  # the same positions, tokens and teacher as the loss
            assert (
                abs(metrics[f"head{k}_rank{r}"] - (top[..., r] == batch.top_ids[:, k:, 0]).float().mean().item()) < 1e-6
            )
    vocab = batch.top_ids[:, :, 0].unique()  # a trimmed vocabulary: the heads' top-1 over the subset, as full ids
    trimmed = train.evaluate(heads, base, batch, vocab=vocab)
    top1 = vocab[manual_head_logits(heads, batch, 1)[..., vocab].argmax(-1)]
    assert abs(trimmed["head1_agree"] - (top1 == batch.top_ids[:, 1:, 0]).float().mean().item()) < 1e-6
    assert trimmed["head1_agree"] > metrics["head1_agree"]  # fewer wrong candidates


@pytest.fixture(scope="module")
def trained(one_thread):
    """Heads trained briefly on the random base's own greedy continuations of random prompts (one thread:
    120 steps on two busy threads crawl)."""
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
    assert losses[-1] < 0.1 * losses[0], losses[::10]  # measured: 8.1 -> 0.09
    metrics = train.evaluate(heads, base, batch)
    assert all(metrics[f"head{k}_agree"] > 0.9 for k in (1, 2, 3)), metrics  # measured: 0.98, 0.99, 0.98


# ------------------------------------------------------------------------------------------- drafts


def reference_tree(heads, hidden, pending, paths, vocab=None):
    """Node by node: node p's token is head len(p)'s rank p[-1] guess after [pending, tokens of p's ancestors]."""
    rows = []
    for h, x in zip(hidden, pending.tolist()):
        token = {(): x}
        for p in paths:  # sorted by (length, path): a node's ancestors come first
            reads = torch.tensor([token[p[:i]] for i in range(len(p))])
            logits = heads.head_logits(len(p), h, reads, vocab)  # (N,)
            rank = int(logits.topk(p[-1] + 1).indices[p[-1]])
            token[p] = rank if vocab is None else int(vocab[rank])
        rows.append([token[p] for p in paths])
    return rows


@pytest.mark.parametrize("vocab", [None, torch.arange(1, 97, 3)])
@pytest.mark.parametrize("gamma, depth", [(1, 1), (2, 2), (4, 3)])
def test_drafts_are_the_ranked_head_guesses_under_their_path(gamma, depth, vocab):
    heads = heads_on(make_base(), num_heads=3, seed=0)
    prefill, pending = fake_prefill(), torch.tensor([4, 60])
    drafter = SequentialDrafter(heads, mode="tree", tree=[list(p) for p in SMALL_TREE], vocab=vocab)
    drafter.begin([[1], [2]], prefill, pending)
    draft = drafter.propose(gamma, SamplingConfig(), None)
    kept = [p for p in SMALL_TREE if len(p) <= depth]
    assert draft.q is None and draft.parents.tolist() == node_table(SMALL_TREE, depth)[0].tolist()
    assert draft.tokens.tolist() == reference_tree(heads, prefill.hidden[:, -1], pending, kept, vocab)
    chain = SequentialDrafter(heads, mode="chain", vocab=vocab)
    chain.begin([[1], [2]], prefill, pending)
    draft = chain.propose(gamma, SamplingConfig(), None)
    assert draft.q is None and draft.parents is None
    assert draft.tokens.tolist() == reference_tree(
        heads, prefill.hidden[:, -1], pending, [(0,) * d for d in range(1, depth + 1)], vocab
    )


# ------------------------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("gamma", [1, 2, 3, 4])
def test_greedy_equals_plain_with_random_heads(mode, batch, gamma):
    base = make_base()
    heads = heads_on(base, seed=gamma)
    prompts = PROMPTS[:batch]  # three prompts of different lengths
    out = spec(base, make_drafter(heads, base, mode=mode, tree_nodes=12), prompts, 20, gamma)
    assert out.tokens == plain(base, prompts, 20)


class StateSpy(HiddenSpy):
    """Medusa's hidden-state spy (a from-scratch base forward over the true context before every proposal),
    also checking the pending token against the context's last token and recording every draft."""

    def begin(self, prompts, prefill, pending):
        super().begin(prompts, prefill, pending)
        self.drafts = []

    def propose(self, gamma, sampling, generator):
        for i, ctx in enumerate(self.ctx):
            if self.emitted[i] < self.n:
                assert int(self.inner.pending[i]) == ctx[-1], f"stale pending token in row {i}"
        draft = super().propose(gamma, sampling, generator)
        self.drafts.append(draft.tokens)
        return draft


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("gamma", [1, 2, 3, 4])
def test_trained_heads_accept_often_exactly_and_track_the_accepted_position(trained, mode, gamma):
    base, heads, prompts, batch, _ = trained
    # ragged: a training prompt, a shortened one (unseen), a prompt extended into its own continuation
    ragged = [prompts[0], prompts[1][2:], batch.tokens[2, :11].tolist()]
    spy = StateSpy(make_drafter(heads, base, mode=mode), base, 30)
    out = spec(base, spy, ragged, 30, gamma)
    assert out.tokens == plain(base, ragged, 30)
    # measured tau: chain 1.80, 2.57, 3.10, 3.10; tree 1.88, 2.73, 3.33, 3.33 (3 heads: gamma 4 drafts 3 deep)
    assert out.stats.tau > 1 + 0.5 * min(gamma, 3) and spy.checked > 10


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_trimmed_vocabulary_drafts_only_its_tokens_and_stays_exact(trained, mode):
    base, heads, prompts, _, _ = trained
    vocab = torch.arange(0, 97, 2)
    spy = StateSpy(make_drafter(heads, base, mode=mode, vocab=vocab), base, 20)
    out = spec(base, spy, prompts[:3], 20, 3)
    assert out.tokens == plain(base, prompts[:3], 20)
    drafted = torch.cat([d.flatten() for d in spy.drafts])
    assert drafted.numel() > 0 and bool((drafted % 2 == 0).all())


def test_tree_covering_every_rank_always_accepts_two_tokens():
    base = make_base(num_tokens=8)
    heads = heads_on(base, num_heads=2, seed=0)
    tree = [[i] for i in range(8)] + [[i, j] for i in range(8) for j in range(8)]  # every token at depth 1 and 2
    prompts = [[1, 2, 3], [4, 5, 6, 7, 1]]
    out = spec(base, SequentialDrafter(heads, mode="tree", tree=tree), prompts, 22, 2)
    assert out.tokens == plain(base, prompts, 22)
    assert out.stats.forwards.tolist() == [8, 8]  # prefill, then 7 steps of 3 tokens: 1 + 21 = 22


@pytest.mark.parametrize("case", lossless_cases(LOSSLESS, SLOW_CASES))
def test_sampling_reproduces_the_target_distribution(case):
    # perturbed heads on the chi-square test's own target; measured acceptance 0.30 (chain), 0.50 (ranked tree)
    mode, candidates, temperature = LOSSLESS[case]
    heads = perturb(SequentialHeads.from_base(sharp_lm(0), num_heads=2, num_layers=1), seed=0, scale=0.3)
    tree = LOSSLESS_TREE if mode == "tree" else None
    drafter = SequentialDrafter(heads, mode=mode, tree=tree, candidates=candidates)
    (stat, critical), stats = run_lossless(drafter, SamplingConfig(temperature=temperature))
    assert 0.2 < stats.alpha < 1  # acceptance and rejection both exercised, at depth 1 and 2
    assert stat < critical, f"chi2 {stat:.1f} >= critical {critical:.1f}: sequential {case} is not lossless"


@pytest.mark.parametrize("vocab", [None, torch.arange(1, 97, 3)])
def test_sampled_tree_draws_each_parents_children_given_its_path(vocab):
    """At T > 0 the static tree keeps its nodes and parents; a parent's children are distinct draws without
    replacement, in node order, from head d's distribution given [pending, the parent's path] as sampled
    (tests/test_tree.py's check of the siblings and their q, and each parent's first child against the head
    run on its path alone)."""
    heads = heads_on(make_base(), num_heads=3, seed=0)
    prefill, pending = fake_prefill(), torch.tensor([4, 60])
    sampling = SamplingConfig(temperature=0.7, top_k=40)
    drafter = SequentialDrafter(heads, mode="tree", tree=[list(p) for p in SMALL_TREE], vocab=vocab)
    drafter.begin([[1], [2]], prefill, pending)
    draft = drafter.propose(3, sampling, torch.Generator().manual_seed(0))
    kept = [p for p in SMALL_TREE if len(p) <= 3]
    parents = node_table(SMALL_TREE, 3)[0].tolist()
    assert draft.parents.tolist() == parents
    check_sampled_siblings(draft, 97, vocab)
    for row, (h, x) in enumerate(zip(prefill.hidden[:, -1], pending.tolist())):
        token = {(): x, **{p: int(t) for p, t in zip(kept, draft.tokens[row])}}
        for i, p in enumerate(kept):
            if parents[i] in parents[:i]:
                continue  # not its parent's first child: its q is checked against the first's
            reads = torch.tensor([token[p[:j]] for j in range(len(p))])
            probs = probs_from_logits(heads.head_logits(len(p), h, reads, vocab), sampling)  # (N,)
            torch.testing.assert_close(draft.q[row, i], expand_probs(probs, vocab, 97))


# ------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda b, h: SequentialHeads.from_base(b, num_heads=0, num_layers=1), "num_heads=0"),
        (lambda b, h: SequentialHeads.from_base(b, num_heads=2, num_layers=True), "num_layers=True"),
        (
            lambda b, h: SequentialHeads(embedding=b.to_logits, projection=b.to_logits, num_heads=2),
            "embedding is a Linear",
        ),
        (
            lambda b, h: SequentialHeads(embedding=b.token_emb.emb, projection=b.token_emb.emb, num_heads=2),
            "projection is a Embedding",
        ),
        (
            lambda b, h: SequentialHeads(embedding=nn.Embedding(50, 32), projection=b.to_logits, num_heads=2),
            "embedding has 50 tokens",
        ),
        (lambda b, h: h(torch.zeros(3, 32), torch.zeros(3, 3, dtype=torch.long)), r"tokens of shape \(3, 3\)"),
        (
            lambda b, h: h.head_logits(2, torch.zeros(3, 32), torch.zeros(3, 1, dtype=torch.long)),
            "head 2 reads 2 tokens",
        ),
        (lambda b, h: SequentialDrafter(h, mode="beam"), "mode='beam'"),
        (lambda b, h: SequentialDrafter(h, tree_nodes=0), "tree_nodes=0"),
        (lambda b, h: SequentialDrafter(h, tree=[]), r"tree=\[\]"),
        (lambda b, h: SequentialDrafter(h, tree=[[0], [1, 0]]), r"prefix \(1,\) is not in the tree"),
        (lambda b, h: SequentialDrafter(h, tree=[[97]]), "below the vocabulary size 97"),
        (lambda b, h: SequentialDrafter(h, tree=[[3]], vocab=torch.arange(3)), "below the vocabulary size 3"),
        (lambda b, h: SequentialDrafter(h, mode="chain", tree=[[0]]), "mode='chain'"),
        (lambda b, h: SequentialDrafter(h, vocab=torch.tensor([5, 2])), "sorted and distinct"),
        (lambda b, h: train.loss(h, b, random_batch(b), weight=0), "weight=0"),
        (lambda b, h: train.loss(h, b, random_batch(b), target="yes"), "target='yes'"),
        (lambda b, h: train.loss(h, b, random_batch(b), positions=0), "positions=0"),
        (lambda b, h: train.loss(h, b, random_batch(b, t=2)), "T=2"),
        (
            lambda b, h: train.evaluate(h, b, replace(random_batch(b), tokens=torch.zeros(3, 5, dtype=torch.long))),
            r"tokens \(3, 5\)",
        ),
    ],
)
def test_bad_arguments_raise_one_line_errors(make, match):
    base = make_base()
    heads = train.build(base, num_heads=2, num_layers=1)
    with pytest.raises(ValueError, match=match) as error:
        make(base, heads)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("package", ["sequential", "prophet"])
def test_grow_tree_reads_sequential_checkpoints_and_refuses_others(package, tmp_path):
    from omegaconf import OmegaConf

    from experiments.grow_tree import grow
    from experiments.lib.store.checkpoint import save_checkpoint
    from tests.conftest import make_lm

    base = make_lm(num_tokens=64, dim=16, depth=1)
    heads = SequentialHeads.from_base(base, num_heads=2)
    metrics = {f"head{k}_rank{r}": (0.6 if k == 1 else 0.3) * 0.5**r for k in (1, 2) for r in range(10)}
    save_checkpoint(
        tmp_path / "ckpt",
        model=heads,
        tokenizer_json=None,
        step=1,
        model_config={"package": package, "module": {"num_heads": 2, "num_layers": 1}},
        extra={"kind": "drafter", "metrics": metrics, "base_fingerprint": "x"},
    )
    cfg = OmegaConf.create({"checkpoint": str(tmp_path / "ckpt"), "tree_nodes": 4})
    if package == "prophet":
        with pytest.raises(ValueError, match="not a Medusa, sequential heads or block prophet checkpoint"):
            grow(cfg)
    else:
        assert grow(cfg) == [[0], [1], [2], [0, 0]]


@pytest.mark.parametrize("family", ["medusa", "sequential"])
def test_chains_and_trees_at_t1_sample_with_q(family):
    """A head chain or tree at T > 0 returns the distribution each token was drawn from (zero outside the
    trimmed vocabulary, positive at the token; a tree's siblings distinct, each q without the earlier
    siblings); a tree with candidates="ranked", and everything at T = 0, drafts deterministically (q None)."""
    from medusa.drafter import MedusaDrafter
    from medusa.heads import MedusaHeads
    from tests.conftest import make_lm
    from verify.backends.target import Target

    base = make_lm()
    vocab = torch.arange(0, 97, 2)
    heads = (SequentialHeads if family == "sequential" else MedusaHeads).from_base(base, num_heads=3, num_layers=1)
    make = SequentialDrafter if family == "sequential" else MedusaDrafter
    prefill = Target(base).prefill([[1, 2, 3], [4, 5]])
    sampling, gen = SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0)
    for mode, candidates in (("chain", "sampled"), ("tree", "sampled"), ("tree", "ranked")):
        drafter = make(heads, mode=mode, vocab=vocab, candidates=candidates)
        drafter.begin([[1, 2, 3], [4, 5]], prefill, torch.tensor([6, 8]))
        draft = drafter.propose(3, sampling, gen)
        assert drafter.propose(3, SamplingConfig(), None).q is None
        if candidates == "ranked":
            assert draft.q is None
            continue
        if mode == "tree":
            check_sampled_siblings(draft, 97, vocab)
            continue
        assert draft.q.shape == (2, 3, 97)
        torch.testing.assert_close(draft.q.sum(-1), torch.ones(2, 3))
        assert not draft.q[..., 1::2].any()  # nothing outside the subset
        assert (draft.q.gather(2, draft.tokens[..., None]) > 0).all() and (draft.tokens % 2 == 0).all()


# ------------------------------------------------------------------------------------------- Hydra++


def prefix_heads(base, seed=None, dropout=0.0):
    """Heads with Hydra++'s prefix layer, built as the registry builds the family; with a seed, random (the prefix
    layer too, so it is not the identity)."""
    heads = family_build(base, num_heads=3, num_layers=1, prefix=True, dropout=dropout)
    return heads if seed is None else randomise(heads, seed)


def test_a_fresh_prefix_layer_is_the_identity_and_trains():
    base = make_base()
    batch = random_batch(base)
    heads, plain_heads = prefix_heads(base), train.build(base, num_heads=3, num_layers=1)
    assert torch.equal(heads.context(batch.hidden), batch.hidden)
    tokens = train.following_tokens(batch.tokens, 3)
    assert torch.equal(heads(heads.context(batch.hidden), tokens), plain_heads(batch.hidden, tokens))
    torch.manual_seed(0)
    total, _ = train.loss(heads, base, batch)
    total.backward()
    # zero output projections: they get gradients first (q, k, v and the MLP's inputs only once they move)
    assert heads.prefix.o_proj.weight.grad.abs().sum() > 0 and heads.prefix.down_proj.weight.grad.abs().sum() > 0
    assert {key.split(".")[0] for key in heads.state_dict()} == {"mix", "blocks", "projections", "prefix"}
    rebuilt = family_build(base, num_heads=3, num_layers=1, prefix=True)
    perturb(heads, seed=3)
    rebuilt.load_state_dict(heads.state_dict(), strict=True)
    assert torch.equal(rebuilt.context(batch.hidden), heads.context(batch.hidden))
    assert not torch.allclose(heads.context(batch.hidden), batch.hidden)


def test_the_prefix_layer_is_causal():
    base = make_base()
    heads = prefix_heads(base, seed=0)
    hidden = random_batch(base).hidden
    changed = hidden.clone()
    changed[:, 10] += 1.0
    out, new = heads.context(hidden), heads.context(changed)
    assert torch.equal(out[:, :10], new[:, :10]) and (new[:, 10:] - out[:, 10:]).abs().amax(-1).min() > 1e-5


class PrefixSpy(StateSpy):
    """Before every proposal: the drafter's state is the prefix layer's output over a from-scratch base
    forward of the true context, at its last position (so its cache holds exactly the accepted positions).
    StateSpy's own check reads the base's state, which the heads no longer read: replaced here."""

    def propose(self, gamma, sampling, generator):
        for i, ctx in enumerate(self.ctx):
            if self.emitted[i] < self.n:
                _, hidden = self.base(torch.tensor([ctx[:-1]]), return_logits_and_embeddings=True)
                want = self.inner.heads.context(hidden)[0, -1]
                assert torch.allclose(self.inner.hidden[i], want, atol=1e-4), f"stale prefix state in row {i}"
                self.checked += 1
        draft = self.inner.propose(gamma, sampling, generator)
        self.drafts.append(draft.tokens)
        return draft


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("gamma", [1, 2, 4])
def test_prefix_heads_decode_exactly_and_their_cache_holds_the_accepted_positions(trained, mode, gamma):
    base, trained_heads, prompts, batch, _ = trained
    heads = prefix_heads(base)
    heads.load_state_dict(trained_heads.state_dict(), strict=False)  # the trained heads, over a prefix layer
    g = torch.Generator().manual_seed(gamma)
    with torch.no_grad():  # a prefix layer that is not the identity, small enough that drafts still get accepted
        for p in heads.prefix.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    ragged = [prompts[0], prompts[1][2:], batch.tokens[2, :11].tolist()]
    spy = PrefixSpy(make_drafter(heads, base, mode=mode), base, 30)
    out = spec(base, spy, ragged, 30, gamma)
    assert out.tokens == plain(base, ragged, 30)
    assert not torch.allclose(heads.context(batch.hidden), batch.hidden, atol=1e-3)
    # rows accept different counts (rollback of the prefix cache's padded block exercised)
    assert spy.checked > 10 and out.stats.tau > 1 + 0.3 * min(gamma, 3), out.stats.tau


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_prefix_heads_sample_losslessly(mode):
    heads = perturb(family_build(sharp_lm(0), num_heads=2, num_layers=1, prefix=True), seed=0, scale=0.3)
    drafter = SequentialDrafter(heads, mode=mode, tree=LOSSLESS_TREE if mode == "tree" else None)
    (stat, critical), stats = run_lossless(drafter, SamplingConfig(temperature=1.0))
    assert 0.2 < stats.alpha < 1
    assert stat < critical, f"chi2 {stat:.1f} >= critical {critical:.1f}: prefix heads ({mode}) are not lossless"


def test_dropout_acts_in_training_only():
    base = make_base()
    batch = random_batch(base)
    heads = prefix_heads(base, seed=0, dropout=0.5)
    same = prefix_heads(base, seed=0)  # the same weights (the same draws), no dropout
    tokens = train.following_tokens(batch.tokens, 3)
    heads.train()
    assert not torch.equal(heads(batch.hidden, tokens), heads(batch.hidden, tokens))
    drafter = make_drafter(heads, base, mode="chain")
    assert not heads.training  # drafting puts the heads in eval mode
    assert torch.equal(heads(batch.hidden, tokens), same(batch.hidden, tokens))
    prompts = PROMPTS[:2]
    assert (
        spec(base, drafter, prompts, 16, 3).tokens
        == spec(base, make_drafter(same, base, mode="chain"), prompts, 16, 3).tokens
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dropout=1.0), "dropout=1.0"),
        (dict(dropout=-0.1), "dropout=-0.1"),
        (dict(dropout=True), "dropout=True"),
        (dict(prefix="yes"), "prefix='yes'"),
    ],
)
def test_hydra_settings_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match) as error:
        family_build(make_base(), num_heads=2, **kwargs)
    assert "\n" not in str(error.value)
