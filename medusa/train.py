"""Medusa's training side, as registered in experiments/lib/families/registry.py (the drafter training loop calls it).

The entry point owns the loop and hands over a FeatureBatch (experiments/lib/training/features.py): tokens (B, T + 1)
and the frozen base's outputs on tokens[:, :-1]: hidden (B, T, d) and its top-k next-token distribution
(top_ids, top_logp (B, T, k)). These three functions are Medusa's:

    build(base, **module)                   -> the heads (module kwargs are JSON-able: a checkpoint rebuilds them)
    loss(heads, base, batch, **loss)        -> (scalar to minimise, per-head metrics)
    evaluate(heads, base, batch)            -> agreement with the base, and the rank rates a static tree grows from

The inference side, make_drafter(heads, base, **decode) -> a MedusaDrafter, lives beside it in medusa/drafter.py.

Alignment. Head k at position t guesses tokens[:, t + 1 + k]. The base's own distribution for that token,
given the true prefix, is its output at t + k: the teacher of self-distillation and the reference of
agreement. So head k has a target only for t < T - k.

Position subsampling. Consecutive positions of a window are highly correlated, and every head's cost is
per position; so each step trains on `positions` positions drawn at random from all windows of the batch
(all with t < T - K, where every head has a target) rather than on every position of a few windows: many
more windows for the same compute.

Answer mask. With a batch mask (verify/training/features.py), head k at t counts only where token t + 1 + k is
an answer token (mask[:, t + k]): positions are drawn among those where at least one head's target is, and
each head's loss and metrics are means over its own answer targets.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from medusa.heads import MedusaHeads
from medusa.trees import RANKS
from verify.common.vocab import full_ids
from verify.training.distill import (
    accepted_mass,
    answers_only,
    chain_tau,
    check_mask,
    check_target,
    distill_loss,
    masked_mean,
    subset_index,
)
from verify.training.features import FeatureBatch

__all__ = ["build", "loss", "evaluate"]


def build(
    base: nn.Module,
    *,
    num_heads: int = 4,
    num_layers: int = 1,
    share_base_projection: bool = False,
    init: str = "medusa1",
) -> MedusaHeads:
    """Fresh heads on `base` (Medusa-1's init: block weights zero, projections copied from the base's output
    layer; init="random": PyTorch's default init, the ablation)."""
    return MedusaHeads.from_base(
        base, num_heads=num_heads, num_layers=num_layers, share_base_projection=share_base_projection, init=init
    )


def check_batch(module: MedusaHeads, batch: FeatureBatch) -> None:
    _, t = batch.check()
    if t <= module.num_heads:
        raise ValueError(f"sequence length T={t}: head {module.num_heads} needs T > num_heads to have any target")


def _sample_positions(
    b: int, usable: int, positions: int | None, device: torch.device, eligible: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Row and position indices (n,) of `positions` random positions t < usable (all of them when None), drawn
    among those where `eligible` (B, usable) is True when given."""
    candidates = None if eligible is None else eligible.flatten().nonzero()[:, 0]  # (m,) flat indices
    total = b * usable if candidates is None else candidates.numel()
    pick = torch.randperm(total, device=device)[: total if positions is None else min(positions, total)]
    pick = pick if candidates is None else candidates[pick]
    return pick // usable, pick % usable


def sample_positions(
    module: nn.Module, batch: FeatureBatch, *, weight: float, target: str, positions: int | None
) -> tuple[Tensor, Tensor]:
    """Check the loss settings and the batch; row and position indices (n,) of `positions` random positions
    t < T - K (where every head has a target), with a batch mask only those where some head's target is an answer
    token. Shared by Medusa's and the sequential heads' losses."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0:
        raise ValueError(f"weight={weight!r}: must be a number > 0 (0.8 is the common choice)")
    if positions is not None and (isinstance(positions, bool) or not isinstance(positions, int) or positions < 1):
        raise ValueError(f"positions={positions!r}: must be an integer >= 1, or null for every position")
    check_target(target)
    check_batch(module, batch)
    b, t, _ = batch.hidden.shape
    k = module.num_heads
    # (B, T - K): some head's target at t, token t + 1 + k for k = 1..K, is an answer token (mask[:, t + k])
    eligible = None if batch.mask is None else batch.mask.unfold(1, k, 1)[:, 1:].any(dim=-1)
    return _sample_positions(b, t - k, positions, batch.hidden.device, eligible)


def heads_loss(
    logits: Tensor,
    batch: FeatureBatch,
    row: Tensor,
    pos: Tensor,
    *,
    vocab: Tensor | None,
    vocab_size: int,
    weight: float,
    target: str,
) -> tuple[Tensor, dict[str, float]]:
    """logits (n, K, N) of heads 1..K at positions (row, pos) -> (sum_k weight^k * L_k, metrics), L_k head k's
    distillation loss for token t + 1 + k (teacher: the base's distribution at t + k), with a batch mask over the
    positions where that token is an answer token."""
    index = subset_index(vocab, vocab_size, logits.device)
    terms = [
        distill_loss(
            logits[:, k - 1],
            top_ids=batch.top_ids[row, pos + k],
            top_logp=batch.top_logp[row, pos + k],
            true_ids=batch.tokens[row, pos + k + 1],
            target=target,
            index=index,
            mask=None if batch.mask is None else batch.mask[row, pos + k],
        )
        for k in range(1, logits.shape[1] + 1)
    ]
    total = sum(weight**k * term for k, term in enumerate(terms, start=1))
    values = torch.stack([total.detach(), *[term.detach() for term in terms]]).tolist()  # one host sync
    metrics = {"loss": values[0]} | {f"head{k}_loss": v for k, v in enumerate(values[1:], start=1)}
    return total, metrics | {"positions": row.numel()}


def loss(
    module: MedusaHeads,
    base: nn.Module,
    batch: FeatureBatch,
    *,
    vocab: Tensor | None = None,
    weight: float = 0.8,
    target: str = "kl",
    positions: int | None = 2048,
) -> tuple[Tensor, dict[str, float]]:
    """sum_k weight^k * L_k, L_k head k's loss against the base's distribution for token t + 1 + k (`kl`),
    its top-1 (`argmax`) or the corpus token (`true`), on `positions` random positions of the batch.
    Metrics: each L_k (`head{k}_loss`), `loss`, `positions`.

    Medusa's own code weights head k by weight^(k - 1); weight^k differs by the constant factor `weight`.
    """
    row, pos = sample_positions(module, batch, weight=weight, target=target, positions=positions)  # (n,), (n,)
    logits = module(batch.hidden[row, pos], vocab)  # (n, K, N)
    return heads_loss(logits, batch, row, pos, vocab=vocab, vocab_size=module.vocab_size, weight=weight, target=target)


@torch.no_grad()
def evaluate(
    module: MedusaHeads, base: nn.Module, batch: FeatureBatch, *, vocab: Tensor | None = None
) -> dict[str, float]:
    """Per head k: `head{k}_agree`, how often its top-1 is the base's own top-1 for that token given the
    true prefix (what greedy acceptance of head k's chain token needs); `head{k}_top1` / `head{k}_top5`
    against the corpus token; and for each rank r < 10 `head{k}_rank{r}`: how often the rank-r guess is
    the base's top-1 (rank0 = agree); `head{k}_mass`, the probability that speculative sampling at T = 1 accepts
    head k's sampled draft (verify.training.distill.accepted_mass); `chain_tau` and `chain_mass`, a chain of 3's
    tau at T = 0 and its expectation at T = 1. The rank rates are what a static tree is grown from
    (medusa.trees.tree_from_accuracies); a vocabulary smaller than 10 has fewer ranks. With a batch mask, each
    is a rate over the positions whose token t + 1 + k is an answer token."""
    check_batch(module, batch)
    t = batch.hidden.shape[1]
    out = module(batch.hidden, vocab)  # (B, T, K, N)
    ranks = min(RANKS, out.shape[-1])
    names, values, matches, masses = [], [], [], []
    for k in range(1, module.num_heads + 1):
        logits = out[:, : t - k, k - 1]  # (B, T - k, N)
        top = full_ids(logits.topk(ranks, dim=-1).indices, vocab)  # (B, T - k, R) full-vocabulary ids
        truth = batch.tokens[:, k + 1 :, None] == top  # (B, T - k, R)
        base_pick = batch.top_ids[:, k:, 0]  # (B, T - k): the base's own choice of token t + 1 + k
        mask = batch.mask_at(k)  # (B, T - k): whether token t + 1 + k is an answer token, or None
        names += [f"head{k}_agree", f"head{k}_top1", f"head{k}_top5"]
        values += [
            masked_mean(top[..., 0] == base_pick, mask),
            masked_mean(truth[..., 0], mask),
            masked_mean(truth[..., :5].any(-1), mask),
        ]
        names += [f"head{k}_rank{r}" for r in range(ranks)]
        values += list(rank_rates(top, base_pick, mask))
        matches.append(answers_only(top[..., 0] == base_pick, mask))  # the chain from t drafts head k's top-1
        mass = accepted_mass(logits, batch.top_ids[:, k:], batch.top_logp[:, k:], vocab)  # (B, T - k)
        masses.append(answers_only(mass, mask))
        names.append(f"head{k}_mass")
        values.append(masked_mean(mass, mask))
    names += ["chain_tau", "chain_mass"]
    values += [chain_tau(matches, batch.mask_at(1)), chain_tau(masses, batch.mask_at(1))]
    return dict(zip(names, torch.stack(values).tolist()))  # one host sync


def rank_rates(top: Tensor, base_pick: Tensor, mask: Tensor | None = None) -> Tensor:
    """How often each rank's guess is the base's own choice: top (..., R) full ids, ranked; base_pick (...) -> (R,),
    over the positions where `mask` (...) is True when given (0 when none is).
    What a static tree of ranks grows from (medusa.trees.tree_from_accuracies)."""
    hits = (top == base_pick[..., None]).float().flatten(0, -2)  # (n, R)
    if mask is None:
        return hits.mean(dim=0)
    check_mask(mask, base_pick.shape)
    return (hits * mask.flatten()[:, None]).sum(dim=0) / mask.sum().clamp(min=1)
