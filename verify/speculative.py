"""The one speculative decoding loop. Every drafter plugs in here; they differ only in how they propose.

A step: the drafter proposes k tokens per row; the target runs [pending, draft...] in one forward;
an acceptance rule keeps a prefix and adds one token; the target's cache is rolled back to the kept
tokens; the drafter is told the verdict and rolls back its own state. Rows of a batch accept
different numbers of tokens in the same step; each row stops at EOS or after max_new_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from verify.acceptance import check_rule, greedy_accept, speculative_accept, typical_accept
from verify.drafter import Draft, Drafter, Verdict
from verify.plain import Generation, check_max_new_tokens, rows_to_lists
from verify.sampling import SamplingConfig, probs_from_logits, sample_token
from verify.stats import DecodeStats
from verify.target import Target


@dataclass(frozen=True)
class SpecConfig:
    gamma: int = 4  # draft tokens per step (the starting value when adaptive)
    rule: str = "auto"  # auto | greedy | speculative | typical (see verify/acceptance.py)
    delta: float = 0.0  # leniency of speculative sampling; > 0 is NOT lossless
    typical_epsilon: float = 0.09
    typical_alpha: float = 0.3
    adaptive_gamma: bool = False  # grow gamma after a fully accepted step, shrink after a rejection
    max_gamma: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.gamma, int) or self.gamma < 1:
            raise ValueError(f"gamma={self.gamma!r}: must be an integer >= 1")
        if not isinstance(self.max_gamma, int) or self.max_gamma < self.gamma:
            raise ValueError(f"max_gamma={self.max_gamma!r}: must be an integer >= gamma ({self.gamma})")


def check_drafter(target: Target, drafter: Drafter) -> None:
    if not isinstance(drafter, Drafter):
        raise ValueError(f"drafter {type(drafter).__name__} lacks begin/propose/commit/vocab_size")
    if drafter.vocab_size != target.vocab_size:
        raise ValueError(
            f"drafter vocabulary size {drafter.vocab_size} differs from the target's {target.vocab_size}: "
            "a drafter must use the target's tokenizer"
        )


def _accept(p: Tensor, draft: Draft, rule: str, spec: SpecConfig, generator) -> tuple[Tensor, Tensor]:
    if rule == "greedy":
        return greedy_accept(p, draft.tokens)
    if rule == "typical":
        return typical_accept(p, draft.tokens, epsilon=spec.typical_epsilon, alpha=spec.typical_alpha, generator=generator)
    return speculative_accept(p, draft.q, draft.tokens, delta=spec.delta, generator=generator)


def _next_gamma(gamma: int, accepted: Tensor, k: int, active: Tensor, spec: SpecConfig) -> int:
    if not spec.adaptive_gamma or k < gamma:
        return gamma
    if bool((accepted[active] == k).all()):
        return min(gamma + 1, spec.max_gamma)
    return max(gamma - 1, 1)


@torch.inference_mode()
def speculative_generate(
    target: Target,
    drafter: Drafter,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    spec: SpecConfig = SpecConfig(),
    sampling: SamplingConfig = SamplingConfig(),
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> Generation:
    """Generate with drafts verified by the target; returns the same record as plain decoding."""
    check_max_new_tokens(max_new_tokens)
    rule = check_rule(spec.rule, delta=spec.delta, temperature=sampling.temperature)
    check_drafter(target, drafter)
    target.check_tokens(prompts, max_new_tokens=max_new_tokens)
    b, device = len(prompts), target.device
    stats = DecodeStats.zeros(b, device)
    out = torch.zeros(b, max_new_tokens + spec.max_gamma + 1, dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    rows = torch.arange(b, device=device)
    gamma = spec.gamma
    with stats.timed("total"):
        with stats.timed("target"):
            prefill = target.prefill(prompts)
        pending = sample_token(prefill.logits[:, -1], sampling, generator)  # (b,)
        out[:, 0] = pending
        stats.tokens += 1
        stats.forwards += 1
        if eos_id is not None:
            done |= pending == eos_id
        with stats.timed("draft"):
            drafter.begin(prompts, prefill, pending)
        while True:
            active = ~done & (stats.tokens < max_new_tokens)
            if not bool(active.any()):
                break
            # Never draft past a row's budget: a step emits at most k + 1 tokens, and the positions it
            # processes stay below prompt + max_new_tokens <= max_seq_len.
            left = int((max_new_tokens - stats.tokens)[active].min())
            k = min(gamma, left - 1)
            with stats.timed("draft"):
                draft = drafter.propose(k, sampling, generator) if k > 0 else Draft.empty(b, device)
            if draft.parents is not None:
                raise NotImplementedError("tree drafts need tree verification (verify/tree.py)")
            k = draft.length
            with stats.timed("target"):
                verified = target.extend(torch.cat((pending[:, None], draft.tokens), dim=1))
            p = probs_from_logits(verified.logits, sampling)  # (b, k + 1, V)
            accepted, nxt = _accept(p, draft, rule, spec, generator)
            accepted = torch.where(active, accepted, torch.zeros_like(accepted))
            step = torch.cat((draft.tokens, torch.zeros_like(nxt)[:, None]), dim=1)
            step[rows, accepted] = nxt  # (b, k + 1): accepted drafts, then the target's token
            _emit(out, stats, step, accepted + 1, active, done, eos_id)
            stats.forwards += active
            stats.proposed += active * k
            stats.accepted += accepted
            positions = torch.arange(k, device=device)
            stats.record_positions(
                (active[:, None] & (positions < k)).sum(0), (active[:, None] & (positions < accepted[:, None])).sum(0)
            )
            positions_kept = torch.arange(k + 1, device=device) < torch.where(active, accepted + 1, 0)[:, None]
            target.commit(positions_kept)
            pending = torch.where(active, nxt, pending)
            with stats.timed("draft"):
                drafter.commit(Verdict(accepted, step, pending, verified, _chain_path(b, k, device)))
            gamma = _next_gamma(gamma, accepted, k, active, spec)
    return Generation(tokens=rows_to_lists(out, stats.tokens), stats=stats)


def _chain_path(b: int, k: int, device: torch.device) -> Tensor:
    return torch.arange(k + 1, device=device).expand(b, -1)


def _emit(out: Tensor, stats: DecodeStats, step: Tensor, count: Tensor, active: Tensor, done: Tensor, eos_id) -> None:
    """Append each active row's first `count` step tokens to `out`, cut after an EOS (marking it done)."""
    count = torch.where(active, count, torch.zeros_like(count))
    if eos_id is not None:
        is_eos = (step == eos_id) & (torch.arange(step.shape[1], device=step.device) < count[:, None])
        first = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, count)
        done |= is_eos.any(1)
        count = torch.minimum(count, first)
    index = stats.tokens[:, None] + torch.arange(step.shape[1], device=step.device)
    keep = torch.arange(step.shape[1], device=step.device) < count[:, None]
    out.scatter_(1, index, torch.where(keep, step, out.gather(1, index)))
    stats.tokens += count
