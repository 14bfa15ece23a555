"""Self-distillation targets shared by every drafter family: the frozen base's own distribution.

A drafter's draft is accepted when it agrees with the base, not with the data: so its training target is
the base's distribution for the same token (Medusa-2 and EAGLE train this way), and its validation
figure is agreement with the base's top-1, which is what greedy acceptance measures.

The teacher is stored sparse: the base's `k` most likely tokens and their log-probabilities (over the
full vocabulary), `ids (..., k)` and `logp (..., k)`, computed once in fp32 (experiments/lib/training/features.py).
Three targets:
- `kl`: cross-entropy to the teacher renormalised over its top-k, i.e. KL(p_topk || q) up to a constant.
  With k = 16 the top-k holds most of the base's mass on this corpus, and the student's full softmax
  still normalises over every token it can emit.
- `argmax`: cross-entropy to the base's top-1 (what greedy acceptance checks, nothing more).
- `true`: cross-entropy to the corpus token (learning the data, the pre-distillation recipe).
- `tv`: 1 - sum over the teacher's top-k of min(p, q), the total variation the acceptance rule pays for: speculative
  sampling accepts a draft from q with probability exactly sum_x min(p(x), q(x)), so this loss is one minus a lower
  bound of the acceptance rate (the mass outside the top-k counts as no overlap). p is the teacher's probability
  over the full vocabulary, not renormalised; q the student's softmax. Its gradient reaches only the tokens where
  q < p, and vanishes once q covers p there: alone it can stall far from p, so
- `kl_tv`: the `kl` cross-entropy plus `tv` (the acceptance-rate losses of the literature mix the two, the divergence
  pulling q towards p from afar, the total variation aiming at the accepted mass).

A trimmed drafter vocabulary (`vocab`, sorted ids (N,)) gives student logits over the subset only; teacher
tokens outside it are dropped (the drafter can never propose them), and positions whose target falls
wholly outside it are left out of the mean.

A `mask` (bool, one flag per position) keeps only the positions whose target is an answer token: the loss and
the agreement are means over those alone, and a batch without any is a zero loss (with a graph) and a 0
agreement, never a NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

from verify.common.vocab import full_ids

TARGETS = ("kl", "argmax", "true", "tv", "kl_tv")


def check_target(target: str) -> str:
    if target not in TARGETS:
        raise ValueError(f"target={target!r}: must be one of {', '.join(TARGETS)} (kl and argmax distil the base)")
    return target


def subset_index(vocab: Tensor | None, vocab_size: int, device: torch.device) -> Tensor | None:
    """(V,) long: the position of each full-vocabulary id in the subset `vocab`, -1 outside; None for no subset."""
    if vocab is None:
        return None
    index = torch.full((vocab_size,), -1, dtype=torch.long, device=device)
    index[vocab.to(device)] = torch.arange(vocab.numel(), device=device)
    return index


def distill_loss(
    logits: Tensor,
    *,
    top_ids: Tensor,
    top_logp: Tensor,
    true_ids: Tensor | None = None,
    target: str = "kl",
    index: Tensor | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """Mean loss of student logits (N, V') against the teacher top-k (N, k) (or true ids (N,)).

    `index` (from `subset_index`) maps full ids to the student's subset columns when V' < V; `mask` (N,) bool
    keeps only the positions where it is True (None: all)."""
    check_target(target)
    check_mask(mask, logits.shape[:-1])
    log_q = logits.float().log_softmax(dim=-1)  # (N, V')
    if target == "true":
        if true_ids is None:
            raise ValueError("target='true' needs the corpus tokens")
        ids, weight = true_ids[:, None], torch.ones_like(true_ids, dtype=log_q.dtype)[:, None]
    elif target == "argmax":
        ids, weight = top_ids[:, :1], torch.ones_like(top_logp[:, :1], dtype=log_q.dtype)
    else:  # kl, tv, kl_tv: the teacher's top-k probabilities
        ids, weight = top_ids, top_logp.float().exp()
    if index is not None:  # teacher tokens the subset cannot emit carry no target
        ids = index[ids]
        weight = weight * (ids >= 0)
        ids = ids.clamp(min=0)
    mass = weight.sum(dim=-1)  # (N,)
    keep = mass > 0 if mask is None else (mass > 0) & mask
    log_q_top = log_q[keep].gather(-1, ids[keep])  # (n, k) the student's log-probability of each teacher token
    loss = log_q_top.new_zeros(log_q_top.shape[0])  # (n,)
    if target != "tv":
        p = weight[keep] / mass[keep, None]  # (n, k) renormalised teacher
        loss = loss - (p * log_q_top).sum(dim=-1)
    if target in ("tv", "kl_tv"):
        loss = loss + 1 - torch.minimum(weight[keep], log_q_top.exp()).sum(dim=-1)
    return loss.mean() if loss.numel() else log_q.sum() * 0.0  # no target at all: a zero that still has a graph


def student_top1(logits: Tensor, vocab: Tensor | None) -> Tensor:
    """(..., V') student logits -> (...) its top-1 as a full-vocabulary id."""
    return full_ids(logits.argmax(dim=-1), vocab)


def agreement(logits: Tensor, top_ids: Tensor, vocab: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
    """Share of positions where the student's top-1 is the base's top-1: logits (..., V'), top_ids (..., k);
    over the positions where `mask` (...) is True when given."""
    return masked_mean(student_top1(logits, vocab) == top_ids[..., 0], mask)


def accepted_mass(logits: Tensor, top_ids: Tensor, top_logp: Tensor, vocab: Tensor | None = None) -> Tensor:
    """(...) sum over the teacher's top-k of min(p, q): the probability that speculative sampling at T = 1 accepts a
    draft token drawn from the student's q, a lower bound since the teacher's mass outside its top-k counts as no
    overlap. logits (..., V') over `vocab` (sorted subset ids, None: all V); top_ids / top_logp (..., k) the
    teacher's, log-probabilities over the full vocabulary. Teacher tokens outside the subset add nothing: the
    drafter can never propose them."""
    q = logits.float().softmax(dim=-1)  # (..., V')
    ids, inside = top_ids, torch.ones_like(top_ids, dtype=torch.bool)
    if vocab is not None:  # full ids -> subset columns, by binary search in the sorted subset
        vocab = vocab.to(top_ids.device)
        ids = torch.searchsorted(vocab, top_ids.contiguous()).clamp(max=vocab.numel() - 1)  # (..., k)
        inside = vocab[ids] == top_ids
    q_top = torch.where(inside, q.gather(-1, ids), 0.0)  # (..., k)
    return torch.minimum(top_logp.float().exp(), q_top).sum(dim=-1)


CHAIN = 3  # drafts of the chain whose acceptance validation measures (`chain_tau`)


def chain_tau(matches: list[Tensor], mask: Tensor | None = None, *, depth: int = CHAIN) -> Tensor:
    """tau of a greedy chain of `depth` drafts (or as many as there are), teacher-forced: matches[j] (B, L_j) bool
    says whether draft j + 1 of the chain started at position s is the base's own top-1 there (the drafts before it
    taken as accepted, which greedy text makes true). A chain accepts its leading run of matches and the verify
    pass adds one token, so tau = 1 + the mean of that run over starts s (mask (B, >= L): the starts whose first
    draft is an answer token; a family zeroes the drafts past the answer with `answers_only`). What a drafter is
    worth at T = 0, in one forward, where per-draft agreement rates would count a draft after a rejected one.
    Given the acceptance probabilities at T = 1 instead (float, from `accepted_mass`), the same product is the
    expected run of a sampled chain along the data's text (`chain_mass`)."""
    chain = matches[:depth]
    length = min(m.shape[1] for m in chain)
    run = torch.stack([m[:, :length] for m in chain], dim=-1).float().cumprod(dim=-1).sum(dim=-1)  # (B, L)
    return 1 + masked_mean(run, None if mask is None else mask[:, :length])


def answers_only(values: Tensor, mask: Tensor | None) -> Tensor:
    """`values` (...) (a chain's matches or acceptance probabilities) zeroed where `mask` (...) is False: a chain that
    reaches a position whose token is not an answer token (past the answer's end) stops there, as decoding does."""
    return values if mask is None else values * mask


def masked_mean(values: Tensor, mask: Tensor | None) -> Tensor:
    """Mean of `values` (...) over the positions where `mask` (...) is True (every position when None); 0 when
    none is, so a batch without an answer position reports no NaN (a float keeps its graph)."""
    if mask is None:
        return values.float().mean()
    check_mask(mask, values.shape)
    return torch.where(mask, values.float(), 0.0).sum() / mask.sum().clamp(min=1)


def check_mask(mask: Tensor | None, shape: tuple[int, ...]) -> None:
    """A one-line ValueError unless `mask` is None or bool of exactly `shape` (broadcasting would hide a shift)."""
    if mask is not None and (mask.dtype != torch.bool or mask.shape != shape):
        raise ValueError(
            f"a loss mask must be bool {tuple(shape)}, one flag per position; got {mask.dtype} {tuple(mask.shape)}"
        )
