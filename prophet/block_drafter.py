"""Drafting with the block prophet: K draft positions from one prophet forward per decoding step.

State. The cache holds the context entries (f_t, x_{t+1}) of every accepted position, exactly as the
autoregressive prophet's (prophet/drafter.py), and two predictions made from them: `feature`, the predicted
feature at the pending position (its logits are draft position 1), and `block`, the K - 1 slots' predicted
features (positions 2..K). Neither reads a drafted token, so `propose` is only the frozen output layer
over K features and a pick per position: no prophet forward at all.

One forward per step. `commit` appends the accepted path's true pairs and, in the same forward, the K - 1
slots after them: slot i sits at the position after the row's last accepted entry plus i - 1 and sees the
accepted entries of its row (not the padding of rows that accepted fewer) and the slots before it. The cache
then keeps the accepted entries only, and the outputs give the next step's `feature` and `block`. So a step
costs the autoregressive prophet's commit forward, K - 1 entries wider, instead of that forward plus one
forward per further draft token; the time is counted as drafting, as every drafter's commit is.

Picks. A chain takes each position's top-1 at T = 0, or at T > 0 a sample from each position's distribution
after the shared sampling transform, with that distribution as q: the lossless rule then applies unchanged
(q may ignore the earlier draft tokens; it only has to be what the token was drawn from). A tree is a static
tree of the positions' ranks, grown from the ranks' measured accuracies (medusa.drafter.PositionDrafter),
with sampled siblings at T > 0.

Refinement (`refine=R`, chains only, a tree ignores it; 0 by default). A slot never sees the tokens drafted
before it, which is what the autoregressive prophet's later steps gain from. A refinement pass re-reads the
block as that prophet would: one forward of K - 1 entries (position j's predicted feature, position j's
current guess) on top of the cache (appended, then dropped), whose entry j predicts position j + 1 again, now
given the guesses of positions 1..j (Jacobi iteration; R passes, each from the previous pass's features and
guesses). The chain is then drawn position by position: position i takes the refined distribution while the
tokens drawn so far are the guesses it was conditioned on, and the slot's own distribution from the first
mismatch on. Which one is used is settled by the earlier tokens only, so each token's q is what it was drawn
from, and the rule stays lossless. Each pass costs one more prophet forward per step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import Tensor

from medusa.drafter import PositionDrafter
from prophet.block import BlockProphet
from prophet.drafter import pad_block, path_features, prefill_cache
from prophet.model import check_same_base
from verify.backends.target import TargetOutput
from verify.common.vocab import full_ids, trim_linear
from verify.loop.drafter import Draft, Verdict
from verify.loop.sampling import SamplingConfig, draft_from_logits


class BlockProphetDrafter(PositionDrafter):
    def __init__(
        self,
        prophet: BlockProphet,
        *,
        mode: str = "tree",
        tree: list | None = None,
        tree_nodes: int = 16,
        vocab: Tensor | None = None,
        accuracies: list[list[float]] | None = None,
        candidates: str = "sampled",
        compile: bool = False,
        refine: int = 0,
    ):
        """Position k of the block is head k of a static tree (see PositionDrafter for the settings);
        `compile` runs the prophet's forwards through torch.compile (one program: every commit is padded);
        `refine`: refinement passes of a chain (see the module docstring); a tree ignores it (one setting serves
        both methods of a config)."""
        if isinstance(refine, bool) or not isinstance(refine, int) or refine < 0:
            raise ValueError(f"refine={refine!r}: must be an integer >= 0 (refinement passes of a chain)")
        super().__init__(
            positions=prophet.block,
            vocab_size=prophet.vocab_size,
            mode=mode,
            tree=tree,
            tree_nodes=tree_nodes,
            vocab=vocab,
            accuracies=accuracies,
            candidates=candidates,
        )
        self.prophet = prophet.eval()  # drafting is inference; a training loop switches back with .train()
        self.weight, self.bias = trim_linear(prophet.head.to_logits, self.vocab)  # (N, d_base), (N,) or None
        self.target_layers = prophet.fuse_layers  # blocks whose states the target hands over (verify/loop/drafter.py)
        self.compile, self.refine = compile, refine
        self.cache = None

    @torch.inference_mode()
    def begin(self, prompts: list[list[int]], prefill: TargetOutput, pending: Tensor) -> None:
        """Seed the cache from the prompts (as the autoregressive prophet does), then run the slots once."""
        self.cache, self.feature = prefill_cache(self.prophet, prompts, prefill, pending)  # (b, d_base)
        b = self.feature.shape[0]
        self.block = self.prophet.decode(self.prophet.slot_inputs(b), self.cache, compile=self.compile)
        self.cache.commit(
            torch.zeros(b, self.prophet.block - 1, dtype=torch.bool, device=self.feature.device), prefix=True
        )

    @torch.inference_mode()
    def propose(self, gamma: int, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        features = torch.cat((self.feature[:, None], self.block), dim=1)  # (b, K, d_base)
        if self.refine and self.mode == "chain":
            return self._refined_chain(features, min(gamma, self.max_depth), sampling, generator)
        return self.draft(self._logits(features), gamma, sampling, generator)

    def _refined_chain(
        self, features: Tensor, depth: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Draft:
        """features (b, K, d_base) of the block -> a chain of `depth` tokens drawn from the refined distributions
        while the drawn tokens match the guesses they were conditioned on (module docstring)."""
        first = self._logits(features)  # (b, K, N): the slots' own distributions, conditioned on no draft token
        logits = first
        for _ in range(self.refine):
            guess = full_ids(logits.argmax(dim=-1), self.vocab)  # (b, K)
            out = self.prophet.step(features[:, :-1], guess[:, :-1], self.cache, compile=self.compile)  # (b, K-1, d)
            self.cache.commit(
                torch.zeros(guess.shape[0], guess.shape[1] - 1, dtype=torch.bool, device=guess.device), prefix=True
            )
            features = torch.cat((features[:, :1], out), dim=1)  # position j + 1 given the guesses of 1..j
            logits = self._logits(features)
        tokens, qs = [], []
        match = torch.ones(features.shape[0], dtype=torch.bool, device=features.device)  # drawn so far == guesses
        for i in range(depth):
            chosen = torch.where(match[:, None], logits[:, i], first[:, i])
            token, q = draft_from_logits(chosen, sampling, generator, vocab=self.vocab, vocab_size=self.vocab_size)
            match &= token == guess[:, i]
            tokens.append(token)
            qs += [] if q is None else [q]
        return Draft(tokens=torch.stack(tokens, dim=1), q=torch.stack(qs, dim=1) if qs else None)

    def _logits(self, features: Tensor) -> Tensor:
        """(..., d_base) predicted features -> (..., N) logits over the subset (all V untrimmed)."""
        return F.linear(features, self.weight, self.bias)

    @torch.inference_mode()
    def commit(self, verdict: Verdict) -> None:
        """One forward: the accepted path's true pairs (a + 1 per row, padded), then the K - 1 slots after each
        row's last accepted entry; the cache keeps the a + 1 entries."""
        features, tokens = path_features(self.prophet, verdict), verdict.tokens[:, : verdict.path.shape[1]]
        if self.compile:  # one compiled program: the widest path a block allows (K drafts and the pending token);
            features, tokens = pad_block(features, tokens, self.prophet.block + 1)  # a hybrid's longer copy: its own
        width, slots = tokens.shape[1], self.prophet.block - 1
        b = tokens.shape[0]
        x = torch.cat((self.prophet.fused(features, tokens), self.prophet.slot_inputs(b)), dim=1)
        allow, pos = commit_attention(verdict.accepted, width, slots, self.cache.lengths)
        out = self.prophet.decode(x, self.cache, allow=allow, pos=pos, compile=self.compile)  # (b, width + slots, d)
        self.cache.commit(torch.arange(width + slots, device=out.device) < (verdict.accepted + 1)[:, None], prefix=True)
        self.feature = out[torch.arange(b, device=out.device), verdict.accepted]  # predicted at the new pending
        self.block = out[:, width:]  # (b, K - 1, d_base)


def commit_attention(accepted: Tensor, width: int, slots: int, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """Attention among a commit's new entries: `width` path entries (the first accepted + 1 of each row real),
    then `slots` slots. accepted (b,), lengths (b,) the rows' cached entries before the commit.

    Path entries are a chain (causal, at positions lengths + j). Slot i (1-based) sits at lengths + accepted + i
    and sees the row's real path entries and the slots up to itself. Returns allow (b, n, n) over the new
    entries (every cached entry stays visible) and positions (b, n), n = width + slots."""
    device = accepted.device
    j = torch.arange(width, device=device)
    i = torch.arange(1, slots + 1, device=device)
    path_sees_path = repeat(j[:, None] >= j[None, :], "q k -> b q k", b=accepted.shape[0])  # (b, W, W)
    path_sees_slots = torch.zeros(accepted.shape[0], width, slots, dtype=torch.bool, device=device)
    slot_sees_path = repeat(j[None, :] <= accepted[:, None], "b k -> b q k", q=slots)  # (b, slots, W)
    slot_sees_slots = repeat(i[:, None] >= i[None, :], "q k -> b q k", b=accepted.shape[0])  # (b, slots, slots)
    allow = torch.cat(
        (
            torch.cat((path_sees_path, path_sees_slots), dim=-1),
            torch.cat((slot_sees_path, slot_sees_slots), dim=-1),
        ),
        dim=1,
    )
    pos = torch.cat((lengths[:, None] + j, rearrange(lengths + accepted, "b -> b 1") + i), dim=1)
    return allow, pos


def make_drafter(
    module: BlockProphet, base: torch.nn.Module, *, vocab: Tensor | None = None, **decode_kwargs
) -> BlockProphetDrafter:
    """decode_kwargs: `decode:` of conf/drafter/prophet_block.yaml (mode, tree, tree_nodes, candidates) and
    `accuracies` (the positions' measured rank accuracies); `vocab` the sorted token ids (N,) the drafts may use
    (verify.common.vocab.frequent_tokens), None for the full vocabulary."""
    check_same_base(module, base)
    return BlockProphetDrafter(module, vocab=vocab, **decode_kwargs)
