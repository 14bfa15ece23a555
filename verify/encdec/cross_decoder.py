"""The lean engine's decoder with cross-attention: the decoder side of an x-transformers encoder-decoder
(`XTransformer`, or a TransformerWrapper over `Decoder(cross_attend=True)`) on a static KV cache.

Blocks are (self-attention, cross-attention, feed-forward), pre-norm. Self-attention works exactly as in
`verify.backends.engine.LeanDecoder` (rotary keys written once into `StaticCache` slots, a boolean mask over the
whole buffer, chains and trees alike). Cross-attention reads the encoder output through keys and values
computed once per batch (`context`): a decode step never touches the encoder again, and rolling the
self-attention cache back needs nothing from the cross side. x-transformers applies no rotary to
cross-attention unless it is given context positions (the decoder never is), so neither does this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from verify.backends.cache import StaticCache, visibility, write_kv
from verify.backends.engine import (
    _LAYERS_OFF,
    UnsupportedModel,
    _attend,
    _bias,
    _check_attention,
    _feedforward_weights,
    _layer_norm_weight,
    _require,
    _rotate,
    pre_norm_blocks,
    rotary_table,
)


@dataclass
class CrossContext:
    """What every decoder step attends to on the encoder side, per cross-attention layer."""

    k: list[Tensor]  # (b, h, S, dh) per layer
    v: list[Tensor]  # (b, h, S, dh) per layer
    mask: Tensor  # (b, 1, 1, S) True where the source has a real token (padding is never attended)


class LeanCrossDecoder:
    """x-transformers decoder layers with cross-attention as fused tensors: inputs (b, n, d) and a
    `CrossContext` -> hidden (b, n, d) after the final norm."""

    def __init__(self, layers: nn.Module, *, where: str = "decoder"):
        _require(layers, {**_LAYERS_OFF, "cross_attend": True}, where)
        self.blocks: list[tuple[str, tuple]] = []
        for kind, gain, module, here in pre_norm_blocks(layers, where, kinds=("a", "c", "f")):
            if kind == "f":
                self.blocks.append(("f", (gain, *_feedforward_weights(module, here))))
            else:
                self.blocks.append((kind, (gain, *self._attention(module, here, cross=kind == "c"))))
        kinds = [kind for kind, _ in self.blocks]
        if "a" not in kinds or "c" not in kinds:
            raise UnsupportedModel(f"{where} needs self-attention and cross-attention layers, has {''.join(kinds)!r}")
        final = layers.final_norm
        self.final_gain = (
            None if type(final).__name__ == "Identity" else _layer_norm_weight(final, where + ".final_norm")
        )
        self.inv_freq = layers.rotary_pos_emb.inv_freq.detach()
        self.dim = layers.dim
        self.dtype = self.blocks[0][1][0].dtype
        self.cos = self.sin = None

    def _attention(self, attn: nn.Module, where: str, *, cross: bool) -> tuple:
        """Self-attention: one fused qkv weight. Cross-attention: q from the decoder, one fused kv weight
        applied to the encoder output once per batch."""
        _check_attention(attn, where)
        self.heads, self.scale = attn.heads, attn.scale
        self.dim_head = attn.to_q.out_features // attn.heads
        layers = (attn.to_q, attn.to_k, attn.to_v)
        bias = [
            _bias(layer) if layer.bias is not None else layer.weight.new_zeros(layer.out_features) for layer in layers
        ]
        has_bias = any(layer.bias is not None for layer in layers)
        if not cross:
            w = torch.cat([layer.weight for layer in layers]).detach()  # (3 h dh, d)
            return w, torch.cat(bias) if has_bias else None, attn.to_out.weight.detach(), _bias(attn.to_out)
        wkv = torch.cat([attn.to_k.weight, attn.to_v.weight]).detach()  # (2 h dh, d_context)
        bkv = torch.cat(bias[1:]) if has_bias else None
        return (
            attn.to_q.weight.detach(),
            bias[0] if has_bias else None,
            wkv,
            bkv,
            attn.to_out.weight.detach(),
            _bias(attn.to_out),
        )

    @property
    def num_layers(self) -> int:
        return sum(kind == "a" for kind, _ in self.blocks)

    def new_cache(self, batch: int, capacity: int, *, device: torch.device) -> StaticCache:
        return StaticCache(
            layers=self.num_layers,
            batch=batch,
            heads=self.heads,
            dim_head=self.dim_head,
            capacity=capacity,
            device=device,
            dtype=self.dtype,
        )

    def context(self, encoded: Tensor, source_mask: Tensor) -> CrossContext:
        """Encoder output (b, S, d) and source mask (b, S) -> every cross-attention layer's keys and values."""
        ks, vs = [], []
        for kind, w in self.blocks:
            if kind == "c":
                kv = rearrange(F.linear(encoded, w[3], w[4]), "b s (two h d) -> two b h s d", two=2, h=self.heads)
                ks.append(kv[0])
                vs.append(kv[1])
        return CrossContext(k=ks, v=vs, mask=rearrange(source_mask, "b s -> b 1 1 s"))

    def _table(self, length: int) -> tuple[Tensor, Tensor]:
        if self.cos is None or self.cos.shape[0] < length:  # grown by doubling: rotary has no maximum length
            size = max(length, 2 * (0 if self.cos is None else self.cos.shape[0]))
            self.cos, self.sin = (t.to(self.dtype) for t in rotary_table(self.inv_freq, size, self.dim_head))
        return self.cos, self.sin

    def __call__(
        self,
        x: Tensor,
        cache: StaticCache,
        context: CrossContext,
        *,
        pos: Tensor | None = None,
        allow: Tensor | None = None,
    ) -> Tensor:
        """Run n new entries x (b, n, d) on top of `cache` and append them to it; returns hidden (b, n, d).
        pos and allow as in `verify.backends.engine.LeanDecoder.__call__` (a chain by default, a tree with both)."""
        n = x.shape[1]
        start = cache.reserve(n)
        k_buf, v_buf = cache.buffers(n, full=False)
        hidden = self.forward(x, k_buf, v_buf, start, pos, allow, context)
        cache.advance(n)
        return hidden

    def forward(
        self,
        x: Tensor,
        k_buf: list[Tensor],
        v_buf: list[Tensor],
        start: Tensor,
        pos: Tensor | None,
        allow: Tensor | None,
        context: CrossContext,
    ) -> Tensor:
        n, capacity = x.shape[1], k_buf[0].shape[2]
        slots = start[:, None] + torch.arange(n, device=x.device)  # (b, n)
        pos = slots if pos is None else pos
        cos, sin = (
            rearrange(t[pos], "b n r -> b 1 n r") for t in self._table(capacity)
        )  # pos < capacity: a tree node sits at depth < n
        mask = visibility(start, n, allow, capacity)  # (b, 1, n, S)
        layer = cross = 0
        for kind, w in self.blocks:
            h = F.layer_norm(x, (self.dim,), w[0])
            if kind == "a":
                qkv = rearrange(F.linear(h, w[1], w[2]), "b n (three h d) -> three b h n d", three=3, h=self.heads)
                q, k = _rotate(qkv[:2], cos, sin)  # one rotation for queries and keys together
                k_all, v_all = write_kv(k_buf[layer], v_buf[layer], k, qkv[2], slots)  # (b, h, S, dh)
                x = x + F.linear(
                    rearrange(_attend(q, k_all, v_all, mask, self.scale), "b h n d -> b n (h d)"), w[3], w[4]
                )
                layer += 1
            elif kind == "c":
                q = rearrange(F.linear(h, w[1], w[2]), "b n (h d) -> b h n d", h=self.heads)
                out = _attend(q, context.k[cross], context.v[cross], context.mask, self.scale)
                x = x + F.linear(rearrange(out, "b h n d -> b n (h d)"), w[5], w[6])
                cross += 1
            else:
                x = x + F.linear(F.gelu(F.linear(h, w[1], w[2])), w[3], w[4])
        return x if self.final_gain is None else F.layer_norm(x, (self.dim,), self.final_gain)
