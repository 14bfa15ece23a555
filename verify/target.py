"""The target model and its KV cache: the one owner of the cache and the one rollback function.

Layout of the cache for a batch of rows: `length` slots per row, right-aligned. Row b's valid tokens
occupy slots [start[b], length); slots before start[b] are left padding, masked out by x-transformers'
`seq_start_pos`. Keys are cached before rotary is applied and rotary only sees position differences,
so moving a row's valid slots (right-aligning after a rollback) leaves every attention score unchanged.

Convention shared with the decode loops: the last emitted token of a row is *pending*, not yet in the
cache; the next `extend` starts with it. Nothing outside this file knows x-transformers is underneath.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange, repeat
from torch import Tensor, nn


@dataclass
class TargetOutput:
    logits: Tensor  # (b, n, V) next-token logits at each new position
    hidden: Tensor  # (b, n, d) final hidden states (after the final norm) at each new position


def tree_attention(parents: Tensor) -> tuple[Tensor, Tensor]:
    """parents (b, n) (-1 for a root) -> ancestor-or-self mask (b, n, n) and depth (b, n).

    Nodes are in topological order (parents before children). Each round moves every node's walk
    pointer one ancestor up, so the loop runs over tree depth, never over tokens or rows.
    """
    b, n = parents.shape
    mask = repeat(torch.eye(n, dtype=torch.bool, device=parents.device), "i j -> b i j", b=b).clone()
    depth = torch.zeros_like(parents)
    cur = repeat(torch.arange(n, device=parents.device), "n -> b n", b=b)
    for _ in range(n):
        par = parents.gather(1, cur.clamp(min=0))
        alive = (cur >= 0) & (par >= 0)
        if not alive.any():
            break
        depth = depth + alive.long()
        cur = torch.where(alive, par, torch.full_like(par, -1))
        mask |= torch.nn.functional.one_hot(cur.clamp(min=0), n).bool() & rearrange(alive, "b n -> b n 1")
    return mask, depth


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
        self.cache = None  # x-transformers LayerIntermediates
        self.start: Tensor | None = None  # (b,) first valid slot per row
        self._start_arg: Tensor | None = None  # `start`, or None when no row is padded
        self.length = 0  # slots per row, padding included

    @property
    def row_lengths(self) -> Tensor:
        """(b,) number of valid (cached) tokens per row."""
        return self.length - self.start

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
        self.reset()
        self._set_start(width - lens)
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
        b, k = tokens.shape
        if parents.ndim == 1:
            parents = repeat(parents, "k -> b k", b=b)
        ancestors, depth = tree_attention(parents.to(self.device))
        bias = torch.zeros(b, 1, k, self.length + k, device=self.device)
        bias[..., self.length:] = bias[..., self.length:].masked_fill(~rearrange(ancestors, "b i j -> b 1 i j"), float("-inf"))
        past = repeat(torch.arange(self.length, device=self.device), "l -> b l", b=b)
        pos = torch.cat((past, self.length + depth), dim=1)
        return self._forward(tokens, attn_bias=bias, pos=pos)

    def _forward(self, tokens: Tensor, **kwargs) -> TargetOutput:
        n = tokens.shape[1]
        (logits, hidden), inter = self.model(
            tokens,
            cache=self.cache,
            cache_age=n,  # the default (1) would silently keep only the last new token
            input_not_include_cache=True,  # embed only the new tokens, not the whole prefix again
            seq_start_pos=self._start_arg,
            return_intermediates=True,
            return_logits_and_embeddings=True,
            **kwargs,
        )
        inter.hiddens = None  # per-layer activations are not needed by later steps; free them
        self.cache = inter
        self.length += n
        return TargetOutput(logits=logits, hidden=hidden)

    @torch.no_grad()
    def commit(self, keep: Tensor) -> None:
        """Roll back: of the last k slots (the last `extend`), keep those where keep (b, k) is True.

        Kept slots stay in order (for a tree: the accepted root-to-node path). This is the only
        function that edits the cache. When every row keeps the same prefix it crops; otherwise it
        gathers each row's kept slots and right-aligns them (one host sync for the new width).
        """
        b, k = keep.shape
        keep = keep.to(self.device)
        counts = keep.sum(dim=1)
        prefix_kept = keep.cumsum(dim=1) == torch.arange(1, k + 1, device=self.device)
        same_prefix = bool((prefix_kept == keep).all() & (counts == counts[0]).all())
        if same_prefix:
            self._crop(self.length - k + int(counts[0]))
            return
        slots = torch.arange(self.length, device=self.device)
        valid = torch.cat((slots[: self.length - k] >= rearrange(self.start, "b -> b 1"), keep), dim=1)
        n_valid = valid.sum(dim=1)
        width = int(n_valid.max())
        # Stable sort puts dropped slots first and kept slots last, each in original order.
        order = torch.sort(valid.to(torch.uint8), dim=1, stable=True).indices[:, self.length - width:]
        index = repeat(order, "b n -> b h n d", h=1, d=1)
        for layer in self.cache.attn_intermediates:
            if layer.cached_kv is None:
                continue
            layer.cached_kv = tuple(
                t.gather(2, index.expand(-1, t.shape[1], -1, t.shape[3])) for t in layer.cached_kv
            )
        self._set_start(width - n_valid)
        self._set_length(width)

    def _set_start(self, start: Tensor) -> None:
        self.start = start
        # Without padding, skip x-transformers' left-padding mask: it costs a mask per layer per step.
        self._start_arg = start if bool(start.any()) else None

    def _crop(self, length: int) -> None:
        for layer in self.cache.attn_intermediates:
            if layer.cached_kv is not None:
                layer.cached_kv = tuple(t[..., :length, :] for t in layer.cached_kv)
        self._set_length(length)

    def _set_length(self, length: int) -> None:
        self.length = length
        self.cache.cache_length = length
