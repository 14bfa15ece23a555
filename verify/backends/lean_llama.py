"""The lean engine for Hugging Face Llama models (verify.backends.hf.HFBase around a LlamaForCausalLM).

transformers' eager Llama is, at the sizes a CPU decodes, mostly Python: a 6-block, 9M-parameter model
costs about 5.8 ms per token here, for about 18 MFLOP of weights. This reads its weights into the same
fused form the x-transformers engine uses (one qkv matmul, one gate-and-up matmul per block) and runs
them with plain torch ops on the project's StaticCache, optionally torch.compile'd; `Target`, the decode
loops and every drafter use it exactly as they use the x-transformers engine.

What differs from x-transformers' blocks: RMSNorm, SwiGLU feed-forward, grouped-query attention (keys
and values cached for kv_heads heads only; each group of queries attends to its shared head), and
rotary on the first and second half of each head (transformers' rotate_half) instead of interleaved
pairs. Anything else (rope scaling, sliding windows, an MLP bias, another activation) is refused in one
line, and the engine is checked numerically against the model's own forward when it is built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from verify.backends.cache import StaticCache, kv_index, visibility, write_kv
from verify.backends.engine import LeanDecoder, LeanLM, UnsupportedModel, block_depth
from verify.backends.ordered_attention import attend_in_order, order_plan
from verify.backends.ordered_kernel import attend_kernel, fast_bf16, kernel_name, kernel_plan
from verify.backends.packed import linear


def _check_config(config) -> None:
    """One line naming the first setting this engine does not implement."""
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    checks = [
        ("model_type", config.model_type, config.model_type == "llama"),
        ("hidden_act", config.hidden_act, config.hidden_act == "silu"),
        ("mlp_bias", getattr(config, "mlp_bias", False), not getattr(config, "mlp_bias", False)),
        ("rope_type", rope, rope == "default"),
        ("pretraining_tp", getattr(config, "pretraining_tp", 1), getattr(config, "pretraining_tp", 1) == 1),
    ]
    for name, value, ok in checks:
        if not ok:
            raise UnsupportedModel(
                f"{name}={value!r}: the lean Llama engine does not implement it (use the transformers adapter, "
                "verify.backends.hf.HFTarget)"
            )


def llama_shape(config) -> dict:
    """A Llama config (transformers' LlamaConfig, or its config.json as a dict) -> the shape of its layers: dim,
    heads, kv_heads, dim_head, hidden (the feed-forward width), rope_theta, eps. The one place the project derives
    it: the lean engine, the EAGLE draft layer and the serving formats all read it here."""
    get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
    dim, heads = get("hidden_size"), get("num_attention_heads")
    theta = (get("rope_parameters") or {}).get("rope_theta") or get("rope_theta") or 1e4
    return dict(
        dim=dim,
        heads=heads,
        kv_heads=get("num_key_value_heads") or heads,
        dim_head=get("head_dim") or dim // heads,
        hidden=get("intermediate_size"),
        rope_theta=float(theta),
        eps=get("rms_norm_eps") or 1e-6,
    )


def half_rotary_table(inv_freq: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """cos, sin (length, dim_head) for rotary on the two halves of a head, with the sign of the swap in sin:
    rotary(x) = x * cos + swap_halves(x) * sin, swap_halves(x1, x2) = (x2, x1)."""
    freqs = torch.outer(torch.arange(length, device=inv_freq.device, dtype=torch.float32), inv_freq.float())
    return torch.cat((freqs.cos(), freqs.cos()), dim=-1), torch.cat((-freqs.sin(), freqs.sin()), dim=-1)


def rotate_halves(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary on x (..., dh) with `half_rotary_table`'s cos, sin (transformers' rotate_half convention)."""
    return x * cos + torch.cat(x.chunk(2, dim=-1)[::-1], dim=-1) * sin


def group_bias(mask: Tensor, heads: int, kv_heads: int) -> Tensor:
    """mask (b, 1, n, S) -> the additive float32 bias (b * g, r * n, S) of grouped attention (0 seen, -inf not):
    the r query heads of a group stack along n, so the mask repeats r times. Built once per forward, not per
    layer; float32, as the scores it is added to."""
    b, _, n, span = mask.shape
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias.expand(b, kv_heads, n, span).repeat(1, 1, heads // kv_heads, 1).reshape(-1, n * heads // kv_heads, span)


def attend_grouped(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
    """q (b, n, h, dh) over k, v (b, g, S, dh), g kv heads shared by h / g query heads each, under the additive
    `group_bias` -> (b, n, h * dh). The queries of a group stack along n, so one batched matmul (scale and
    bias folded into it) covers every head and no key is copied."""
    b, n, h, d = q.shape
    g, span = k.shape[1], k.shape[2]
    q = rearrange(q, "b n (g r) d -> (b g) (r n) d", g=g)
    keys = k.reshape(b * g, span, d).transpose(1, 2).float()
    scores = torch.baddbmm(bias, q.float(), keys, alpha=scale)  # float32 scores (b g, r n, S), as SDPA's
    out = torch.bmm(scores.softmax(dim=-1).to(v.dtype), v.reshape(b * g, span, d))  # (b g, r n, d)
    return rearrange(out, "(b g) (r n) d -> b n (g r d)", b=b, n=n)


def _attend_fused(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """SDPA of q (b, n, h, dh) over k, v (b, g, S, dh) (g kv heads shared by h / g query heads) under the
    boolean mask (b, 1, n, S) -> (b, n, h * dh). Its CPU kernel keeps scores and sums in float32."""
    g = k.shape[1]
    out = F.scaled_dot_product_attention(
        rearrange(q, "b n h d -> b h n d"), k.to(q.dtype), v, attn_mask=mask, scale=scale, enable_gqa=q.shape[2] != g
    )
    return rearrange(out, "b h n d -> b n (h d)")


class LlamaDecoder(LeanDecoder):
    """The blocks of a transformers LlamaModel as fused tensors; the interface of `LeanDecoder`."""

    orders_attention = True  # attention="ordered" sums in position order (ordered_attention.py)

    def __init__(self, model: nn.Module):  # model: the LlamaModel (HFBase.hf.model)
        config = model.config
        _check_config(config)
        self.blocks = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.q_proj, attn.k_proj, attn.v_proj)
            w = torch.cat([p.weight for p in projections]).detach()
            b = None if attn.q_proj.bias is None else torch.cat([p.bias for p in projections]).detach()
            out_bias = None if attn.o_proj.bias is None else attn.o_proj.bias.detach()
            self.blocks.append(
                ("a", (layer.input_layernorm.weight.detach(), w, b, attn.o_proj.weight.detach(), out_bias))
            )
            gate_up = torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight)).detach()  # (2 hidden, d): one matmul
            self.blocks.append(
                ("f", (layer.post_attention_layernorm.weight.detach(), gate_up, mlp.down_proj.weight.detach()))
            )
        self.depth = block_depth([kind for kind, _ in self.blocks])
        self.final_gain = model.norm.weight.detach()
        shape = llama_shape(config)
        self.eps, self.heads, self.kv_heads = shape["eps"], shape["heads"], shape["kv_heads"]
        self.dim_head = shape["dim_head"]
        self.scale = self.dim_head**-0.5
        self.inv_freq = model.rotary_emb.inv_freq.detach()
        self.dim = config.hidden_size
        self.step, self.compiled = self.forward, False
        self.dtype = self.final_gain.dtype
        self.cos = self.sin = None
        self._table(1)

    def new_cache(
        self, batch: int, capacity: int, *, device: torch.device | None = None, layers: int | None = None
    ) -> StaticCache:
        """Keys and values are cached for the kv heads only. Keys are bf16 values (a bf16 model computes them in
        bf16); they are stored float32 for the pure-torch attention, whose scores are float32 products (each layer
        of each step converted the whole span's keys: most of a batch-64 step at 1,000 tokens), and bf16 where the
        C++ operator multiplies bf16 pairs itself (half the bytes each step reads). The same values either way."""
        device = device if device is not None else self.inv_freq.device
        bf16_keys = self.dtype == torch.bfloat16 and kernel_name(device, self.dim_head) == "cpp" and fast_bf16()
        return StaticCache(
            layers=self.num_layers if layers is None else layers,
            batch=batch,
            heads=self.kv_heads,
            dim_head=self.dim_head,
            capacity=capacity,
            device=device,
            dtype=self.dtype,
            key_dtype=None if bf16_keys else torch.float32,
        )

    def _table(self, length: int) -> tuple[Tensor, Tensor]:
        if self.cos is None or self.cos.shape[0] < length:  # grown by doubling, outside any compiled step
            size = max(length, 2 * (0 if self.cos is None else self.cos.shape[0]))
            self.cos, self.sin = (t.to(self.dtype) for t in half_rotary_table(self.inv_freq, size))
        return self.cos, self.sin

    def forward(
        self,
        x: Tensor,
        k_buf: list[Tensor],
        v_buf: list[Tensor],
        start: Tensor,
        pos: Tensor | None,
        allow: Tensor | None,
        layers: tuple[int, ...] = (),
        blocks: int | None = None,
        attention: str = "ordered",
    ) -> Tensor | tuple[Tensor, Tensor]:
        """As `LeanDecoder.forward`: writes keys/values at slots start (b,) + [0, n), returns hidden (b, n, d).
        attention="ordered" sums in position order at any n (a tree of any size stays exact); "fused": SDPA."""
        n, capacity = x.shape[1], k_buf[0].shape[2]
        slots = start[:, None] + torch.arange(n, device=x.device)  # (b, n)
        pos = slots if pos is None else pos
        cos, sin = (rearrange(t[pos], "b n r -> b n 1 r") for t in self._table(capacity))
        # Decoding forwards (a step, a chain, a tree) sum attention in position order, so that a tree node equals
        # its path decoded alone and a batched row equals itself alone: the C++ operator (ordered_kernel.py) where it
        # builds, else the pure-torch form (ordered_attention.py). Not SDPA there: past a few hundred keys its result
        # for a query depends on how many queries share the call (measured: 4e-6 apart at 600 keys). A prefill, the
        # same call for every decoder of a prompt, takes SDPA's fused kernel.
        ordered = attention == "ordered"
        kernel = ordered and kernel_name(x.device, self.dim_head) == "cpp"
        if kernel:
            plan = kernel_plan(start, n, allow)
        else:
            mask = visibility(start, n, allow, capacity)
            plan = ordered and order_plan(
                start,
                n,
                allow,
                capacity,
                heads=self.heads,
                kv_heads=self.kv_heads,
                bias=group_bias(mask, self.heads, self.kv_heads),
                static=True,  # shared chunks up to the span (masked past c0): no host read of c0
            )
        index = kv_index(slots, k_buf[0])  # where keys/values go, in every layer
        rotated = self.heads + self.kv_heads  # queries and keys: rotated together, as (b, n, heads, dh)
        layer, saved = 0, {}
        ends = {2 * i - 1: i for i in layers}
        for i, (kind, w) in enumerate(self.blocks if blocks is None else self.blocks[: 2 * blocks]):
            h = F.rms_norm(x, (self.dim,), w[0], self.eps)
            if kind == "a":
                qkv = rearrange(linear(h, w[1], w[2]), "b n (h d) -> b n h d", d=self.dim_head)
                qk = rotate_halves(qkv[:, :, :rotated], cos, sin)
                k, v = (rearrange(t, "b n h d -> b h n d") for t in (qk[:, :, self.heads :], qkv[:, :, rotated:]))
                k_all, v_all = write_kv(k_buf[layer], v_buf[layer], k, v, slots, index)
                if kernel:
                    attended = attend_kernel(qk[:, :, : self.heads], k_all, v_all, plan, self.scale)
                elif ordered:
                    attended = attend_in_order(qk[:, :, : self.heads], k_all, v_all, plan, self.scale)
                else:
                    attended = _attend_fused(qk[:, :, : self.heads], k_all, v_all, mask, self.scale)
                x = x + linear(attended, w[3], w[4])
                layer += 1
            else:
                gate, up = linear(h, w[1]).chunk(2, dim=-1)
                x = x + linear(F.silu(gate) * up, w[2])
            if i in ends:
                saved[ends[i]] = x
        if blocks is not None:
            return x
        hidden = F.rms_norm(x, (self.dim,), self.final_gain, self.eps)
        if not layers:
            return hidden
        return hidden, torch.stack([saved[i] for i in layers], dim=2)


class LeanLlama(LeanLM):
    """An HFBase around a LlamaForCausalLM on the lean engine: the interface of `LeanLM`."""

    def __init__(self, base: nn.Module, vocab: Tensor | None = None):
        model = base.hf
        if type(model).__name__ != "LlamaForCausalLM":
            raise UnsupportedModel(
                f"{type(model).__name__}: the lean engine runs LlamaForCausalLM "
                "(others go through verify.backends.hf.HFTarget)"
            )
        self.decoder = LlamaDecoder(model.model)
        self.embedding = model.model.embed_tokens.weight.detach()
        self.vocab = vocab
        head = model.lm_head
        self.head_weight = head.weight.detach() if vocab is None else head.weight.detach()[vocab]
        self.head_bias = (
            None if head.bias is None else (head.bias.detach() if vocab is None else head.bias.detach()[vocab])
        )
        self.vocab_size, self.max_seq_len = base.num_tokens, base.max_seq_len
        self.step, self.compiled = self.forward, False
        self.block_steps: dict = {}  # decode mode -> `forward_blocks` in it (an early-exit drafter's step)
