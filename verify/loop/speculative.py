"""The one speculative decoding loop. Every drafter plugs in here; they differ only in how they propose.

A step: the drafter proposes k tokens per row; the target runs [pending, draft...] in one forward;
an acceptance rule keeps a prefix and adds one token; the target's cache is rolled back to the kept
tokens (a tree's at the next step's host read, see below); the drafter is told the verdict and rolls back
its own state. Rows of a batch accept different numbers of tokens in the same step; each row stops at EOS
or after max_new_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from verify.backends.cache import keeps_prefix
from verify.backends.target import Target
from verify.common.numerics import DRAFT_Q, TARGET_LOGITS, EosId, check_usable, eos_ids, usable
from verify.loop.acceptance import (
    check_delta,
    check_rule,
    check_typical,
    greedy_accept,
    speculative_accept,
    typical_accept,
)
from verify.loop.drafter import Draft, Drafter, Verdict
from verify.loop.plain import Generation, check_max_new_tokens, rows_to_lists
from verify.loop.sampling import SamplingConfig, probs_from_logits, sample_token
from verify.loop.stats import DecodeStats
from verify.loop.tree import tree_greedy_accept, tree_sampling_accept, tree_typical_accept, verify_parents


@dataclass(frozen=True)
class SpecConfig:
    gamma: int = 4  # draft tokens per step (the starting value when adaptive)
    rule: str = "auto"  # auto | greedy | speculative | typical (see verify/loop/acceptance.py)
    delta: float = 0.0  # leniency of speculative sampling, chains and trees alike; > 0 is NOT lossless
    typical_epsilon: float = 0.09  # typical acceptance (chains and trees): p(x) > min(epsilon, alpha * exp(-H(p)))
    typical_alpha: float = 0.3
    adaptive_gamma: bool = False  # grow gamma after a fully accepted step, shrink after a rejection
    max_gamma: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.gamma, int) or self.gamma < 1:
            raise ValueError(f"gamma={self.gamma!r}: must be an integer >= 1")
        if not isinstance(self.max_gamma, int) or self.max_gamma < self.gamma:
            raise ValueError(f"max_gamma={self.max_gamma!r}: must be an integer >= gamma ({self.gamma})")
        check_delta(self.delta)
        check_typical(self.typical_epsilon, self.typical_alpha)


def check_drafter(target: Target, drafter: Drafter) -> None:
    if not isinstance(drafter, Drafter):
        raise ValueError(f"drafter {type(drafter).__name__} lacks begin/propose/commit/vocab_size")
    if drafter.vocab_size != target.vocab_size:
        raise ValueError(
            f"drafter vocabulary size {drafter.vocab_size} differs from the target's {target.vocab_size}: "
            "a drafter must use the target's tokenizer"
        )


def _verify_chain(target: Target, pending: Tensor, draft: Draft, rule: str, spec: SpecConfig, sampling, generator):
    """One target forward over [pending, d_1 .. d_k]; returns (forward, accepted (b,), path (b, k+1), next (b,))."""
    verified = target.extend(torch.cat((pending[:, None], draft.tokens), dim=1))
    if rule == "greedy":  # argmax of the logits = argmax of the one-hot greedy p: skip building p
        accepted, nxt = greedy_accept(verified.logits, draft.tokens)
    elif rule == "typical":
        p = probs_from_logits(verified.logits, sampling)  # (b, k + 1, V)
        accepted, nxt = typical_accept(
            p, draft.tokens, epsilon=spec.typical_epsilon, alpha=spec.typical_alpha, generator=generator
        )
    else:
        p = probs_from_logits(verified.logits, sampling)
        accepted, nxt = speculative_accept(p, draft.q, draft.tokens, delta=spec.delta, generator=generator)
    path = torch.minimum(torch.arange(draft.length + 1, device=pending.device), accepted[:, None])
    return verified, accepted, path, nxt


def _verify_tree(target: Target, pending: Tensor, draft: Draft, rule: str, spec: SpecConfig, sampling, generator):
    """One target forward over [pending, tree nodes] with tree attention; returns as `_verify_chain`."""
    b = pending.shape[0]
    parents = verify_parents(draft.parents.expand(b, -1).to(pending.device))  # (b, k + 1)
    tokens = torch.cat((pending[:, None], draft.tokens), dim=1)
    verified = target.extend(tokens, parents=parents)
    if rule == "greedy":  # the walk below with one-hot p, vectorised
        return (verified, *tree_greedy_accept(verified.logits, tokens, parents))
    p = probs_from_logits(verified.logits, sampling)
    if rule == "typical":
        accepted, path, nxt = tree_typical_accept(
            p, tokens, parents, epsilon=spec.typical_epsilon, alpha=spec.typical_alpha, generator=generator
        )
    else:  # speculative sampling (lossless at delta 0): the walk of tree_sampling_accept
        q = None if draft.q is None else torch.cat((torch.zeros_like(draft.q[:, :1]), draft.q), dim=1)
        accepted, path, nxt = tree_sampling_accept(p, tokens, parents, q, generator, delta=spec.delta)
    return verified, accepted, path, nxt


def _q_parents(draft: Draft, b: int, device: torch.device) -> Tensor:
    """(b, k) the verify index of each draft node's parent: the node whose p the rule compared its q with."""
    if draft.parents is None:  # a chain: draft token j follows verify position j
        return torch.arange(draft.length, device=device).expand(b, -1)
    return draft.parents.to(device).expand(b, -1) + 1


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
    eos_id: EosId = None,
    generator: torch.Generator | None = None,
) -> Generation:
    """Generate with drafts verified by the target; returns the same record as plain decoding (a row stops
    at EOS, any of the ids when eos_id is a list, even inside an accepted draft).

    Raises NonFiniteError (verify/common/numerics.py) when the target's logits a row used, or the drafter's q an
    acceptance rule divided by, held NaN or inf; it names the decode step (0 = the prefill) and the row."""
    check_max_new_tokens(max_new_tokens)
    rule = check_rule(spec.rule, delta=spec.delta, temperature=sampling.temperature)
    check_drafter(target, drafter)
    eos = eos_ids(eos_id, target.vocab_size, target.device)
    target.check_tokens(prompts, max_new_tokens=max_new_tokens)
    # The target's residual states after these blocks, in every TargetOutput the drafter sees; most
    # drafters read none, and then the target computes none.
    target.use_layers(getattr(drafter, "target_layers", ()))
    attach = getattr(drafter, "attach", None)  # a drafter that runs the target's own first blocks (early exit)
    if attach is not None:
        attach(target)
    b, device = len(prompts), target.device
    stats = DecodeStats.zeros(b, device)
    out = torch.zeros(b, max_new_tokens + spec.max_gamma + 1, dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    rows = torch.arange(b, device=device)
    gamma = spec.gamma
    with stats.timed("total"):
        with stats.timed("target"):
            prefill = target.prefill(prompts, last_logits=True)  # drafters read its hidden states
        pending = sample_token(prefill.logits[:, -1], sampling, generator)  # (b,)
        # What the last step used, as (what, values (b, n, V), used (b, n)); `fine` says all of it was
        # finite, and is read with the host read that opens every iteration (no extra sync).
        decode_step, checks = (
            0,
            [(TARGET_LOGITS, prefill.logits[:, -1:], torch.ones(b, 1, dtype=torch.bool, device=device))],
        )
        fine = usable(*checks[0][1:])
        out[:, 0] = pending
        stats.tokens += 1
        stats.forwards += 1
        if eos is not None:
            done |= torch.isin(pending, eos)
        with stats.timed("draft"):
            drafter.begin(prompts, prefill, pending)
        # A tree's rollback waits for the next step's host read, which also reads whether every row kept a
        # prefix of the tree's nodes (`keeps_prefix`): a length rewind then, not a gather and scatter over every
        # layer's buffers, and no read of its own. It runs right after that read, before the next draft (an
        # early-exit drafter drafts on the target's cache) and before the next target forward.
        tree_kept, tree_prefix = None, torch.ones((), dtype=torch.bool, device=device)
        while True:
            active = ~done & (stats.tokens < max_new_tokens)
            # The step's one host read: whether any row goes on, whether the last step's values were finite,
            # the fewest tokens an active row has left, and whether the last step's tree kept prefixes. Never draft
            # past a row's budget: a step emits at most k + 1 tokens, and the positions it processes stay below
            # prompt + max_new_tokens <= max_seq_len.
            left = torch.where(active, max_new_tokens - stats.tokens, max_new_tokens).min()
            go, all_fine, left, prefix = torch.stack(
                (active.any().long(), fine.long(), left, tree_prefix.long())
            ).tolist()
            if tree_kept is not None:  # the last step's tree, also when the loop ends: the cache as a step leaves it
                target.commit(tree_kept, prefix=bool(prefix))
                tree_kept = None
            if not all_fine:
                for what, values, used in checks:
                    check_usable(what, decode_step, values, used)
            if not go:
                break
            k = min(gamma, left - 1)
            with stats.timed("draft"):
                draft = drafter.propose(k, sampling, generator) if k > 0 else Draft.empty(b, device)
            verify = _verify_chain if draft.parents is None else _verify_tree
            with stats.timed("target"):
                verified, accepted, path, nxt = verify(target, pending, draft, rule, spec, sampling, generator)
            depth = path.shape[1] - 1  # draft tokens a row could accept: k for a chain, the depth for a tree
            if depth > k:  # the budget keeps every row within max_new_tokens and max_seq_len
                raise RuntimeError(f"{type(drafter).__name__} drafted {depth} tokens deep; the budget was {k}")
            accepted = torch.where(active, accepted, torch.zeros_like(accepted))
            # step (b, D + 1): the accepted draft tokens along the path, then the target's own token
            step = torch.cat(
                (draft.tokens.gather(1, (path[:, 1:] - 1).clamp(min=0)), torch.zeros_like(nxt)[:, None]), dim=1
            )
            step[rows, accepted] = nxt
            _emit(out, stats, step, accepted + 1, active, done, eos)
            _record(stats, active, accepted, depth)
            kept = torch.zeros(b, draft.length + 1, dtype=torch.bool, device=device)
            kept.scatter_(1, path, True)  # a path is padded by repeating its last accepted node
            kept &= active[:, None]
            if draft.parents is None:
                target.commit(kept, prefix=True)  # a chain keeps a prefix: a length rewind, known without a read
            else:  # nothing reads the target's cache before the next step's host read, which commits this
                tree_kept, tree_prefix = kept, keeps_prefix(kept)
            # The rule chose every row's tokens from p at the kept nodes (a chain: positions 0..accepted),
            # and divided by q at the children of kept nodes; nothing else it computed was used.
            decode_step, checks = decode_step + 1, [(TARGET_LOGITS, verified.logits, kept)]
            fine = usable(verified.logits, kept)
            if rule == "speculative" and draft.q is not None:
                used_q = kept.gather(1, _q_parents(draft, b, device))  # (b, k)
                checks.append((DRAFT_Q, draft.q, used_q))
                fine = fine & usable(draft.q, used_q)
            pending = torch.where(active, nxt, pending)
            with stats.timed("draft"):
                drafter.commit(Verdict(accepted, step, pending, verified, active, path))
            gamma = _next_gamma(gamma, accepted, depth, active, spec)
    stats.copied = getattr(drafter, "copied_rows", 0)  # a hybrid's choices (verify/loop/drafter.py)
    stats.chosen = stats.copied + getattr(drafter, "learned_rows", 0)
    return Generation(tokens=rows_to_lists(out, stats.tokens), stats=stats)


def _record(stats: DecodeStats, active: Tensor, accepted: Tensor, depth: int) -> None:
    """Count proposals and acceptances per row and per position (for a tree: per depth)."""
    stats.forwards += active
    stats.proposed += active * depth
    stats.accepted += accepted
    positions = torch.arange(depth, device=active.device)
    stats.record_positions(active.sum().expand(depth), (active[:, None] & (positions < accepted[:, None])).sum(0))


def _emit(
    out: Tensor, stats: DecodeStats, step: Tensor, count: Tensor, active: Tensor, done: Tensor, eos: Tensor | None
) -> None:
    """Append each active row's first `count` step tokens to `out`, cut after its first EOS (any of the ids
    `eos` (n,)), marking the row done."""
    count = torch.where(active, count, torch.zeros_like(count))
    if eos is not None:
        is_eos = torch.isin(step, eos) & (torch.arange(step.shape[1], device=step.device) < count[:, None])
        first = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, count)
        done |= is_eos.any(1)
        count = torch.minimum(count, first)
    index = stats.tokens[:, None] + torch.arange(step.shape[1], device=step.device)
    keep = torch.arange(step.shape[1], device=step.device) < count[:, None]
    out.scatter_(1, index, torch.where(keep, step, out.gather(1, index)))
    stats.tokens += count
