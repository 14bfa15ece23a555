"""An encoder-decoder target (and draft model) for the one speculative loop and plain decoding.

The prompts the loops pass are the SOURCE token lists. `prefill` encodes them once (x-transformers'
own encoder forward, right-padded with a source mask: it runs once per batch, so it need not be lean),
computes every cross-attention layer's keys and values from the encoder output, and starts each row's
decoder at `bos_id`: the BOS token goes into the decoder's cache and its logits are the prefill's
output (b, 1, V). From there the decoder is a causal LM over its own tokens, so the rest of the
contract is `verify.backends.target.Target`'s: the last emitted token is pending (not yet cached), `extend` runs
a chain or a tree on top of a static per-row cache, `commit` keeps the accepted slots per row.

Drafters: `Seq2SeqDraftDrafter` (below) is the independent draft model with a small encoder-decoder.
Prompt lookup (verify/drafters/prompt_lookup.py) needs no change: the loop hands it the sources as prompts, so
it matches the generated text against source + generated text, and copies what followed in the source.

Decoder start token: the caller chooses `bos_id`. The project's seq2seq models (experiments/
train_seq2seq.py) reuse the tokenizer's EOS id (0, "<|endoftext|>") as the decoder start, as T5 reuses
its pad id: no tokenizer change, and a target never emits its start token as anything but "end".
"""

from __future__ import annotations

import torch
from einops import repeat
from torch import Tensor, nn

from verify.backends.cache import StaticCache, tree_attention
from verify.backends.engine import UnsupportedModel, check_wrapper
from verify.backends.target import TargetOutput, pad_prompts
from verify.common.numerics import NonFiniteError
from verify.drafters.draft_model import DraftModelDrafter
from verify.encdec.cross_decoder import CrossContext, LeanCrossDecoder


def split_model(model: nn.Module | tuple[nn.Module, nn.Module]) -> tuple[nn.Module, nn.Module]:
    """An `XTransformer` or an (encoder, decoder) pair of TransformerWrappers -> (encoder, decoder)."""
    if isinstance(model, (tuple, list)) and len(model) == 2:
        return model[0], model[1]
    encoder, decoder = getattr(model, "encoder", None), getattr(model, "decoder", None)
    decoder = getattr(decoder, "net", decoder)  # XTransformer wraps its decoder in an AutoregressiveWrapper
    if encoder is None or decoder is None:
        raise UnsupportedModel(
            f"{type(model).__name__} is not an encoder-decoder: pass an XTransformer or (encoder, decoder)"
        )
    return encoder, decoder


class Seq2SeqTarget:
    """A frozen x-transformers encoder-decoder plus its decoder's KV cache (see the module docstring).

    `max_draft` is the widest extend the cache makes room for beyond max_seq_len (a wider one grows it).
    """

    def __init__(
        self, model: nn.Module | tuple[nn.Module, nn.Module], *, bos_id: int, pad_id: int = 0, max_draft: int = 64
    ):
        self.encoder, decoder = split_model(model)
        for module in (self.encoder, decoder):
            module.eval()
            for p in module.parameters():
                p.requires_grad_(False)
        check_wrapper(decoder)
        if self.encoder.num_tokens != decoder.num_tokens:
            raise UnsupportedModel(
                f"encoder vocabulary {self.encoder.num_tokens} != decoder vocabulary {decoder.num_tokens}: "
                "source and output must share one tokenizer (prompt lookup copies source tokens)"
            )
        self.decoder = LeanCrossDecoder(decoder.attn_layers, where="decoder.attn_layers")
        self.embedding = decoder.token_emb.emb.weight.detach()  # (V, d)
        head = decoder.to_logits
        self.head_weight, self.head_bias = head.weight.detach(), None if head.bias is None else head.bias.detach()
        self.vocab_size: int = decoder.num_tokens
        self.max_seq_len: int = decoder.max_seq_len  # decoder positions: the start token + generated tokens
        self.max_source_len: int = self.encoder.max_seq_len
        if not 0 <= bos_id < self.vocab_size:
            raise ValueError(f"bos_id={bos_id!r}: must be a token id in [0, {self.vocab_size})")
        self.bos_id, self.pad_id, self.max_draft = bos_id, pad_id, max_draft
        self.device = self.embedding.device
        self.layers: tuple[int, ...] = ()
        self.reset()
        check_against_reference(self.encoder, decoder, self)

    def reset(self) -> None:
        self.cache: StaticCache | None = None
        self.context: CrossContext | None = None

    def use_layers(self, layers: tuple[int, ...]) -> None:
        """Only () is served: no drafter that reads a decoder's inner layers exists for encoder-decoders."""
        if tuple(layers) != ():
            raise ValueError(
                f"layers={list(layers)!r}: an encoder-decoder target gives no layer states (only () is allowed)"
            )

    @property
    def row_lengths(self) -> Tensor:
        """(b,) decoder tokens in the cache per row (the start token included)."""
        return self.cache.lengths

    def check_tokens(self, prompts: list[list[int]], *, max_new_tokens: int) -> None:
        """One-line errors for sources the model cannot take, before any work starts."""
        if len(prompts) == 0:
            raise ValueError("prompts=[]: need at least one source")
        for i, source in enumerate(prompts):
            if len(source) == 0:
                raise ValueError(f"source {i} is empty: every source needs at least one token")
            bad = [t for t in source if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise ValueError(f"source {i} has token id {bad[0]}: ids must be in [0, {self.vocab_size})")
            if len(source) > self.max_source_len:
                raise ValueError(
                    f"source {i} has {len(source)} tokens: the encoder takes at most {self.max_source_len}"
                )
        if 1 + max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"max_new_tokens={max_new_tokens}: the decoder takes at most max_seq_len - 1 = "
                f"{self.max_seq_len - 1} new tokens after its start token"
            )

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], *, last_logits: bool = False) -> TargetOutput:
        """Encode the sources, run the start token; returns its outputs (b, 1, .): [:, -1] predicts token 1.
        One position either way (last_logits, as the decoder-only targets take it, changes nothing)."""
        source, lengths = pad_prompts(prompts, self.pad_id, self.device)  # (b, S) right-padded
        source_mask = torch.arange(source.shape[1], device=self.device) < lengths[:, None]  # (b, S)
        encoded = self.encoder(source, mask=source_mask, return_embeddings=True)  # (b, S, d)
        self.context = self.decoder.context(encoded, source_mask)
        self.cache = self.decoder.new_cache(len(prompts), self.max_seq_len + self.max_draft + 1, device=self.device)
        return self._run(torch.full((len(prompts), 1), self.bos_id, dtype=torch.long, device=self.device))

    @torch.inference_mode()
    def extend(self, tokens: Tensor, *, parents: Tensor | None = None) -> TargetOutput:
        """Run k new tokens (b, k) in one forward on top of the cache and append them to it. With parents
        (k,) or (b, k) (-1 = attached to the cached prefix) they form a tree: a node sees the cached
        prefix, its ancestors and itself at position prefix length + depth (and the whole source)."""
        if parents is None:
            return self._run(tokens)
        if parents.ndim == 1:
            parents = repeat(parents, "k -> b k", b=tokens.shape[0])
        ancestors, depth = tree_attention(parents.to(self.device))
        return self._run(tokens, pos=self.cache.lengths[:, None] + depth, allow=ancestors)

    def _run(self, tokens: Tensor, **tree) -> TargetOutput:
        x = self.embedding[tokens]  # (b, k, d)
        hidden = self.decoder(x, self.cache, self.context, **tree)
        logits = torch.nn.functional.linear(hidden, self.head_weight, self.head_bias)  # (b, k, V)
        return TargetOutput(logits=logits, hidden=hidden)

    def commit(self, keep: Tensor, *, prefix: bool = False) -> None:
        """Roll back: of the slots the last `extend` added, keep those where keep (b, k) is True (`prefix`: see
        StaticCache.commit)."""
        self.cache.commit(keep, prefix=prefix)


class Seq2SeqDraftDrafter(DraftModelDrafter):
    """A small encoder-decoder drafting for an encoder-decoder target: `DraftModelDrafter` with a
    `Seq2SeqTarget` as its LM. Its `begin` prefills that LM with the sources (encode once, start token
    cached), so the cache discipline (`roll_uncached`) and the drafting (argmax, or a sample with q at
    temperature > 0) are the draft model's own, unchanged."""

    def __init__(self, model: nn.Module | tuple[nn.Module, nn.Module], *, bos_id: int, pad_id: int = 0):
        self.vocab = None  # drafts over the whole vocabulary
        # The draft LM runs at most the 2 uncached tokens at once, never a wide extend: a cache of
        # max_seq_len + 3 slots (not + 65) matters when thousands of rows decode together.
        self.lm = Seq2SeqTarget(model, bos_id=bos_id, pad_id=pad_id, max_draft=2)
        self.vocab_size = self.lm.vocab_size

    def begin(self, prompts: list[list[int]], prefill: TargetOutput, pending: Tensor) -> None:
        # The draft's encoder may take fewer source tokens than the target's: say so in one line.
        self.lm.check_tokens(prompts, max_new_tokens=0)
        super().begin(prompts, prefill, pending)


@torch.inference_mode()
def check_against_reference(
    encoder: nn.Module, decoder: nn.Module, target: Seq2SeqTarget, *, tolerance: float = 1e-3
) -> None:
    """Run 2 ragged sources and 5 decoder positions through both: a difference means an option the
    structural checks missed."""
    was_training = (encoder.training, decoder.training)
    encoder.eval(), decoder.eval()
    gen = torch.Generator(device=target.device).manual_seed(0)  # any inputs do: both forwards read the same ones
    source = torch.randint(0, target.vocab_size, (2, 4), generator=gen, device=target.device)
    source_mask = torch.tensor([[True] * 4, [True, True, True, False]], device=target.device)
    tokens = torch.randint(0, target.vocab_size, (2, 5), generator=gen, device=target.device)
    try:
        encoded = encoder(source, mask=source_mask, return_embeddings=True)
        ref = decoder(tokens, context=encoded, context_mask=source_mask)
        cache = target.decoder.new_cache(2, 8, device=target.device)
        hidden = target.decoder(target.embedding[tokens], cache, target.decoder.context(encoded, source_mask))
        ours = torch.nn.functional.linear(hidden, target.head_weight, target.head_bias)
    finally:
        encoder.train(was_training[0]), decoder.train(was_training[1])
    if not bool(torch.isfinite(ref).all()):  # else the difference below is NaN and blames the lean decoder
        raise NonFiniteError(
            "the encoder-decoder's own forward gives NaN/inf on 2 random sources: its weights hold NaN/inf"
        )
    err = float((ref.float() - ours.float()).abs().max())
    if not err <= tolerance * max(1.0, float(ref.float().abs().max())):
        raise UnsupportedModel(
            f"the lean encoder-decoder differs from the x-transformers forward by {err:.2e}: the model uses an "
            "option it does not implement"
        )
