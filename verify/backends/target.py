"""The target model and its KV cache: prefill a batch, extend it by a chain or a tree of new tokens in
one forward, roll it back per row.

Convention shared with the decode loops: the last emitted token of a row is *pending*, not yet in the
cache; the next `extend` starts with it. The forward runs on the lean engine over a static cache
(cache.py): engine.py for x-transformers LMs, lean_llama.py for a Hugging Face Llama (all in verify/backends/).
choose.py's `make_target` picks the engine; hf.py is the target for other Hugging Face causal LMs.

Where the project knows it is x-transformers underneath (what to change for another model family):
verify/backends/engine.py reads an x-transformers decoder's weights and options into fused tensors, refuses the
options it does not implement (UnsupportedModel) and is checked numerically against x-transformers' own
forward; verify/encdec/cross_decoder.py does the same for an encoder-decoder's decoder; prophet.model.base_features
reads block states from the x-transformers forward's `layer_hiddens` (training features only); the Medusa,
sequential and prophet drafters borrow the base's `token_emb` and `to_logits` by their x-transformers
names (verify/backends/hf.py's HFBase gives a Hugging Face model the same two names). The KV cache
(verify/backends/cache.py) is the project's own, not x-transformers'. The decode loops, the acceptance rules and
the drafters' proposing see only Target and TargetOutput.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import repeat
from torch import Tensor, nn

from verify.backends.cache import StaticCache, tree_attention
from verify.backends.engine import check_layers
from verify.backends.lean import lean
from verify.backends.ordered_kernel import kernel_name


@dataclass
class TargetOutput:
    logits: Tensor  # (b, n, V) next-token logits at each new position
    hidden: Tensor  # (b, n, d) final hidden states (after the final norm) at each new position
    layers: Tensor | None = (
        None  # (b, n, S, d) residual states after the blocks `Target.use_layers` chose; None: none chosen
    )


def left_to_right(x: Tensor, lengths: Tensor) -> Tensor:
    """(b, W, ...) rows left-padded to width W -> the same rows starting at index 0 (padding moved to the end)."""
    w = x.shape[1]
    index = (torch.arange(w, device=x.device) + (w - lengths)[:, None]) % w
    return x.gather(1, index.view(*index.shape, *([1] * (x.ndim - 2))).expand_as(x))


def right_to_left(x: Tensor, lengths: Tensor) -> Tensor:
    """The inverse of `left_to_right`: rows starting at index 0 -> rows ending at index W - 1."""
    return left_to_right(x, x.shape[1] - lengths)


def pad_prompts(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Prompts -> tokens (b, W) starting at index 0, padded at the end, and lengths (b,)."""
    width = max(len(p) for p in prompts)
    # Padded on the host and copied once: a copy per row would be a transfer per prompt.
    tokens = torch.tensor([p + [pad_id] * (width - len(p)) for p in prompts], dtype=torch.long, device=device)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    return tokens, lengths


def check_prompts(prompts: list[list[int]], *, vocab_size: int, max_seq_len: int, max_new_tokens: int) -> None:
    """One-line errors for prompts a model cannot take, before any work starts."""
    if len(prompts) == 0:
        raise ValueError("prompts=[]: need at least one prompt")
    if max_new_tokens >= max_seq_len:  # no prompt fits: say so of max_new_tokens, not of a prompt's length
        raise ValueError(
            f"max_new_tokens={max_new_tokens}: must be less than the model's max_seq_len={max_seq_len} "
            "(a prompt needs at least one of its positions)"
        )
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        bad = [t for t in prompt if not 0 <= int(t) < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]}: ids must be in [0, {vocab_size})")
        if len(prompt) + max_new_tokens > max_seq_len:
            raise ValueError(
                f"prompt {i} has {len(prompt)} tokens: with max_new_tokens={max_new_tokens} it must be at most "
                f"max_seq_len - max_new_tokens = {max_seq_len - max_new_tokens}"
            )


REMEMBERED = 64  # distinct prompts a continuous batch keeps the prefill of (`Target.fill_row(remember=True)`)
ROOM = 256  # new tokens a prefill's cache has room for beyond the longest prompt before it grows


class Target:
    """A frozen causal LM (an x-transformers TransformerWrapper with rotary positions, or an HFBase around a
    transformers Llama) plus its KV cache.

    `vocab` (ids (N,)) makes every output's logits (b, n, N) over that subset: for a draft model.
    `max_draft` is the widest extend the cache makes room for beyond max_seq_len (a wider one grows it).
    `compile=True` runs every extend through a torch.compile'd step with static shapes: an extend of k
    tokens is padded to the smallest of `widths` that fits (else the next power of two), so a decode
    loop compiles one program per width it uses (plain decoding: 1; a chain: gamma + 1). `compile="graph"`
    pads the same way and replays each width's eager step as a CUDA graph (verify/backends/graphs.py).
    `use_layers` makes every output also carry the residual states after chosen blocks (`layers`).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        pad_id: int = 0,
        max_draft: int = 64,
        compile: bool | str = False,
        widths: tuple[int, ...] = (1,),
        vocab: Tensor | None = None,
        ordered: bool = True,
    ):
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.model = model
        self.engine = lean(model, compile=compile, vocab=vocab)  # vocab: logits over a subset (a draft LM)
        self.mode = compile  # False, True or "graph" (verify/backends/graphs.py MODES)
        self.compiled, self.widths = bool(compile), tuple(sorted(widths))  # compiled: steps of static shapes
        self.vocab_size: int = model.num_tokens
        self.max_seq_len: int = model.max_seq_len
        self.pad_id = pad_id
        self.max_draft = max_draft
        self.device = next(model.parameters()).device
        self.layers: tuple[int, ...] = ()  # blocks whose residual states every output carries (`use_layers`)
        # Decoding forwards sum attention in position order (a k-token verification gives each token the bits k
        # one-token steps give it); ordered=False takes the fused kernel, for a drafter that needs no exactness.
        self.ordered = bool(ordered) and self.engine.decoder.orders_attention  # what runs, as results record it
        # which form sums it: "cpp" (the C++ operator) or "torch" (its pure-torch fallback); "-" when not ordered
        self.ordered_attention = kernel_name(self.device, self.engine.decoder.dim_head) if self.ordered else "-"
        self.reset()

    def reset(self) -> None:
        self.cache: StaticCache | None = None
        # prompt -> its one-row prefill: every layer's keys then values (heads, n, dh), and its last logits (V,)
        self.remembered: dict[tuple[int, ...], tuple[list[Tensor], Tensor]] = {}

    def use_layers(self, layers: tuple[int, ...]) -> None:
        """From the next prefill on, outputs carry `layers` (b, n, S, d): the residual states after these
        blocks of the model (layer i as `verify.backends.engine.check_layers` defines it), in this order. () for
        none: then the forwards compute and return nothing extra. Refuses blocks the model does not have."""
        self.layers = check_layers(layers, self.engine.decoder.depth)

    @property
    def row_lengths(self) -> Tensor:
        """(b,) number of valid (cached) tokens per row."""
        return self.cache.lengths

    def check_tokens(self, prompts: list[list[int]], *, max_new_tokens: int) -> None:
        check_prompts(prompts, vocab_size=self.vocab_size, max_seq_len=self.max_seq_len, max_new_tokens=max_new_tokens)

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], *, last_logits: bool = False) -> TargetOutput:
        """Run the prompts; returns outputs for every prompt position, left-padded (row b ends at index W - 1).
        last_logits: logits (b, 1, V) of each row's last position only (what decoding continues from)."""
        tokens, lengths = pad_prompts(prompts, self.pad_id, self.device)
        self.cache = None  # dropped first, so that the new cache can take its buffers (a graph replays on them)
        # Room for the longest prompt and ROOM new tokens (a power of two: few distinct shapes for a compiled
        # step), not the model's whole context: a compiled step attends over every slot, and SmolLM2's 8,192
        # made its step 2x slower than eager. A longer generation grows the cache by doubling.
        # Draft room: max_draft slots, but no more than the model's context (a short-context model's cache of
        # many rows, as the statistical tests run 20,000 of, would be mostly draft room); a wider extend grows it.
        longest = max(len(p) for p in prompts)
        room = min(self.max_draft, self.max_seq_len)
        capacity = min(self.max_seq_len, 1 << (longest + ROOM - 1).bit_length()) + room + 1
        self.cache = self.engine.decoder.new_cache(len(prompts), capacity, device=self.device)
        logits_at = lengths - 1 if last_logits else None
        logits, hidden, *states = self.engine(
            tokens, self.cache, eager=True, layers=self.layers, attention="fused", logits_at=logits_at
        )
        self.cache.commit(torch.arange(tokens.shape[1], device=self.device) < lengths[:, None])  # drop the padding
        layers = right_to_left(states[0], lengths) if states else None  # left-padded like hidden
        logits = logits if last_logits else right_to_left(logits, lengths)
        return TargetOutput(logits=logits, hidden=right_to_left(hidden, lengths), layers=layers)

    @torch.inference_mode()
    def open_rows(self, batch: int, capacity: int) -> None:
        """An empty cache of `batch` rows and `capacity` slots each, for a continuous batch (`fill_row`)."""
        self.cache = None  # dropped first, so that the new cache can take its buffers
        self.cache = self.engine.decoder.new_cache(batch, capacity + self.max_draft + 1, device=self.device)
        self.remembered = {}

    @torch.inference_mode()
    def fill_row(self, row: int, prompt: list[int], *, remember: bool = False) -> Tensor:
        """Empty row `row` and prefill `prompt` into it alone (the bits a batch of one gives it); returns the
        logits (V,) at its last position. The caller sets every row's length afterwards (`cache.set_lengths`).
        remember: a prompt many requests share (the base asked for its own questions from one template prefix):
        its first prefill's keys, values and logits are kept, and every later fill copies them into the row
        instead of running the model again; the same bits, since the prefill of a prompt alone is deterministic."""
        if len(prompt) + 1 > self.cache.capacity:
            raise ValueError(f"a prompt of {len(prompt)} tokens does not fit rows of {self.cache.capacity} slots")
        key, n = tuple(prompt) if remember else None, len(prompt)  # the key only where it is looked up
        if key in self.remembered:
            saved, logits = self.remembered[key]
            for buf, entries in zip(self.cache.k + self.cache.v, saved):
                buf[row, :, :n].copy_(entries)
            return logits.clone()
        tokens = torch.tensor([prompt], dtype=torch.long, device=self.device)
        last = torch.tensor([n - 1], device=self.device)
        logits, *_ = self.engine(tokens, self.cache.row(row), eager=True, attention="fused", logits_at=last)
        if remember and len(self.remembered) < REMEMBERED:  # a few distinct prompts (one per steering line)
            saved = [buf[row, :, :n].clone() for buf in self.cache.k + self.cache.v]
            self.remembered[key] = (saved, logits[0, 0].clone())
        return logits[0, 0]

    @torch.inference_mode()
    def extend(self, tokens: Tensor, *, parents: Tensor | None = None) -> TargetOutput:
        """Run k new tokens (b, k) in one forward on top of the cache and append them to it.

        Without `parents` the tokens form a chain. With parents (k,) or (b, k) (-1 = attached to the
        cached prefix) they form a tree: a node sees the cached prefix, its ancestors and itself, at
        position prefix length + depth, so its logits equal those of its root-to-node path run alone.
        """
        kwargs = {}
        if parents is not None:
            if parents.ndim == 1:
                parents = repeat(parents, "k -> b k", b=tokens.shape[0])
            ancestors, depth = tree_attention(parents.to(self.device))
            kwargs = dict(allow=ancestors, pos=self.cache.lengths[:, None] + depth)
        elif self.compiled:
            # A chain as the tree it is, so that a compiled width is one program for chains and trees alike
            # (a `pos is None` guard would make two, and the second might first compile inside a timed run).
            b, k = tokens.shape
            steps = torch.arange(k, device=self.device)
            causal = (steps[:, None] >= steps[None, :]).repeat(b, 1, 1)  # contiguous, as a tree's: same guards
            kwargs = dict(allow=causal, pos=self.cache.lengths[:, None] + steps)
        k, width = tokens.shape[1], self._width(tokens.shape[1])
        if width > k:
            tokens, kwargs = self._pad(tokens, kwargs, width)
        attention = "ordered" if self.ordered else "fused"
        logits, hidden, *states = self.engine(tokens, self.cache, layers=self.layers, attention=attention, **kwargs)
        layers = states[0] if states else None
        if width > k:  # drop the padding entries again: a length rewind
            self.cache.commit(torch.arange(width, device=self.device).expand(tokens.shape[0], width) < k, prefix=True)
            logits, hidden = logits[:, :k], hidden[:, :k]
            layers = None if layers is None else layers[:, :k]
        return TargetOutput(logits=logits, hidden=hidden, layers=layers)

    def _width(self, k: int) -> int:
        if not self.compiled:
            return k
        return next((w for w in self.widths if w >= k), 1 << (k - 1).bit_length())

    def _pad(self, tokens: Tensor, kwargs: dict, width: int) -> tuple[Tensor, dict]:
        """Pad k tokens to `width` with entries that see only themselves and that nothing real sees."""
        b, k = tokens.shape
        tokens = F.pad(tokens, (0, width - k), value=self.pad_id)
        if kwargs:  # a tree: grow the ancestor matrix by an identity block, positions by anything valid
            allow = torch.eye(width, dtype=torch.bool, device=self.device).repeat(b, 1, 1)
            allow[:, :k, :k] = kwargs["allow"]
            pos = torch.cat((kwargs["pos"], kwargs["pos"][:, :1].expand(b, width - k)), dim=1)
            kwargs = dict(allow=allow, pos=pos)
        return tokens, kwargs

    def commit(self, keep: Tensor, *, prefix: bool = False) -> None:
        """Roll back: of the slots the last `extend` added, keep those where keep (b, k) is True. `prefix=True`:
        every row keeps a prefix (a chain), known without reading `keep` back (see StaticCache.commit)."""
        self.cache.commit(keep, prefix=prefix)
