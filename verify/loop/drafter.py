"""What the one speculative loop needs from a drafter: a small structural protocol and two records.

A drafter proposes; the loop verifies, accepts, rolls the target back and then tells the drafter what
happened (`Verdict`) so it can roll back its own state. Drafters leave the target's cache as they found
it: only an early-exit drafter (verify/drafters/early_exit.py) writes into it, beyond every row's length, and
rewinds it before `propose` returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from verify.backends.target import TargetOutput
from verify.loop.sampling import SamplingConfig


@dataclass
class Draft:
    tokens: Tensor  # (b, k) proposed tokens, k >= 0
    # (b, k, V) distribution each token was drawn from; None = chosen deterministically (q one-hot). A tree
    # node's q is its distribution given its earlier siblings (the rule tries siblings in node order), e.g. the
    # parent's without them for draws without replacement (verify.loop.sampling.sample_siblings); whether a node is
    # in the tree at all must not depend on its own token, or the kept tokens no longer follow their q.
    q: Tensor | None = None
    parents: Tensor | None = None  # (k,) or (b, k) tree parents, -1 = child of the pending token; None = a chain

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    @staticmethod
    def empty(batch: int, device: torch.device) -> Draft:
        return Draft(tokens=torch.zeros(batch, 0, dtype=torch.long, device=device))


@dataclass
class Verdict:
    """The outcome of one verification step, for every row of the batch."""

    accepted: Tensor  # (b,) draft tokens accepted (0..k); 0 for rows that were already finished
    tokens: Tensor  # (b, k + 1) the step's tokens: accepted drafts, then the new pending token at index `accepted`
    pending: Tensor  # (b,) the new pending token (emitted, not yet in the target's cache)
    target: (
        TargetOutput  # the verification forward over [old pending, draft...]: logits, hidden and layers (b, k + 1, .)
    )
    active: Tensor  # (b,) rows that were still generating; finished rows carry placeholders in every field
    path: Tensor  # (b, D + 1) indices into that forward of [old pending, accepted nodes...], padded by repeating
    #               the last accepted node (a chain: 0, 1, .., accepted, accepted, ..)


@runtime_checkable
class Drafter(Protocol):
    """A drafter may also have `target_layers: tuple[int, ...]` (read with getattr, default ()): blocks of the
    target whose residual states it reads (layer i as verify.backends.engine.check_layers defines it). The loop asks
    the target for them, and the drafter finds them in `TargetOutput.layers` of the prefill (begin) and of
    every verdict (commit). It is not a protocol member, so drafters without it need no change.

    Likewise optional: `attach(target)`, called by the loop once per call before the prefill, for a drafter
    that drafts with the target's own first blocks on the target's cache (verify/drafters/early_exit.py); and
    `copied_rows` / `learned_rows`, read once at the end of a call: how many row-cycles a drafter that chooses
    per row (verify/drafters/hybrid.py) copied and drafted, recorded in DecodeStats."""

    vocab_size: int

    def begin(self, prompts: list[list[int]], prefill: TargetOutput, pending: Tensor) -> None:
        """Start a batch: the prompts, the target's prefill outputs (b, L, .) (left-padded like the
        prompts) and the first pending token (b,)."""

    def propose(self, gamma: int, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        """Draft up to `gamma` tokens per row (a chain), or a tree of draft nodes."""

    def commit(self, verdict: Verdict) -> None:
        """Roll the drafter's own state to the accepted tokens plus the new pending token."""
