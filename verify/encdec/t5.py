"""Hugging Face T5 (`transformers.T5ForConditionalGeneration`) as an encoder-decoder target and draft
model, with the interface `verify.encdec.seq2seq.Seq2SeqTarget` gives the loops.

The decoder's cache is transformers' `EncoderDecoderCache` (self-attention: a `DynamicCache`; the
cross-attention keys and values are computed at the first decoder forward and reused), and rollback is
cropping: `cache.crop(-n)` drops the newest n self-attention entries.

Batch 1 only, chains only. T5 has no positions in its keys: its relative position bias is computed from
cache slot indices, so row b's token must sit in the slot its position names. HF's cache keeps one
length for the whole batch, so rows that accept different numbers of tokens would leave holes (and,
with left padding, every step would have to realign every row's cache). A tree would need the bias
from tree depths, which the model's forward does not take. One source at a time is what T5's own
assisted generation supports too; larger batches and parents are refused in one line.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from verify.backends.target import TargetOutput
from verify.common.numerics import is_int
from verify.drafters.draft_model import DraftModelDrafter


def check_t5(model: nn.Module, who: str) -> None:
    """A one-line error for a module that is not a transformers encoder-decoder (a causal LM, an x-transformers
    model), before anything reads its config."""
    config = getattr(model, "config", None)
    if not (getattr(config, "is_encoder_decoder", False) is True and callable(getattr(model, "get_encoder", None))):
        raise ValueError(
            f"{who} takes a transformers T5ForConditionalGeneration (an encoder-decoder), got {type(model).__name__}"
        )


def decoder_start_id(model: nn.Module) -> int:
    """The decoder start token as transformers' generate picks it: generation_config.decoder_start_token_id,
    then config.decoder_start_token_id, then the BOS id (generation_config's, then config's)."""
    config, generation = model.config, getattr(model, "generation_config", None)
    candidates = [
        getattr(generation, "decoder_start_token_id", None),
        getattr(config, "decoder_start_token_id", None),
        getattr(generation, "bos_token_id", None),
        getattr(config, "bos_token_id", None),
    ]
    start = next((c for c in candidates if c is not None), None)
    if start is None:
        raise ValueError(
            "decoder_start_token_id=None and bos_token_id=None: a T5 decoder needs a start token (set "
            "decoder_start_token_id, or bos_token_id, in the model's generation_config or config)"
        )
    if not (is_int(start) and 0 <= start < config.vocab_size):
        raise ValueError(f"decoder_start_token_id={start!r}: must be a token id in [0, {config.vocab_size})")
    return start


class T5Target:
    """A frozen T5ForConditionalGeneration plus its decoder cache; prompts are sources, the decoder
    starts at the token transformers' generate starts it at (`decoder_start_id`; T5: the pad id)."""

    def __init__(self, model: nn.Module, *, max_seq_len: int = 512):
        check_t5(model, "T5Target")
        self.bos_id: int = decoder_start_id(model)
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.model, config = model, model.config
        self.vocab_size: int = config.vocab_size
        self.pad_id: int = config.pad_token_id
        # Relative positions have no hard limit: this bounds source and decoder lengths for the budgets.
        self.max_seq_len = self.max_source_len = max_seq_len
        self.device = next(model.parameters()).device
        self.reset()

    def reset(self) -> None:
        self.cache = None
        self.encoded = None
        self.length = 0  # decoder tokens in the cache

    def use_layers(self, layers: tuple[int, ...]) -> None:
        if tuple(layers) != ():
            raise ValueError(f"layers={list(layers)!r}: a T5 target gives no layer states (only () is allowed)")

    @property
    def row_lengths(self) -> Tensor:
        return torch.tensor([self.length], device=self.device)

    def check_tokens(self, prompts: list[list[int]], *, max_new_tokens: int) -> None:
        """One-line errors for sources T5 cannot take here, before any work starts."""
        if len(prompts) != 1:
            raise ValueError(f"batch of {len(prompts)} sources: the T5 target decodes one source at a time (batch 1)")
        source = prompts[0]
        if len(source) == 0:
            raise ValueError("source 0 is empty: every source needs at least one token")
        bad = [t for t in source if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(f"source 0 has token id {bad[0]}: ids must be in [0, {self.vocab_size})")
        if len(source) > self.max_source_len:
            raise ValueError(f"source 0 has {len(source)} tokens: at most max_seq_len={self.max_source_len}")
        if 1 + max_new_tokens > self.max_seq_len:
            raise ValueError(f"max_new_tokens={max_new_tokens}: at most max_seq_len - 1 = {self.max_seq_len - 1}")

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], *, last_logits: bool = False) -> TargetOutput:
        """Encode the source once, run the decoder start token; returns its outputs (1, 1, .).
        One position either way (last_logits, as the decoder-only targets take it, changes nothing)."""
        from transformers import DynamicCache, EncoderDecoderCache

        if len(prompts) != 1:
            raise ValueError(f"batch of {len(prompts)} sources: the T5 target decodes one source at a time (batch 1)")
        source = torch.tensor(prompts, dtype=torch.long, device=self.device)  # (1, S)
        self.encoded = self.model.get_encoder()(input_ids=source, return_dict=True)
        self.cache, self.length = EncoderDecoderCache(DynamicCache(), DynamicCache()), 0
        return self._run(torch.full((1, 1), self.bos_id, dtype=torch.long, device=self.device))

    @torch.inference_mode()
    def extend(self, tokens: Tensor, *, parents: Tensor | None = None) -> TargetOutput:
        """Run a chain of k new tokens (1, k) on top of the cache and append them to it."""
        if parents is not None:
            raise ValueError(
                "parents given: the T5 target verifies chains only (its position bias comes from cache slots)"
            )
        return self._run(tokens)

    def _run(self, tokens: Tensor) -> TargetOutput:
        out = self.model(
            encoder_outputs=self.encoded,
            decoder_input_ids=tokens,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=True,
            return_dict=True,
        )
        self.cache, self.length = out.past_key_values, self.length + tokens.shape[1]
        return TargetOutput(logits=out.logits.float(), hidden=out.decoder_hidden_states[-1])

    def commit(self, keep: Tensor, *, prefix: bool = False) -> None:
        """Roll back: keep (1, k) must be a prefix of the last extend's k tokens (a chain); crop the rest.
        `prefix` (the Target interface's hint) changes nothing: the crop needs the count on the host anyway."""
        k, kept = keep.shape[1], int(keep.sum())
        if not bool(keep[0, :kept].all()):
            raise ValueError("keep is not a prefix: the T5 target rolls back chains only")
        if kept < k:
            self.cache.crop(-(k - kept))  # transformers 5: a negative value removes that many newest entries
            self.length -= k - kept


class T5DraftDrafter(DraftModelDrafter):
    """A smaller T5 drafting for a T5 target: `DraftModelDrafter` with a `T5Target` as its LM (the same
    cache discipline, `roll_uncached`, and q returned at temperature > 0)."""

    def __init__(self, model: nn.Module):
        check_t5(model, "T5DraftDrafter")
        self.vocab = None
        self.lm = T5Target(model)
        self.vocab_size = self.lm.vocab_size
