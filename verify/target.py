"""The target model and its KV cache (verify/cache.py): prefill a batch, extend it by a chain or a tree
of new tokens in one forward, roll it back per row.

Convention shared with the decode loops: the last emitted token of a row is *pending*, not yet in the
cache; the next `extend` starts with it. Nothing outside this file knows x-transformers is underneath.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import repeat
from torch import Tensor, nn

from verify.cache import KVCache


@dataclass
class TargetOutput:
    logits: Tensor  # (b, n, V) next-token logits at each new position
    hidden: Tensor  # (b, n, d) final hidden states (after the final norm) at each new position


class Target:
    """A frozen causal LM (x-transformers TransformerWrapper with rotary positions) plus its KV cache."""

    def __init__(self, model: nn.Module, *, pad_id: int = 0):
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.model = model
        self.vocab_size: int = model.num_tokens
        self.max_seq_len: int = model.max_seq_len
        self.pad_id = pad_id
        self.device = next(model.parameters()).device
        self.reset()

    def reset(self) -> None:
        self.cache = KVCache()

    @property
    def row_lengths(self) -> Tensor:
        """(b,) number of valid (cached) tokens per row."""
        return self.cache.row_lengths

    def check_tokens(self, prompts: list[list[int]], *, max_new_tokens: int) -> None:
        """One-line errors for prompts the model cannot take, before any work starts."""
        if len(prompts) == 0:
            raise ValueError("prompts=[]: need at least one prompt")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
            bad = [t for t in prompt if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token id {bad[0]}: ids must be in [0, {self.vocab_size})")
            if len(prompt) + max_new_tokens > self.max_seq_len:
                raise ValueError(
                    f"prompt {i} has {len(prompt)} tokens: with max_new_tokens={max_new_tokens} it must be at most "
                    f"max_seq_len - max_new_tokens = {self.max_seq_len - max_new_tokens}"
                )

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> TargetOutput:
        """Left-pad and run the prompts; returns outputs for every prompt position (padding included)."""
        lens = torch.tensor([len(p) for p in prompts], device=self.device)
        width = int(lens.max())
        tokens = torch.full((len(prompts), width), self.pad_id, dtype=torch.long, device=self.device)
        for i, prompt in enumerate(prompts):
            tokens[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        self.cache.reset(width - lens)
        return self._forward(tokens)

    @torch.inference_mode()
    def extend(self, tokens: Tensor, *, parents: Tensor | None = None) -> TargetOutput:
        """Run k new tokens (b, k) in one forward on top of the cache and append them to it.

        Without `parents` the tokens form a chain. With parents (k,) or (b, k) (-1 = attached to the
        cached prefix) they form a tree: a node sees the cached prefix, its ancestors and itself, at
        position prefix length + depth, so its logits equal those of its root-to-node path run alone.
        """
        if parents is None:
            return self._forward(tokens)
        if parents.ndim == 1:
            parents = repeat(parents, "k -> b k", b=tokens.shape[0])
        return self._forward(tokens, **self.cache.tree_kwargs(parents.to(self.device)))

    def _forward(self, tokens: Tensor, **kwargs) -> TargetOutput:
        n = tokens.shape[1]
        (logits, hidden), inter = self.model(
            tokens,
            input_not_include_cache=True,  # embed only the new tokens, not the whole prefix again
            return_intermediates=True,
            return_logits_and_embeddings=True,
            **self.cache.forward_kwargs(n),
            **kwargs,
        )
        self.cache.append(inter, n)
        return TargetOutput(logits=logits, hidden=hidden)

    def commit(self, keep: Tensor) -> None:
        """Roll back: of the slots the last `extend` added, keep those where keep (b, k) is True."""
        self.cache.commit(keep)
