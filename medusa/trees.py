"""Static Medusa trees: rank paths grown from head accuracies, and their node tables.

A tree is a list of rank paths: node (r1, .., rd) carries head d's rank-rd guess, under the node
(r1, .., r_{d-1}). `verify.loop.tree.grow_tree` adds nodes greedily by the product of their rank accuracies,
accuracies[d][r] = how often head d + 1's rank-r guess is the base's own next-next.. token.

Before any measurement there is `default_tree`, grown from a fixed table of typical accuracies:
- top-1 accuracy of heads 1..5: 0.56, 0.32, 0.20, 0.15, 0.12 (Medusa on Vicuna-7B); a head
  beyond the fifth keeps losing a fifth: 0.12 * 0.8^(k - 5);
- rank decay: accuracy(rank r) = top1 * rho^r with rho = 1 - sqrt(top1). This is our assumption, not a
  published table. It makes the ranks of head k sum to sqrt(top1_k) < 1 (a head cannot be right more than
  always) and makes weaker heads flatter, as measured heads are: head 1 gets rho = 0.25 (top-5 0.75, near the
  paper's "top-5 above 0.8" for the first head), head 4 rho = 0.61 (top-5 0.35).
After training, `tree_from_accuracies` grows the tree from the `head{k}_rank{r}` metrics of
`medusa.train.evaluate` instead.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from verify.common.numerics import check_int
from verify.loop.tree import Path, grow_tree, sort_paths, tree_from_paths

MEDUSA_TOP1 = (0.56, 0.32, 0.20, 0.15, 0.12)  # heads 1..5, Vicuna-7B (Cai et al. 2024)
RANKS = 10  # ranks per head considered when growing a tree (evaluate() measures ranks 0..9)


def typical_accuracies(num_heads: int, ranks: int = RANKS) -> list[list[float]]:
    """accuracies[k][r] for heads 1..num_heads and ranks 0..ranks-1, from the table above."""
    check_int("num_heads", num_heads)
    check_int("ranks", ranks)
    out = []
    for k in range(num_heads):
        top1 = MEDUSA_TOP1[k] if k < len(MEDUSA_TOP1) else MEDUSA_TOP1[-1] * 0.8 ** (k + 1 - len(MEDUSA_TOP1))
        rho = 1 - math.sqrt(top1)
        out.append([top1 * rho**r for r in range(ranks)])
    return out


def default_tree(
    num_heads: int, tree_nodes: int, *, ranks: int = RANKS, accuracies: list[list[float]] | None = None
) -> list[Path]:
    """A static tree of `tree_nodes` nodes for `num_heads` heads: grown from the heads' measured rank
    `accuracies` (`accuracies_from_metrics` of a checkpoint's validation metrics) when given, else from
    the typical accuracies above, as before any head was measured.

    `ranks` caps the rank of any node (a vocabulary smaller than 10 has fewer ranks)."""
    check_int("tree_nodes", tree_nodes)
    if accuracies is None:
        return grow_tree(typical_accuracies(num_heads, ranks), tree_nodes)
    if len(accuracies) < num_heads:
        raise ValueError(f"accuracies for {len(accuracies)} heads: the tree needs all {num_heads}")
    return grow_tree([row[:ranks] for row in accuracies[:num_heads]], tree_nodes)


def accuracies_from_metrics(metrics: dict, num_heads: int) -> list[list[float]]:
    """The `head{k}_rank{r}` entries of evaluate()'s metrics -> accuracies[k - 1][r]."""
    check_int("num_heads", num_heads)
    out = []
    for k in range(1, num_heads + 1):
        row = []
        while f"head{k}_rank{len(row)}" in metrics:
            row.append(float(metrics[f"head{k}_rank{len(row)}"]))
        if not row:
            raise ValueError(
                f"metrics have no head{k}_rank0: need medusa.train.evaluate() output for {num_heads} heads"
            )
        out.append(row)
    return out


def tree_from_accuracies(metrics: dict, num_heads: int, tree_nodes: int) -> list[Path]:
    """Grow a `tree_nodes`-node tree from measured rank accuracies (the metrics of evaluate())."""
    check_int("tree_nodes", tree_nodes)
    return grow_tree(accuracies_from_metrics(metrics, num_heads), tree_nodes)


def node_table(paths: list[Path], max_depth: int, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor, Tensor]:
    """The nodes no deeper than max_depth -> parents (k,) draft-indexed, head (k,) 0-based, rank (k,), on `device`.

    Node (r1, .., rd) is head d's rank-rd guess, so its token is top[:, d - 1, rd] of the heads' top-k.
    Cutting by depth keeps every kept node's prefix, so the result is still a tree.
    """
    kept = [p for p in sort_paths(paths) if len(p) <= max_depth]
    parents, depth = tree_from_paths(kept, device)
    rank = torch.tensor([p[-1] for p in kept], device=device)
    return parents, depth - 1, rank
