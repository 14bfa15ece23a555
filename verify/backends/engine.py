"""A lean decode engine for the x-transformers decoders this project trains, on a static KV cache.

x-transformers is the training network; at decode time its forward is mostly Python and dispatch
(an eager step of the 10.5M-parameter base costs about 4x its weight matmuls) and its cache grows by
concatenation. `LeanDecoder` reads the weights of an x-transformers `AttentionLayers` (pre-norm
LayerNorm, rotary attention, GELU feed-forward, final norm: what `experiments.lib.store.lm.build_lm` and the
prophet build) into a few fused tensors and runs them with plain torch ops:

- one fused qkv matmul per layer; keys are rotated once, when written, from a precomputed table;
- keys and values go into `StaticCache` buffers at each row's own slots (row b's token at position p
  lives in slot p), so rows of a batch need no padding and rollback is a length rewind;
- attention covers the whole buffer under a boolean mask, so every step of a given width has the same
  shapes (what torch.compile needs to compile a step once).

Nothing here is specific to the target: the draft model and the prophet run on the same engine.
Options the engine does not implement are refused in one line when it is built, and a numerical check
against the x-transformers forward catches any that the structural checks miss.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import Tensor, nn

from verify.backends.cache import StaticCache, visibility, write_kv
from verify.backends.packed import linear, pack

_ATTN_OFF = dict(  # Attention attributes that must have these values (anything else changes the math)
    num_mem_kv=0,
    qk_norm=False,
    head_scale=False,
    sparse_topk=None,
    to_v_gate=None,
    to_output_gate=None,
    to_v_head_gate=None,
    data_dependent_alibi=None,
    rel_proj_pos_bias=None,
    laser=False,
    hybrid_module=None,
    use_latent_q=False,
    use_latent_kv=False,
    attn_on_attn=False,
    orthog_projected_values=False,
)
_LAYERS_OFF = dict(  # AttentionLayers attributes likewise
    pre_norm=True,
    sandwich_norm=False,
    pre_and_post_norm=False,
    residual_attn=False,
    cross_attend=False,
    rel_pos=None,
    polar_pos_emb=None,
    num_residual_streams=1,
    unet_skips=False,
    reinject_input=False,
    add_value_residual=False,
    softclamp_output=False,
    need_condition=False,
)
_ATTEND_OFF = dict(
    pre_softmax_talking_heads=None,
    post_softmax_talking_heads=None,
    pre_scale_post_talking_heads=None,
    selective=False,
    add_zero_kv=False,
    head_attn_sink=None,
    softclamp_logits=False,
    cope=None,
)


# How a decoder sums attention: "ordered", chunk by chunk in position order, so that every decoding forward (a
# step, a chain, a tree) gives a token the bits its path decoded alone gives it (verify/backends/ordered_attention.py);
# "fused", one fused kernel (SDPA), for a prefill (the same call for every decoder of a prompt) and for decoding
# that needs no exactness.
ATTENTION = ("ordered", "fused")


def block_depth(layer_types: Sequence[str]) -> int | None:
    """Blocks of a decoder whose layers are (attention, feed-forward) pairs; None for any other layout."""
    depth = len(layer_types) // 2
    return depth if tuple(layer_types) == ("a", "f") * depth and depth > 0 else None


def check_layers(layers: object, depth: int | None, *, name: str = "layers") -> tuple[int, ...]:
    """Block indices whose residual states a caller asks a base for -> the same indices as a tuple.

    Layer i of a base (the one definition the project uses: prophet.model.base_features, the lean engine,
    the Target's `layers` output, the prophet's fusion) is the residual stream after the i-th block
    (attention + feed-forward) of the base's decoder, before the final norm, i in 1..depth. In
    x-transformers 2.31 it is `layer_hiddens[2 * i]` of `base(tokens, return_intermediates=True)`
    (index 0 is the embedding input). Layer `depth` is refused: after the final norm it is the final
    hidden state, which every output carries anyway. Order is kept: states come back in the order asked.
    """
    if not isinstance(layers, (list, tuple)):
        raise ValueError(f"{name}={layers!r}: must be a list of block indices")
    if layers and (depth is None or depth < 2):
        why = "its decoder is not made of attention + feed-forward blocks" if depth is None else "it has a single block"
        raise ValueError(f"{name}={list(layers)!r}: the base has no layer states to give ({why})")
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= depth - 1:
            raise ValueError(f"{name}={list(layers)!r}: {i!r} is not a block index in [1, {depth - 1}]")
    if len(set(layers)) != len(layers):
        raise ValueError(f"{name}={list(layers)!r}: each block at most once")
    return tuple(layers)


class UnsupportedModel(ValueError):
    """The x-transformers model uses an option the lean engine does not implement."""


def _require(obj: object, expected: dict, where: str) -> None:
    for name, want in expected.items():
        have = getattr(obj, name, want)
        if have is not want and have != want:
            raise UnsupportedModel(f"{where}.{name}={have!r}: the lean engine implements only {name}={want!r}")


def _layer_norm_weight(norm: nn.Module, where: str) -> Tensor:
    """x-transformers' bias-free LayerNorm -> its effective gain (gamma + unit offset)."""
    if type(norm).__name__ != "LayerNorm" or not hasattr(norm, "gamma"):
        raise UnsupportedModel(
            f"{where} is {type(norm).__name__}: the lean engine implements x-transformers' LayerNorm only"
        )
    return norm.gamma.detach() + float(norm.unit_offset)


def _check_attention(attn: nn.Module, where: str) -> None:
    if type(attn).__name__ != "Attention":
        raise UnsupportedModel(
            f"{where} is {type(attn).__name__}: the lean engine implements self-attention and feed-forward layers only"
        )
    _require(attn, _ATTN_OFF, where)
    _require(attn.attend, _ATTEND_OFF, where + ".attend")
    if attn.kv_heads != attn.heads or attn.rotate_num_heads != attn.heads:
        raise UnsupportedModel(
            f"{where}: kv_heads={attn.kv_heads}, rotate_num_heads={attn.rotate_num_heads}; the lean engine needs "
            f"both equal to heads={attn.heads}"
        )
    for name in ("to_q", "to_k", "to_v", "to_out"):
        if type(getattr(attn, name)) is not nn.Linear:
            raise UnsupportedModel(
                f"{where}.{name} is {type(getattr(attn, name)).__name__}: the lean engine needs a plain Linear"
            )


def _feedforward_weights(ff: nn.Module, where: str) -> tuple[Tensor, ...]:
    """x-transformers FeedForward as Linear -> GELU -> Linear (no GLU, no post-activation norm)."""
    seq = getattr(ff, "ff", None)
    ok = (
        type(ff).__name__ == "FeedForward"
        and isinstance(seq, nn.Sequential)
        and len(seq) == 3
        and isinstance(seq[0], nn.Sequential)
        and len(seq[0]) == 2
        and type(seq[0][0]) is nn.Linear
        and type(seq[0][1]) is nn.GELU
        and seq[0][1].approximate == "none"
        and type(seq[2]) is nn.Linear
    )
    if not ok:
        raise UnsupportedModel(
            f"{where}: the lean engine implements the Linear-GELU-Linear feed-forward only "
            "(no GLU, no other activation)"
        )
    up, down = seq[0][0], seq[2]
    return up.weight.detach(), _bias(up), down.weight.detach(), _bias(down)


def _bias(layer: nn.Linear) -> Tensor | None:
    return None if layer.bias is None else layer.bias.detach()


def rotary_table(inv_freq: Tensor, length: int, dim_head: int) -> tuple[Tensor, Tensor]:
    """cos, sin (length, dim_head) for x-transformers' interleaved rotary on the first 2 * len(inv_freq)
    channels; the rest pass through (cos 1, sin 0). sin carries the sign of the pair swap, so that
    rotary(x) = x * cos + swap_pairs(x) * sin: four elementwise ops, no slicing or concatenation."""
    freqs = torch.outer(torch.arange(length, device=inv_freq.device, dtype=torch.float32), inv_freq.float())
    sign = torch.tensor([-1.0, 1.0], device=inv_freq.device)  # (x1, x2) -> (-x2, x1)
    cos = rearrange(torch.stack((freqs.cos(), freqs.cos()), dim=-1), "n d r -> n (d r)")
    sin = rearrange(freqs.sin()[..., None] * sign, "n d r -> n (d r)")
    rest = dim_head - cos.shape[-1]
    return F.pad(cos, (0, rest), value=1.0), F.pad(sin, (0, rest), value=0.0)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary on x (..., n, dh) with tables cos, sin (..., n, dh) from `rotary_table`."""
    swapped = rearrange(rearrange(x, "... (d two) -> ... d two", two=2).flip(-1), "... d two -> ... (d two)")
    return x * cos + swapped * sin


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Softmax attention of q (b, h, n, dh) over the whole buffer k, v (b, h, S, dh) under mask (b, 1, n, S).

    Written out rather than SDPA: for a handful of queries over a few hundred slots, the fused CPU
    kernel's fixed cost (about 90 us a call here) exceeds the arithmetic."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    return torch.matmul(scores.masked_fill(~mask, float("-inf")).softmax(dim=-1), v)


def pre_norm_blocks(
    layers: nn.Module, where: str, *, kinds: tuple[str, ...]
) -> list[tuple[str, Tensor, nn.Module, str]]:
    """The structural checks every lean decoder makes of x-transformers AttentionLayers (causal, plain
    rotary positions, the default execution order, pre-norm residual blocks of `kinds` only) ->
    (kind, norm gain, module, its name) per layer."""
    if not getattr(layers, "causal", False):
        raise UnsupportedModel(f"{where}.causal=False: the lean engine runs causal decoders only")
    rotary = getattr(layers, "rotary_pos_emb", None)
    if rotary is None or rotary.scale is not None or rotary.interpolation_factor != 1:
        raise UnsupportedModel(
            f"{where}: the lean engine needs plain rotary positions (rotary_pos_emb=True, no xpos, no interpolation)"
        )
    if tuple(layers.layers_execute_order) != tuple(range(len(layers.layers))):
        raise UnsupportedModel(f"{where}: custom layer execution orders are not implemented by the lean engine")
    blocks = []
    for i, (kind, (norms, module, residual)) in enumerate(zip(layers.layer_types, layers.layers)):
        here = f"{where}.layers[{i}]"
        if norms[1] is not None or norms[2] is not None or type(residual).__name__ != "Residual":
            raise UnsupportedModel(f"{here}: the lean engine implements pre-norm residual blocks only")
        _require(residual, dict(residual_scale=None, scale_residual_constant=1.0), here)
        if kind not in kinds:
            raise UnsupportedModel(
                f"{here}: layer type {kind!r}; the lean engine implements {', '.join(map(repr, kinds))} only"
            )
        blocks.append((kind, _layer_norm_weight(norms[0], here + ".norm"), module, here))
    return blocks


class LeanDecoder:
    """The layers of an x-transformers decoder as fused tensors: inputs (b, n, d) -> hidden (b, n, d) after the
    final norm, and on request the residual states after chosen blocks (`check_layers` says what layer i is)."""

    orders_attention = False  # its attention is one product over the slots, whatever `attention` asks

    def __init__(self, layers: nn.Module, *, where: str = "decoder"):
        _require(layers, _LAYERS_OFF, where)
        self.blocks: list[tuple[str, tuple]] = []
        for kind, gain, module, here in pre_norm_blocks(layers, where, kinds=("a", "f")):
            if kind == "a":
                self.blocks.append(("a", (gain, *self._attention(module, here))))
            else:
                self.blocks.append(("f", (gain, *_feedforward_weights(module, here))))
        if not self.num_layers:
            raise UnsupportedModel(f"{where} has no attention layer")
        self.depth = block_depth([kind for kind, _ in self.blocks])  # None: no layer states to give
        final = layers.final_norm
        self.final_gain = (
            None if type(final).__name__ == "Identity" else _layer_norm_weight(final, where + ".final_norm")
        )
        self.inv_freq = layers.rotary_pos_emb.inv_freq.detach()
        self.dim = layers.dim
        self.step, self.compiled = self.forward, False  # or its compiled version (`lean(..., compile=True)`)
        self.dtype = self.blocks[0][1][0].dtype  # the first block's norm gain: the model's dtype
        self.cos = self.sin = None
        self._table(1)

    def _attention(self, attn: nn.Module, where: str) -> tuple:
        _check_attention(attn, where)
        self.heads, self.scale = attn.heads, attn.scale
        layers = (attn.to_q, attn.to_k, attn.to_v)
        w = torch.cat([layer.weight for layer in layers]).detach()  # (3 h dh, d): one matmul for q, k and v
        b = None  # a bias on any of them: zeros stand in for the others
        if any(layer.bias is not None for layer in layers):
            b = torch.cat(
                [_bias(layer) if layer.bias is not None else w.new_zeros(layer.out_features) for layer in layers]
            )
        self.dim_head = attn.to_q.out_features // attn.heads
        return w, b, attn.to_out.weight.detach(), _bias(attn.to_out)

    @property
    def num_layers(self) -> int:
        return sum(kind == "a" for kind, _ in self.blocks)

    def new_cache(
        self, batch: int, capacity: int, *, device: torch.device | None = None, layers: int | None = None
    ) -> StaticCache:
        """A cache for all attention layers, or for the first `layers` of them (what `blocks=` runs)."""
        device = device if device is not None else self.inv_freq.device
        return StaticCache(
            layers=self.num_layers if layers is None else layers,
            batch=batch,
            heads=self.heads,
            dim_head=self.dim_head,
            capacity=capacity,
            device=device,
            dtype=self.dtype,
        )

    def _table(self, length: int) -> tuple[Tensor, Tensor]:
        if self.cos is None or self.cos.shape[0] < length:  # grown by doubling: rotary has no maximum length
            size = max(length, 2 * (0 if self.cos is None else self.cos.shape[0]))
            self.cos, self.sin = (t.to(self.dtype) for t in rotary_table(self.inv_freq, size, self.dim_head))
        return self.cos, self.sin

    def __call__(
        self, x: Tensor, cache: StaticCache, *, pos: Tensor | None = None, allow: Tensor | None = None
    ) -> Tensor:
        """Run n new entries x (b, n, d) on top of `cache` and append them to it; returns hidden (b, n, d).

        pos (b, n): rotary positions (default: each row's next positions, a chain). allow (b, n, r) with
        r >= n: which of the last r slots (the r - n newest cached ones, then the new ones) each new
        entry sees; older slots are always visible (default: causal among the new entries).
        """
        start = cache.reserve(x.shape[1])  # host-side bookkeeping stays outside the tensor program
        self._table(cache.capacity)  # grown here, never inside a compiled step (it would invalidate it)
        hidden = self.step(x, *cache.buffers(x.shape[1], full=self.compiled), start, pos, allow)
        cache.advance(x.shape[1])
        return hidden

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
        """The tensor program of a step (what torch.compile sees): writes keys/values into the layers'
        buffers k_buf, v_buf (b, h, S, dh) at slots start (b,) + [0, n) and returns hidden (b, n, d).

        With `layers` (checked by the caller, see `check_layers`) it returns (hidden, states), states
        (b, n, len(layers), d) the residual streams after those blocks, in that order. A compiled step
        is one program per `layers` value; with none, the program is the plain one.

        With `blocks` = i it runs the first i blocks only and returns the residual stream after block i
        (layer i's state, no final norm), writing keys and values of the first i attention layers only:
        an early-exit drafter runs the target's own first blocks on the target's cache this way. `attention` is
        the Llama decoder's choice (ATTENTION); this decoder sums every query's keys in one product either way."""
        n, capacity = x.shape[1], k_buf[0].shape[2]
        slots = start[:, None] + torch.arange(n, device=x.device)  # (b, n)
        pos = slots if pos is None else pos
        cos, sin = (rearrange(t[pos], "b n r -> b 1 n r") for t in self._table(capacity))
        mask = visibility(start, n, allow, capacity)  # (b, 1, n, S)
        layer, saved = 0, {}
        ends = {2 * i - 1: i for i in layers}  # block i (1-based) ends with layer 2i - 1 (0-based), its feed-forward
        for index, (kind, w) in enumerate(self.blocks if blocks is None else self.blocks[: 2 * blocks]):
            h = F.layer_norm(x, (self.dim,), w[0])
            if kind == "a":
                qkv = rearrange(linear(h, w[1], w[2]), "b n (three h d) -> three b h n d", three=3, h=self.heads)
                q, k = _rotate(qkv[:2], cos, sin)  # one rotation for queries and keys together
                k_all, v_all = write_kv(k_buf[layer], v_buf[layer], k, qkv[2], slots)  # (b, h, S, dh)
                x = x + linear(
                    rearrange(_attend(q, k_all, v_all, mask, self.scale), "b h n d -> b n (h d)"), w[3], w[4]
                )
                layer += 1
            else:
                x = x + linear(F.gelu(linear(h, w[1], w[2])), w[3], w[4])
            if index in ends:
                saved[ends[index]] = x
        if blocks is not None:
            return x
        hidden = x if self.final_gain is None else F.layer_norm(x, (self.dim,), self.final_gain)
        if not layers:
            return hidden
        return hidden, torch.stack([saved[i] for i in layers], dim=2)  # (b, n, S, d)


def check_wrapper(wrapper: nn.Module) -> None:
    """Refuse a TransformerWrapper whose embedding or output side the lean engine does not implement:
    token embedding in, rotary positions only, one Linear out (also the encoder-decoder's decoder side)."""
    if getattr(wrapper, "num_memory_tokens", 0) or getattr(wrapper, "l2norm_embed", False):
        raise UnsupportedModel("the model uses memory tokens or l2norm_embed: the lean engine implements neither")
    for name in ("post_emb_norm", "project_emb"):
        if type(getattr(wrapper, name, nn.Identity())).__name__ != "Identity":
            raise UnsupportedModel(
                f"the model's {name} is {type(getattr(wrapper, name)).__name__}: the lean engine implements none"
            )
    if type(getattr(wrapper, "pos_emb", None)).__name__ != "always":
        raise UnsupportedModel(
            "the model has an absolute position embedding: the lean engine implements rotary positions only"
        )
    if not isinstance(getattr(wrapper, "to_logits", None), nn.Linear):
        raise UnsupportedModel(
            "the model's to_logits is not a Linear layer: the lean engine needs one output projection"
        )


class LeanLM:
    """An x-transformers TransformerWrapper on the lean engine: token ids (b, n) -> (logits, hidden).

    `vocab` (sorted ids (N,)) keeps only those rows of the output layer: logits are (b, n, N), over the
    subset in its order. A draft model with a trimmed vocabulary reads them; a target never does."""

    def __init__(self, wrapper: nn.Module, vocab: Tensor | None = None):
        check_wrapper(wrapper)
        self.decoder = LeanDecoder(wrapper.attn_layers, where="attn_layers")
        self.embedding = wrapper.token_emb.emb.weight.detach()
        self.vocab = vocab
        head = wrapper.to_logits
        self.head_weight = head.weight.detach() if vocab is None else head.weight.detach()[vocab]  # (N, d)
        self.head_bias = (
            None if head.bias is None else (head.bias.detach() if vocab is None else head.bias.detach()[vocab])
        )
        self.vocab_size, self.max_seq_len = wrapper.num_tokens, wrapper.max_seq_len
        self.step, self.compiled = self.forward, False  # or its compiled version (`lean(..., compile=True)`)
        self.block_steps: dict = {}  # decode mode -> `forward_blocks` in it (an early-exit drafter's step)

    def pack_weights(self) -> None:
        """Eager bf16 on a CPU: every weight matrix of the blocks and the output layer prepacked for oneDNN
        (verify/backends/packed.py), once; anything else is left as it is. Results are bitwise the same."""
        self.decoder.blocks = [
            (kind, tuple(pack(t) if i else t for i, t in enumerate(w))) for kind, w in self.decoder.blocks
        ]
        self.head_weight = pack(self.head_weight)

    def __call__(
        self,
        tokens: Tensor,
        cache: StaticCache,
        *,
        pos: Tensor | None = None,
        allow: Tensor | None = None,
        eager: bool = False,
        layers: tuple[int, ...] = (),
        attention: str = "ordered",
        logits_at: Tensor | None = None,
    ) -> tuple[Tensor, ...]:
        """tokens (b, n) on top of `cache` (see `LeanDecoder.__call__`) -> logits (b, n, V), hidden (b, n, d),
        and with `layers` (block indices, see `check_layers`) a third output: states (b, n, len(layers), d).

        `eager` skips the compiled step (a prefill has a new width for every prompt length). `attention`: one of
        ATTENTION, how a decoder that has both sums attention (the x-transformers decoder has one way).
        `logits_at` (b,): logits (b, 1, V) at that position of each row only (a prefill that decoding continues
        from: the output layer over every prompt position was most of a batched prefill's work)."""
        if layers:
            layers = check_layers(layers, self.decoder.depth)
        if attention not in ATTENTION:
            raise ValueError(f"attention={attention!r}: must be one of {', '.join(ATTENTION)}")
        start = cache.reserve(tokens.shape[1])
        self.decoder._table(cache.capacity)  # grown here, never inside a compiled step
        compiled = self.compiled and not eager
        step = self.step if compiled else self.forward
        out = step(
            tokens, *cache.buffers(tokens.shape[1], full=compiled), start, pos, allow, layers, attention, logits_at
        )
        cache.advance(tokens.shape[1])
        return out

    def first_blocks(self, tokens: Tensor, cache: StaticCache, *, blocks: int, step=None) -> Tensor:
        """tokens (b, n) through the embedding and the first `blocks` blocks only, appended to `cache` (its
        first `blocks` attention layers are written; any others are left as they are) -> the residual
        states after block `blocks` (b, n, d). `step`: a compiled `forward_blocks` (then the cache's whole
        buffers are passed, for fixed shapes)."""
        start = cache.reserve(tokens.shape[1])
        self.decoder._table(cache.capacity)  # grown here, never inside a compiled step
        k_buf, v_buf = cache.buffers(tokens.shape[1], full=step is not None)
        state = (step or self.forward_blocks)(tokens, k_buf[:blocks], v_buf[:blocks], start, blocks)
        cache.advance(tokens.shape[1])
        return state

    def forward_blocks(
        self, tokens: Tensor, k_buf: list[Tensor], v_buf: list[Tensor], start: Tensor, blocks: int
    ) -> Tensor:
        """The tensor program of `first_blocks` (a chain of new tokens at each row's next positions)."""
        return self.decoder.forward(F.embedding(tokens, self.embedding), k_buf, v_buf, start, None, None, blocks=blocks)

    def forward(
        self,
        tokens: Tensor,
        k_buf: list[Tensor],
        v_buf: list[Tensor],
        start: Tensor,
        pos: Tensor | None,
        allow: Tensor | None,
        layers: tuple[int, ...] = (),
        attention: str = "ordered",
        logits_at: Tensor | None = None,
    ) -> tuple[Tensor, ...]:
        x = F.embedding(tokens, self.embedding)
        out = self.decoder.forward(x, k_buf, v_buf, start, pos, allow, layers, attention=attention)
        hidden, states = out if layers else (out, None)
        read = hidden if logits_at is None else hidden.gather(1, repeat(logits_at, "b -> b 1 d", d=hidden.shape[-1]))
        logits = linear(read, self.head_weight, self.head_bias)
        return (logits, hidden) if states is None else (logits, hidden, states)
