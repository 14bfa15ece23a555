"""A hybrid drafter: prompt lookup where the context repeats itself, a learned drafter everywhere else.

Prompt lookup (verify/drafters/prompt_lookup.py) is right for the stretches where an answer copies its context
(extraction, summaries, translation, retrieved passages) and costs nothing to draft; a learned drafter (Medusa
heads, sequential heads, the prophet, a draft model) guesses where nothing is copied. SAM-decoding and
llama.cpp's n-gram-then-draft chain combine the two the same way: retrieve when a retrieval exists, else draft.

Each cycle, per row: when the context's last `min_match` tokens or more (the longest such suffix, up to
`max_ngram`) occurred earlier, the row drafts what followed that occurrence, `gamma` tokens (the loop's budget);
otherwise it takes the learned drafter's draft: a chain of at most `learned_gamma` tokens, or its tree. The choice
reads the context only, never a token being drafted, so every drafted token still comes with the distribution it
was drawn from (lookup's one-hot, the learned drafter's q): speculative sampling stays lossless and greedy
acceptance exact, in chains and trees.

Both drafters see every prefill and every verdict, whichever of them drafted: the learned drafter rolls its state
from the verdict alone (one that did not propose this cycle has no drafted entries to drop), and lookup appends
the accepted tokens to its context. A drafter whose commit keeps its own drafted tokens' cache entries (a draft
model, an early exit on its own cache: `rolls_own_draft`) would be left a wrong context after a copy, and is refused.

The choice costs one host read a cycle (how many rows copy). When every row copies, the learned drafter does not
run at all: that is the saving on copied stretches. When rows chose differently, `merge_rows` makes one draft of
both (the shorter side padded with nodes it cannot lose by).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from verify.backends.target import Target, TargetOutput
from verify.drafters.prompt_lookup import PromptLookupDrafter
from verify.loop.drafter import Draft, Drafter, Verdict
from verify.loop.sampling import SamplingConfig


def check_hybrid(*, max_ngram: int, min_match: int, learned_gamma: int | None) -> None:
    """One-line errors for the hybrid's settings."""
    for name, value in dict(max_ngram=max_ngram, min_match=min_match).items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"hybrid {name}={value!r}: must be an integer >= 1")
    if min_match > max_ngram:
        raise ValueError(
            f"hybrid min_match={min_match}: must be at most max_ngram={max_ngram} (the longest suffix it looks up)"
        )
    if learned_gamma is not None and (
        isinstance(learned_gamma, bool) or not isinstance(learned_gamma, int) or learned_gamma < 1
    ):
        raise ValueError(f"hybrid learned_gamma={learned_gamma!r}: must be an integer >= 1, or null (the loop's gamma)")


class HybridDrafter:
    def __init__(
        self,
        learned: Drafter,
        *,
        max_ngram: int = 3,
        min_match: int = 2,
        learned_gamma: int | None = None,
        branches: bool = False,
    ):
        """`learned`: the drafter of rows lookup does not serve; `min_match`: the shortest repeated suffix that
        makes a row copy; `learned_gamma`: the learned chain's (or tree's depth) cap below the loop's gamma,
        None for none (the loop's gamma is then both sides' budget); `branches`: a copying row verifies the copy
        and the learned draft side by side, as two branches of one tree (`add_branch`), instead of the copy alone."""
        check_hybrid(max_ngram=max_ngram, min_match=min_match, learned_gamma=learned_gamma)
        if getattr(learned, "rolls_own_draft", False):
            raise ValueError(
                f"{type(learned).__name__} keeps its own drafted tokens in its cache on commit, so a copied draft "
                "would leave it a wrong context: a hybrid's learned side must roll its state from the verdict alone "
                "(Medusa, sequential heads, a prophet, an early exit on the target's cache)"
            )
        if not isinstance(branches, bool):
            raise ValueError(f"hybrid branches={branches!r}: must be true or false")
        self.branches = branches
        self.learned = learned
        self.lookup = PromptLookupDrafter(vocab_size=learned.vocab_size, max_ngram=max_ngram, min_ngram=min_match)
        self.vocab_size = learned.vocab_size
        self.learned_gamma = learned_gamma
        # budget=auto (experiments/lib/methods/calibrate.py): lookup drafts for free, and a capped learned side costs
        # the same whatever the loop's gamma
        self.flat_draft_cost = learned_gamma is not None or getattr(learned, "flat_draft_cost", False)
        # blocks of the target the learned drafter reads (verify/loop/drafter.py): the loop asks the target for them
        self.target_layers = getattr(learned, "target_layers", ())
        self.copied_rows = 0  # row-cycles drafted by lookup, and by the learned drafter: the split, for reports
        self.learned_rows = 0

    def attach(self, target: Target) -> None:
        attach = getattr(self.learned, "attach", None)  # an early-exit drafter drafts on the target's own blocks
        if attach is not None:
            attach(target)

    def begin(self, prompts: list[list[int]], prefill: TargetOutput, pending: Tensor) -> None:
        self.lookup.begin(prompts, prefill, pending)
        self.learned.begin(prompts, prefill, pending)

    def propose(self, gamma: int, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        start, copy = self.lookup.match()  # (b,), (b,): a row copies when its suffix of >= min_match tokens recurs
        copied = self.lookup.continuation(start, gamma)  # (b, gamma)
        b = copied.shape[0]
        n_copy = int(copy.sum())  # the cycle's one host read
        self.copied_rows += n_copy
        self.learned_rows += b - n_copy
        if n_copy == b and not self.branches:
            return Draft(tokens=copied)
        learned = self.learned.propose(min(gamma, self.learned_gamma or gamma), sampling, generator)
        if n_copy == 0:
            return learned
        if self.branches:
            return add_branch(learned, copied, copy, self.vocab_size)
        return merge_rows(learned, copied, copy, self.vocab_size)

    def commit(self, verdict: Verdict) -> None:
        self.lookup.commit(verdict)
        self.learned.commit(verdict)

    @property
    def copied_share(self) -> float:
        """The share of row-cycles lookup drafted (0 before any)."""
        total = self.copied_rows + self.learned_rows
        return self.copied_rows / total if total else 0.0


def merge_rows(learned: Draft, copied: Tensor, copy: Tensor, vocab_size: int) -> Draft:
    """One draft for a batch whose rows chose differently: rows where `copy` (b,) take the chain `copied` (b, m),
    the others `learned` (a chain or a tree of n nodes); max(n, m) nodes each.

    The shorter side is padded with nodes drawn deterministically (q one-hot): a chain by repeating its last
    token; a tree (or a chain beside a tree) by extra children of the pending token carrying the row's first
    token, so no row drafts deeper than its own draft and the loop's budget. A padded node is verified and
    may be accepted (then it was the target's choice anyway); it changes nothing else."""
    m = copied.shape[1]
    k = max(learned.length, m)
    if learned.parents is None:  # two chains: one chain of k tokens
        tokens = torch.where(copy[:, None], _repeat_last(copied, k), _repeat_last(learned.tokens, k))
        parents = None
    else:  # a tree beside a chain: each copied token the child of the one before
        b, device = copied.shape[0], copied.device
        chain = torch.arange(-1, m - 1, device=device).expand(b, -1)  # (b, m)
        tree = learned.parents.to(device).expand(b, -1)  # (b, n)
        tokens = torch.where(copy[:, None], _more_roots(copied, k), _more_roots(learned.tokens, k))
        parents = torch.where(copy[:, None], _pad(chain, k, -1), _pad(tree, k, -1))
    q = None
    if learned.q is not None:  # (b, n, V) -> (b, k, V): lookup's rows and every padded node one-hot
        one_hot = F.one_hot(tokens, vocab_size).to(learned.q.dtype)  # (b, k, V)
        q = torch.cat((learned.q, one_hot[:, learned.length :]), dim=1)
        q = torch.where(copy[:, None, None], one_hot, q)
    return Draft(tokens=tokens, q=q, parents=parents)


def add_branch(learned: Draft, copied: Tensor, copy: Tensor, vocab_size: int) -> Draft:
    """One tree of the learned draft (a chain or a tree of n nodes) and, in the rows where `copy` (b,), the copied
    chain (b, m) as one more branch from the pending token; n + m nodes each.

    A copying row lists the copy first (nodes 0..m-1, each the child of the one before), then the learned nodes:
    when both begin with the same token, the greedy walk, which follows the first matching sibling, follows the
    copy. The other rows list the learned nodes first, then m pad nodes: children of the pending token carrying
    the row's first token, tried after every real sibling. Copied and pad nodes are deterministic (q one-hot);
    the learned nodes keep their q, drawn without knowing the copy, so the multi-candidate rule stays lossless."""
    b, n, m, device = copied.shape[0], learned.length, copied.shape[1], copied.device
    tree = torch.arange(-1, n - 1, device=device) if learned.parents is None else learned.parents.to(device)
    tree = tree.expand(b, -1)  # (b, n)
    chain = torch.arange(-1, m - 1, device=device).expand(b, -1)  # (b, m)
    first = torch.cat((chain, torch.where(tree >= 0, tree + m, tree)), dim=1)  # the copy, then the learned nodes
    last = torch.cat((tree, torch.full_like(chain, -1)), dim=1)  # the learned nodes, then pad children of the root
    parents = torch.where(copy[:, None], first, last)
    pad = learned.tokens[:, :1].expand(-1, m)
    tokens = torch.where(copy[:, None], torch.cat((copied, learned.tokens), 1), torch.cat((learned.tokens, pad), 1))
    q = None
    if learned.q is not None:
        extra = F.one_hot(torch.where(copy[:, None], copied, pad), vocab_size).to(learned.q.dtype)  # (b, m, V)
        q = torch.where(copy[:, None, None], torch.cat((extra, learned.q), dim=1), torch.cat((learned.q, extra), dim=1))
    return Draft(tokens=tokens, q=q, parents=parents)


def _repeat_last(tokens: Tensor, k: int) -> Tensor:
    """(b, n) -> (b, k): a chain continued by repeats of its last token."""
    return torch.cat((tokens, tokens[:, -1:].expand(-1, k - tokens.shape[1])), dim=1)


def _more_roots(tokens: Tensor, k: int) -> Tensor:
    """(b, n) -> (b, k): extra nodes (children of the pending token) carrying each row's first token."""
    return torch.cat((tokens, tokens[:, :1].expand(-1, k - tokens.shape[1])), dim=1)


def _pad(parents: Tensor, k: int, value: int) -> Tensor:
    return torch.cat((parents, parents.new_full((parents.shape[0], k - parents.shape[1]), value)), dim=1)
