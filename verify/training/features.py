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
        ok = (
            self.tokens.shape == (b, t + 1)
            and self.top_ids.shape[:2] == (b, t)
            and self.top_logp.shape == self.top_ids.shape
        )
        if not ok or (self.layers is not None and self.layers.shape[:2] != (b, t)):
            raise ValueError(
                f"a feature batch needs tokens (B, T + 1) and hidden, top_ids, top_logp[, layers] "
                f"of (B, T, ...); got {', '.join(f'{k} {tuple(v)}' for k, v in shapes.items())}"
            )
        return b, t

    def to(self, device: torch.device) -> FeatureBatch:
        move = lambda x: None if x is None else x.to(device, non_blocking=True)  # noqa: E731
        return FeatureBatch(*(move(x) for x in (self.tokens, self.hidden, self.top_ids, self.top_logp, self.layers)))
