"""The block prophet: the prophet's network drafting a whole block of K tokens in one forward pass
(parallel drafting, as PARD and DFlash do), instead of one prophet step per draft token.

The context is the autoregressive prophet's: one entry (f_t, x_{t+1}) per accepted position, the base's
TRUE feature beside the next token, and the last entry's output, the predicted feature at the pending
position, gives the first draft token. After it come K - 1 placeholder slots: slot i's input is a learned
vector of its own (`slots[i - 1]`, PARD's mask token, one per slot), at the position slot i would hold
in a chain, and its output is the predicted feature i positions further, read through the frozen output
layer like every other prediction. A slot sees the context and the earlier slots of its block (causal,
as a chain would), never a drafted token: every position's distribution is a function of the context
alone, so a block drafts as Medusa's heads do (a chain of per-position picks, or a static tree of their
ranks, verified by the rules that already exist) while the slots attend over the whole context and the
base's features as the prophet does.

Training is one forward over the context and S blocks side by side: context entry c at position c with
causal attention (the autoregressive prophet's teacher-forced step, which trains the first draft position);
block s starts after context entry s, its slot i at position s + i sees context entries <= s and its own
slots <= i (`block_attention`). Decoding (prophet/block_drafter.py) runs the slots on the lean engine's
static cache in the same forward that appends the accepted entries, and drops them again.
"""

from __future__ import annotations

import torch
from einops import rearrange, repeat
from torch import Tensor, nn

from prophet.model import Prophet
from verify.common.numerics import check_int


class BlockProphet(Prophet):
    def __init__(self, *, block: int = 4, **prophet_kwargs):
        """`block` = K: draft positions per forward (the context's own prediction and K - 1 slots), >= 2.
        prophet_kwargs: the network's (see Prophet: head, dim, depth, heads, attn_dim_head, ff_mult, fuse_layers)."""
        check_int("block", block)
        if block < 2:
            raise ValueError(f"block={block}: a block drafts at least 2 positions (the context's and a slot's)")
        arch = prophet_kwargs.get("arch", "xtransformers")
        if arch != "xtransformers":
            raise ValueError(f"arch={arch!r}: a block prophet runs the x-transformers network only (xtransformers)")
        super().__init__(**prophet_kwargs)
        self.block = block
        dim = self.fuse.out_features
        # Built after the prophet's own weights: the network draws the same random numbers as an unblocked prophet's.
        # (K - 1, dim): one mask vector per slot, made where the other weights are
        self.slots = nn.Parameter(torch.randn(block - 1, dim, device=self.fuse.weight.device) * dim**-0.5)

    @property
    def num_heads(self) -> int:
        """Draft positions per block, named as Medusa's heads are (a static tree reads head k's ranks)."""
        return self.block

    def block_forward(
        self, features: Tensor, next_tokens: Tensor, starts: Tensor, layers: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Training: true features f_t (B, T, d_base), tokens x_{t+1} (B, T), block starts (S,) (context indices,
        each <= T - K) and, when fused, the layer states (B, T, S', d_base) -> the context's predictions of
        f_{t+1} (B, T, d_base) and each block's slot predictions (B, S, K - 1, d_base), slot i of block s
        predicting f_{s+1+i}."""
        t, s = features.shape[1], starts.shape[0]
        context = self.fused(self.seed(features, layers), next_tokens)  # (B, T, dim)
        slots = repeat(self.slots, "k d -> b (s k) d", b=context.shape[0], s=s)
        bias, pos = block_attention(starts, t, self.block - 1)
        out = self.out(self.decoder(torch.cat((context, slots), dim=1), attn_bias=bias, pos=pos))
        return out[:, :t], rearrange(out[:, t:], "b (s k) d -> b s k d", s=s)

    def slot_inputs(self, batch: int) -> Tensor:
        """The K - 1 slots' decoder inputs for `batch` rows: (batch, K - 1, dim)."""
        return repeat(self.slots, "k d -> b k d", b=batch)


def block_attention(starts: Tensor, t: int, slots: int) -> tuple[Tensor, Tensor]:
    """Additive attention bias (1, 1, N, N) and positions (N,) for T context entries followed by S blocks of
    `slots` slots each (N = T + S * slots), blocks in the order of `starts` (S,).

    Context entry c (position c) sees context entries <= c. Slot i (1-based) of the block starting after
    context entry s sits at position s + i and sees context entries <= s and its block's slots <= i."""
    device = starts.device
    s = starts.shape[0]
    context = torch.arange(t, device=device)
    slot = repeat(torch.arange(1, slots + 1, device=device), "k -> (s k)", s=s)  # (S * slots,) slot number i
    owner = repeat(starts, "s -> (s k)", k=slots)  # (S * slots,) the context entry each slot's block follows
    group = repeat(torch.arange(s, device=device), "s -> (s k)", k=slots)  # which block
    ctx_sees_ctx = context[:, None] >= context[None, :]  # (T, T) causal
    slot_sees_ctx = owner[:, None] >= context[None, :]  # (S k, T)
    slot_sees_slot = (group[:, None] == group[None, :]) & (slot[:, None] >= slot[None, :])  # (S k, S k)
    visible = torch.cat(
        (
            torch.cat((ctx_sees_ctx, torch.zeros(t, s * slots, dtype=torch.bool, device=device)), dim=1),
            torch.cat((slot_sees_ctx, slot_sees_slot), dim=1),
        ),
        dim=0,
    )
    bias = torch.zeros(visible.shape, device=device).masked_fill(~visible, float("-inf"))
    return rearrange(bias, "q k -> 1 1 q k"), torch.cat((context, owner + slot))
