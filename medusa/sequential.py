"""Sequentially dependent Medusa heads (Hydra, Ankner et al. 2024): each head also reads the tokens before it.

A Medusa head k guesses token t + 1 + k from the base's final hidden state h_t alone, blind to the tokens
it guesses after. A sequential head k reads h_t AND the embeddings of x_{t+1} .. x_{t+k}: the pending token
x_{t+1} (already chosen by the base, so even head 1 knows the next token) and the k - 1 tokens drafted
before it. While drafting, those are the heads' own guesses along the tree path; in training, the true
tokens (teacher forcing), which is what the drafted ones are whenever the path is accepted.

Head k:  z = Linear_k([h ; e_1 ; .. ; e_k])   (d + k * e inputs -> d)
         z = z + SiLU(Linear(z))              (num_layers residual blocks, medusa.heads.ResBlock)
         logits = its own trainable copy of the base's output layer

Initialisation, and why: Linear_k starts at [I, 0, .., 0] with bias 0 and the blocks at zero, so z == h and
a fresh sequential head is exactly a fresh Medusa head (the base's projection of h): training starts from
the same point as Medusa's and only has to learn what the tokens add. Each head, block and projection is
its own module (no `[block] * n` ties).

The embedding is the frozen base's own, borrowed through prophet.model.FrozenHead: a plain object, not a
submodule, read with detached weights, so it is never a parameter, never in the state_dict and never
receives a gradient.

Hydra++'s recipe, both off by default (the ablation in docs/ablations.md measures them at equal minutes):
- `prefix`: one attention layer over the base's hidden states under the heads (medusa/prefix.py; built by
  experiments/lib/families/sequential.py, starting as the identity); the heads read its output h'_t where they
  read h_t. `context` applies it to whole windows.
- `dropout`: in training, dropout on each head's input [h; e_1 .. e_k] and before its projection (inactive
  in eval mode, so drafting is unchanged by it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from medusa.heads import FrozenHead, ResBlock, check_head_sizes, copy_linear
from medusa.prefix import context
from verify.common.vocab import check_vocab, subset_linear, trim_linear


class SequentialHeads(nn.Module):
    """hidden (..., d) and tokens (..., K) -> logits (..., K, N); [..., k - 1, :] is head k's guess for
    token t + 1 + k, having read tokens[..., :k] = x_{t+1} .. x_{t+k}."""

    def __init__(
        self,
        *,
        embedding: nn.Embedding,
        projection: nn.Linear,
        num_heads: int,
        num_layers: int = 1,
        prefix: nn.Module | None = None,
        dropout: float = 0.0,
    ):
        """`prefix`: the prefix layer, built (medusa/prefix.py says what it must offer), None for none; `dropout`: the
        training dropout rate on each head's input and before its projection, in [0, 1)."""
        super().__init__()
        check_head_sizes(num_heads=num_heads, num_layers=num_layers)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise ValueError(f"dropout={dropout!r}: must be a number in [0, 1)")
        if prefix is not None and not isinstance(prefix, nn.Module):
            raise ValueError(f"prefix is a {type(prefix).__name__}: need a built layer (an nn.Module) or None")
        if not isinstance(embedding, nn.Embedding):
            raise ValueError(f"embedding is a {type(embedding).__name__}: need the base's token nn.Embedding(V, e)")
        if not isinstance(projection, nn.Linear):
            raise ValueError(f"projection is a {type(projection).__name__}: need the base's output nn.Linear(dim, V)")
        if embedding.num_embeddings != projection.out_features:
            raise ValueError(
                f"embedding has {embedding.num_embeddings} tokens, projection {projection.out_features}: "
                "both must be the same base's"
            )
        self.dim, self.vocab_size = projection.in_features, projection.out_features
        self.emb_dim = embedding.embedding_dim  # the base's embedding width (x-transformers may project it to dim)
        self.num_heads, self.num_layers = num_heads, num_layers
        self.base = FrozenHead(embedding=embedding, to_logits=projection)  # borrowed: not registered, not saved
        w = projection.weight
        self.mix = nn.ModuleList(self._identity_mix(k, device=w.device, dtype=w.dtype) for k in range(1, num_heads + 1))
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(self.dim, device=w.device, dtype=w.dtype) for _ in range(num_layers)])
            for _ in range(num_heads)
        )
        self.projections = nn.ModuleList(copy_linear(projection) for _ in range(num_heads))
        self.drop = nn.Dropout(dropout)  # the identity in eval mode: drafting never drops
        self.prefix = prefix

    def _identity_mix(self, k: int, *, device, dtype) -> nn.Linear:
        """Linear(d + k e -> d) with weight [I, 0, .., 0] and bias 0: it passes h through and ignores the tokens."""
        mix = nn.Linear(self.dim + k * self.emb_dim, self.dim, device=device, dtype=dtype)
        with torch.no_grad():
            mix.weight.zero_()
            mix.weight[:, : self.dim].copy_(torch.eye(self.dim, device=device, dtype=dtype))
            mix.bias.zero_()
        return mix

    @classmethod
    def from_base(
        cls, base: nn.Module, *, num_heads: int, num_layers: int = 1, prefix: nn.Module | None = None, dropout=0.0
    ) -> SequentialHeads:
        """Heads for an x-transformers TransformerWrapper or an HFBase: its token embedding is borrowed, its
        `to_logits` copied; `prefix` a built prefix layer (Hydra++'s), None for none."""
        return cls(
            embedding=base.token_emb.emb,
            projection=base.to_logits,
            num_heads=num_heads,
            num_layers=num_layers,
            prefix=prefix,
            dropout=dropout,
        )

    def context(self, hidden: Tensor) -> Tensor:
        """What the heads read for whole windows: hidden (B, T, d) -> the prefix layer's output, or hidden itself."""
        return hidden if self.prefix is None else context(self.prefix, hidden)

    def features(self, k: int, hidden: Tensor, tokens: Tensor) -> Tensor:
        """Head k's features before its projection: hidden (..., d), tokens (..., k) ids -> (..., d)."""
        if tokens.shape[-1] != k:
            raise ValueError(
                f"head {k} reads {k} tokens (x_(t+1) .. x_(t+{k})); got tokens of shape {tuple(tokens.shape)}"
            )
        emb = self.base.embed(tokens).to(hidden.dtype)  # (..., k, e), detached: no gradient reaches the base
        x = torch.cat((hidden, rearrange(emb, "... k e -> ... (k e)")), dim=-1)  # (..., d + k e)
        return self.drop(self.blocks[k - 1](self.mix[k - 1](self.drop(x))))

    def head_logits(self, k: int, hidden: Tensor, tokens: Tensor, vocab: Tensor | None = None) -> Tensor:
        """Head k (1-based) alone: hidden (..., d), tokens (..., k) -> logits (..., N) over the sorted ids
        `vocab` (N,) (None: all V). The rows are gathered per call, so their gradients reach the full projection."""
        return subset_linear(self.features(k, hidden, tokens), self.projections[k - 1], vocab)

    def forward(self, hidden: Tensor, tokens: Tensor, vocab: Tensor | None = None) -> Tensor:
        """hidden (..., d), tokens (..., K) = x_{t+1} .. x_{t+K} -> logits (..., K, N) (training, teacher forcing).

        Head k reads only tokens[..., :k]: its own input width leaves no way to see a later token."""
        if tokens.shape[-1] != self.num_heads:
            raise ValueError(
                f"tokens of shape {tuple(tokens.shape)}: the {self.num_heads} heads read "
                f"x_(t+1) .. x_(t+{self.num_heads}), shape (..., {self.num_heads})"
            )
        return torch.stack(
            [self.head_logits(k, hidden, tokens[..., :k], vocab) for k in range(1, self.num_heads + 1)], dim=-2
        )

    @torch.no_grad()
    def stacked(self, vocab: Tensor | None = None) -> DecodeHeads:
        """The heads for decoding, with their projections trimmed to `vocab` (sorted ids (N,), None = all V)
        once, instead of re-indexing N rows of every projection on every draft step.

        The name is MedusaHeads.stacked's, which the drafter's shared constructor calls. The projections
        are a snapshot: build the drafter after training."""
        vocab = check_vocab(vocab, self.vocab_size)
        rows = [trim_linear(proj, vocab) for proj in self.projections]
        proj_w = torch.stack([w for w, _ in rows])  # (K, N, d)
        proj_b = None if rows[0][1] is None else torch.stack([b for _, b in rows])  # (K, N)
        return DecodeHeads(self, proj_w, proj_b)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_layers={self.num_layers}, emb_dim={self.emb_dim}, "
            f"prefix={self.prefix is not None}, dropout={self.drop.p}"
        )


@dataclass(eq=False)
class DecodeHeads:
    """One head at a time for drafting: (k, hidden (m, d), tokens (m, k)) -> logits (m, N) over the trimmed vocabulary.

    A draft step runs head k once on every node that has children at depth k, so there is one call per
    level, batched over rows and nodes; the heads' inputs differ in width, so they are not stacked over K."""

    heads: SequentialHeads
    proj_weight: Tensor  # (K, N, d) each head's projection rows of the vocabulary subset
    proj_bias: Tensor | None  # (K, N) or None

    def __call__(self, k: int, hidden: Tensor, tokens: Tensor) -> Tensor:
        bias = None if self.proj_bias is None else self.proj_bias[k - 1]
        return F.linear(self.heads.features(k, hidden, tokens), self.proj_weight[k - 1], bias)
