"""Early exit as a drafter family: an exit head trained on one layer of the frozen base.

The drafter (verify/drafters/early_exit.py) runs the base's own first `layer` blocks and reads the next token
from the residual state after block `layer` through this head. The head is what is trained: the
base's final norm (its gain copied: an x-transformers base's LayerNorm, a Llama's RMSNorm with the config's eps),
`num_layers` residual blocks x + SiLU(Linear(x)) started at zero, then a trainable copy of the base's output
layer (a Llama's lm_head, even where it is tied to the embeddings). So a fresh head is the "logit lens" (the
base's own norm and output layer applied to an intermediate state), and training starts there.

Training reads layer `layer`'s states from the feature cache (the drafter trainer asks for that layer) and
distils the base's own next-token distribution at the same position (verify/training/distill.py).
The training side of a family (registered in experiments/lib/families/registry.py): build, loss, evaluate; the inference
side is verify.drafters.early_exit.make_drafter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from medusa.heads import ResBlock, copy_linear
from prophet.model import base_depth
from verify.backends.engine import check_layers
from verify.backends.lean import lean
from verify.backends.lean_llama import LlamaDecoder
from verify.common.vocab import subset_linear, trim_linear
from verify.drafters.early_exit import check_lean_base
from verify.training.distill import (
    CHAIN,
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

__all__ = ["build", "loss", "evaluate"]


NORMS = ("layer", "rms")  # x-transformers' bias-free LayerNorm; a Llama's RMSNorm


class ExitHead(nn.Module):
    """Layer `layer`'s residual states (..., d) -> next-token logits (..., V), or (..., N) over sorted ids `vocab`."""

    def __init__(
        self,
        *,
        layer: int,
        norm_gain: Tensor,
        projection: nn.Linear,
        num_layers: int = 1,
        norm: str = "layer",
        eps: float = 1e-5,
    ):
        """norm_gain (d,): the base's final norm gain; `norm`, one of NORMS, and `eps` its kind and epsilon."""
        super().__init__()
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
            raise ValueError(
                f"num_layers={num_layers!r}: must be an integer >= 0 (0: the norm and the output layer only)"
            )
        if norm not in NORMS:
            raise ValueError(f"norm={norm!r}: must be one of {', '.join(NORMS)}")
        self.layer, self.vocab_size = layer, projection.out_features
        dim, w = projection.in_features, projection.weight
        # both keep their gain as `norm.weight`: a checkpoint's keys are the same for either base
        if norm == "layer":
            self.norm = nn.LayerNorm(dim, eps=eps, bias=False, device=w.device, dtype=w.dtype)
        else:
            self.norm = nn.RMSNorm(dim, eps=eps, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            self.norm.weight.copy_(norm_gain)
        self.blocks = nn.Sequential(*[ResBlock(dim, device=w.device, dtype=w.dtype) for _ in range(num_layers)])
        self.projection = copy_linear(projection)

    def forward(self, state: Tensor, vocab: Tensor | None = None) -> Tensor:
        """Training: the subset's rows are gathered per call, so their gradients reach the full projection."""
        return subset_linear(self.blocks(self.norm(state)), self.projection, vocab)

    @torch.no_grad()
    def for_decoding(self, vocab: Tensor | None = None) -> Callable[[Tensor], Tensor]:
        """The head as a function for the drafter, its output layer trimmed to `vocab` once (not every step)."""
        weight, bias = trim_linear(self.projection, vocab)  # (N, d), (N,) or None
        return lambda state: F.linear(self.blocks(self.norm(state)), weight, bias)


def build(base: nn.Module, *, layer: int, num_layers: int = 1) -> ExitHead:
    """A fresh exit head on block `layer` of `base` (1 .. depth - 1: the last block's state is the base's
    own output): an x-transformers TransformerWrapper or an HFBase around a Llama."""
    check_lean_base(base)
    layer = check_layers([layer], base_depth(base), name="drafter.module.layer")[0]
    decoder = lean(base).decoder  # the gain as the engine applies it, whichever model the base is
    projection = base.to_logits  # x-transformers' output layer; HFBase's property gives the Llama's lm_head
    if isinstance(decoder, LlamaDecoder):  # RMSNorm, eps from the config (llama_shape)
        return ExitHead(
            layer=layer,
            norm_gain=decoder.final_gain,
            projection=projection,
            num_layers=num_layers,
            norm="rms",
            eps=decoder.eps,
        )
    final = decoder.final_gain  # x-transformers' LayerNorm gain (gamma + unit offset), or None
    gain = torch.ones(projection.in_features, device=projection.weight.device) if final is None else final
    return ExitHead(layer=layer, norm_gain=gain, projection=projection, num_layers=num_layers)


def _state(module: ExitHead, batch: FeatureBatch) -> Tensor:
    """Layer `layer`'s states (B, T, d) from the batch (the drafter trainer asks the cache for exactly that layer)."""
    batch.check()
    if batch.layers is None or batch.layers.shape[2] != 1:
        got = None if batch.layers is None else tuple(batch.layers.shape)
        raise ValueError(
            f"an exit head on layer {module.layer} needs the batch's states of that one layer (B, T, 1, d); got {got}"
        )
    return batch.layers[:, :, 0]


def loss(
    module: ExitHead, base: nn.Module, batch: FeatureBatch, *, vocab: Tensor | None = None, target: str = "kl"
) -> tuple[Tensor, dict[str, float]]:
    """Cross-entropy of the head's next-token distribution at every position to the base's (`kl`), its
    top-1 (`argmax`) or the corpus token (`true`), with a batch mask only where the next token is an answer
    token; metrics `loss` and `agree`."""
    check_target(target)
    logits = module(_state(module, batch), vocab)  # (B, T, N)
    index = subset_index(vocab, module.vocab_size, logits.device)
    total = distill_loss(
        logits.flatten(0, 1),
        top_ids=batch.top_ids.flatten(0, 1),
        top_logp=batch.top_logp.flatten(0, 1),
        true_ids=batch.tokens[:, 1:].flatten(),
        target=target,
        index=index,
        mask=None if batch.mask is None else batch.mask.flatten(),
    )
    agree = agreement(logits.detach(), batch.top_ids, vocab, batch.mask)
    values = torch.stack([total.detach(), agree]).tolist()  # one host sync
    return total, {"loss": values[0], "agree": values[1]}


@torch.no_grad()
def evaluate(
    module: ExitHead, base: nn.Module, batch: FeatureBatch, *, vocab: Tensor | None = None
) -> dict[str, float]:
    """`agree`: how often the head's top-1 is the base's own top-1 after the same prefix (what accepts a
    greedy draft token); `top1`: how often it is the corpus token; `mass`: the probability that speculative
    sampling at T = 1 accepts its sampled draft (verify.training.distill.accepted_mass); `chain_tau` / `chain_mass`:
    a chain of 3's tau at T = 0 and its expectation at T = 1. With a batch mask, rates over the answer positions."""
    logits = module(_state(module, batch), vocab)  # (B, T, N)
    top = student_top1(logits, vocab)  # (B, T) full-vocabulary ids
    hits = (top == batch.top_ids[..., 0], top == batch.tokens[:, 1:])  # (B, T) each
    mass = accepted_mass(logits, batch.top_ids, batch.top_logp, vocab)  # (B, T): T = 1 acceptance of each draft
    # the chain from position s drafts s, s + 1, ... in turn, each after the true (greedy: accepted) tokens
    runs = [answers_only(m, batch.mask) for m in (hits[0], mass)]  # a chain stops past the answer's end
    chains = [chain_tau([run[:, j:] for j in range(CHAIN)], batch.mask) for run in runs]
    values = torch.stack([masked_mean(m, batch.mask) for m in (*hits, mass)] + chains)
    return dict(zip(("agree", "top1", "mass", "chain_tau", "chain_mass"), values.tolist()))
