"""Prompt lookup (n-gram) drafting: propose the continuation of the latest earlier occurrence of the
context's last n tokens. Training-free, strong on code, deterministic (q is one-hot).

The search is vectorised over rows and window positions: one comparison of every length-n window
with the row's suffix, per n, from `max_ngram` down to `min_ngram`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from verify.backends.target import TargetOutput
from verify.loop.drafter import Draft, Verdict
from verify.loop.sampling import SamplingConfig


class PromptLookupDrafter:
    def __init__(self, *, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"min_ngram={min_ngram}, max_ngram={max_ngram}: need 1 <= min_ngram <= max_ngram")
        self.vocab_size = vocab_size
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def begin(self, prompts: list[list[int]], prefill: TargetOutput, pending: Tensor) -> None:
        device = pending.device
        width = max(len(p) for p in prompts) + 64
        # (b, T) right-padded with 0, padded on the host and copied once (not a transfer per prompt)
        self.ctx = torch.tensor([p + [0] * (width - len(p)) for p in prompts], dtype=torch.long, device=device)
        self.lengths = torch.tensor([len(p) for p in prompts], device=device)
        self._append(pending[:, None], torch.ones_like(self.lengths))

    def propose(self, gamma: int, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        start, _ = self.match()
        return Draft(tokens=self.continuation(start, gamma))

    def continuation(self, start: Tensor, gamma: int) -> Tensor:
        """(b, gamma) context tokens from each row's `start` (b,) on."""
        index = start[:, None] + torch.arange(gamma, device=start.device)
        # Past the context's end there is nothing to copy: repeat the last token (likely rejected, still valid).
        index = torch.minimum(index, (self.lengths - 1)[:, None])
        return self.ctx.gather(1, index)

    def commit(self, verdict: Verdict) -> None:
        self._append(verdict.tokens, verdict.accepted + 1)

    def match(self) -> tuple[Tensor, Tensor]:
        """(b,) start of the continuation after the latest earlier match of the longest n-gram suffix (n from
        max_ngram down to min_ngram), and (b,) whether a row found one (else its start is its last token)."""
        b, width = self.ctx.shape
        found = torch.zeros(b, dtype=torch.bool, device=self.ctx.device)
        start = self.lengths - 1  # no match: point at the last token
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if width < n + 1:
                continue
            windows = self.ctx.unfold(1, n, 1)  # (b, W, n), window i covers [i, i + n)
            suffix_index = (self.lengths - n).clamp(min=0)[:, None] + torch.arange(n, device=self.ctx.device)
            suffix = self.ctx.gather(1, suffix_index)  # (b, n)
            i = torch.arange(windows.shape[1], device=self.ctx.device)
            # An earlier occurrence, not the suffix itself, with at least one token after it.
            valid = (i[None] + n < self.lengths[:, None]) & (self.lengths[:, None] > n)
            match = (windows == suffix[:, None, :]).all(-1) & valid
            latest = torch.where(match, i[None], -1).amax(dim=1)
            hit = (latest >= 0) & ~found
            start = torch.where(hit, latest + n, start)
            found |= hit
        return start, found

    def _append(self, tokens: Tensor, counts: Tensor) -> None:
        """Append each row's first counts[b] tokens of tokens (b, k) to its context."""
        k = tokens.shape[1]
        needed = int((self.lengths + counts).max())
        if needed > self.ctx.shape[1]:
            grown = torch.zeros(self.ctx.shape[0], 2 * needed, dtype=torch.long, device=self.ctx.device)
            grown[:, : self.ctx.shape[1]] = self.ctx
            self.ctx = grown
        index = (self.lengths[:, None] + torch.arange(k, device=tokens.device)).clamp(max=self.ctx.shape[1] - 1)
        keep = torch.arange(k, device=tokens.device) < counts[:, None]
        self.ctx.scatter_(1, index, torch.where(keep, tokens, self.ctx.gather(1, index)))
        self.lengths = self.lengths + counts
