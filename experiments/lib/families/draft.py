"""The independent draft model as a drafter family: a small LM distilled from the frozen base.

Classic speculative decoding (Leviathan et al., Chen et al.) drafts with a smaller LM of the same
tokenizer. Trained on the corpus it learns the data; what acceptance rewards is agreeing with the base,
so here it is trained on the base's own next-token distribution (verify/training/distill.py), read from the
feature cache like every other drafter. It shares no weights with the base (only the vocabulary) and
reads only the tokens and the teacher's top-k of a FeatureBatch, never the hidden states.

The training side of a family (registered in experiments/lib/families/registry.py): build, loss, evaluate; the inference
side is verify.drafters.draft_model.make_drafter.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from x_transformers import TransformerWrapper

from experiments.lib.store.lm import build_lm
from verify.backends.hf import HFBase
from verify.common.vocab import subset_linear
from verify.training.distill import (
    CHAIN,
    agreement,
    chain_tau,
    check_target,
    distill_loss,
    masked_mean,
    student_top1,
    subset_index,
)
from verify.training.features import FeatureBatch

__all__ = ["build", "loss", "evaluate"]


def build(
    base: nn.Module,
    *,
    dim: int = 128,
    depth: int = 2,
    heads: int = 4,
    ff_mult: int = 4,
    attn_dim_head: int | None = None,
    arch: str = "x-transformers",
    kv_heads: int | None = None,
) -> nn.Module:
    """A fresh LM with the base's vocabulary and context (its own embedding and output layer). arch="llama": a
    transformers LlamaForCausalLM (RMSNorm, SwiGLU, grouped-query attention over `kv_heads`), the form vLLM's
    draft_model serves (python -m experiments.export)."""
    lm = build_lm(
        arch=arch,
        num_tokens=base.num_tokens,
        max_seq_len=base.max_seq_len,
        dim=dim,
        depth=depth,
        heads=heads,
        ff_mult=ff_mult,
        attn_dim_head=attn_dim_head,
        **({"kv_heads": kv_heads} if arch == "llama" else {}),
    )
    return lm.to(base.to_logits.weight.device)


def _logits(module: TransformerWrapper, tokens: Tensor, vocab: Tensor | None) -> Tensor:
    """inputs (B, T) -> logits (B, T, N) over the subset's rows of the draft's own output layer (gradients
    reach them)."""
    if isinstance(module, HFBase):  # a Llama draft model: transformers' own forward
        hidden = module.hf.model(input_ids=tokens).last_hidden_state
    else:
        hidden = module(tokens, return_embeddings=True)  # (B, T, d) after the final norm
    return subset_linear(hidden, module.to_logits, vocab)


def _check(module: TransformerWrapper, base: nn.Module, batch: FeatureBatch) -> None:
    batch.check()
    if module.num_tokens != base.num_tokens:
        raise ValueError(
            f"the draft model has {module.num_tokens} tokens, the base {base.num_tokens}: build it on this base"
        )


def loss(
    module: TransformerWrapper, base: nn.Module, batch: FeatureBatch, *, vocab: Tensor | None = None, target: str = "kl"
) -> tuple[Tensor, dict[str, float]]:
    """Cross-entropy of the draft's next-token distribution to the base's (`kl`), its top-1 (`argmax`) or
    the corpus token (`true`), over every position (with a batch mask, every position whose next token is an
    answer token); metrics `loss` and `agree` (top-1 = base's top-1)."""
    check_target(target)
    _check(module, base, batch)
    logits = _logits(module, batch.tokens[:, :-1], vocab)  # (B, T, N)
    index = subset_index(vocab, module.num_tokens, logits.device)
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
    values = torch.stack([total.detach(), agree]).tolist()
    return total, {"loss": values[0], "agree": values[1]}


@torch.no_grad()
def evaluate(
    module: TransformerWrapper, base: nn.Module, batch: FeatureBatch, *, vocab: Tensor | None = None
) -> dict[str, float]:
    """`agree`: how often the draft's top-1 is the base's top-1 after the same true prefix (what accepts a
    greedy draft token); `top1`: how often it is the corpus token. With a batch mask, rates over the answer
    positions."""
    _check(module, base, batch)
    top = student_top1(_logits(module, batch.tokens[:, :-1], vocab), vocab)  # (B, T) full-vocabulary ids
    hits = (top == batch.top_ids[..., 0], top == batch.tokens[:, 1:])  # (B, T) each
    # the chain from position s drafts s, s + 1, ... in turn, each after the true (greedy: accepted) tokens
    chain = chain_tau([hits[0][:, j:] for j in range(CHAIN)], batch.mask)
    values = torch.stack([masked_mean(hit, batch.mask) for hit in hits] + [chain])
    return dict(zip(("agree", "top1", "chain_tau"), values.tolist()))
