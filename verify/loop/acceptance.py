"""Acceptance rules for a chain of draft tokens: pure, vectorised over rows and positions, no host sync.

Every rule takes the target's distributions p at the k + 1 verified positions (the sampling transform
already applied) and the draft, and returns (accepted (b,), next_token (b,)): the number of draft
tokens kept, and the token the target adds after them (a correction at the first rejection, or the
bonus token after a fully accepted draft). p = target, q = draft, always in that order.

Lossless: `greedy_accept` (temperature 0) and `speculative_accept` with delta = 0.
NOT lossless: `speculative_accept` with delta > 0 and `typical_accept`; their outputs do not follow
the target's distribution and every result that uses them says so.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from verify.common.numerics import is_finite_number
from verify.loop.sampling import greedy_tokens, sample_from_probs

RULES = ("auto", "greedy", "speculative", "typical")


def check_delta(delta: float) -> None:
    if not is_finite_number(delta) or not 0 <= delta <= 1:
        raise ValueError(f"delta={delta!r}: must be a number in [0, 1] (0 = lossless speculative sampling)")


def check_typical(epsilon: float, alpha: float) -> None:
    """Typical acceptance's options: accept x if p(x) > min(epsilon, alpha * exp(-H(p)))."""
    if not is_finite_number(epsilon) or not 0 < epsilon <= 1:
        raise ValueError(f"typical_epsilon={epsilon!r}: must be a number in (0, 1] (a probability threshold)")
    if not is_finite_number(alpha) or not alpha > 0:
        raise ValueError(f"typical_alpha={alpha!r}: must be a finite number > 0")


def check_rule(rule: str, *, delta: float, temperature: float) -> str:
    """Validate the rule and its options; resolve "auto" (greedy at temperature 0, else speculative)."""
    if rule not in RULES:
        raise ValueError(f"rule={rule!r}: must be one of {', '.join(RULES)}")
    check_delta(delta)
    if rule == "greedy" and temperature != 0:
        raise ValueError(f"rule='greedy' with temperature={temperature}: greedy acceptance needs temperature 0")
    if rule == "auto":
        return "greedy" if temperature == 0 else "speculative"
    return rule


def is_lossless(rule: str, *, delta: float) -> bool:
    return rule == "greedy" or (rule == "speculative" and delta == 0)


def _accepted_prefix(ok: Tensor) -> Tensor:
    """(b, k) per-position acceptance -> (b,) length of the accepted prefix."""
    return ok.long().cumprod(dim=1).sum(dim=1)


def greedy_accept(p: Tensor, draft: Tensor) -> tuple[Tensor, Tensor]:
    """p (b, k+1, V) (or the logits: same argmax), draft (b, k): keep the longest prefix equal to the
    target's argmax, then add its argmax."""
    choice = greedy_tokens(p)  # (b, k+1)
    accepted = _accepted_prefix(draft == choice[:, :-1])
    return accepted, choice.gather(1, accepted[:, None]).squeeze(1)


def speculative_accept(
    p: Tensor, q: Tensor | None, draft: Tensor, *, delta: float = 0.0, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Speculative sampling (Leviathan et al., Chen et al.), with MLX-style leniency `delta`.

    Accept draft token x with probability min(1, p(x)/q(x) + delta); at the first rejection sample
    from norm(max(0, p - q)); after a fully accepted draft sample the bonus token from p.
    q = None means the draft was deterministic: q is one-hot on each draft token.
    delta = 0 is lossless; delta > 0 is NOT lossless (it accepts tokens the target would not emit).
    """
    b, k1, vocab = p.shape
    k = k1 - 1
    if q is None:
        q = F.one_hot(draft, vocab).to(p.dtype)
    p_x = p[:, :k].gather(-1, draft[..., None]).squeeze(-1)  # (b, k)
    q_x = q.gather(-1, draft[..., None]).squeeze(-1)
    u = torch.rand(b, k, generator=generator, device=p.device)
    ok = u < (p_x / q_x.clamp(min=1e-20) + delta).clamp(max=1.0)
    accepted = _accepted_prefix(ok)
    # After a full acceptance q is zero at position k, so the "residual" is p itself: the bonus token.
    q_padded = torch.cat((q, torch.zeros(b, 1, vocab, dtype=q.dtype, device=q.device)), dim=1)
    at = accepted[:, None, None].expand(-1, 1, vocab)
    p_at, q_at = p.gather(1, at).squeeze(1), q_padded.gather(1, at).squeeze(1)
    residual = (p_at - q_at).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    # Rounding can leave no residual mass where p == q; then p itself is the right distribution.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_at)
    return accepted, sample_from_probs(residual, generator)


def typical_accept(
    p: Tensor, draft: Tensor, *, epsilon: float = 0.09, alpha: float = 0.3, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """Medusa's typical acceptance: accept x if p(x) > min(epsilon, alpha * exp(-H(p))). NOT lossless.

    The token after the accepted prefix is sampled from p there (argmax when p is one-hot).
    """
    k = draft.shape[1]
    entropy = -(p * p.clamp(min=1e-30).log()).sum(dim=-1)  # (b, k+1)
    threshold = torch.minimum(torch.full_like(entropy, epsilon), alpha * torch.exp(-entropy))
    p_x = p[:, :k].gather(-1, draft[..., None]).squeeze(-1)
    accepted = _accepted_prefix(p_x > threshold[:, :k])
    p_at = p.gather(1, accepted[:, None, None].expand(-1, 1, p.shape[-1])).squeeze(1)
    return accepted, sample_from_probs(p_at, generator)
