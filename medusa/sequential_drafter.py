"""The sequential (Hydra) drafter: a chain or a static tree, each head reading the path drafted before it.

State is Medusa's plus one token per row: the target's final hidden state at the last accepted position
(the state whose projection chose the pending token) and the pending token itself, which every head reads
first. Both come for free from the loop: the prefill's last position and the first pending token at
`begin`, the last accepted node of the verification forward and `verdict.pending` at `commit`. The
drafter never runs the target.

The tree is Medusa's static tree of rank paths (medusa.trees): node (r1, .., rd) is head d's rank-rd
guess. What differs is what a guess is conditioned on: head d runs under each node of depth d - 1 that
has children, reading [pending, the node's path tokens], so the rank-rd child of node (r1, .., r_{d-1})
is head d's rank-rd guess *given that path*. A step runs one head per level, batched over every row and
every parent of that level (one head call, one top-k); which parent, rank and ancestors each node reads
is a table computed once per depth limit, so proposing loops over levels only, never over rows or nodes.
A chain is the tree of rank-0 paths [(0,), (0, 0), ..] returned without parents.

At T = 0 the picks are the ranked guesses (q = None). At T > 0 a chain samples each head's token given the
path sampled before it and returns q (as MedusaDrafter's chain does), and a tree (`candidates="sampled"`,
the default) keeps its shape and samples too: under each parent, head d's distribution given that parent's
path, and the parent's children are distinct draws without replacement from it, the j-th child in node
order the j-th draw, with q that draw's distribution (without the earlier siblings, renormalised). The
tree rule tries siblings in that order, so this is lossless (see MedusaDrafter). `candidates="ranked"`
keeps the ranked guesses at T > 0.

`vocab` (sorted ids (N,)) trims the heads' projections: top-k runs over the subset and maps back to full
ids, which is also what the next head's embedding reads.

The constructor (validation, the default tree, the depth limits) and the hidden-state bookkeeping are
MedusaDrafter's, inherited; only proposing and the pending token are new. Heads with Hydra++'s prefix layer
read its output instead of the target's hidden state: medusa.prefix.PrefixCache runs the layer over the
prefill at `begin` and over the accepted path at `commit`, and its output is `self.hidden`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange, repeat
from torch import Tensor

from medusa.drafter import MedusaDrafter
from medusa.prefix import PrefixCache
from medusa.sequential import SequentialHeads
from medusa.trees import node_table
from verify.backends.target import TargetOutput
from verify.common.vocab import expand_probs, full_ids
from verify.loop.drafter import Draft, Verdict
from verify.loop.sampling import SamplingConfig, draft_from_logits, probs_from_logits, sample_siblings
from verify.loop.tree import Path


@dataclass
class Level:
    """The nodes of one depth d of a static tree, and what head d reads to fill them."""

    reads: Tensor  # (P, d) for each parent with children: the verify indices of its path, root (pending) first
    slot: Tensor  # (C,) for each node of depth d, in node order: the row of `reads` it is a child of
    rank: Tensor  # (C,) its rank among head d's guesses under that parent
    width: int  # top-k width: the largest rank read at this depth, plus one
    sibling: Tensor  # (C,) sampled trees: its draw number under that parent (earlier siblings in node order)
    draws: int  # sampled trees: draws per parent, the most children any parent of this depth has


def level_table(paths: list[Path], max_depth: int, device: torch.device | str = "cpu") -> tuple[Tensor, list[Level]]:
    """The nodes no deeper than max_depth -> parents (n,) draft-indexed (medusa.trees.node_table's order and
    convention: -1 = child of the pending token) and one Level per depth.

    Nodes come sorted by (depth, path), so each depth is a contiguous block: appending the blocks level by
    level to [pending] gives the verify indexing (root 0, draft node i at i + 1). Tensors on `device`."""
    parents, head, rank = node_table(paths, max_depth)  # read on the host; only the tables go to `device`
    par, depth = parents.tolist(), (head + 1).tolist()

    def path_of(node: int) -> list[int]:  # draft node (-1 = root) -> verify indices root .. node
        out = []
        while node >= 0:
            out.append(node + 1)
            node = par[node]
        return [0, *reversed(out)]

    levels = []
    for d in range(1, max(depth) + 1):
        nodes = [i for i, di in enumerate(depth) if di == d]
        sources = sorted({par[i] for i in nodes})  # parents with children, in node order (-1, the root, first)
        ranks = rank[nodes]
        sibling = [[par[j] for j in nodes[:n]].count(par[i]) for n, i in enumerate(nodes)]
        levels.append(
            Level(
                reads=torch.tensor([path_of(s) for s in sources], device=device),
                slot=torch.tensor([sources.index(par[i]) for i in nodes], device=device),
                rank=ranks.to(device),
                width=int(ranks.max()) + 1,
                sibling=torch.tensor(sibling, device=device),
                draws=max(sibling) + 1,
            )
        )
    return parents.to(device), levels


class SequentialDrafter(MedusaDrafter):
    flat_draft_cost = False  # one head call per level: the draft cost grows with the depth

    def __init__(
        self,
        heads: SequentialHeads,
        *,
        mode: str = "tree",
        tree: list | None = None,
        tree_nodes: int = 16,
        vocab: Tensor | None = None,
        accuracies: list[list[float]] | None = None,
        candidates: str = "sampled",
    ):
        super().__init__(
            heads,
            mode=mode,
            tree=tree,
            tree_nodes=tree_nodes,
            vocab=vocab,
            accuracies=accuracies,
            candidates=candidates,
        )  # self.stacked: DecodeHeads
        heads.eval()  # drafting is inference: a head's training dropout must not act here
        self.prefix = None if heads.prefix is None else PrefixCache(heads.prefix)
        if mode == "chain":  # the chain is the tree of top-1 guesses, drafted the same way
            self.paths = [(0,) * d for d in range(1, heads.num_heads + 1)]
        self._levels: dict[int, tuple[Tensor, list[Level]]] = {}

    def begin(self, prompts: list[list[int]], prefill: TargetOutput, pending: Tensor) -> None:
        super().begin(prompts, prefill, pending)  # self.hidden (b, d)
        if self.prefix is not None:  # the heads read the prefix layer's output at the last prompt position
            self.hidden = self.prefix.begin(prompts, prefill)
        self.pending = pending  # (b,): every head reads it first

    @torch.inference_mode()
    def propose(self, gamma: int, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        depth = min(gamma, self.max_depth)  # never deeper than the loop's budget or the number of heads
        parents, levels = self._table(depth, self.hidden.device)
        hidden = self.hidden.to(self.dtype)  # (b, d)
        tokens = self.pending[:, None]  # (b, 1) verify-indexed: the root, then each level's nodes appended
        sample = not sampling.greedy and (self.mode == "chain" or self.candidates == "sampled")
        qs = []  # sampled: each level's q (b, C, V), zero outside the subset
        for d, level in enumerate(levels, start=1):  # head d fills depth d: one call over all rows and parents
            p = level.reads.shape[0]
            reads = rearrange(tokens[:, level.reads], "b p k -> (b p) k")  # (b P, d) full ids of each parent's path
            logits = self.stacked(d, repeat(hidden, "b d -> (b p) d", p=p), reads)  # (b P, N)
            if sample and self.mode == "chain":  # one node per level, sampled from head d given the sampled path
                token, q = draft_from_logits(logits, sampling, generator, vocab=self.vocab, vocab_size=self.vocab_size)
                tokens, qs = torch.cat((tokens, token[:, None]), dim=1), qs + [q[:, None]]
                continue
            if sample:  # a tree at T > 0: each parent's children drawn without replacement from head d given its path
                probs = rearrange(probs_from_logits(logits, sampling), "(b p) n -> b p n", p=p)
                index, q = sample_siblings(probs, level.draws, generator)  # (b, P, W), (b, P, W, N)
                tokens = torch.cat((tokens, full_ids(index[:, level.slot, level.sibling], self.vocab)), dim=1)
                qs.append(expand_probs(q[:, level.slot, level.sibling], self.vocab, self.vocab_size))
                continue
            top = rearrange(logits.topk(level.width, dim=-1).indices, "(b p) r -> b p r", p=p)  # subset positions
            tokens = torch.cat((tokens, full_ids(top[:, level.slot, level.rank], self.vocab)), dim=1)
        q = torch.cat(qs, dim=1) if qs else None  # (b, k, V) in node order
        return Draft(tokens=tokens[:, 1:], q=q, parents=None if self.mode == "chain" else parents)

    def commit(self, verdict: Verdict) -> None:
        super().commit(verdict)  # self.hidden: the target's state at the last accepted node
        if self.prefix is not None:  # or the prefix layer's output there, having read the accepted path
            self.hidden = self.prefix.commit(verdict)
        self.pending = verdict.pending

    def _table(self, depth: int, device: torch.device) -> tuple[Tensor, list[Level]]:
        """(parents, levels) of the tree's nodes no deeper than `depth`, built once per depth."""
        if depth not in self._levels:
            self._levels[depth] = level_table(self.paths, depth, device)
        return self._levels[depth]


def make_drafter(
    module: SequentialHeads,
    base: object,
    *,
    mode: str = "tree",
    tree: list | None = None,
    tree_nodes: int = 16,
    vocab: Tensor | None = None,
    accuracies: list[list[float]] | None = None,
    candidates: str = "sampled",
) -> SequentialDrafter:
    """The drafter for decoding (decode kwargs from conf/drafter/sequential.yaml `decode:`); `vocab` the sorted
    token ids (N,) its heads may propose (verify.common.vocab.frequent_tokens), None for the full vocabulary;
    `accuracies` the heads' measured rank accuracies, to grow the default tree from (see MedusaDrafter)."""
    return SequentialDrafter(
        module, mode=mode, tree=tree, tree_nodes=tree_nodes, vocab=vocab, accuracies=accuracies, candidates=candidates
    )
