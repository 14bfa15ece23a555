"""The prophet's network as EAGLE's and EAGLE-3's draft layer: one Llama decoder layer that serving engines load.

x-transformers cannot express either layer (EAGLE's first layer has no input norm; EAGLE-3's attention reads
a 2d-wide input made of two separately normed halves, with the residual taken from one of them), so this is
plain torch, laid out tensor for tensor as vLLM's and speculators' checkpoints are (experiments/lib/formats/
common.py maps the names). Both are a Llama layer: RMSNorm, SwiGLU feed-forward, grouped-query attention
with rotary on the two halves of each head (transformers' rotate_half); no biases anywhere.

- arch "eagle" (EAGLE-1): the input is fc(cat(embedding, feature)) (the fc lives in the prophet); the layer
  has no input norm and no final norm: out = h + mlp(norm(h)), h = x + attn(x). Its output is the predicted
  final hidden state, read by the base's own output layer.
- arch "eagle3": the input is cat(g, embedding) (g: fc of the base's low/mid/high layer states for a true
  position, or the layer's own output for a drafted one); attention reads cat(input_norm(embedding),
  hidden_norm(g)), the residual is g (hidden_norm(g) with `norm_before_residual`); the output g' is the
  pre-norm residual stream, fed back as it is, and logits read `norm(g')`.

Two forwards share the weights: `forward(x, attn_bias=None, pos=None)` for training (full sequences, the
prophet's unroll masks) and `decode(x, cache, allow=None, pos=None)` on a `StaticCache` for drafting.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from verify.backends.cache import StaticCache, visibility, write_kv
from verify.backends.lean_llama import attend_grouped, group_bias, half_rotary_table, llama_shape, rotate_halves
from verify.common.numerics import check_int

ARCHS = ("eagle", "eagle3")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device: torch.device | None = None):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim, device=device)), eps

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class EagleLayer(nn.Module):
    def __init__(
        self,
        *,
        arch: str,
        dim: int,
        heads: int,
        kv_heads: int,
        dim_head: int,
        hidden: int,
        rope_theta: float = 10000.0,
        eps: float = 1e-5,
        norm_before_residual: bool = False,
        device: torch.device | None = None,
    ):
        """dim: the base's width (both formats read and write the base's features unprojected); hidden: the
        feed-forward width; heads share kv_heads key/value heads; rotary with base `rope_theta`."""
        super().__init__()
        if arch not in ARCHS:
            raise ValueError(f"arch={arch!r}: must be one of {', '.join(ARCHS)}")
        for name, value in dict(dim=dim, heads=heads, kv_heads=kv_heads, dim_head=dim_head, hidden=hidden).items():
            check_int(name, value)
        if heads % kv_heads:
            raise ValueError(f"heads={heads} is not a multiple of kv_heads={kv_heads}")
        if dim_head % 2:
            raise ValueError(f"dim_head={dim_head}: rotary on two halves needs an even head size")
        self.arch, self.dim, self.heads, self.kv_heads, self.dim_head = arch, dim, heads, kv_heads, dim_head
        self.hidden, self.rope_theta, self.eps = hidden, float(rope_theta), float(eps)
        self.norm_before_residual = bool(norm_before_residual)
        width = 2 * dim if arch == "eagle3" else dim  # EAGLE-3 attends over cat(embedding, g)
        linear = lambda i, o: nn.Linear(i, o, bias=False, device=device)  # noqa: E731
        self.q_proj, self.k_proj = linear(width, heads * dim_head), linear(width, kv_heads * dim_head)
        self.v_proj, self.o_proj = linear(width, kv_heads * dim_head), linear(heads * dim_head, dim)
        self.gate_proj, self.up_proj, self.down_proj = linear(dim, hidden), linear(dim, hidden), linear(hidden, dim)
        self.post_attention_layernorm = RMSNorm(dim, eps, device)
        if arch == "eagle3":
            self.input_layernorm, self.hidden_norm, self.norm = (RMSNorm(dim, eps, device) for _ in range(3))
        exponents = torch.arange(0, dim_head, 2, dtype=torch.float32, device=device) / dim_head
        inv_freq = 1.0 / rope_theta**exponents
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # as transformers' default rope

    def config(self) -> dict:
        """The constructor's keyword arguments (what a checkpoint records to rebuild the layer)."""
        keys = ("arch", "dim", "heads", "kv_heads", "dim_head", "hidden", "rope_theta", "eps", "norm_before_residual")
        return {k: getattr(self, k) for k in keys}

    def readout(self, out: Tensor) -> Tensor:
        """The layer's output (..., d) -> what the output layer reads: norm(g') for EAGLE-3, itself for EAGLE."""
        return self.norm(out) if self.arch == "eagle3" else out

    def forward(self, x: Tensor, attn_bias: Tensor | None = None, pos: Tensor | None = None) -> Tensor:
        """Training: inputs x (b, n, width) -> outputs (b, n, d). attn_bias (1 or b, 1, n, n) additive, None for
        causal; pos (n,) or (b, n) rotary positions, None for 0..n-1 (the prophet's unroll passes both)."""
        return self.forward_keys(x, attn_bias, pos)[0]

    def forward_keys(
        self,
        x: Tensor,
        attn_bias: Tensor | None = None,
        pos: Tensor | None = None,
        context: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """`forward`, whose queries may also read `context`: the rotated keys and values (b, m, g, dh) x 2 of
        entries an earlier call computed (attn_bias then (1 or b, 1, n, m + n)); returns the outputs and this call's
        own keys and values, context first (b, m + n, g, dh) x 2, to pass on. The anchored training-time test
        (prophet.model.Prophet.unroll_anchored) computes each drafted step's entries once this way."""
        if context is not None and attn_bias is None:
            raise ValueError("forward_keys with a context needs attn_bias: causal alignment over it is undefined")
        b, n, _ = x.shape
        pos = torch.arange(n, device=x.device) if pos is None else pos
        cos, sin = self._rotary(pos.expand(b, n))
        kept = []

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # (b, n, h, dh), (b, n, g, dh) x 2
            if context is not None:
                k, v = torch.cat((context[0], k), dim=1), torch.cat((context[1], v), dim=1)
            kept.extend((k, v))
            q, k, v = (rearrange(t, "b n h d -> b h n d") for t in (q, k, v))
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_bias, is_causal=attn_bias is None, enable_gqa=self.heads != self.kv_heads
            )
            return rearrange(out, "b h n d -> b n (h d)")

        out = self._block(x, cos, sin, attend)
        return out, (kept[0], kept[1])

    def new_cache(self, batch: int, capacity: int, *, device: torch.device | None = None) -> StaticCache:
        """One layer's keys and values, for the kv heads only."""
        weight = self.o_proj.weight
        return StaticCache(
            layers=1,
            batch=batch,
            heads=self.kv_heads,
            dim_head=self.dim_head,
            capacity=capacity,
            device=device if device is not None else weight.device,
            dtype=weight.dtype,
        )

    def decode(
        self, x: Tensor, cache: StaticCache, *, allow: Tensor | None = None, pos: Tensor | None = None
    ) -> Tensor:
        """Drafting: n new entries x (b, n, width) on top of `cache`, appended to it -> outputs (b, n, d).
        `allow`, `pos` as verify.backends.engine.LeanDecoder.__call__ (a tree level; None: a chain)."""
        n = x.shape[1]
        start = cache.reserve(n)
        (k_buf,), (v_buf,) = cache.buffers(n, full=False)
        slots = start[:, None] + torch.arange(n, device=x.device)  # (b, n)
        cos, sin = self._rotary(slots if pos is None else pos)
        bias = group_bias(visibility(start, n, allow, k_buf.shape[2]), self.heads, self.kv_heads)

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            k, v = (rearrange(t, "b n g d -> b g n d") for t in (k, v))
            k_all, v_all = write_kv(k_buf, v_buf, k, v, slots)  # (b, g, S, dh)
            return attend_grouped(q, k_all, v_all, bias, self.dim_head**-0.5)

        out = self._block(x, cos, sin, attend)
        cache.advance(n)
        return out

    def _rotary(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """pos (b, n) -> cos, sin (b, n, 1, dh), in the layer's dtype. The tables are kept and grown by doubling
        (a draft step would otherwise rebuild them for every position so far)."""
        need, table = int(pos.max()) + 1, getattr(self, "_table", None)
        if table is None or table[0].shape[0] < need or table[0].device != self.inv_freq.device:
            size = max(need, 2 * (0 if table is None else table[0].shape[0]))
            self._table = table = half_rotary_table(self.inv_freq, size)
        dtype = self.o_proj.weight.dtype
        return (rearrange(t[pos], "b n d -> b n 1 d").to(dtype) for t in table)

    def _block(self, x: Tensor, cos: Tensor, sin: Tensor, attend) -> Tensor:
        """The layer on inputs x (b, n, width); `attend` maps rotated q (b, n, h, dh), k and v (b, n, g, dh) to
        (b, n, h * dh) (training: SDPA; drafting: over the cache)."""
        if self.arch == "eagle3":
            g, emb = x.chunk(2, dim=-1)
            normed = self.hidden_norm(g)
            residual = normed if self.norm_before_residual else g
            h = torch.cat((self.input_layernorm(emb), normed), dim=-1)  # the order of the q/k/v columns
        else:
            residual = h = x  # EAGLE's first layer: no input norm
        q, k, v = (
            rearrange(p(h), "b n (h d) -> b n h d", d=self.dim_head) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = rotate_halves(q, cos, sin), rotate_halves(k, cos, sin)
        h = residual + self.o_proj(attend(q, k, v))
        m = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))


def layer_shape(base: nn.Module, *, heads: int, attn_dim_head: int | None, ff_mult: int) -> dict:
    """EagleLayer's shape for a base: a Hugging Face Llama's own (heads, kv heads, head size, feed-forward
    width, rope theta, norm eps), so the layer is the one serving engines build from the base's config; for
    another base (an x-transformers one) the prophet's settings with as many kv heads as heads."""
    dim = base.to_logits.in_features
    config = getattr(getattr(base, "hf", None), "config", None)
    if config is not None and getattr(config, "model_type", None) == "llama":
        return llama_shape(config)
    if attn_dim_head is None and dim % heads:
        raise ValueError(f"the base's width {dim} is not divisible by heads={heads}: pass attn_dim_head")
    return dict(dim=dim, heads=heads, kv_heads=heads, dim_head=attn_dim_head or dim // heads, hidden=ff_mult * dim)
