"""The prophet's side of the generic drafter training entry point (experiments/train_drafter.py).

Four functions, nothing else: `build` the module on a frozen base, its `loss` on a batch, `evaluate`
its multi-step agreement with the base, and turn it into a `drafter` for the one speculative loop.
The loop hands over the frozen base's outputs, computed under no_grad for inputs tokens[:, :-1]:
hidden (B, T, d) = f_0 .. f_{T-1} (final hidden, after the final norm) and logits (B, T, V).

Step 1 (EAGLE-1): the input (f_t, x_{t+1}) predicts f_{t+1}, with feature regression (SmoothL1) to the
base's f_{t+1} plus cross-entropy of the prophet's logits against the base's own distribution at
t + 1 (weights 1.0 and 0.1). Steps 2..unroll (EAGLE-3's training-time test): the prophet reads its own
predicted features, as it does when drafting; step j is weighted decay^(j - 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from prophet.drafter import ProphetDrafter
from prophet.model import Prophet


def build(base: nn.Module, **module_kwargs) -> Prophet:
    """module_kwargs: `module:` of conf/drafter/prophet.yaml (dim, depth, heads, attn_dim_head, ff_mult)."""
    return Prophet.from_base(base, **module_kwargs)


def loss(
    module: Prophet,
    base: nn.Module,
    *,
    tokens: Tensor,
    hidden: Tensor,
    logits: Tensor,
    feature_weight: float = 1.0,
    ce_weight: float = 0.1,
    unroll: int = 1,
    decay: float = 0.8,
) -> tuple[Tensor, dict[str, float]]:
    """tokens (B, T + 1), hidden (B, T, d), logits (B, T, V) -> (weighted loss, metrics per step)."""
    for name, value in dict(feature_weight=feature_weight, ce_weight=ce_weight, decay=decay).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name}={value!r}: must be a number >= 0")
    _check_batch(module, base, tokens, hidden, logits, steps=unroll, name="unroll")
    total, parts = hidden.new_zeros(()), {}
    for j, pred in enumerate(module.unroll(hidden, tokens[:, 1:], unroll), start=1):
        pred, target, teacher = _valid(pred, hidden, logits, j)
        log_q = module.logits(pred).float().log_softmax(dim=-1)
        feature = F.smooth_l1_loss(pred.float(), target.float())
        ce = -(teacher.float().softmax(dim=-1) * log_q).sum(dim=-1).mean()  # CE to the base's distribution
        total = total + decay ** (j - 1) * (feature_weight * feature + ce_weight * ce)
        top1 = (log_q.argmax(dim=-1) == teacher.argmax(dim=-1)).float().mean()
        parts.update({f"step{j}_feature": feature, f"step{j}_ce": ce, f"step{j}_top1": top1})
    parts["loss"] = total
    values = torch.stack([v.detach().float() for v in parts.values()]).tolist()  # one host sync
    return total, dict(zip(parts, values))


@torch.no_grad()
def evaluate(
    module: Prophet, base: nn.Module, *, tokens: Tensor, hidden: Tensor, logits: Tensor, eval_steps: int = 5
) -> dict[str, float]:
    """Agreement of the prophet's top-1 with the base's top-1 at steps 1..eval_steps (`step{j}_top1`).

    Step j reads the prophet's own predicted features for j - 1 steps after the true ones, exactly the
    attention a draft chain sees (teacher-forced tokens: a draft only matters after accepted ones).
    """
    _check_batch(module, base, tokens, hidden, logits, steps=eval_steps, name="eval_steps")
    out = {}
    for j, pred in enumerate(module.unroll(hidden, tokens[:, 1:], eval_steps), start=1):
        pred, _, teacher = _valid(pred, hidden, logits, j)
        out[f"step{j}_top1"] = (module.logits(pred).argmax(dim=-1) == teacher.argmax(dim=-1)).float().mean()
    return dict(zip(out, torch.stack(list(out.values())).tolist()))


def drafter(module: Prophet, base: nn.Module, *, vocab: Tensor | None = None, **decode_kwargs) -> ProphetDrafter:
    """decode_kwargs: `decode:` of conf/drafter/prophet.yaml (mode, top_k, depth, tree_nodes); `vocab` the
    sorted token ids (N,) the drafts may use (verify.vocab.frequent_tokens), None for the full vocabulary."""
    _check_same_base(module, base)
    return ProphetDrafter(module, vocab=vocab, **decode_kwargs)


def _valid(pred: Tensor, hidden: Tensor, logits: Tensor, j: int) -> tuple[Tensor, Tensor, Tensor]:
    """Step j's predictions at indices t in [j - 1, T - 2] (B, T - j, d), with their targets f_{t+1} and
    the base's logits at t + 1 (B, T - j, V). Earlier indices have no j - 1 predictions before them; the
    last one has no f_T in the batch."""
    return pred[:, j - 1 : -1], hidden[:, j:], logits[:, j:]


def _check_batch(module: Prophet, base: nn.Module, tokens: Tensor, hidden: Tensor, logits: Tensor, *, steps, name) -> None:
    _check_same_base(module, base)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{name}={steps!r}: must be an integer >= 1")
    b, t1 = tokens.shape
    if hidden.shape[:2] != (b, t1 - 1) or logits.shape[:2] != (b, t1 - 1):
        raise ValueError(f"tokens {tuple(tokens.shape)} need hidden and logits of (B, T) = ({b}, {t1 - 1}); "
                         f"got {tuple(hidden.shape)} and {tuple(logits.shape)}")
    if t1 - 1 < steps + 1:
        raise ValueError(f"{name}={steps} needs sequences of at least {steps + 1} positions; got T={t1 - 1}")


def _check_same_base(module: Prophet, base: nn.Module) -> None:
    if module.head.to_logits is not base.to_logits:
        raise ValueError("the prophet was built on another base: build it with prophet.train.build(base)")
