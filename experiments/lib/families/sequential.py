"""The sequential heads' build as the family registry calls it: medusa.sequential_train.build, plus Hydra++'s prefix
layer when the config asks for one (`drafter.module.prefix=true`).

The prefix layer is the prophet's EAGLE-1 layer (prophet.eagle.EagleLayer, arch "eagle": a Llama layer without an
input norm, h = x + attn(x), out = h + mlp(norm(h))) at the base's width and of a Llama base's own shape (another
base's: 4 heads, a 4x MLP). It is built here because medusa/ sits below prophet/ and cannot import it; the heads
take it ready-made (medusa/prefix.py runs it). Its two output projections start at zero, so a fresh layer is the
identity and fresh heads with it draft exactly as fresh heads without it.
"""

from __future__ import annotations

import torch
from torch import nn

from medusa import sequential_train
from medusa.sequential import SequentialHeads
from prophet.eagle import EagleLayer, layer_shape

PREFIX_HEADS = 4  # attention heads of a non-Llama base's prefix layer (a Llama base's layer has the base's own)


def prefix_layer(base: nn.Module) -> EagleLayer:
    """An EAGLE-1 layer shaped for `base`, on its device and in its dtype, whose output projections are zero."""
    weight = base.to_logits.weight
    shape = layer_shape(base, heads=PREFIX_HEADS, attn_dim_head=None, ff_mult=4)
    layer = EagleLayer(arch="eagle", **shape, device=weight.device).to(dtype=weight.dtype)
    with torch.no_grad():
        layer.o_proj.weight.zero_()
        layer.down_proj.weight.zero_()
    return layer


def build(
    base: nn.Module, *, num_heads: int = 4, num_layers: int = 1, prefix: bool = False, dropout: float = 0.0
) -> SequentialHeads:
    """Fresh sequential heads on `base` (module kwargs of conf/drafter/sequential.yaml); `prefix`: with Hydra++'s
    prefix layer, `dropout`: Hydra++'s training dropout (medusa.sequential)."""
    if not isinstance(prefix, bool):
        raise ValueError(f"prefix={prefix!r}: must be true or false")
    layer = prefix_layer(base) if prefix else None
    return sequential_train.build(base, num_heads=num_heads, num_layers=num_layers, prefix=layer, dropout=dropout)
