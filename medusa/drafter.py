"""The Medusa drafter: proposes a chain or a static tree from the heads, for the one speculative loop.

State is one vector per row: the target's final hidden state at the last accepted position, the state
whose own projection chose the pending token. Head k reads it and guesses the token k steps after the
pending one. It comes for free from the target's forwards: the prefill's last position at `begin`, the
last accepted node of the verification forward at `commit`. The drafter never runs the target.

A step is one batched computation of all heads on (b, d) (`MedusaHeads.stacked`) and one top-k; the
tree's shape (which head and rank each node reads, and its parent) is a table computed once per depth
limit, so proposing has no Python loop over heads, tokens or rows. At T = 0 a node of rank r is head d's
rank-r guess (q None). At T > 0 a chain samples token k from head k's distribution (the shared sampling
transform) and returns q: speculative sampling then accepts it with probability min(1, p / q) instead of
only as often as the base samples the head's top guess. A tree at T > 0 keeps its shape and samples too
(`candidates="sampled"`, the default): the children of a node at depth d - 1 are distinct draws without
replacement from head d's distribution, the j-th child in node order the j-th draw, with q that draw's
distribution (head d's without the earlier siblings, renormalised; verify.loop.sampling.sample_siblings). Head d
reads no path, so every parent at depth d - 1 draws its own children from the same distribution,
independently. The tree rule tries siblings in order and removes each rejected one's q from the residual,
so this is lossless; `candidates="ranked"` keeps the top-ranked guesses at T > 0 too.

`vocab` (sorted ids (N,), see verify/common/vocab.py) trims the heads' projections to the N most frequent
tokens: argmax and top-k run over the subset and map back to full ids, so drafts never leave it.
"""

from __future__ import annotations

import torch
from einops import repeat
from torch import Tensor

from medusa.heads import MedusaHeads
from medusa.trees import RANKS, default_tree, node_table
from verify.backends.target import TargetOutput
from verify.common.vocab import check_vocab, expand_probs, full_ids
from verify.loop.drafter import Draft, Verdict
from verify.loop.sampling import SamplingConfig, draft_from_logits, probs_from_logits, sample_siblings
from verify.loop.tree import Path, check_candidates, sibling_groups, sort_paths

MODES = ("chain", "tree")


def check_tree(tree: list, vocab_size: int) -> list[Path]:
    """Config rank paths (lists of ints) -> sorted tuples; one-line errors for anything else.

    `vocab_size` is how many tokens a head ranks: the trimmed subset's size when the vocabulary is trimmed."""
    if len(tree) == 0:
        raise ValueError("tree=[]: a tree needs at least one rank path, or null for the default tree")
    paths = [tuple(p) for p in tree]
    for p in paths:
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in p):
            raise ValueError(f"tree path {list(p)}: ranks must be integers")
        if any(r >= vocab_size for r in p):
            raise ValueError(
                f"tree path {list(p)}: ranks must be below the vocabulary size {vocab_size} (trimmed: the subset's)"
            )
    return sort_paths(paths)


class PositionDrafter:
    """Drafts from per-position distributions: logits (b, K, N) for the K tokens after the pending one, position
    k's distribution reading no earlier draft token (Medusa's heads, the block prophet's slots). A chain takes
    each position's top-1 (sampled with q at T > 0); a tree is a static tree of rank paths (see the module
    docstring), grown from the positions' measured rank accuracies when given."""

    flat_draft_cost = True  # budget=auto: the distributions are computed once per step, whatever gamma

    def __init__(
        self,
        *,
        positions: int,
        vocab_size: int,
        mode: str = "tree",
        tree: list | None = None,
        tree_nodes: int = 16,
        vocab: Tensor | None = None,
        accuracies: list[list[float]] | None = None,
        candidates: str = "sampled",
    ):
        """`accuracies[k][r]`: how often position k + 1's rank-r guess was the base's choice (measured on
        validation, medusa.trees.accuracies_from_metrics): the default tree (tree None) is grown from them,
        else from typical Medusa accuracies. `candidates`: a tree's children at T > 0, "sampled" (drawn
        without replacement, with q) or "ranked" (the top guesses, q None); see the module docstring."""
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: must be one of {', '.join(MODES)}")
        self.candidates = check_candidates(candidates)
        if isinstance(tree_nodes, bool) or not isinstance(tree_nodes, int) or tree_nodes < 1:
            raise ValueError(f"tree_nodes={tree_nodes!r}: must be an integer >= 1")
        self.mode, self.vocab_size = mode, vocab_size
        self.vocab = check_vocab(vocab, vocab_size)  # (N,) or None = all V
        ranked = vocab_size if self.vocab is None else self.vocab.numel()  # tokens a position can rank
        self._tables: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
        self._groups: dict[int, tuple[Tensor, Tensor, Tensor]] = {}
        if mode == "chain":
            if tree is not None:
                raise ValueError("tree is given but mode='chain': a tree needs mode='tree'")
            self.paths, self.max_depth = [], positions
            return
        if tree is None:  # tree_nodes only sizes the default tree; a given tree is used as it is
            tree = default_tree(positions, tree_nodes, ranks=min(RANKS, ranked), accuracies=accuracies)
        self.paths = check_tree(tree, ranked)
        self.ranks = max(max(p) for p in self.paths) + 1  # top-k width: the largest rank any node reads
        self.max_depth = min(positions, max(map(len, self.paths)))  # deeper nodes have no position

    def draft(self, logits: Tensor, gamma: int, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        """logits (b, K, N) over the subset (all V untrimmed) -> a chain or tree no deeper than gamma."""
        depth = min(gamma, self.max_depth)  # never deeper than the loop's budget or the number of positions
        if self.mode == "chain":  # (b, depth): position k's top-1 at k, or at T > 0 a sample from it with q
            tokens, q = draft_from_logits(
                logits[:, :depth], sampling, generator, vocab=self.vocab, vocab_size=self.vocab_size
            )
            return Draft(tokens=tokens, q=q)
        parents, head, rank = self._table(depth, logits.device)
        if not sampling.greedy and self.candidates == "sampled":
            return self._sampled_tree(logits[:, :depth], parents, depth, sampling, generator)
        top = logits.topk(self.ranks, dim=-1).indices  # (b, K, R) positions in the subset
        return Draft(tokens=full_ids(top[:, head, rank], self.vocab), parents=parents)  # (b, k), (k,)

    def _sampled_tree(
        self, logits: Tensor, parents: Tensor, depth: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> Draft:
        """logits (b, depth, N) of positions 1..depth -> the tree's nodes as draws without replacement, with q."""
        head, group, sibling = self._sibling_table(depth, logits.device)
        probs = probs_from_logits(logits, sampling)[:, head]  # (b, G, N): the position filling each parent's children
        index, q = sample_siblings(probs, int(sibling.max()) + 1, generator)  # (b, G, W), (b, G, W, N)
        tokens = full_ids(index[:, group, sibling], self.vocab)  # (b, k)
        return Draft(tokens=tokens, q=expand_probs(q[:, group, sibling], self.vocab, self.vocab_size), parents=parents)

    def _table(self, depth: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """(parents, head, rank) of the tree's nodes no deeper than `depth`, built once per depth."""
        if depth not in self._tables:
            self._tables[depth] = node_table(self.paths, depth, device)
        return self._tables[depth]

    def _sibling_table(self, depth: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """For a sampled tree no deeper than `depth`, built once per depth: head (G,), the position (0-based) that
        draws the children of each node with children (the pending token's: position 0), and each node's group
        (k,) and draw number among its siblings (k,) (verify.loop.tree.sibling_groups)."""
        if depth not in self._groups:
            parents, head, _ = node_table(self.paths, depth)
            sources, group, sibling = sibling_groups(parents)
            # a node's children are one level deeper: the root's come from head 0, node s's from head[s] + 1
            source_head = torch.where(sources >= 0, head[sources.clamp(min=0)] + 1, torch.zeros_like(sources))
            self._groups[depth] = (source_head.to(device), group.to(device), sibling.to(device))
        return self._groups[depth]


class MedusaDrafter(PositionDrafter):
    def __init__(
        self,
        heads: MedusaHeads,
        *,
        mode: str = "tree",
        tree: list | None = None,
        tree_nodes: int = 16,
        vocab: Tensor | None = None,
        accuracies: list[list[float]] | None = None,
        candidates: str = "sampled",
    ):
        """Head k is position k; see PositionDrafter for the settings."""
        super().__init__(
            positions=heads.num_heads,
            vocab_size=heads.vocab_size,
            mode=mode,
            tree=tree,
            tree_nodes=tree_nodes,
            vocab=vocab,
            accuracies=accuracies,
            candidates=candidates,
        )
        self.heads = heads
        self.dtype = next(heads.parameters()).dtype
        self.stacked = heads.stacked(self.vocab)  # built once: hidden (b, d) -> logits (b, K, N)

    def begin(self, prompts: list[list[int]], prefill: TargetOutput, pending: Tensor) -> None:
        self.hidden = prefill.hidden[:, -1]  # (b, d): prompts are left-padded, so -1 is every row's last token

    @torch.inference_mode()
    def propose(self, gamma: int, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        return self.draft(self.stacked(self.hidden.to(self.dtype)), gamma, sampling, generator)  # logits (b, K, N)

    def commit(self, verdict: Verdict) -> None:
        # path[:, a] is the verify index of the last accepted node (the old pending token when a = 0)
        last = verdict.path.gather(1, verdict.accepted[:, None])  # (b, 1)
        hidden = verdict.target.hidden  # (b, k + 1, d)
        self.hidden = hidden.gather(1, repeat(last, "b 1 -> b 1 d", d=hidden.shape[-1]))[:, 0]


def make_drafter(
    module: MedusaHeads,
    base: object,
    *,
    mode: str = "tree",
    tree: list | None = None,
    tree_nodes: int = 16,
    vocab: Tensor | None = None,
    accuracies: list[list[float]] | None = None,
    candidates: str = "sampled",
) -> MedusaDrafter:
    """The drafter for decoding (decode kwargs from conf/drafter/medusa.yaml `decode:`); `vocab` the sorted
    token ids (N,) its heads may propose (verify.common.vocab.frequent_tokens), None for the full vocabulary;
    `accuracies` the heads' measured rank accuracies, to grow the default tree from (see MedusaDrafter)."""
    return MedusaDrafter(
        module, mode=mode, tree=tree, tree_nodes=tree_nodes, vocab=vocab, accuracies=accuracies, candidates=candidates
    )
