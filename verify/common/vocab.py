"""Trimmed drafter vocabularies: a drafter's output layer restricted to the N most frequent tokens.

Lossless by construction: a trimmed drafter proposes only tokens of the subset, and the distribution q
it reports is zero outside it, so the acceptance rules see the distribution the tokens were really drawn
from and keep the target's distribution exactly. Rare tokens are still emitted, by the target's own
correction; they just never come from a draft. The speed comes from projecting onto N rows instead of V.

`ids` below is always the sorted subset (N,) of full-vocabulary ids, or None for the full vocabulary
(every function then passes its input through unchanged).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def frequent_tokens(counts: Tensor, n: int | None) -> Tensor | None:
    """counts (V,) -> sorted ids (N,) of the n most frequent tokens; None if n is None or n >= V."""
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(
            f"n={n!r}: the trimmed vocabulary size must be an integer >= 1, or None for the full vocabulary"
        )
    if counts.ndim != 1:
        raise ValueError(f"counts of shape {tuple(counts.shape)}: need one count per token, shape (V,)")
    if n >= counts.numel():
        return None
    # A stable sort breaks ties by the lower id, so the same counts always give the same subset.
    top = torch.sort(counts, descending=True, stable=True).indices[:n]
    return top.sort().values


def check_vocab(ids: Tensor | None, vocab_size: int) -> Tensor | None:
    """A drafter's `vocab` argument: None, or sorted distinct long ids (N,) below vocab_size; one-line errors."""
    if ids is None:
        return None
    if not isinstance(ids, Tensor) or ids.ndim != 1 or ids.numel() == 0 or ids.is_floating_point():
        raise ValueError(f"vocab={ids!r}: must be a non-empty 1-D tensor of token ids, or None for the full vocabulary")
    ids = ids.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"vocab ids span [{int(ids.min())}, {int(ids.max())}]: must lie in [0, {vocab_size})")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("vocab ids must be sorted and distinct (as frequent_tokens returns them)")
    return ids


def trim_linear(layer: nn.Linear, ids: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """The rows of an output layer for the subset, detached: weight (N, d) and bias (N,) or None.

    Indexing copies the rows into one contiguous (N, d) block, built once, so a projection onto the
    subset reads N rows and never touches the others."""
    weight = layer.weight.detach()
    bias = None if layer.bias is None else layer.bias.detach()
    if ids is None:
        return weight, bias
    ids = ids.to(weight.device)
    return weight[ids], None if bias is None else bias[ids]


def subset_linear(x: Tensor, layer: nn.Linear, ids: Tensor | None) -> Tensor:
    """layer(x) onto the subset's rows only: (..., d) -> (..., N) (all V when ids is None). For training: the
    rows are gathered per call, so gradients reach the layer's full weight (trim_linear detaches them)."""
    if ids is None:
        return layer(x)
    return torch.nn.functional.linear(x, layer.weight[ids], None if layer.bias is None else layer.bias[ids])


def subset_logits(logits: Tensor, ids: Tensor | None) -> Tensor:
    """(..., V) full logits -> (..., N) logits of the subset."""
    return logits if ids is None else logits.index_select(-1, ids.to(logits.device))


def full_ids(index: Tensor, ids: Tensor | None) -> Tensor:
    """(...) positions in the subset (an argmax, a top-k or a sample over N) -> (...) full-vocabulary ids."""
    return index if ids is None else ids.to(index.device)[index]


def expand_probs(q: Tensor, ids: Tensor | None, vocab_size: int) -> Tensor:
    """(..., N) distribution over the subset -> (..., V) over the full vocabulary, zero outside the subset."""
    if ids is None:
        return q
    full = q.new_zeros(*q.shape[:-1], vocab_size)
    return full.index_copy_(-1, ids.to(q.device), q)
