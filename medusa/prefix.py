"""Hydra++'s prefix layer for the sequential heads: one attention layer over the base's hidden states.

A sequential head reads the base's final hidden state h_t of one position. Hydra++ (Ankner et al. 2024) puts
one more decoder layer under the heads: it attends causally over h_0 .. h_t and hands the heads its output
h'_t instead, so a head can also read what the base computed at earlier positions (a name three tokens back,
the list being enumerated) that h_t alone may no longer carry.

The layer comes built (experiments/lib/families/sequential.py makes it an EAGLE-1 layer of the base's shape whose
output projections start at zero, so a fresh layer is the identity; Hydra's own layer ends in a final norm instead,
which is not). Here it is only run, through the interface that layer has: `layer(x)` causal over whole windows,
`layer.new_cache(b, capacity)` and `layer.decode(x, cache)` appending to its own StaticCache.

Decoding keeps the layer's keys and values for every accepted position (`PrefixCache`): the prefill's positions at
`begin`, and at `commit` the accepted path's, read from the verification forward. Drafted tokens never enter it
(the heads read their embeddings, not their hidden states), so a rejected draft leaves nothing to roll back.
"""

from __future__ import annotations

import torch
from einops import repeat
from torch import Tensor, nn

from verify.backends.cache import StaticCache
from verify.backends.target import TargetOutput, left_to_right
from verify.loop.drafter import Verdict


def layer_dtype(layer: nn.Module) -> torch.dtype:
    """The dtype the layer computes in (bf16 when loaded on a bf16 base): its inputs are cast to it."""
    return next(layer.parameters()).dtype


def context(layer: nn.Module, hidden: Tensor) -> Tensor:
    """Training and evaluation: hidden (B, T, d) -> (B, T, d), position t attending causally over 0..t."""
    return layer(hidden.to(layer_dtype(layer))).to(hidden.dtype)


class PrefixCache:
    """The prefix layer's state while decoding: its keys and values for every accepted position of each row,
    and its output at the last one (`hidden` (b, d), what the heads read)."""

    def __init__(self, layer: nn.Module):
        self.layer = layer
        self.cache: StaticCache | None = None
        self.hidden: Tensor | None = None

    @torch.inference_mode()
    def begin(self, prompts: list[list[int]], prefill: TargetOutput) -> Tensor:
        """Run the layer over every prompt position (prefill.hidden (b, W, d), rows left-padded) -> (b, d)."""
        lengths = torch.tensor([len(p) for p in prompts], device=prefill.hidden.device)
        hidden = left_to_right(prefill.hidden, lengths)  # (b, W, d), rows from index 0
        b, width = hidden.shape[:2]
        self.cache = self.layer.new_cache(b, max(64, 2 * width))  # grows by doubling when an answer outruns it
        out = self.layer.decode(hidden.to(layer_dtype(self.layer)), self.cache)  # (b, W, d)
        self.cache.commit(torch.arange(width, device=hidden.device) < lengths[:, None])  # drop the padding entries
        self.hidden = out[torch.arange(b, device=hidden.device), lengths - 1]
        return self.hidden

    @torch.inference_mode()
    def commit(self, verdict: Verdict) -> Tensor:
        """Append the accepted path's positions [old pending, accepted drafts..] (a + 1 per row) -> (b, d), the
        output at the last accepted one. Rows accept different counts: the padded block is fed and a + 1 kept."""
        hidden = verdict.target.hidden  # (b, k + 1, d) the verification forward's final hidden states
        path = hidden.gather(1, repeat(verdict.path, "b n -> b n d", d=hidden.shape[-1]))  # (b, D + 1, d)
        out = self.layer.decode(path.to(layer_dtype(self.layer)), self.cache)
        width = path.shape[1]
        self.cache.commit(torch.arange(width, device=out.device) < (verdict.accepted + 1)[:, None], prefix=True)
        self.hidden = out[torch.arange(out.shape[0], device=out.device), verdict.accepted]
        return self.hidden
