"""Medusa heads (Cai et al. 2024; DESIGN §6): K small heads on the frozen base's final hidden state.

Head k (k = 1..K) reads the hidden state at position t (after the base's final norm) and guesses token
t + 1 + k; the base's own output layer already guesses t + 1. A head is `num_layers` residual blocks
x + SiLU(Linear(x)), then a vocabulary projection.

Initialisation, and why:
- every block's Linear starts at zero (weight and bias), so a block is the identity and a fresh head k
  outputs exactly the base's projection of the hidden state: training starts from "the next token is a
  good guess for the one after", not from noise;
- each block is its own module (a known public version builds the list with `[block] * n`, which repeats
  one instance and silently ties the layers);
- each head gets its own trainable COPY of the base's output layer. `share_base_projection=True` is the
  ablation that reads every head through the frozen base projection instead; the base owns that layer,
  so it is held in a plain tuple, outside this module's parameters and state_dict: a checkpoint of the
  heads never contains (or overwrites) base weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def check_head_sizes(*, num_heads: int, num_layers: int) -> None:
    """One-line ValueErrors for head counts that cannot build (bool is an int: `True` is a typo)."""
    for name, value in (("num_heads", num_heads), ("num_layers", num_layers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be an integer >= 1")


class ResBlock(nn.Module):
    """x + SiLU(Linear(x)), zero-initialised so it starts as the identity."""

    def __init__(self, dim: int, *, device=None, dtype=None):
        super().__init__()
        self.linear = nn.Linear(dim, dim, device=device, dtype=dtype)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


def copy_linear(layer: nn.Linear) -> nn.Linear:
    """A trainable copy of `layer` (a deepcopy would inherit the frozen base's requires_grad=False)."""
    w = layer.weight
    out = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        out.weight.copy_(w)
        if layer.bias is not None:
            out.bias.copy_(layer.bias)
    return out


class MedusaHeads(nn.Module):
    """hidden (B, T, d) -> logits (B, T, K, V); [:, t, k - 1] is head k's guess for token t + 1 + k."""

    def __init__(self, *, projection: nn.Linear, num_heads: int, num_layers: int, share_base_projection: bool = False):
        super().__init__()
        check_head_sizes(num_heads=num_heads, num_layers=num_layers)
        if not isinstance(share_base_projection, bool):
            raise ValueError(f"share_base_projection={share_base_projection!r}: must be true or false")
        if not isinstance(projection, nn.Linear):
            raise ValueError(f"projection is a {type(projection).__name__}: need the base's output nn.Linear(dim, V)")
        self.dim, self.vocab_size = projection.in_features, projection.out_features
        self.num_heads, self.num_layers = num_heads, num_layers
        self.share_base_projection = share_base_projection
        w = projection.weight
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(self.dim, device=w.device, dtype=w.dtype) for _ in range(num_layers)])
            for _ in range(num_heads)
        )
        if share_base_projection:
            self.projections = None
            self._base_projection = (projection,)  # a tuple: not registered, so not ours to train or save
        else:
            self.projections = nn.ModuleList(copy_linear(projection) for _ in range(num_heads))
            self._base_projection = ()

    @classmethod
    def from_base(cls, base: nn.Module, *, num_heads: int, num_layers: int, share_base_projection: bool = False) -> "MedusaHeads":
        """Heads for an x-transformers TransformerWrapper: its `to_logits` is the projection to copy or share."""
        return cls(projection=base.to_logits, num_heads=num_heads, num_layers=num_layers, share_base_projection=share_base_projection)

    def forward(self, hidden: Tensor) -> Tensor:
        # K is small (4-5): a loop over separate modules costs K small matmuls and copies no weights.
        if self.share_base_projection:  # one projection for all heads: one matmul over (B, T, K, d)
            features = torch.stack([blocks(hidden) for blocks in self.blocks], dim=2)  # (B, T, K, d)
            return self._base_projection[0](features)  # (B, T, K, V)
        logits = [proj(blocks(hidden)) for blocks, proj in zip(self.blocks, self.projections)]  # K x (B, T, V)
        return torch.stack(logits, dim=2)  # (B, T, K, V)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, num_layers={self.num_layers}, share_base_projection={self.share_base_projection}"
