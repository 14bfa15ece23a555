"""The independent draft model as a drafter family: a small LM distilled from the frozen base.

Classic speculative decoding (Leviathan et al., Chen et al.) drafts with a smaller LM of the same
tokenizer. Trained on the corpus it learns the data; what acceptance rewards is agreeing with the base,
so here it is trained on the base's own next-token distribution (verify/training/distill.py), read from the
feature cache like every other drafter. It reads only the tokens and the teacher's top-k of a FeatureBatch,
never the hidden states.

Two starting points (`init`): `random`, a fresh LM of the sizes given; `base`, the usual way to make a draft
model when the base has no smaller sibling: a copy of a Llama base's embeddings and output layer (frozen, tied
as the base ties them), its first `depth` blocks and its final norm (trained), then distilled like the other.
The cut model starts as an exit at layer `depth` (the early-exit family's logit lens), and only its blocks and
norm learn, at LR_SCALE times the drafters' learning rate: they start from weights that already work.

The training side of a family (registered in experiments/lib/families/registry.py): build, loss, evaluate; the inference
side is verify.drafters.draft_model.make_drafter.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn
from x_transformers import TransformerWrapper

from experiments.lib.store.lm import build_lm
from verify.backends.hf import HFBase
from verify.common.vocab import subset_linear
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

__all__ = ["INITS", "LR_SCALE", "build", "cut_from_base", "evaluate", "loss"]


INITS = ("random", "base")
LR_SCALE = 0.1  # init=base fine-tunes copied blocks, which the drafters' lr of 1e-3 (set for fresh weights) would
# overwrite within a few dozen Adam steps. Measured on SmolLM2 (2 blocks, 24 steps): agreement .054 at the full lr,
# .040 at a tenth; the cut starts far from the base (KL 14.9), so its training length, not its lr, decides there


def build(
    base: nn.Module,
    *,
    init: str = "random",
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
    draft_model serves (python -m experiments.export). init="base": the base's first `depth` blocks, embeddings,
    final norm and output layer (module docstring); the sizes are then the base's and dim, heads, ff_mult,
    attn_dim_head, arch and kv_heads are not read."""
    if init not in INITS:
        raise ValueError(f"init={init!r}: must be one of {', '.join(INITS)}")
    if init == "base":
        return cut_from_base(base, depth=depth)
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


def cut_from_base(base: nn.Module, *, depth: int) -> HFBase:
    """A Llama draft model made of a copy of a Llama base's embeddings and output layer (frozen), first `depth`
    blocks and final norm (trained at LR_SCALE times the drafters' rate), in float32 on the base's device."""
    if not (isinstance(base, HFBase) and type(base.hf).__name__ == "LlamaForCausalLM"):
        raise ValueError(
            f"init='base' cuts the draft model from a Llama base (transformers' LlamaForCausalLM, as base=smollm2), "
            f"this base is {type(getattr(base, 'hf', base)).__name__}: use init=random"
        )
    if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth < base.depth:
        raise ValueError(f"depth={depth!r}: init='base' takes 1 to {base.depth - 1} of the base's {base.depth} blocks")
    from transformers import LlamaForCausalLM

    config = copy.deepcopy(base.hf.config)
    config.num_hidden_layers = depth
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:depth]
    draft = LlamaForCausalLM(config)
    weights = base.hf.state_dict()  # a tied base lists its embeddings under lm_head.weight too
    own = draft.state_dict()
    draft.load_state_dict({name: weights[name].detach().clone().float() for name in own}, strict=True)
    # the input and output layers stay the base's: the blocks learn to produce states its output layer reads
    draft.get_input_embeddings().weight.requires_grad_(False)
    draft.get_output_embeddings().weight.requires_grad_(False)
    module = HFBase(draft.float()).to(base.to_logits.weight.device)
    module.lr_scale = LR_SCALE  # read by the training loop's optimizer
    return module


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
    greedy draft token); `top1`: how often it is the corpus token; `mass`: the probability that speculative
    sampling at T = 1 accepts its sampled draft (verify.training.distill.accepted_mass); `chain_tau` / `chain_mass`:
    a chain of 3's tau at T = 0 and its expectation at T = 1. With a batch mask, rates over the answer positions."""
    _check(module, base, batch)
    logits = _logits(module, batch.tokens[:, :-1], vocab)  # (B, T, N)
    top = student_top1(logits, vocab)  # (B, T) full-vocabulary ids
    hits = (top == batch.top_ids[..., 0], top == batch.tokens[:, 1:])  # (B, T) each
    mass = accepted_mass(logits, batch.top_ids, batch.top_logp, vocab)  # (B, T): T = 1 acceptance of each draft
    # the chain from position s drafts s, s + 1, ... in turn, each after the true (greedy: accepted) tokens
    runs = [answers_only(m, batch.mask) for m in (hits[0], mass)]  # a chain stops past the answer's end
    chains = [chain_tau([run[:, j:] for j in range(CHAIN)], batch.mask) for run in runs]
    values = torch.stack([masked_mean(m, batch.mask) for m in (*hits, mass)] + chains)
    return dict(zip(("agree", "top1", "mass", "chain_tau", "chain_mass"), values.tolist()))
