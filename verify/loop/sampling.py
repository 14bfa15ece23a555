"""The one sampling transform: logits -> the distribution p that decoding samples from.

Plain decoding, every drafter and every acceptance rule call `probs_from_logits` with the same
`SamplingConfig`, so "lossless" is measured against exactly the distribution plain decoding uses.
Temperature 0 means greedy: p is one-hot on the argmax (ties: the lowest token id, as torch.argmax).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from verify.common.numerics import is_finite_number
from verify.common.vocab import expand_probs, full_ids

MIN_TEMPERATURE = 1e-6  # every temperature below it samples the argmax anyway: a logit gap of 1e-4 is e^-100


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None  # None = no top-k filter
    top_p: float = 1.0  # 1 = no nucleus filter

    def __post_init__(self) -> None:
        # Validated here, once, so no decode loop starts with settings it cannot honour. Finiteness first:
        # nan < 0 is False, so a range check alone lets NaN through, and a NaN temperature makes every p
        # NaN (an infinite one makes p uniform whatever the model says). True is an int to Python, not a setting.
        if not is_finite_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r}: must be a number >= 0, finite (0 = greedy)")
        if 0 < self.temperature < MIN_TEMPERATURE:  # logits / T would overflow to inf and p turn NaN, silently
            raise ValueError(
                f"temperature={self.temperature!r}: must be a number >= 0, and 0 or at least "
                f"{MIN_TEMPERATURE} (logits / T overflows below it; 0 = greedy is its limit)"
            )
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1
        ):
            raise ValueError(f"top_k={self.top_k!r}: must be an integer >= 1, or None for no top-k")
        if not is_finite_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r}: must be a number in (0, 1] (1 = no nucleus filter)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _filter_top_k(logits: Tensor, k: int) -> Tensor:
    k = min(k, logits.shape[-1])
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def _filter_top_p(logits: Tensor, top_p: float) -> Tensor:
    # Keep the smallest set of most likely tokens whose mass reaches top_p (always at least one).
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = (cum - sorted_logits.softmax(dim=-1)) >= top_p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def greedy_tokens(logits: Tensor) -> Tensor:
    """(..., V) logits -> (...) their argmax (ties: the lowest id), taken in float32: the same index (the cast is
    exact), but a CPU's bf16 argmax is not vectorised: 94 us a row of SmolLM2's 49,152 logits against 25 in float32
    (AMD EPYC, 2 threads), 1.6 ms of each 17-node tree's verification."""
    return logits.float().argmax(dim=-1)


def probs_from_logits(logits: Tensor, cfg: SamplingConfig) -> Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after temperature, top-k and top-p."""
    logits = logits.float()
    if cfg.greedy:
        return torch.nn.functional.one_hot(greedy_tokens(logits), logits.shape[-1]).float()
    logits = logits / cfg.temperature
    if cfg.top_k is not None:
        logits = _filter_top_k(logits, cfg.top_k)
    if cfg.top_p < 1:
        logits = _filter_top_p(logits, cfg.top_p)
    return logits.softmax(dim=-1)


def sample_from_probs(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """(..., V) probabilities -> (...) sampled ids, vectorised over every leading dimension.

    The exponential race (argmax of p / E with E ~ Exp(1)) draws exactly from p and, unlike
    torch.multinomial, takes any number of leading dimensions in one call.
    """
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def sample_siblings(probs: Tensor, width: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """(..., V) probabilities -> `width` distinct ids drawn WITHOUT replacement, in draw order (..., width), and
    q (..., width, V): the distribution each draw came from, `probs` without the draws before it, renormalised.

    The tree rule (verify.loop.tree.tree_sampling_accept) tries siblings in turn and, on a rejection, removes the
    sibling's q from the residual: each try is a valid rejection step whatever distribution the sibling came
    from, as long as q is that distribution given the earlier siblings. So siblings may be distinct draws,
    which never waste a try on a token already rejected.

    The same exponential race as `sample_from_probs`: the first `width` arrivals (largest p / E) are
    successive draws, each from what is left. Ids of probability 0 arrive only after every other, lowest id
    first (a fixed order, not the noise's): when fewer than `width` ids have mass, the extra draws are
    deterministic picks and their q is one-hot on them, which the rules treat like any deterministic candidate.
    """
    vocab = probs.shape[-1]
    if not 1 <= width <= vocab:
        raise ValueError(f"width={width}: must be between 1 and the vocabulary size {vocab}")
    noise = torch.empty_like(probs).exponential_(generator=generator)
    last = -1.0 - torch.arange(vocab, device=probs.device, dtype=probs.dtype)  # below every p / E: id order
    index = torch.where(probs > 0, probs / noise, last).topk(width, dim=-1).indices  # (..., width)
    drawn = F.one_hot(index, vocab).to(probs.dtype)  # (..., width, V)
    before = drawn.cumsum(dim=-2) - drawn  # 1 at the ids drawn before each draw
    left = probs.unsqueeze(-2) * (1 - before)  # (..., width, V)
    mass = left.sum(-1, keepdim=True)
    return index, torch.where(mass > 0, left / mass.clamp(min=1e-30), drawn)


def sample_token(logits: Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None) -> Tensor:
    """(..., V) logits -> (...) next tokens. Greedy skips the softmax (same result as one-hot p)."""
    if cfg.greedy:
        return greedy_tokens(logits)
    return sample_from_probs(probs_from_logits(logits, cfg), generator)


def draft_from_logits(
    logits: Tensor, cfg: SamplingConfig, generator: torch.Generator | None, *, vocab: Tensor | None, vocab_size: int
) -> tuple[Tensor, Tensor | None]:
    """A drafter's logits (..., N) over the sorted ids `vocab` (N,) (None: all V) -> draft tokens (...) as
    full-vocabulary ids, and q (..., V), the distribution each was drawn from.

    Greedy: the argmax, q None (the loop treats it as one-hot). Otherwise a sample from the same transform
    the target's p goes through (so p / q compare like with like), q zero outside the subset: lossless
    speculative sampling accepts a draft with probability min(1, p / q), far more often than a fixed top
    guess, which the base samples only as often as p gives it."""
    if cfg.greedy:
        return full_ids(greedy_tokens(logits), vocab), None
    q = probs_from_logits(logits, cfg)  # (..., N)
    return full_ids(sample_from_probs(q, generator), vocab), expand_probs(q, vocab, vocab_size)
