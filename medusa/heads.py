"""Medusa heads (Cai et al. 2024): K small heads on the frozen base's final hidden state.

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
These two are Medusa-1's init (`init="medusa1"`). `init="random"` is its ablation: PyTorch's default init for
the blocks and the projections, a head that starts from noise (docs/ablations.md measures both at equal minutes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import Tensor, nn

from verify.common.vocab import check_vocab, subset_linear, trim_linear

INITS = ("medusa1", "random")  # Medusa-1's init (zero blocks, the base's output layer copied), or PyTorch's


def check_head_sizes(*, num_heads: int, num_layers: int) -> None:
    """One-line ValueErrors for head counts that cannot build (bool is an int: `True` is a typo)."""
    for name, value in (("num_heads", num_heads), ("num_layers", num_layers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be an integer >= 1")


@dataclass(eq=False)
class FrozenHead:
    """The base's token embedding and output layer, borrowed: used frozen, never registered, never saved."""

    embedding: nn.Embedding
    to_logits: nn.Linear
    depth: int | None = (
        None  # blocks of the base's decoder (see verify.backends.engine.block_depth): what fuse_layers may name
    )

    def embed(self, tokens: Tensor) -> Tensor:
        """(..., n) ids -> (..., n, d_base) embeddings; detached weights keep the base out of autograd."""
        return F.embedding(tokens, self.embedding.weight.detach())

    def logits(self, features: Tensor) -> Tensor:
        """(..., d_base) features -> (..., V) logits through the base's own output layer."""
        bias = None if self.to_logits.bias is None else self.to_logits.bias.detach()
        return F.linear(features, self.to_logits.weight.detach(), bias)

    def __deepcopy__(self, memo: dict) -> FrozenHead:
        return self  # borrowed: a copy of the prophet (e.g. an EMA) shares the base, never clones it


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

    def __init__(
        self,
        *,
        projection: nn.Linear,
        num_heads: int,
        num_layers: int,
        share_base_projection: bool = False,
        init: str = "medusa1",
    ):
        super().__init__()
        check_head_sizes(num_heads=num_heads, num_layers=num_layers)
        if not isinstance(share_base_projection, bool):
            raise ValueError(f"share_base_projection={share_base_projection!r}: must be true or false")
        if init not in INITS:
            raise ValueError(f"init={init!r}: must be one of {', '.join(INITS)}")
        if init == "random" and share_base_projection:
            raise ValueError("init='random' with share_base_projection=true: a shared base projection is not re-drawn")
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
        if init == "random":  # the ablation: every layer redrawn as nn.Linear draws it
            for layer in self.modules():
                if isinstance(layer, nn.Linear):
                    layer.reset_parameters()

    @classmethod
    def from_base(
        cls, base: nn.Module, *, num_heads: int, num_layers: int, share_base_projection: bool = False, init="medusa1"
    ) -> MedusaHeads:
        """Heads for an x-transformers TransformerWrapper: its `to_logits` is the projection to copy or share."""
        return cls(
            projection=base.to_logits,
            num_heads=num_heads,
            num_layers=num_layers,
            share_base_projection=share_base_projection,
            init=init,
        )

    def forward(self, hidden: Tensor, vocab: Tensor | None = None) -> Tensor:
        """hidden (..., d) -> logits (..., K, V), or (..., K, N) over the sorted ids `vocab` (N,).

        Training on a trimmed vocabulary projects onto its N rows only (4x fewer logits for 2048 of 8192);
        the rows are gathered per call, so their gradients reach the full projections."""
        features = torch.stack([blocks(hidden) for blocks in self.blocks], dim=-2)  # (..., K, d)
        if self.share_base_projection:  # one frozen projection for all heads: one matmul
            weight, bias = trim_linear(self._base_projection[0], vocab)
            return F.linear(features, weight, bias)
        logits = []  # K is small (4-5): K separate matmuls copy no weights
        for k, proj in enumerate(self.projections):
            logits.append(subset_linear(features[..., k, :], proj, vocab))
        return torch.stack(logits, dim=-2)  # (..., K, N)

    @torch.no_grad()
    def stacked(self, vocab: Tensor | None = None) -> StackedHeads:
        """The heads' weights stacked once for decoding: all K heads in one batched computation per step.

        A snapshot of the trained weights: build it after training. `vocab` (sorted ids (N,), None = all V) keeps only
        those rows of the projections, so the logits come out over the subset."""
        vocab = check_vocab(vocab, self.vocab_size)
        blocks = [[block.linear for block in head] for head in self.blocks]  # K x L
        block_w = torch.stack([torch.stack([lin.weight for lin in head]) for head in blocks])  # (K, L, d, d)
        block_b = torch.stack([torch.stack([lin.bias for lin in head]) for head in blocks])  # (K, L, d)
        if self.share_base_projection:
            proj_w, proj_b = trim_linear(self._base_projection[0], vocab)  # (N, d), (N,) or None
        else:
            rows = [trim_linear(proj, vocab) for proj in self.projections]
            proj_w = torch.stack([w for w, _ in rows])  # (K, N, d)
            proj_b = None if rows[0][1] is None else torch.stack([b for _, b in rows])  # (K, N)
        # torch.stack and row indexing copy; only the frozen base projection (shared, untrimmed) is read in place
        return StackedHeads(block_w, block_b, proj_w, proj_b)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_layers={self.num_layers}, "
            f"share_base_projection={self.share_base_projection}"
        )


@dataclass(eq=False)
class StackedHeads:
    """All heads as stacked tensors: hidden (b, d) -> logits (b, K, N) in batched matmuls over K.

    The training modules run K separate heads (K small matmuls, K projections); decoding runs one
    batched matmul per block layer and one for the projections, whatever K is."""

    block_weight: Tensor  # (K, L, d, d) nn.Linear layout (out, in)
    block_bias: Tensor  # (K, L, d)
    proj_weight: Tensor  # (K, N, d) one projection per head, or (N, d) the shared base projection
    proj_bias: Tensor | None  # (K, N), (N,) or None

    def __call__(self, hidden: Tensor) -> Tensor:
        k, layers = self.block_weight.shape[:2]
        x = repeat(hidden, "b d -> k b d", k=k)  # every head reads the same hidden state
        for layer in range(layers):  # L is 1-2: a loop over layers, never over heads
            w, bias = self.block_weight[:, layer], self.block_bias[:, layer]  # (K, d, d), (K, d)
            x = x + F.silu(torch.baddbmm(rearrange(bias, "k d -> k 1 d"), x, w.mT))  # (K, b, d)
        if self.proj_weight.ndim == 2:  # shared: one (K * b, d) @ (d, N)
            logits = F.linear(x, self.proj_weight, self.proj_bias)  # (K, b, N)
        elif self.proj_bias is None:
            logits = torch.bmm(x, self.proj_weight.mT)  # (K, b, N)
        else:
            logits = torch.baddbmm(rearrange(self.proj_bias, "k n -> k 1 n"), x, self.proj_weight.mT)
        return rearrange(logits, "k b n -> b k n")
