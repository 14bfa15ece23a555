"""The sequential (Hydra) heads' training side, as registered in experiments/lib/families/registry.py.

The same three functions, signatures and conventions as medusa/train.py (read its docstring):

    build(base, **module)                   -> the heads (module kwargs are JSON-able: a checkpoint rebuilds them)
    loss(heads, base, batch, **loss)        -> (scalar to minimise, per-head metrics)
    evaluate(heads, base, batch)            -> agreement with the base, and the rank rates a static tree grows from

The inference side, make_drafter(heads, base, **decode) -> a SequentialDrafter, is in medusa/sequential_drafter.py.

Alignment. Head k at position t reads hidden[t] and the TRUE tokens x_{t+1} .. x_{t+k} = batch.tokens[:, t + 1 ..
t + k] (teacher forcing: while drafting it reads its predecessors' guesses, which equal these whenever the
path is accepted) and guesses tokens[:, t + 1 + k]. Its teacher is the base's distribution at t + k, given
the true prefix: exactly Medusa's head k target. So head k has a target only for t < T - k, and the loss
samples positions t < T - K, where every head has one.

Because head k conditions on the true path, `head{k}_rank{r}` is how often its rank-r guess is the base's
top-1 *given that the path to it was accepted*: the conditional rate a static tree's node value multiplies
(medusa.trees.tree_from_accuracies grows trees for these heads from it unchanged).

A batch mask is honoured as Medusa's (sample_positions, heads_loss, evaluate): head k at t counts only where its
token t + 1 + k is an answer token; the tokens it reads may be the user's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from medusa import train as medusa_train
from medusa.sequential import SequentialHeads
from medusa.train import check_batch, heads_loss, sample_positions
from verify.training.features import FeatureBatch

__all__ = ["build", "loss", "evaluate"]


def build(
    base: nn.Module, *, num_heads: int = 4, num_layers: int = 1, prefix: nn.Module | None = None, dropout: float = 0.0
) -> SequentialHeads:
    """Fresh heads on `base` (each equal to a fresh Medusa head: the base's projection of h); `prefix` (a built
    layer) and `dropout` are Hydra++'s prefix layer and training dropout (medusa.sequential). The registry builds
    the family through experiments/lib/families/sequential.py, which makes the prefix layer from `prefix: true`."""
    return SequentialHeads.from_base(base, num_heads=num_heads, num_layers=num_layers, prefix=prefix, dropout=dropout)


def following_tokens(tokens: Tensor, num_heads: int) -> Tensor:
    """tokens (B, T + 1) -> (B, T, K): [:, t] = tokens[:, t + 1 .. t + K], what the heads read at t.

    Zero-padded past the end: at t >= T - K the last columns are padding, which only heads k with
    t >= T - k read, and those have no target there."""
    return F.pad(tokens[:, 1:], (0, num_heads - 1)).unfold(1, num_heads, 1)


def loss(
    module: SequentialHeads,
    base: nn.Module,
    batch: FeatureBatch,
    *,
    vocab: Tensor | None = None,
    weight: float = 0.8,
    target: str = "kl",
    positions: int | None = 2048,
) -> tuple[Tensor, dict[str, float]]:
    """sum_k weight^k * L_k, L_k head k's loss against the base's distribution for token t + 1 + k (`kl`),
    its top-1 (`argmax`) or the corpus token (`true`), on `positions` random positions t < T - K of the batch.
    Metrics: each L_k (`head{k}_loss`), `loss`, `positions` (as medusa.train.loss)."""
    row, pos = sample_positions(module, batch, weight=weight, target=target, positions=positions)  # (n,), (n,)
    reads = following_tokens(batch.tokens, module.num_heads)[row, pos]  # (n, K) true x_{t+1} .. x_{t+K}
    logits = module(module.context(batch.hidden)[row, pos], reads, vocab)  # (n, K, N)
    return heads_loss(logits, batch, row, pos, vocab=vocab, vocab_size=module.vocab_size, weight=weight, target=target)


class _TeacherForced:
    """The heads seen as Medusa heads, hidden (B, T, d) -> logits (B, T, K, N), reading the batch's true
    following tokens; so Medusa's evaluate measures them with exactly its own metrics and alignment."""

    def __init__(self, heads: SequentialHeads, tokens: Tensor):
        self.heads, self.num_heads = heads, heads.num_heads
        self.reads = following_tokens(tokens, heads.num_heads)  # (B, T, K)

    def __call__(self, hidden: Tensor, vocab: Tensor | None) -> Tensor:
        return self.heads(self.heads.context(hidden), self.reads, vocab)


@torch.no_grad()
def evaluate(
    module: SequentialHeads, base: nn.Module, batch: FeatureBatch, *, vocab: Tensor | None = None
) -> dict[str, float]:
    """medusa.train.evaluate's metrics, heads reading the true tokens: per head k `head{k}_agree` (its top-1
    is the base's top-1 for token t + 1 + k), `head{k}_top1` / `head{k}_top5` (against the corpus token) and
    `head{k}_rank{r}` for r < 10 (the rank-r guess is the base's top-1; rank0 = agree)."""
    check_batch(module, batch)
    return medusa_train.evaluate(_TeacherForced(module, batch.tokens), base, batch, vocab=vocab)
