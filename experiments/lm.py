"""The frozen base language model: an x-transformers decoder with rotary positions.

One builder, `build_lm`, used by base training, by checkpoint loading and (through `_target_`) by the
`conf/base/*.yaml` size presets. It takes plain keyword arguments so a checkpoint's `meta.json` can
rebuild the exact network with `build_lm(**meta["model_config"])`.

Choices, and why:
- rotary positions and no absolute position embedding: drafters and tree verification pass explicit
  `pos` and additive attention biases, which x-transformers supports with rotary only;
- pre-norm with a final norm (the x-transformers default): the final hidden state that Medusa heads and
  the prophet read is normalised, like the published bases;
- `attn_dim_head` defaults to dim // heads, so the attention width equals the model width (x-transformers
  would otherwise use 64 per head whatever the width; the 2.9M and 10.5M presets assume dim // heads).
"""

from __future__ import annotations

import torch
from x_transformers import Decoder, TransformerWrapper

__all__ = ["build_lm", "check_lm_sizes", "count_parameters"]


def _check_positive_int(name: str, value: object) -> None:
    # bool is an int subclass: `depth=True` is a typo, not a size
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_lm_sizes(
    *,
    num_tokens: int,
    dim: int,
    depth: int,
    heads: int,
    max_seq_len: int,
    ff_mult: int = 4,
    attn_dim_head: int | None = None,
) -> None:
    """Raise a one-line ValueError for any size that cannot build a model (cheap: builds nothing)."""
    sizes = dict(num_tokens=num_tokens, dim=dim, depth=depth, heads=heads, max_seq_len=max_seq_len, ff_mult=ff_mult)
    for name, value in sizes.items():
        _check_positive_int(name, value)
    if attn_dim_head is None:
        if dim % heads != 0:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads}) unless attn_dim_head is given")
        if dim // heads < 2:
            raise ValueError(f"dim // heads = {dim // heads} is too small for rotary positions (need at least 2)")
    else:
        _check_positive_int("attn_dim_head", attn_dim_head)
        if attn_dim_head < 2:
            raise ValueError(f"attn_dim_head must be at least 2 for rotary positions, got {attn_dim_head}")


def build_lm(
    *,
    num_tokens: int,
    dim: int,
    depth: int,
    heads: int,
    max_seq_len: int,
    ff_mult: int = 4,
    attn_dim_head: int | None = None,
) -> TransformerWrapper:
    """A decoder-only LM: token ids (B, N) -> logits (B, N, num_tokens)."""
    check_lm_sizes(
        num_tokens=num_tokens, dim=dim, depth=depth, heads=heads, max_seq_len=max_seq_len,
        ff_mult=ff_mult, attn_dim_head=attn_dim_head,
    )
    dim_head = attn_dim_head if attn_dim_head is not None else dim // heads
    decoder = Decoder(
        dim=dim,
        depth=depth,
        heads=heads,
        attn_dim_head=dim_head,
        ff_mult=ff_mult,
        rotary_pos_emb=True,
        # x-transformers warns when the rotary dim (dim_head // 2) is below 32; our small heads are deliberate
        verbose=False,
    )
    return TransformerWrapper(
        num_tokens=num_tokens,
        max_seq_len=max_seq_len,
        attn_layers=decoder,
        use_abs_pos_emb=False,
    )


def count_parameters(model: torch.nn.Module, *, trainable_only: bool = False) -> int:
    """Number of scalar parameters (shared tensors counted once, as `parameters()` yields them once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
