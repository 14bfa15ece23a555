"""The prophet's training side, as registered in experiments/lib/families/registry.py.

Three functions, nothing else: `build` the module on a frozen base, its `loss` on a batch, `evaluate`
its multi-step agreement with the base (the inference side, make_drafter, is in prophet/drafter.py).
The loop hands over a FeatureBatch (experiments/lib/training/features.py) for inputs tokens[:, :-1]: hidden (B, T, d) =
f_0 .. f_{T-1} (final hidden, after the final norm), the base's top-k next-token distribution
(top_ids, top_logp (B, T, k)) and, for a prophet with fuse_layers, the residual states of those blocks.

Step 1 (EAGLE-1): the input (f_t, x_{t+1}) predicts f_{t+1}, with feature regression (SmoothL1) to the
base's f_{t+1} plus cross-entropy of the prophet's logits against the base's own distribution at
t + 1 (weights 1.0 and 0.1; `target` as in verify/training/distill.py). Steps 2..unroll (EAGLE-3's
training-time test): the prophet reads its own predicted features, as it does when drafting; step j is
weighted decay^(j - 1).

Answer mask. With a batch mask (verify/training/features.py), step j's prediction of f_{t+1} counts only where
its logits' token, t + 2, is an answer token (mask[:, t + 1]): its feature, cross-entropy and agreement terms
are means over those positions alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from prophet.eagle import ARCHS
from prophet.model import Prophet, check_same_base
from verify.training.distill import (
    accepted_mass,
    agreement,
    answers_only,
    chain_tau,
    check_target,
    distill_loss,
    masked_mean,
    student_top1,
    subset_index,
)
from verify.training.features import FeatureBatch


def build(base: nn.Module, **module_kwargs) -> Prophet:
    """module_kwargs: `module:` of conf/drafter/prophet.yaml (dim, depth, heads, attn_dim_head, ff_mult,
    fuse_layers)."""
    return Prophet.from_base(base, **module_kwargs)


def loss(
    module: Prophet,
    base: nn.Module,
    batch: FeatureBatch,
    *,
    vocab: Tensor | None = None,
    feature_weight: float = 1.0,
    ce_weight: float = 0.1,
    unroll: int = 1,
    decay: float = 0.8,
    target: str = "kl",
    anchors: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """batch (B, T) -> (weighted loss, metrics per step). `vocab` (sorted ids (N,)): logits over the subset only.
    `anchors`: steps 2..unroll only on the chains starting at that many random indices (the same for every window
    of the batch; an EAGLE layer only), each step's terms means over them; None: over every index."""
    check_loss_settings(feature_weight=feature_weight, ce_weight=ce_weight, decay=decay, target=target)
    _check_batch(module, base, batch, steps=unroll, name="unroll")
    _, weight, bias = module.output_layer(vocab)  # the frozen output layer (its subset rows)
    index = subset_index(vocab, module.vocab_size, batch.hidden.device)
    total, parts = batch.hidden.new_zeros(()), {}
    for j, (pred, truth, top_ids, top_logp, true_ids, mask) in enumerate(
        _unrolled(module, batch, unroll, anchors), start=1
    ):
        feature, ce, agree = position_loss(
            module.readout(pred),  # EAGLE-3: its final norm, what both the output layer and f_{t+1} compare with
            truth,
            top_ids,
            top_logp,
            true_ids,
            (weight, bias),
            index=index,
            vocab=vocab,
            target=target,
            mask=mask,
        )
        total = total + decay ** (j - 1) * (feature_weight * feature + ce_weight * ce)
        parts.update({f"step{j}_feature": feature, f"step{j}_ce": ce, f"step{j}_agree": agree})
    parts["loss"] = total
    values = torch.stack([v.detach().float() for v in parts.values()]).tolist()  # one host sync
    return total, dict(zip(parts, values))


def _unrolled(module: Prophet, batch: FeatureBatch, unroll: int, anchors: int | None):
    """Per step j: (predictions, their target features, the base's top-k ids and log-probabilities, the corpus
    tokens, the answer mask or None), (B, n, ...) each: every valid index, or with `anchors` the sampled chains."""
    if anchors is not None:  # checked whatever unroll is: a setting that does nothing is still a wrong one
        if isinstance(anchors, bool) or not isinstance(anchors, int) or anchors < 1:
            raise ValueError(f"anchors={anchors!r}: must be an integer >= 1, or null for every index")
        if module.arch not in ARCHS:
            raise ValueError(f"anchors: the anchored training-time test needs arch=eagle or eagle3, not {module.arch}")
    if anchors is None or unroll == 1:
        preds = module.unroll(batch.hidden, batch.tokens[:, 1:], unroll, layers=batch.layers)
        for j, pred in enumerate(preds, start=1):
            pred, truth, top_ids, top_logp, mask = _valid(pred, batch, j)
            yield pred, truth, top_ids, top_logp, batch.tokens[:, j + 1 :], mask
        return
    t = batch.hidden.shape[1]
    room = t - unroll  # indices 0 .. t - 1 - unroll start a whole chain
    starts = torch.randperm(room, device=batch.hidden.device)[: min(anchors, room)].sort().values  # (A,)
    preds = module.unroll_anchored(batch.hidden, batch.tokens[:, 1:], unroll, starts, layers=batch.layers)
    pred, truth, top_ids, top_logp, mask = _valid(preds[0], batch, 1)
    yield pred, truth, top_ids, top_logp, batch.tokens[:, 2:], mask
    for j, pred in enumerate(preds[1:], start=2):
        at = starts + j - 1  # (A,) the predictions' indices: each predicts the base's feature at at + 1
        mask = None if batch.mask is None else batch.mask[:, at + 1]
        teacher = batch.hidden[:, at + 1], batch.top_ids[:, at + 1], batch.top_logp[:, at + 1]
        yield pred, *teacher, batch.tokens[:, at + 2], mask


def check_loss_settings(*, target: str, **weights: float) -> None:
    """The loss weights (numbers >= 0) and the distillation target, each with a one-line error."""
    for name, value in weights.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name}={value!r}: must be a number >= 0")
    check_target(target)


def position_loss(
    pred: Tensor,
    truth: Tensor,
    top_ids: Tensor,
    top_logp: Tensor,
    true_ids: Tensor,
    layer: tuple[Tensor, Tensor | None],
    *,
    index: Tensor | None,
    vocab: Tensor | None,
    target: str,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """One draft position's terms: predicted features (B, n, d) against the base's (B, n, d), and their logits
    through the (trimmed) frozen output layer `layer` = (weight, bias) against the base's top-k (B, n, k) and the
    corpus tokens (B, n) -> (SmoothL1 of the features, distillation loss, agreement with the base's top-1).
    `vocab` the sorted subset ids (None: all V) and `index` their map (verify.training.distill.subset_index);
    `mask` (B, n) bool: each term a mean over the predictions where it is True (None: all)."""
    logits = F.linear(pred, *layer)  # (B, n, N)
    ce = distill_loss(
        logits.flatten(0, 1),
        top_ids=top_ids.flatten(0, 1),
        top_logp=top_logp.flatten(0, 1),
        true_ids=true_ids.flatten(),
        target=target,
        index=index,
        mask=None if mask is None else mask.flatten(),
    )
    if mask is None:
        feature = F.smooth_l1_loss(pred.float(), truth)
    else:  # per prediction first, so a masked-out one adds neither to the sum nor to the count
        feature = masked_mean(F.smooth_l1_loss(pred.float(), truth, reduction="none").mean(dim=-1), mask)
    return feature, ce, agreement(logits, top_ids, vocab, mask)


@torch.no_grad()
def evaluate(
    module: Prophet, base: nn.Module, batch: FeatureBatch, *, vocab: Tensor | None = None, eval_steps: int = 5
) -> dict[str, float]:
    """Agreement of the prophet's top-1 with the base's top-1 at steps 1..eval_steps (`step{j}_agree`), the T = 1
    acceptance probability of its draft there (`step{j}_mass`, verify.training.distill.accepted_mass), and the
    chain's tau at T = 0 (`chain_tau`) and its expectation at T = 1 (`chain_mass`).

    Step j reads the prophet's own predicted features for j - 1 steps after the true ones, exactly the
    attention a draft chain sees (teacher-forced tokens: a draft only matters after accepted ones).
    `vocab` restricts the prophet's choice to the subset it drafts from. With a batch mask, over the predictions
    whose token is an answer token."""
    _check_batch(module, base, batch, steps=eval_steps, name="eval_steps")
    _, weight, bias = module.output_layer(vocab)
    out, matches, masses = {}, [], []
    for j, pred in enumerate(
        module.unroll(batch.hidden, batch.tokens[:, 1:], eval_steps, layers=batch.layers), start=1
    ):
        pred, _, top_ids, top_logp, mask = _valid(pred, batch, j)
        logits = F.linear(module.readout(pred), weight, bias)
        out[f"step{j}_agree"] = agreement(logits, top_ids, vocab, mask)
        mass = accepted_mass(logits, top_ids, top_logp, vocab)  # (B, T - j): T = 1 acceptance of step j
        out[f"step{j}_mass"] = masked_mean(mass, mask)
        masses.append(answers_only(mass, mask))  # index s: the chain started at s's step j
        matches.append(answers_only(student_top1(logits, vocab) == top_ids[..., 0], mask))
    out["chain_tau"] = chain_tau(matches, batch.mask_at(1))
    out["chain_mass"] = chain_tau(masses, batch.mask_at(1))
    return dict(zip(out, torch.stack(list(out.values())).tolist()))


def _valid(pred: Tensor, batch: FeatureBatch, j: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """Step j's predictions at indices t in [j - 1, T - 2] (B, T - j, d), with their targets f_{t+1}, the base's
    top-k at t + 1 (B, T - j, k) and whether token t + 2 is an answer token (B, T - j) (None without a mask).
    Earlier indices have no j - 1 predictions before them; the last one has no f_T in the batch."""
    return pred[:, j - 1 : -1], batch.hidden[:, j:], batch.top_ids[:, j:], batch.top_logp[:, j:], batch.mask_at(j)


def _check_batch(module: Prophet, base: nn.Module, batch: FeatureBatch, *, steps, name) -> None:
    check_same_base(module, base)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{name}={steps!r}: must be an integer >= 1")
    _, t = batch.check()
    if t < steps + 1:
        raise ValueError(f"{name}={steps} needs sequences of at least {steps + 1} positions; got T={t}")
