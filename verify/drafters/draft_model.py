"""An independent small draft model (Leviathan et al., Chen et al.): a smaller LM on the target's
tokenizer drafts gamma tokens autoregressively with its own KV cache.

Cache discipline: the draft LM is a target too (`verify.backends.choose.make_target`: the lean engine, or for a
Hugging Face model that only transformers runs, verify.backends.hf's adapter), so it has the one cache owner and
the one rollback.
After a step its cache holds everything up to, but not including, the last accepted token; the two
uncached tokens (that token and the new pending one) open the next draft forward. No token that is
still in the cache is ever fed again, and no rejected token stays in it.

`vocab` (sorted ids (N,), see verify/common/vocab.py) restricts the drafts to a subset of the vocabulary:
argmax or sampling over the subset's logits, q zero outside it (so sampling stays lossless).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from verify.backends.cache import StaticCache
from verify.backends.choose import make_target
from verify.backends.target import Target, TargetOutput
from verify.common.vocab import check_vocab
from verify.loop.drafter import Draft, Verdict
from verify.loop.sampling import SamplingConfig, draft_from_logits


class DraftModelDrafter:
    # Its commit keeps its own drafted tokens' cache entries up to the accepted count: it assumes the accepted tokens
    # are its own draft's (verify/drafters/hybrid.py refuses it as a hybrid's learned side for that reason)
    rolls_own_draft = True

    def __init__(
        self,
        model: nn.Module,
        *,
        pad_id: int = 0,
        compile: bool = False,
        vocab: Tensor | None = None,
        engine: str = "auto",
    ):
        check_causal_lm(model)
        self.vocab = check_vocab(vocab, model.num_tokens)  # (N,) or None = all V
        # The draft LM's output layer keeps only the subset's rows: its logits are (b, n, N).
        # A compiled draft LM runs steps of 1 token, plus 2 at the start of a cycle (the uncached pair).
        # engine: which target runs a Hugging Face draft LM (verify.backends.choose.make_target).
        self.lm = make_target(model, engine=engine, pad_id=pad_id, compile=compile, widths=(1, 2), vocab=self.vocab)
        self.vocab_size = self.lm.vocab_size

    def begin(self, prompts: list[list[int]], prefill: TargetOutput, pending: Tensor) -> None:
        self.lm.prefill(prompts)
        self.uncached = pending[:, None]  # (b, u) context tokens not yet in the draft cache
        self.fed = 0  # slots the last propose added to the draft cache

    @torch.inference_mode()
    def propose(self, gamma: int, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        x, tokens, qs = self.uncached, [], []
        for _ in range(gamma):
            logits = self.lm.extend(x).logits[:, -1]  # (b, N): already over the subset
            token, q = draft_from_logits(logits, sampling, generator, vocab=self.vocab, vocab_size=self.vocab_size)
            tokens.append(token)
            qs += [] if q is None else [q]  # (b, V), zero outside the subset
            x = token[:, None]
        self.fed = self.uncached.shape[1] + gamma - 1
        q = torch.stack(qs, dim=1) if qs else None
        return Draft(tokens=torch.stack(tokens, dim=1), q=q)

    def commit(self, verdict: Verdict) -> None:
        self.uncached, self.fed = roll_uncached(self.lm, self.uncached, self.fed, verdict), 0


def check_causal_lm(model: nn.Module) -> None:
    """A one-line error for a draft model the draft loop cannot run: an encoder-decoder (it needs a source
    encoded first, which the seq2seq drafters do) or a module that is no LM wrapper at all."""
    encoder_decoder = getattr(getattr(model, "config", None), "is_encoder_decoder", False) is True
    if encoder_decoder or not hasattr(model, "num_tokens"):
        raise ValueError(
            f"DraftModelDrafter takes a causal LM (an x-transformers TransformerWrapper, or a Hugging Face causal "
            f"LM wrapped as HFBase), got {type(model).__name__}: for T5 use T5DraftDrafter (verify.encdec.t5), for an "
            "x-transformers encoder-decoder Seq2SeqDraftDrafter (verify.encdec.seq2seq)"
        )


def roll_uncached(cache: Target | StaticCache, uncached: Tensor, fed: int, verdict: Verdict) -> Tensor:
    """The cache discipline above, for a drafter with a cache of its own (this one, an early-exit drafter
    on an own cache): roll `cache` back and return the new uncached tokens (b, u').

    The last propose added `fed` slots: [uncached (u), d1 .. d_{k-1}]. Keep the first u - 1 + a of them, so
    that the last accepted token (the old pending token when a = 0) and the new pending token stay
    uncached. With no draft this step (fed 0, the budget), the new pending token just joins the queue."""
    if fed == 0:
        return torch.cat((uncached, verdict.pending[:, None]), dim=1)
    keep = torch.arange(fed, device=verdict.accepted.device) < (uncached.shape[1] - 1 + verdict.accepted)[:, None]
    cache.commit(keep, prefix=True)
    last_accepted = torch.cat((uncached[:, -1:], verdict.tokens), dim=1).gather(1, verdict.accepted[:, None])
    return torch.cat((last_accepted, verdict.pending[:, None]), dim=1)


def make_drafter(
    module: nn.Module, base: nn.Module, *, vocab: Tensor | None = None, compile: bool = False
) -> DraftModelDrafter:
    """The draft model in the one speculative loop; `vocab` its trimmed output layer (None: all tokens)."""
    return DraftModelDrafter(module, compile=compile, vocab=vocab)
