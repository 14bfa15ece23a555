"""The prophet: a small x-transformers decoder that drafts in the frozen base's feature space.

At position t it reads the base's final hidden state f_t (after the final norm) fused with the
embedding of the next token x_{t+1}, and predicts f_{t+1}; logits come from the frozen base output
layer. Drafting feeds predicted features back in (EAGLE), so the prophet learns a feature dynamics
rather than a token distribution.

`fuse_layers` (EAGLE-3's fusion of low, middle and high features): the TRUE features the prophet reads
become a learned mix of the base's residual states after those blocks and f_t (`seed`), initialised to
f_t exactly, so a fresh fused prophet is the unfused one. Predicted features are fed back unmixed, and
the regression target stays f_{t+1}. `base_features` computes f, the logits and the layer states.

`arch` (prophet/eagle.py): "xtransformers" is the network above; "eagle" and "eagle3" replace fuse, decoder
and out by EAGLE-1's or EAGLE-3's one Llama draft layer at the base's width, which vLLM and speculators load
(experiments/lib/formats/). EAGLE-3 reads fc(the base's layer states) instead of f_t, feeds its own
pre-norm output back, and its logits read the layer's final norm of it (`readout`).

The base's embedding and output layer are reused frozen. They are kept in `FrozenHead`, a plain
object and not an nn.Module, so they are neither parameters nor state_dict entries of the prophet, and
they are applied with detached weights, so no gradient ever reaches the base.

Three forwards share one network:
- `forward(features, next_tokens, layers=None)`: teacher forcing on true features (training step 1);
- `unroll(features, next_tokens, steps, layers=None)`: EAGLE-3's training-time test, step j reading the
  prophet's own predictions of the j - 1 previous steps, with exactly the attention a draft chain sees;
- `step(features, next_tokens, cache, allow=None, pos=None)`: decoding on top of a `verify.backends.cache.StaticCache`,
  on the lean engine (verify/backends/engine.py) built from the same decoder weights; true features come in
  already through `seed`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import Tensor, nn
from x_transformers import Decoder

from medusa.heads import FrozenHead
from prophet.eagle import ARCHS, EagleLayer, layer_shape
from verify.backends.cache import StaticCache
from verify.backends.engine import LeanDecoder, block_depth, check_layers
from verify.backends.hf import HFBase
from verify.backends.lean import lean
from verify.common.numerics import check_int
from verify.common.vocab import trim_linear

XTRANSFORMERS = "xtransformers"  # the default network: an x-transformers Decoder between two projections


@torch.no_grad()
def base_features(base: nn.Module, tokens: Tensor, layers: Sequence[int] = ()) -> tuple[Tensor, Tensor, Tensor | None]:
    """The frozen base's outputs for input tokens (B, T), as given (a training loop passes tokens[:, :-1]):
    hidden (B, T, d) the final hidden states after the final norm, logits (B, T, V), and the states of
    `layers` (B, T, S, d) in that order, or None when `layers` is empty. All float32, without gradients.

    Layer i is the residual stream after block i, before the final norm (verify.backends.engine.check_layers);
    read from the x-transformers forward's `layer_hiddens[2 * i]`. That keeps every block's attention
    intermediates alive until the forward returns, so the plain path is taken when no layer is asked for.
    """
    if isinstance(base, HFBase):  # a Hugging Face causal LM: its own hidden_states give the layers
        return base.features(tokens, tuple(layers))
    layers = check_layers(layers, base_depth(base))
    if not layers:
        logits, hidden = base(tokens, return_logits_and_embeddings=True)
        return hidden.float(), logits.float(), None
    logits, inter = base(tokens, return_intermediates=True)
    states = torch.stack([inter.layer_hiddens[2 * i] for i in layers], dim=2)  # (B, T, S, d)
    return inter.last_layer_hiddens.float(), logits.float(), states.float()


def base_depth(base: nn.Module) -> int | None:
    """Blocks of an x-transformers TransformerWrapper's decoder (None unless they are (attention, feed-forward)
    pairs), or of a Hugging Face causal LM (HFBase)."""
    if isinstance(base, HFBase):
        return base.depth
    return block_depth(base.attn_layers.layer_types)


class Prophet(nn.Module):
    def __init__(
        self,
        *,
        head: FrozenHead,
        dim: int,
        depth: int = 1,
        heads: int = 4,
        attn_dim_head: int | None = None,
        ff_mult: int = 4,
        fuse_layers: Sequence[int] | None = None,
        arch: str = XTRANSFORMERS,
        layer: dict | None = None,
    ):
        """`arch`: "xtransformers" (the decoder of `dim`, `depth`, `heads`, `attn_dim_head`, `ff_mult`), or "eagle"
        / "eagle3", one Llama layer of shape `layer` (prophet.eagle.layer_shape) that vLLM and speculators load."""
        super().__init__()
        if arch not in (XTRANSFORMERS, *ARCHS):
            raise ValueError(f"arch={arch!r}: must be one of {', '.join((XTRANSFORMERS, *ARCHS))}")
        self.arch = arch
        if arch != XTRANSFORMERS:
            self._build_eagle(head, arch, depth, fuse_layers, layer)
            return
        for name, value in dict(dim=dim, depth=depth, heads=heads, ff_mult=ff_mult).items():
            check_int(name, value)
        if attn_dim_head is None and dim % heads != 0:
            raise ValueError(f"dim={dim} is not divisible by heads={heads}: pass attn_dim_head or change them")
        dim_head = attn_dim_head if attn_dim_head is not None else dim // heads
        check_int("attn_dim_head", dim_head)
        if dim_head < 2:
            raise ValueError(f"attn_dim_head={dim_head}: rotary positions need at least 2")
        self.head = head  # a plain object: not a submodule, not in state_dict
        base_dim = head.to_logits.in_features
        self.base_dim, self.vocab_size = base_dim, head.to_logits.out_features
        self.fuse = nn.Linear(2 * base_dim, dim)  # [f_t ; emb(x_{t+1})] -> prophet width (EAGLE's fc)
        self.decoder = Decoder(
            dim=dim,
            depth=depth,
            heads=heads,
            attn_dim_head=dim_head,
            ff_mult=ff_mult,
            rotary_pos_emb=True,  # rotary only: tree drafting needs explicit `pos` and an additive attn_bias
            verbose=False,
        )
        self.out = nn.Linear(dim, base_dim)  # back to the base width, where the frozen output layer reads
        # Built last, and only when asked for: the other weights draw the same random numbers as an
        # unfused prophet's, and an unfused prophet's state_dict is unchanged.
        if isinstance(fuse_layers, (list, tuple)) and not fuse_layers:
            raise ValueError(f"fuse_layers={fuse_layers!r}: name at least one block, or pass None for no fusion")
        self.fuse_layers: tuple[int, ...] = (
            () if fuse_layers is None else check_layers(fuse_layers, head.depth, name="fuse_layers")
        )
        if self.fuse_layers:
            s = len(self.fuse_layers)
            self.mix = nn.Linear((s + 1) * base_dim, base_dim)  # [layer states ; f_t] -> the true features read
            with torch.no_grad():  # mix(...) == f_t exactly: zero on the layer states, identity on f_t, zero bias
                self.mix.weight.zero_()
                self.mix.weight[:, s * base_dim :] = torch.eye(base_dim, device=self.mix.weight.device)
                self.mix.bias.zero_()

    def _build_eagle(self, head: FrozenHead, arch: str, depth: int, fuse_layers, layer: dict | None) -> None:
        """EAGLE's network: fc over cat(feature, embedding) (no bias: vLLM drops one), one layer, no projection
        back. EAGLE-3's: fc over the base's layer states (`seed`, the `mix`), one layer reading cat(g, embedding)."""
        if depth != 1:
            raise ValueError(f"depth={depth}: arch={arch} is one draft layer (the layer vLLM loads); set depth=1")
        if layer is None:
            raise ValueError(f"arch={arch} needs the layer's shape (prophet.eagle.layer_shape): use from_base")
        self.head = head
        self.base_dim, self.vocab_size = head.to_logits.in_features, head.to_logits.out_features
        if layer["dim"] != self.base_dim:
            raise ValueError(f"layer dim={layer['dim']}: arch={arch} runs at the base's width {self.base_dim}")
        device = head.to_logits.weight.device
        if arch == "eagle":
            if fuse_layers:
                raise ValueError(f"fuse_layers={list(fuse_layers)!r}: arch=eagle reads the final hidden state only")
            self.fuse_layers = ()
            self.fuse = nn.Linear(2 * self.base_dim, self.base_dim, bias=False, device=device)
        else:
            if not fuse_layers:
                raise ValueError(
                    "arch=eagle3 reads the base's low, mid and high layer states: set fuse_layers, "
                    "e.g. [2, depth // 2, depth - 3] as vLLM picks them"
                )
            self.fuse_layers = check_layers(fuse_layers, head.depth, name="fuse_layers")
            if list(self.fuse_layers) != sorted(self.fuse_layers):
                raise ValueError(
                    f"fuse_layers={list(fuse_layers)!r}: arch=eagle3 needs them ascending (vLLM hands the layer states "
                    "over in layer order, whatever order a config lists)"
                )
            self.mix = nn.Linear(len(self.fuse_layers) * self.base_dim, self.base_dim, bias=False, device=device)
            self.fuse = None  # the layer norms and joins cat(g, embedding) itself
        self.decoder = EagleLayer(arch=arch, **layer, device=device)
        self.out = nn.Identity()

    @classmethod
    def from_base(
        cls,
        base: nn.Module,
        *,
        dim: int | None = None,
        depth: int = 1,
        heads: int = 4,
        fuse_layers: Sequence[int] | None = None,
        arch: str = XTRANSFORMERS,
        attn_dim_head: int | None = None,
        ff_mult: int = 4,
        **kwargs,
    ) -> Prophet:
        """A prophet for a base (an x-transformers TransformerWrapper or an HFBase), its embedding and output
        layer borrowed.
        `fuse_layers`: blocks of the base (1-based, below the last) whose states `seed` mixes in; None: none.
        arch "eagle" / "eagle3": one Llama layer at the base's width, of a Hugging Face Llama base's own shape
        (`dim` is not read; heads, attn_dim_head and ff_mult shape it on another base)."""
        head = FrozenHead(embedding=base.token_emb.emb, to_logits=base.to_logits, depth=base_depth(base))
        if arch in ARCHS:
            kwargs["layer"] = layer_shape(base, heads=heads, attn_dim_head=attn_dim_head, ff_mult=ff_mult)
        prophet = cls(
            head=head,
            dim=dim,
            depth=depth,
            heads=heads,
            attn_dim_head=attn_dim_head,
            ff_mult=ff_mult,
            fuse_layers=fuse_layers,
            arch=arch,
            **kwargs,
        )
        return prophet.to(base.to_logits.weight.device)

    def logits(self, features: Tensor) -> Tensor:
        """(..., d_base) predicted features -> (..., V) logits (frozen base output layer; an imported EAGLE-3's
        own rows: (..., Vd), over `draft_ids`)."""
        _, weight, bias = self.output_layer(None)
        return F.linear(self.readout(features), weight, bias)

    def readout(self, features: Tensor) -> Tensor:
        """Predicted features (..., d_base) -> what the output layer reads: EAGLE-3's final norm, else themselves."""
        return self.decoder.readout(features) if self.arch in ARCHS else features

    def output_layer(self, vocab: Tensor | None) -> tuple[Tensor | None, Tensor, Tensor | None]:
        """The output layer over the ids drafts come from: (ids (N,) or None for all V, weight (N, d), bias).

        Normally the frozen base's rows for `vocab`. An EAGLE-3 prophet read from a checkpoint trained elsewhere
        has its own output rows over its own draft vocabulary (`set_output_layer`): those, whatever `vocab`."""
        if getattr(self, "lm_head", None) is not None:
            return self.draft_ids, self.lm_head.weight, None
        return (vocab, *trim_linear(self.head.to_logits, vocab))

    def set_output_layer(self, weight: Tensor, ids: Tensor) -> None:
        """Give an EAGLE-3 prophet its own output layer: weight (Vd, d) over the sorted base token ids (Vd,)."""
        if self.arch != "eagle3":
            raise ValueError(f"arch={self.arch}: only an EAGLE-3 prophet has its own output layer")
        self.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device)
        with torch.no_grad():
            self.lm_head.weight.copy_(weight)
        self.register_buffer("draft_ids", ids.to(device=weight.device, dtype=torch.long))

    def seed(self, features: Tensor, layers: Tensor | None = None) -> Tensor:
        """The true features the prophet reads: final hidden states f (b, n, d_base) and the base's states of
        `fuse_layers` (b, n, S, d_base) -> (b, n, d_base). f itself without fusion (`layers` is then not read)."""
        if not self.fuse_layers:
            return features
        s = len(self.fuse_layers)
        if layers is None or layers.shape != (*features.shape[:-1], s, self.base_dim):
            got = None if layers is None else tuple(layers.shape)
            raise ValueError(
                f"layers={got}: this prophet fuses blocks {list(self.fuse_layers)} and needs their states "
                f"{(*features.shape[:-1], s, self.base_dim)} (prophet.model.base_features)"
            )
        if self.arch == "eagle3":  # EAGLE-3's fc: the layer states alone, f_t is not read
            return self.mix(rearrange(layers, "b n s d -> b n (s d)"))
        return self.mix(torch.cat((rearrange(layers, "b n s d -> b n (s d)"), features), dim=-1))

    def fused(self, features: Tensor, next_tokens: Tensor) -> Tensor:
        """features (b, n, d_base), next_tokens (b, n) -> decoder inputs (b, n, dim) (EAGLE-3: (b, n, 2 d_base))."""
        return self._join(features, self.head.embed(next_tokens))

    def _join(self, features: Tensor, emb: Tensor) -> Tensor:
        joined = torch.cat((features, emb), dim=-1)
        return joined if self.fuse is None else self.fuse(joined)

    def forward(self, features: Tensor, next_tokens: Tensor, layers: Tensor | None = None) -> Tensor:
        """Teacher forcing: features f_t (B, T, d_base), tokens x_{t+1} (B, T) and, when fused, the layer
        states (B, T, S, d_base) -> predicted f_{t+1} (B, T, d_base)."""
        return self.out(self.decoder(self.fused(self.seed(features, layers), next_tokens)))

    def unroll(self, features: Tensor, next_tokens: Tensor, steps: int, layers: Tensor | None = None) -> list[Tensor]:
        """EAGLE-3's training-time test: predictions (B, T, d_base) for steps 1..`steps`.

        Step j at index t predicts f_{t+1} from the true features up to index t - j + 1 and the
        prophet's own predictions for the j - 1 indices after it, as drafting step j does. Step j's input
        at index t pairs step j - 1's prediction at t - 1 with x_{t+1}; indices t < j - 1 have no such
        chain and are filler that no valid query sees. Each forward runs all steps so far side by side
        with the attention mask of `unroll_attention`. `layers` (B, T, S, d_base): the base's states of
        `fuse_layers`, mixed into the true features (`seed`); predictions are fed back as they are.
        """
        check_int("steps", steps)
        t = features.shape[1]
        emb = self.head.embed(next_tokens)
        features = self.seed(features, layers)  # the true features as the prophet reads them, here and in the filler
        inputs, preds = [self._join(features, emb)], []
        for j in range(1, steps + 1):
            if j == 1:  # plain causal attention: no mask to build, x-transformers' own fast path
                out = self.decoder(inputs[0])
            else:
                bias, pos = unroll_attention(j, t, features.device)
                out = self.decoder(torch.cat(inputs, dim=1), attn_bias=bias, pos=pos)
            preds.append(self.out(out[:, -t:]))
            if j < steps:  # not detached: step j's loss also trains the steps whose predictions it reads
                shifted = torch.cat((features[:, :1], preds[-1][:, :-1]), dim=1)  # index t <- prediction at t - 1
                inputs.append(self._join(shifted, emb))
        return preds

    def unroll_anchored(
        self, features: Tensor, next_tokens: Tensor, steps: int, anchors: Tensor, layers: Tensor | None = None
    ) -> list[Tensor]:
        """`unroll` with steps 2..`steps` only on the chains that start at `anchors` (A,) (sorted indices, each at
        most T - 1 - steps): step 1 (B, T, d_base) as `unroll`'s, step j (B, A, d_base) at indices anchors + j - 1,
        equal to `unroll`'s step j there.

        An EAGLE layer's step 1 keeps its keys and values; step j computes only its A new entries, each reading the
        true entries up to its anchor and its own chain's earlier entries (as drafting does on a cache), so an
        extra step costs about A / T of the first instead of a forward over every step so far."""
        if self.arch not in ARCHS:
            raise ValueError(f"anchors: the anchored training-time test needs arch=eagle or eagle3, not {self.arch}")
        check_int("steps", steps)
        t, a = features.shape[1], anchors.shape[0]
        if a == 0 or int(anchors.max()) > t - 1 - steps or int(anchors.min()) < 0:
            raise ValueError(f"anchors must be {a} indices in [0, {t - 1 - steps}] for steps={steps} over T={t}")
        emb = self.head.embed(next_tokens)
        out, context = self.decoder.forward_keys(self._join(self.seed(features, layers), emb))
        preds = [self.out(out)]
        seen = torch.arange(t, device=features.device)[None] <= anchors[:, None]  # (A, T): the true prefix
        own = torch.eye(a, dtype=torch.bool, device=features.device)  # a chain entry sees its own chain's
        for j in range(2, steps + 1):
            index = anchors + j - 1  # (A,) where step j's entries sit
            previous = preds[-1] if j > 2 else preds[0][:, anchors]  # (B, A, d): step j - 1's, at index - 1
            visible = torch.cat((seen, *[own] * (j - 1)), dim=1)  # (A, T + (j - 1) A)
            bias = torch.zeros(visible.shape, device=features.device).masked_fill(~visible, float("-inf"))
            x = self._join(previous, emb[:, index])
            out, context = self.decoder.forward_keys(x, rearrange(bias, "q k -> 1 1 q k"), index, context)
            preds.append(self.out(out))
        return preds

    def new_cache(self, batch: int, capacity: int) -> StaticCache:
        """An empty decoding cache for `batch` rows (grows past `capacity` when needed)."""
        if self.arch in ARCHS:
            return self.decoder.new_cache(batch, capacity)
        return lean(self.decoder, LeanDecoder).new_cache(batch, capacity, device=self.out.weight.device)

    def step(
        self,
        features: Tensor,
        next_tokens: Tensor,
        cache: StaticCache,
        *,
        allow: Tensor | None = None,
        pos: Tensor | None = None,
        compile: bool = False,
    ) -> Tensor:
        """Decoding: n new entries (b, n, d_base), (b, n) on top of `cache` -> predicted features (b, n, d_base).

        `allow` and `pos` (see `LeanDecoder.__call__`) turn the new entries into a tree level; without
        them they form a chain after each row's cached entries. The cache takes the new entries.
        `compile` runs the decoder layers through torch.compile (one program per input shape).
        """
        return self.decode(self.fused(features, next_tokens), cache, allow=allow, pos=pos, compile=compile)

    def decode(
        self, x: Tensor, cache: StaticCache, *, allow: Tensor | None = None, pos: Tensor | None = None, compile=False
    ) -> Tensor:
        """`step` from decoder inputs x (b, n, dim) (fused entries, or a block prophet's slots) -> (b, n, d_base).
        An EAGLE layer runs eager (`compile` is not read): one small layer, a few matmuls."""
        if self.arch in ARCHS:
            return self.decoder.decode(x, cache, allow=allow, pos=pos)
        decoder = lean(self.decoder, LeanDecoder, compile=compile)  # rebuilt only when the weights changed
        return self.out(decoder(x, cache, allow=allow, pos=pos))


def unroll_attention(steps: int, t: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Additive attention bias (1, 1, S*T, S*T) and positions (S*T,) for `steps` = S unrolled steps side by side.

    Step i's key at index s is visible to step j's query at index t iff i = 1 and s <= t - j + 1 (the
    true-feature prefix), or 2 <= i <= j and s = t - j + i (the query's own chain of predictions).
    Every entry at index s has position s, as in a draft chain, so all steps see the same distances.
    """
    step = torch.arange(1, steps + 1, device=device)
    index = torch.arange(t, device=device)
    qj, qt = (rearrange(x, "n -> n 1") for x in _grid(step, index))  # query step and index, (S*T, 1)
    ki, ks = (rearrange(x, "n -> 1 n") for x in _grid(step, index))  # key step and index, (1, S*T)
    visible = ((ki == 1) & (ks <= qt - qj + 1)) | ((ki >= 2) & (ki <= qj) & (ks == qt - qj + ki))
    bias = torch.zeros(visible.shape, device=device).masked_fill(~visible, float("-inf"))
    # A filler query (t < j - 1) may see nothing; let it see itself so softmax stays finite.
    bias.diagonal().zero_()
    return rearrange(bias, "q k -> 1 1 q k"), repeat(index, "t -> (s t)", s=steps)


def _grid(step: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
    """Step and index of every entry in step-major order: (S*T,), (S*T,)."""
    return repeat(step, "s -> (s t)", t=index.shape[0]), repeat(index, "t -> (s t)", s=step.shape[0])


def check_same_base(module: Prophet, base: nn.Module) -> None:
    if module.head.to_logits is not base.to_logits:
        raise ValueError("the prophet was built on another base: build it with prophet.train.build(base)")
