"""`FeatureBatch`: what every drafter family's loss reads, the tokens and the frozen base's outputs on them.

The feature cache (experiments/lib/training/features.py) writes and streams these batches; the families' losses
(medusa/, prophet/, experiments/lib/families/draft.py) read them. Kept here, below the families, so that a
drafter package needs nothing from the experiment harness to define its loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class FeatureBatch:
    """What a drafter's loss reads for B windows: the tokens and the frozen base's outputs on tokens[:, :-1]."""

    tokens: Tensor  # (B, T + 1) long
    hidden: Tensor  # (B, T, d) float32: final hidden states (after the final norm)
    top_ids: Tensor  # (B, T, k) long: the base's k most likely next tokens, most likely first
    top_logp: Tensor  # (B, T, k) float32: their log-probabilities under the base (full vocabulary)
    layers: Tensor | None = None  # (B, T, S, d) float32: residual states after the chosen blocks
    # (B, T) bool: True where tokens[:, t + 1] is an answer token, the only positions a loss or a metric may
    # read (a drafter drafts the base's answers, never the user's text); None: every position counts
    mask: Tensor | None = None

    def check(self) -> tuple[int, int]:
        """(B, T) after checking that every field describes the same windows; a one-line ValueError otherwise."""
        b, t = self.hidden.shape[:2]
        shapes = {
            "tokens": self.tokens.shape,
            "hidden": self.hidden.shape,
            "top_ids": self.top_ids.shape,
            "top_logp": self.top_logp.shape,
            **({} if self.layers is None else {"layers": self.layers.shape}),
        }
        got = ", ".join(f"{k} {tuple(v)}" for k, v in shapes.items())
        ok = (
            self.tokens.shape == (b, t + 1)
            and self.top_ids.shape[:2] == (b, t)
            and self.top_logp.shape == self.top_ids.shape
        )
        if not ok or (self.layers is not None and self.layers.shape[:2] != (b, t)):
            raise ValueError(
                f"a feature batch needs tokens (B, T + 1) and hidden, top_ids, top_logp[, layers] "
                f"of (B, T, ...); got {got}"
            )
        if self.mask is not None and (self.mask.shape != (b, t) or self.mask.dtype != torch.bool):
            raise ValueError(
                f"a feature batch's mask must be bool (B, T), one flag per position; got mask "
                f"{tuple(self.mask.shape)} {self.mask.dtype}, {got}"
            )
        return b, t

    def mask_at(self, offset: int) -> Tensor | None:
        """(B, T - offset) bool: [:, t] = mask[:, t + offset], whether a prediction made at t whose target is token
        t + 1 + offset (its teacher at t + offset) counts; None when every position counts."""
        return None if self.mask is None else self.mask[:, offset:]

    def to(self, device: torch.device) -> FeatureBatch:
        move = lambda x: None if x is None else x.to(device, non_blocking=True)  # noqa: E731
        fields = (self.tokens, self.hidden, self.top_ids, self.top_logp, self.layers, self.mask)
        return FeatureBatch(*(move(x) for x in fields))
