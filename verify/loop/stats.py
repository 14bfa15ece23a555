"""Decoding statistics with the project's fixed names.

tau   = tokens emitted / target forward passes (bonus token included; the prefill counts as the
        forward that produced the first token, so plain decoding has tau = 1 exactly)
alpha = accepted draft tokens / proposed draft tokens
Counters are per row (and per position) tensors on the decode's device, updated without host syncs;
timings are wall-clock seconds spent in the drafter, in the target and in total (the rest is the loop's
own bookkeeping). One DecodeStats describes one decode call (one batch); DecodeStats.merge pools several
(a benchmark's batches) and as_dict gives the pooled figures, each defined once here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor


def _sync(device: torch.device) -> None:
    # CUDA kernels run asynchronously: without a sync the time lands in whichever phase syncs next.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class DecodeStats:
    tokens: Tensor  # (b,) tokens emitted per row
    forwards: Tensor  # (b,) target forward passes while the row was active
    proposed: Tensor  # (b,) draft tokens proposed to the row
    accepted: Tensor  # (b,) draft tokens accepted
    proposed_by_position: Tensor  # (gamma,) draft tokens proposed at each position, summed over rows
    accepted_by_position: Tensor  # (gamma,) accepted at each position
    time_draft: float = 0.0
    time_target: float = 0.0
    time_total: float = 0.0
    device: torch.device = torch.device("cpu")
    # a drafter that chooses per row and cycle between copying and drafting (verify/drafters/hybrid.py): how many
    # row-cycles it copied, of how many it chose for (0 of 0 for every other drafter)
    copied: int = 0
    chosen: int = 0

    @classmethod
    def zeros(cls, batch: int, device: torch.device) -> DecodeStats:
        z = lambda n: torch.zeros(n, dtype=torch.long, device=device)  # noqa: E731
        return cls(
            tokens=z(batch),
            forwards=z(batch),
            proposed=z(batch),
            accepted=z(batch),
            proposed_by_position=z(0),
            accepted_by_position=z(0),
            device=device,
        )

    @classmethod
    def merge(cls, parts: Sequence[DecodeStats]) -> DecodeStats:
        """Several decode calls as one: their rows side by side (b = the parts' rows together), the
        by-position counts (padded to the longest) and the timings summed. A call's own figure, such as
        verify_steps, is not the merged one's: sum it over the parts."""
        if not parts:
            raise ValueError("merge needs at least one DecodeStats")
        k = max(p.proposed_by_position.shape[0] for p in parts)
        device = parts[0].tokens.device  # every part's counters live there (torch.cat below needs it)
        return cls(
            tokens=torch.cat([p.tokens for p in parts]),
            forwards=torch.cat([p.forwards for p in parts]),
            proposed=torch.cat([p.proposed for p in parts]),
            accepted=torch.cat([p.accepted for p in parts]),
            proposed_by_position=sum(
                (_pad(p.proposed_by_position, k) for p in parts), torch.zeros(k, dtype=torch.long, device=device)
            ),
            accepted_by_position=sum(
                (_pad(p.accepted_by_position, k) for p in parts), torch.zeros(k, dtype=torch.long, device=device)
            ),
            time_draft=sum(p.time_draft for p in parts),
            time_target=sum(p.time_target for p in parts),
            time_total=sum(p.time_total for p in parts),
            device=parts[0].device,
            copied=sum(p.copied for p in parts),
            chosen=sum(p.chosen for p in parts),
        )

    @contextmanager
    def timed(self, phase: str):
        """Add the wall time of the block to `time_<phase>` (draft, target or total)."""
        _sync(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            _sync(self.device)
            setattr(self, f"time_{phase}", getattr(self, f"time_{phase}") + time.perf_counter() - t0)

    def record_positions(self, proposed: Tensor, accepted: Tensor) -> None:
        """Add per-position counts: proposed, accepted (k,) summed over rows (k may grow)."""
        k = max(proposed.shape[0], self.proposed_by_position.shape[0])
        self.proposed_by_position = _pad(self.proposed_by_position, k) + _pad(proposed, k)
        self.accepted_by_position = _pad(self.accepted_by_position, k) + _pad(accepted, k)

    @property
    def total_tokens(self) -> int:
        return int(self.tokens.sum())

    @property
    def tokens_per_s(self) -> float:
        """Tokens emitted over the call's wall time (the loop's own bookkeeping included)."""
        return self.total_tokens / self.time_total

    @property
    def verify_steps(self) -> int:
        """Target forwards of one call after the prefill, each verifying every active row's draft at once:
        the longest-running row's forwards minus the prefill. Per call: a merged DecodeStats' rows ran in
        separate calls, so sum this over the calls instead."""
        return int(self.forwards.max()) - 1

    @property
    def tau(self) -> float:
        return float(self.tokens.sum()) / max(float(self.forwards.sum()), 1.0)

    @property
    def alpha(self) -> float:
        return float(self.accepted.sum()) / max(float(self.proposed.sum()), 1.0)

    @property
    def row_tau(self) -> list[float]:
        return (self.tokens.float() / self.forwards.clamp(min=1).float()).tolist()

    @property
    def acceptance_by_position(self) -> list[float]:
        return (self.accepted_by_position.float() / self.proposed_by_position.clamp(min=1).float()).tolist()

    @property
    def time_other(self) -> float:
        return max(self.time_total - self.time_draft - self.time_target, 0.0)

    def as_dict(self) -> dict:
        """The figures that pool over rows and calls (of one call, or of a merge of several)."""
        return {
            "tokens": self.total_tokens,
            "tokens_per_s": self.tokens_per_s,
            "tau": self.tau,
            "alpha": self.alpha,
            "row_tau": self.row_tau,
            "acceptance_by_position": self.acceptance_by_position,
            "time_draft": self.time_draft,
            "time_target": self.time_target,
            "time_other": self.time_other,
            "time_total": self.time_total,
            "copied_share": self.copied / self.chosen if self.chosen else None,  # a hybrid's share of copied cycles
        }


def _pad(t: Tensor, k: int) -> Tensor:
    return torch.cat((t.long(), torch.zeros(k - t.shape[0], dtype=torch.long, device=t.device)))
