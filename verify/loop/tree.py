"""Draft trees: static trees from rank paths, greedy tree growth, and tree acceptance.

Indexing. A draft tree has k nodes with parents in draft indexing (-1 = child of the pending token).
Verification runs [pending, node_1 .. node_k]; in that "verify indexing" node 0 is the root (the
pending token, already chosen by the target) and draft node i is i + 1. Parents come before children.

Acceptance on a tree returns (accepted (b,), path (b, D + 1), next_token (b,)): the accepted depth,
the verify indices of the root and the accepted nodes (padded with the last one), and the token the
target adds after them.
"""

from __future__ import annotations

import heapq
import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from verify.backends.cache import tree_attention
from verify.loop.sampling import greedy_tokens, sample_from_probs

Path = tuple[int, ...]

# How a tree drafter picks a node's children at temperature > 0: "sampled" draws them without replacement from
# its distribution and reports q (the default); "ranked" takes its top-ranked guesses (q None, as at T = 0).
CANDIDATES = ("sampled", "ranked")


def check_candidates(candidates: str) -> str:
    if candidates not in CANDIDATES:
        raise ValueError(f"candidates={candidates!r}: must be one of {', '.join(CANDIDATES)}")
    return candidates


def sort_paths(paths: list[Path]) -> list[Path]:
    """Sort rank paths by (length, path), checking that each path's prefix is also in the tree."""
    paths = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
    known = set(paths) | {()}
    for p in paths:
        if len(p) == 0 or any(r < 0 for r in p):
            raise ValueError(f"tree path {p}: paths must be non-empty tuples of ranks >= 0")
        if p[:-1] not in known:
            raise ValueError(f"tree path {p}: its prefix {p[:-1]} is not in the tree")
    return paths


def tree_from_paths(paths: list[Path], device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """Rank paths -> draft parents (k,) (-1 = child of the root) and depth (k,) (1 = child of the root), on `device`.

    Node (i, j) is the j-th ranked guess for depth 2 under the i-th ranked guess for depth 1.
    """
    paths = sort_paths(paths)
    index = {p: i for i, p in enumerate(paths)}
    parents = torch.tensor([index[p[:-1]] if len(p) > 1 else -1 for p in paths], device=device)
    depth = torch.tensor([len(p) for p in paths], device=device)
    return parents, depth


def verify_parents(parents: Tensor) -> Tensor:
    """Draft parents (b, k) -> verify-indexed parents (b, k + 1) with the root at index 0."""
    root = torch.full_like(parents[:, :1], -1)
    return torch.cat((root, parents + 1), dim=1)


def sibling_groups(parents: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Draft parents (k,) -> sources (G,), the nodes that have children in node order (-1 = the pending token),
    group (k,), the index in sources of each node's parent, and sibling (k,), how many earlier siblings each
    node has (0 = its parent's first child).

    A sampled tree gives node i its parent's draw number sibling[i] (draws without replacement): the rule tries
    a node's children in node order, so the j-th child tried is the j-th draw, and its q (the distribution
    without draws < j) is the one it came from. A node's rank in a static tree only orders its siblings: ranks
    {0, 2} under one parent take draws 0 and 1 (skipping a draw would stay lossless, but waste it).
    """
    par = parents.tolist()
    sources = sorted(set(par))
    group = [sources.index(p) for p in par]
    sibling = [par[:i].count(p) for i, p in enumerate(par)]
    return (
        torch.tensor(sources, dtype=torch.long, device=parents.device),
        torch.tensor(group, dtype=torch.long, device=parents.device),
        torch.tensor(sibling, dtype=torch.long, device=parents.device),
    )


def grow_tree(accuracies: list[list[float]], budget: int) -> list[Path]:
    """Grow a static tree of `budget` nodes greedily from measured rank accuracies.

    accuracies[d][r] = how often the rank-r guess for depth d + 1 was right. A node's value is the
    product of its ranks' accuracies (the chance its whole path is accepted); the best frontier node
    is added until the budget is spent. Children always score at most their parent, so the result is a tree.
    """
    if budget < 1:
        raise ValueError(f"budget={budget}: a tree needs at least one node")
    heap = [(-accuracies[0][r], (r,)) for r in range(len(accuracies[0]))]
    heapq.heapify(heap)
    chosen: list[Path] = []
    while heap and len(chosen) < budget:
        neg, path = heapq.heappop(heap)
        chosen.append(path)
        if len(path) < len(accuracies):
            for r, acc in enumerate(accuracies[len(path)]):
                heapq.heappush(heap, (neg * acc, path + (r,)))
    return sort_paths(chosen)


def children_table(parents: Tensor) -> Tensor:
    """Verify-indexed parents (b, n) -> children (b, n, m) in node order, padded with -1."""
    b, n = parents.shape
    is_child = rearrange(parents, "b c -> b 1 c") == rearrange(torch.arange(n, device=parents.device), "p -> 1 p 1")
    m = max(int(is_child.sum(-1).max()), 1)
    # Stable sort of "not a child" puts each node's children first, in node order.
    order = torch.sort((~is_child).to(torch.uint8), dim=-1, stable=True).indices[..., :m]
    return torch.where(is_child.gather(-1, order), order, torch.full_like(order, -1))


def tree_sampling_accept(
    p: Tensor,
    tokens: Tensor,
    parents: Tensor,
    q: Tensor | None = None,
    generator: torch.Generator | None = None,
    *,
    delta: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Multi-candidate acceptance on a tree (SpecInfer, EAGLE-2), with MLX-style leniency `delta` as in
    `verify.loop.acceptance.speculative_accept`; greedy when p is one-hot and delta = 0.

    p (b, n, V) target distributions at the verify nodes; tokens (b, n) verify tokens (root first);
    parents (b, n) verify-indexed; q (b, n, V) the distribution each node was drawn from given its earlier
    siblings (draws without replacement: verify.loop.sampling.sample_siblings), or None for deterministic candidates
    (q one-hot). At a node, try its children in order: accept child c with
    probability min(1, p(c)/q(c) + delta); on rejection p <- norm(max(0, p - q)); if all fail, sample
    from what is left, and the walk stops there for good; at a leaf, sample the bonus token from p. The path
    is always a walk from the root that repeats its last node once it stops. Loops run over depth and
    sibling rank, never over rows or tokens. delta = 0 is lossless; delta > 0 is NOT lossless.
    """
    b, n, vocab = p.shape
    rows = torch.arange(b, device=p.device)
    children = children_table(parents)  # (b, n, m)
    _, depth = tree_attention(parents)
    cur = torch.zeros(b, dtype=torch.long, device=p.device)
    residual = p[:, 0]
    path = [cur]
    # A row whose children were all rejected has stopped for good: its residual already excludes them, and
    # trying them again at the next depth would bias the correction token (and with delta > 0 accept a
    # node that is not a child of the path's end).
    stopped = torch.zeros(b, dtype=torch.bool, device=p.device)
    for _ in range(int(depth.max())):
        moved = torch.zeros(b, dtype=torch.bool, device=p.device)
        for j in range(children.shape[-1]):
            child = children[rows, cur, j]  # (b,)
            try_ = (child >= 0) & ~moved & ~stopped
            c = child.clamp(min=0)
            tok = tokens[rows, c]
            q_c = F.one_hot(tok, vocab).to(p.dtype) if q is None else q[rows, c]
            p_x, q_x = residual.gather(1, tok[:, None]).squeeze(1), q_c.gather(1, tok[:, None]).squeeze(1)
            u = torch.rand(b, generator=generator, device=p.device)
            ok = try_ & (u < (p_x / q_x.clamp(min=1e-20) + delta).clamp(max=1.0))  # + 0.0 changes no bit
            rejected = try_ & ~ok
            left = (residual - q_c).clamp(min=0)
            mass = left.sum(-1, keepdim=True)
            left = torch.where(mass > 0, left / mass.clamp(min=1e-30), residual)
            residual = torch.where(rejected[:, None], left, torch.where(ok[:, None], p[rows, c], residual))
            cur = torch.where(ok, c, cur)
            moved |= ok
        stopped |= ~moved
        path.append(cur)
    path = torch.stack(path, dim=1)  # (b, D + 1), repeats the last accepted node once the walk stops
    accepted = depth.gather(1, cur[:, None]).squeeze(1)
    return accepted, path, sample_from_probs(residual, generator)


def tree_greedy_accept(logits: Tensor, tokens: Tensor, parents: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Greedy acceptance on a tree (temperature 0), with no loop over depth or siblings.

    logits (b, n, V) at the verify nodes; tokens (b, n) and parents (b, n) verify-indexed (root first).
    The same result as `tree_sampling_accept` with one-hot p: walking from the root, a node's children are
    tried in order and the first whose token is the target's argmax after the node is taken. So a node is
    *chosen* when its token matches and no earlier sibling matched; the walk ends at the deepest node whose
    whole path is chosen (chosen nodes form one chain); the next token is the argmax after it. The walk's
    per-sibling loop costs ~2 ms per step for a 9-node tree on a CPU; this is a few tensor ops.
    """
    n = tokens.shape[1]
    ancestors, depth = tree_attention(parents)  # (b, n, n), (b, n)
    best = greedy_tokens(logits)  # (b, n): the target's token after each node
    is_root = parents < 0
    match = (tokens == best.gather(1, parents.clamp(min=0))) & ~is_root
    earlier = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril(-1)  # [i, j]: j comes before i
    siblings = rearrange(parents, "b i -> b i 1") == rearrange(parents, "b j -> b 1 j")
    shadowed = (siblings & earlier & rearrange(match, "b j -> b 1 j")).any(-1)
    chosen = (match & ~shadowed) | is_root
    on_chosen_path = ~(ancestors & ~rearrange(chosen, "b j -> b 1 j")).any(-1)  # every ancestor-or-self chosen
    node = torch.where(on_chosen_path, depth, torch.full_like(depth, -1)).argmax(dim=1)  # (b,) the walk's end
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    return depth[rows, node], path_to(node, ancestors, depth), best[rows, node]


def tree_typical_accept(
    p: Tensor,
    tokens: Tensor,
    parents: Tensor,
    *,
    epsilon: float = 0.09,
    alpha: float = 0.3,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Medusa's typical acceptance on a tree. NOT lossless.

    A node is acceptable if p_parent(token) > min(epsilon, alpha * exp(-H(p_parent))); the accepted node
    is the deepest one whose whole path is acceptable, ties broken by the larger summed log-probability.
    """
    b, n, _ = p.shape
    ancestors, depth = tree_attention(parents)  # (b, n, n), (b, n)
    entropy = -(p * p.clamp(min=1e-30).log()).sum(-1)  # (b, n)
    threshold = torch.minimum(torch.full_like(entropy, epsilon), alpha * torch.exp(-entropy))
    par = parents.clamp(min=0)
    p_parent = p.gather(1, par[..., None].expand(-1, -1, p.shape[-1]))  # (b, n, V)
    p_tok = p_parent.gather(-1, tokens[..., None]).squeeze(-1)
    ok = (p_tok > threshold.gather(1, par)) | (parents < 0)
    logp = torch.where(parents < 0, 0.0, p_tok.clamp(min=1e-30).log())
    path_ok = ~(ancestors & ~ok[:, None, :]).any(-1)
    path_logp = (ancestors.float() * logp[:, None, :]).sum(-1)
    score = torch.where(path_ok, depth * 1e4 + path_logp, torch.full_like(path_logp, -math.inf))
    best = score.argmax(dim=1)  # (b,)
    rows = torch.arange(b, device=p.device)
    accepted = depth[rows, best]
    return accepted, path_to(best, ancestors, depth), sample_from_probs(p[rows, best], generator)


def path_to(node: Tensor, ancestors: Tensor, depth: Tensor) -> Tensor:
    """node (b,) -> its root-to-node path (b, D + 1) in verify indexing, padded by repeating the node."""
    rows = torch.arange(node.shape[0], device=node.device)
    on_path = ancestors[rows, node]  # (b, n)
    levels = torch.arange(int(depth.max()) + 1, device=node.device)
    at_level = on_path[:, None, :] & (depth[:, None, :] == levels[None, :, None])  # (b, D + 1, n)
    return torch.where(at_level.any(-1), at_level.float().argmax(-1), node[:, None])
