"""The block prophet's training side, as registered in experiments/lib/families/registry.py: `build`, `loss`, `evaluate`
(the inference side, make_drafter, is in prophet/block_drafter.py). The batch is a FeatureBatch of the
feature cache for inputs tokens[:, :-1]: hidden f_0 .. f_{T-1}, the base's top-k next-token distribution at
each index, and for a fused prophet the residual states of its blocks.

Positions. Draft position 1 is the context's own prediction: context entry t = (f_t, x_{t+1}) predicts
f_{t+1}, as the autoregressive prophet's teacher-forced step. Draft position j = 1 + i is slot i of the block
that starts after context entry s: it predicts f_{s+1+i}, whose logits are the base's distribution for token
s + 2 + i. Each position has the prophet's loss: SmoothL1 regression of the feature plus `ce_weight` times
the distillation loss against the base's own distribution (verify/training/distill.py), weighted
decay^(j - 1).

Block starts. Every index can start a block, but a block of K - 1 slots costs K - 1 entries, so a step
trains on `starts` of them, drawn at random without replacement among the starts whose slots all have a
target (s <= T - 1 - K), the same for every window of the batch. null draws T // (2 (K - 1)): 1.5T entries
instead of the autoregressive prophet's T, and a training step (forward, loss, backward) of 1.8x its
teacher-forced one (measured at T = 256, K = 4, prophet width 256, a 2048-token vocabulary, one CPU thread;
every start, T // (K - 1), costs 2.5x). Validation takes every start.

Answer mask. With a batch mask (verify/training/features.py), a prediction of f_u counts only where its logits'
token, u + 1, is an answer token (mask[:, u]): every term and metric is a mean over those, and the starts are
drawn among those whose slots predict an answer token in some window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import repeat
from torch import Tensor, nn

from medusa.train import rank_rates
from medusa.trees import RANKS
from prophet.block import BlockProphet
from prophet.model import check_same_base
from prophet.train import check_loss_settings, position_loss
from verify.common.numerics import check_int
from verify.common.vocab import full_ids, trim_linear
from verify.training.distill import accepted_mass, answers_only, chain_tau, masked_mean, subset_index
from verify.training.features import FeatureBatch


def build(base: nn.Module, **module_kwargs) -> BlockProphet:
    """module_kwargs: `module:` of conf/drafter/prophet_block.yaml (block, and the prophet's dim, depth, heads,
    attn_dim_head, ff_mult, fuse_layers)."""
    return BlockProphet.from_base(base, **module_kwargs)


def loss(
    module: BlockProphet,
    base: nn.Module,
    batch: FeatureBatch,
    *,
    vocab: Tensor | None = None,
    feature_weight: float = 1.0,
    ce_weight: float = 0.1,
    decay: float = 0.8,
    starts: int | None = None,
    target: str = "kl",
) -> tuple[Tensor, dict[str, float]]:
    """batch (B, T) -> (weighted loss, metrics per draft position `pos{j}_*`). `vocab` (sorted ids (N,)): logits
    over the subset only."""
    check_loss_settings(feature_weight=feature_weight, ce_weight=ce_weight, decay=decay, target=target)
    t = _check_batch(module, base, batch)
    usable = t - module.block  # starts 0 .. T - 1 - K
    if starts is not None:
        check_int("starts", starts)
    count = min(usable, starts if starts is not None else max(1, t // (2 * (module.block - 1))))
    chosen = _draw_starts(batch, module.block, usable, count)  # (S,)
    weight, bias = trim_linear(module.head.to_logits, vocab)  # the frozen output layer (its subset rows)
    index = subset_index(vocab, module.vocab_size, batch.hidden.device)
    total, parts = batch.hidden.new_zeros(()), {}
    for j, (pred, u) in enumerate(_positions(module, batch, chosen), start=1):
        top_ids, top_logp, true_ids = batch.top_ids[:, u], batch.top_logp[:, u], batch.tokens[:, u + 1]
        mask = None if batch.mask is None else batch.mask[:, u]  # (B, n): whether token u + 1 is an answer token
        feature, ce, agree = position_loss(
            pred,
            batch.hidden[:, u],
            top_ids,
            top_logp,
            true_ids,
            (weight, bias),
            index=index,
            vocab=vocab,
            target=target,
            mask=mask,
        )
        total = total + decay ** (j - 1) * (feature_weight * feature + ce_weight * ce)
        parts.update({f"pos{j}_feature": feature, f"pos{j}_ce": ce, f"pos{j}_agree": agree})
    parts["loss"] = total
    values = torch.stack([v.detach().float() for v in parts.values()]).tolist()  # one host sync
    return total, dict(zip(parts, values)) | {"starts": chosen.numel()}


@torch.no_grad()
def evaluate(
    module: BlockProphet, base: nn.Module, batch: FeatureBatch, *, vocab: Tensor | None = None
) -> dict[str, float]:
    """For each draft position j = 1..K, over every block start: `head{j}_agree`, how often its top-1 is the
    base's own top-1 for that token given the true prefix (what greedy acceptance needs), and `head{j}_rank{r}`
    for r < 10, how often its rank-r guess is (rank0 = agree), which a static tree grows from
    (medusa.trees.tree_from_accuracies); `head{j}_mass`, the probability that speculative sampling at T = 1
    accepts its sampled draft (verify.training.distill.accepted_mass); `chain_tau` / `chain_mass`, a chain of 3's
    tau at T = 0 and its expectation at T = 1. Blocks run in chunks of T // (K - 1) starts, as in training. With a
    batch mask, each is a rate over the predictions whose token is an answer token."""
    t = _check_batch(module, base, batch)
    weight, bias = trim_linear(module.head.to_logits, vocab)
    ranks = min(RANKS, weight.shape[0])
    tops: dict[int, list[Tensor]] = {}
    picks: dict[int, list[Tensor]] = {}
    masks: dict[int, list[Tensor]] = {}
    hits: dict[int, list[Tensor]] = {}  # per draft position, (B, n) top-1 matches by start, for the chain
    masses: dict[int, list[Tensor]] = {}  # per draft position, (B, n) T = 1 acceptance probabilities by start
    every = torch.arange(t - module.block, device=batch.hidden.device)
    for chunk in every.split(max(1, t // (module.block - 1))):
        for j, (pred, u) in enumerate(_positions(module, batch, chunk), start=1):
            if j == 1 and chunk[0] > 0:
                continue  # the context's predictions do not depend on the blocks: counted once
            logits = F.linear(pred, weight, bias)  # (B, n, N)
            top = full_ids(logits.topk(ranks, dim=-1).indices, vocab)  # (B, n, R)
            mask = None if batch.mask is None else batch.mask[:, u]  # (B, n): whether token u + 1 is an answer
            hits.setdefault(j, []).append(answers_only(top[..., 0] == batch.top_ids[:, u, 0], mask))
            mass = accepted_mass(logits, batch.top_ids[:, u], batch.top_logp[:, u], vocab)  # (B, n)
            masses.setdefault(j, []).append(answers_only(mass, mask))
            tops.setdefault(j, []).append(top.flatten(0, 1))
            picks.setdefault(j, []).append(batch.top_ids[:, u, 0].flatten())
            if mask is not None:
                masks.setdefault(j, []).append(mask.flatten())
    names, values = [], []
    for j in sorted(tops):
        rates = rank_rates(torch.cat(tops[j]), torch.cat(picks[j]), torch.cat(masks[j]) if masks else None)  # (R,)
        mass = torch.cat([m.flatten() for m in masses[j]])
        names += [f"head{j}_agree"] + [f"head{j}_rank{r}" for r in range(ranks)] + [f"head{j}_mass"]
        values += [rates[0], *rates, masked_mean(mass, torch.cat(masks[j]) if masks else None)]
    # the chain from start s: the context's draft at index s (token s + 2), then slots 1, 2, ... of s's block
    chains = [[torch.cat(d[j], dim=1) for j in sorted(d)] for d in (hits, masses)]
    names += ["chain_tau", "chain_mass"]
    values += [chain_tau(chain, batch.mask_at(1)) for chain in chains]
    return dict(zip(names, torch.stack(values).tolist()))  # one host sync


def _draw_starts(batch: FeatureBatch, block: int, usable: int, count: int) -> Tensor:
    """(S,) sorted: `count` random block starts among 0 .. usable - 1, with a batch mask among those whose slots'
    tokens s + 3 .. s + 1 + K hold an answer token in some window (all of them if none does: nothing trains)."""
    candidates = torch.arange(usable, device=batch.hidden.device)
    if batch.mask is not None:
        answered = batch.mask.unfold(1, block - 1, 1)[:, 2:].any(dim=2).any(dim=0)  # (usable,): mask[:, s + 2 ..]
        candidates = candidates[answered] if answered.any() else candidates
    return candidates[torch.randperm(candidates.numel(), device=candidates.device)[:count]].sort().values


def _positions(module: BlockProphet, batch: FeatureBatch, starts: Tensor) -> list[tuple[Tensor, Tensor]]:
    """(predictions (B, n, d_base), the indices u (n,) of the features f_u they predict) for draft positions 1..K:
    position 1 the context's predictions at indices 0 .. T - 2 (u = 1 .. T - 1), position 1 + i slot i of the
    blocks at `starts` (u = start + 1 + i)."""
    context, slots = module.block_forward(batch.hidden, batch.tokens[:, 1:], starts, layers=batch.layers)
    t = batch.hidden.shape[1]
    out = [(context[:, :-1], torch.arange(1, t, device=starts.device))]
    targets = repeat(starts, "s -> s k", k=module.block - 1) + torch.arange(2, module.block + 1, device=starts.device)
    return out + [(slots[:, :, i], targets[:, i]) for i in range(module.block - 1)]


def _check_batch(module: BlockProphet, base: nn.Module, batch: FeatureBatch) -> int:
    check_same_base(module, base)
    if not isinstance(module, BlockProphet):
        raise ValueError(f"{type(module).__name__}: the block prophet's loss needs a BlockProphet (block_train.build)")
    _, t = batch.check()
    if t < module.block + 1:
        raise ValueError(f"block={module.block} needs sequences of at least {module.block + 1} positions; got T={t}")
    return t
