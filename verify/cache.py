"""The KV cache of an x-transformers decoder for a batch of rows, and its one rollback function.

Layout: `length` slots per row, right-aligned. Row b's valid tokens occupy slots [start[b], length);
slots before start[b] are left padding, masked out through x-transformers' `seq_start_pos`. Keys are
cached before rotary is applied and rotary only sees position differences, so moving a row's valid
slots (right-aligning after a rollback) leaves every attention score unchanged.

The target owns one of these; a drafter with its own decoder (the draft model, the prophet) owns
another. `commit` is the only code in the project that edits cached keys and values.
"""

from __future__ import annotations

import torch
from einops import rearrange, repeat
from torch import Tensor


def tree_attention(parents: Tensor) -> tuple[Tensor, Tensor]:
    """parents (b, n) (-1 for a root) -> ancestor-or-self mask (b, n, n) and depth (b, n).

    Nodes are in topological order (parents before children). Each round moves every node's walk
    pointer one ancestor up, so the loop runs over tree depth, never over tokens or rows.
    """
    b, n = parents.shape
    mask = repeat(torch.eye(n, dtype=torch.bool, device=parents.device), "i j -> b i j", b=b).clone()
    depth = torch.zeros_like(parents)
    cur = repeat(torch.arange(n, device=parents.device), "n -> b n", b=b)
    for _ in range(n):
        par = parents.gather(1, cur.clamp(min=0))
        alive = (cur >= 0) & (par >= 0)
        if not alive.any():
            break
        depth = depth + alive.long()
        cur = torch.where(alive, par, torch.full_like(par, -1))
        mask |= torch.nn.functional.one_hot(cur.clamp(min=0), n).bool() & rearrange(alive, "b n -> b n 1")
    return mask, depth


class KVCache:
    def __init__(self) -> None:
        self.reset(None)

    def reset(self, start: Tensor | None) -> None:
        """Empty the cache for a new batch whose rows start at slots `start` (b,) (left padding)."""
        self.inter = None  # x-transformers LayerIntermediates
        self.length = 0  # slots per row, padding included
        self._set_start(start)

    @property
    def row_lengths(self) -> Tensor:
        """(b,) number of valid (cached) tokens per row."""
        return self.length - self.start

    def forward_kwargs(self, n: int) -> dict:
        """Keyword arguments that make an x-transformers forward of n new tokens use this cache."""
        return dict(
            cache=self.inter,
            cache_age=n,  # the default (1) would silently keep only the last new token
            seq_start_pos=self._start_arg,
        )

    def tree_kwargs(self, parents: Tensor) -> dict:
        """Attention bias and positions for k new tokens forming a tree, parents (b, k), -1 = on the prefix.

        A node sees the cached prefix, its ancestors and itself, at position prefix length + depth.
        """
        b, k = parents.shape
        ancestors, depth = tree_attention(parents)
        bias = torch.zeros(b, 1, k, self.length + k, device=parents.device)
        bias[..., self.length:] = bias[..., self.length:].masked_fill(~rearrange(ancestors, "b i j -> b 1 i j"), float("-inf"))
        past = repeat(torch.arange(self.length, device=parents.device), "l -> b l", b=b)
        return dict(attn_bias=bias, pos=torch.cat((past, self.length + depth), dim=1))

    def append(self, inter, n: int) -> None:
        """Take the cache a forward of n new tokens returned."""
        inter.hiddens = None  # per-layer activations are not needed by later steps; free them
        self.inter = inter
        self.length += n

    @torch.no_grad()
    def commit(self, keep: Tensor) -> None:
        """Roll back: of the last k slots, keep those where keep (b, k) is True, in order.

        When every row keeps the same prefix this crops; otherwise it gathers each row's kept slots
        and right-aligns them (one host sync for the new width).
        """
        b, k = keep.shape
        device = keep.device
        start = self.start if self.start is not None else torch.zeros(b, dtype=torch.long, device=device)
        counts = keep.sum(dim=1)
        is_prefix = keep.cumsum(dim=1) == torch.arange(1, k + 1, device=device)
        if bool((is_prefix == keep).all() & (counts == counts[0]).all()):
            self._edit(lambda t: t[..., : self.length - k + int(counts[0]), :], self.length - k + int(counts[0]))
            return
        slots = torch.arange(self.length - k, device=device)
        valid = torch.cat((slots >= rearrange(start, "b -> b 1"), keep), dim=1)
        n_valid = valid.sum(dim=1)
        width = int(n_valid.max())
        # Stable sort puts dropped slots first and kept slots last, each in original order.
        order = torch.sort(valid.to(torch.uint8), dim=1, stable=True).indices[:, self.length - width:]
        index = rearrange(order, "b n -> b 1 n 1")
        self._edit(lambda t: t.gather(2, index.expand(-1, t.shape[1], -1, t.shape[3])), width)
        self._set_start(width - n_valid)

    def _edit(self, fn, length: int) -> None:
        for layer in self.inter.attn_intermediates:
            if layer.cached_kv is not None:
                layer.cached_kv = tuple(fn(t) for t in layer.cached_kv)
        self.length = length
        self.inter.cache_length = length

    def _set_start(self, start: Tensor | None) -> None:
        self.start = start
        # Without padding, skip x-transformers' left-padding mask: it costs a mask per layer per step.
        self._start_arg = start if start is not None and bool(start.any()) else None
