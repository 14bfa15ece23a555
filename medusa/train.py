"""Medusa's side of the generic drafter training entry point (experiments/train_drafter.py).

The entry point owns the loop: it freezes the base, draws batches tokens (B, T + 1), runs the base once
under no_grad on tokens[:, :-1] for hidden (B, T, d) and logits (B, T, V), and calls these four functions:

    build(base, **module)             -> the heads (module kwargs are JSON-able: a checkpoint rebuilds them)
    loss(heads, base, ..., **loss)    -> (scalar to minimise, per-head metrics)
    evaluate(heads, base, ...)        -> accuracies, including the rank accuracies a static tree grows from
    drafter(heads, base, **decode)    -> a MedusaDrafter for verify.speculative_generate

Alignment. logits[:, t] is the base's guess for tokens[:, t + 1]; head k at t guesses tokens[:, t + 1 + k].
So head k has targets only for t < T - k: positions t >= T - k are dropped, not padded. The base's own
distribution for that same token is logits[:, t + k] (it sees the true prefix up to t + k), which is the
teacher of self-distillation and the reference of the rank accuracies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from medusa.drafter import MedusaDrafter
from medusa.heads import MedusaHeads
from medusa.trees import RANKS

__all__ = ["build", "loss", "evaluate", "drafter"]


def build(base: nn.Module, *, num_heads: int = 4, num_layers: int = 1, share_base_projection: bool = False) -> MedusaHeads:
    """Fresh heads on `base` (block weights zero, projections copied from the base's output layer)."""
    return MedusaHeads.from_base(base, num_heads=num_heads, num_layers=num_layers, share_base_projection=share_base_projection)


def _check_batch(module: MedusaHeads, tokens: Tensor, hidden: Tensor, logits: Tensor) -> None:
    b, t, _ = hidden.shape
    if tokens.shape != (b, t + 1) or logits.shape[:2] != (b, t):
        raise ValueError(
            f"tokens {tuple(tokens.shape)}, hidden {tuple(hidden.shape)}, logits {tuple(logits.shape)}: "
            "need tokens (B, T + 1) and the base's hidden (B, T, d) and logits (B, T, V) on tokens[:, :-1]"
        )
    if t <= module.num_heads:
        raise ValueError(f"sequence length T={t}: head {module.num_heads} needs T > num_heads to have any target")


def _head_term(pred: Tensor, k: int, tokens: Tensor, logits: Tensor, distill: bool) -> Tensor:
    """Head k's loss on its predictions pred (B, T - k, V) for tokens[:, 1 + k:]."""
    if distill:  # KL(p || q): p the base at t + k, q head k at t, averaged over positions
        log_p = logits[:, k:].float().log_softmax(dim=-1)
        log_q = pred.float().log_softmax(dim=-1)
        return F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1).mean()
    return F.cross_entropy(rearrange(pred.float(), "b t v -> (b t) v"), rearrange(tokens[:, k + 1 :], "b t -> (b t)"))


def loss(
    module: MedusaHeads, base: nn.Module, *, tokens: Tensor, hidden: Tensor, logits: Tensor,
    weight: float = 0.8, distill: bool = False,
) -> tuple[Tensor, dict[str, float]]:
    """sum_k weight^k * L_k, L_k = CE of head k against the true token t + 1 + k (or, with distill,
    KL from the base's distribution at t + k to head k's). Metrics: each L_k (`head{k}_loss`) and `loss`.

    Medusa's own code weights head k by weight^(k - 1); weight^k differs by the constant factor `weight`.
    """
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0:
        raise ValueError(f"weight={weight!r}: must be a number > 0 (0.8 is the common choice)")
    if not isinstance(distill, bool):
        raise ValueError(f"distill={distill!r}: must be true or false")
    _check_batch(module, tokens, hidden, logits)
    out = module(hidden)  # (B, T, K, V)
    t = hidden.shape[1]
    terms = [_head_term(out[:, : t - k, k - 1], k, tokens, logits, distill) for k in range(1, module.num_heads + 1)]
    total = sum(weight**k * term for k, term in enumerate(terms, start=1))
    values = torch.stack([total.detach(), *[term.detach() for term in terms]]).tolist()  # one host sync
    metrics = {"loss": values[0]} | {f"head{k}_loss": v for k, v in enumerate(values[1:], start=1)}
    return total, metrics


@torch.no_grad()
def evaluate(module: MedusaHeads, base: nn.Module, *, tokens: Tensor, hidden: Tensor, logits: Tensor) -> dict[str, float]:
    """Per head k: `head{k}_top1` / `head{k}_top5` against the true token t + 1 + k, and for each rank
    r < 10 `head{k}_rank{r}`: how often the rank-r guess equals the base's argmax for that token given the
    true prefix (logits[:, t + k]). The rank rates are what a static tree is grown from
    (medusa.trees.tree_from_accuracies); a vocabulary smaller than 10 has fewer ranks."""
    _check_batch(module, tokens, hidden, logits)
    out = module(hidden)  # (B, T, K, V)
    t, ranks = hidden.shape[1], min(RANKS, module.vocab_size)
    names, values = [], []
    for k in range(1, module.num_heads + 1):
        top = out[:, : t - k, k - 1].topk(ranks, dim=-1).indices  # (B, T - k, R)
        truth = tokens[:, k + 1 :, None] == top  # (B, T - k, R)
        names += [f"head{k}_top1", f"head{k}_top5"]
        values += [truth[..., 0].float().mean(), truth[..., :5].any(-1).float().mean()]
        base_pick = logits[:, k:].argmax(dim=-1)  # (B, T - k): the base's own choice of token t + 1 + k
        names += [f"head{k}_rank{r}" for r in range(ranks)]
        values += list((top == base_pick[..., None]).float().mean(dim=(0, 1)))
    return dict(zip(names, torch.stack(values).tolist()))  # one host sync


def drafter(module: MedusaHeads, base: nn.Module, *, mode: str = "tree", tree: list | None = None, tree_nodes: int = 16,
            vocab: Tensor | None = None) -> MedusaDrafter:
    """The drafter for decoding (decode kwargs from conf/drafter/medusa.yaml `decode:`); `vocab` the sorted
    token ids (N,) its heads may propose (verify.vocab.frequent_tokens), None for the full vocabulary."""
    return MedusaDrafter(module, mode=mode, tree=tree, tree_nodes=tree_nodes, vocab=vocab)
