"""Drafting with the prophet: chains (EAGLE-1) and dynamic trees (EAGLE-2), on the prophet's own KV cache.

The cache holds one entry per accepted context position t: the pair (f_t, x_{t+1}) of the base's TRUE
feature and the next token; the last entry pairs the last accepted feature with the pending token,
and its output, `self.feature`, is the predicted feature at the pending position (whose logits give the
first draft token). Drafting appends entries made from predicted features; `commit` removes all of
them and appends the true pairs of the accepted path, read from the verification forward's hidden
states. So every cycle starts from the base's own features, never from a stale predicted state (a
public version keeps the drafted state and loses acceptance), at the cost of one prophet forward per
cycle that also yields the next first draft token.

Modes. "chain": gamma tokens, gamma - 1 one-entry forwards; at temperature > 0 each token is sampled
from the prophet's distribution after the shared sampling transform and q is returned, else argmax.
"tree": EAGLE-2's dynamic tree, one forward per level over the whole frontier of every row; growth stops
early once no deeper node can make the final cut. At T = 0 its candidates are each node's top-k tokens
(q None). At T > 0 (`candidates="sampled"`, the default) each frontier node's k children are distinct draws
without replacement from the prophet's distribution after the sampling transform, with q, and the tree is
cut by values fixed before the draws, so the cut never favours a likely token (see `_children` for why that
keeps it lossless); `candidates="ranked"` keeps the top-k candidates at T > 0.
Per-step Python work is kept small: no per-row or per-node loops anywhere.

A prophet with `fuse_layers` reads the target's residual states after those blocks too: the drafter
names them in `target_layers`, the loop asks the target for them, and every true pair is made from
`prophet.seed(hidden, layers)` of the accepted positions (predicted features stay as they are).

`vocab` (sorted ids (N,), see verify/common/vocab.py) trims the frozen output layer to the N most frequent
tokens, once, at construction: every draft step projects onto N rows instead of V (the prophet's
largest matmul at a real vocabulary). Argmax, sampling and the tree's top-k run over the subset and map
back to full ids; a sampled chain's or tree's q is zero outside the subset, so sampling stays lossless.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import Tensor

from prophet.model import Prophet, check_same_base
from verify.backends.cache import StaticCache
from verify.backends.target import TargetOutput, left_to_right, pad_prompts
from verify.common.numerics import check_int
from verify.common.vocab import check_vocab, expand_probs, full_ids
from verify.loop.drafter import Draft, Verdict
from verify.loop.sampling import SamplingConfig, draft_from_logits, probs_from_logits, sample_siblings
from verify.loop.tree import check_candidates

MODES = ("chain", "tree")


class ProphetDrafter:
    def __init__(
        self,
        prophet: Prophet,
        *,
        mode: str = "tree",
        top_k: int = 4,
        depth: int = 5,
        tree_nodes: int = 16,
        compile: bool = False,
        vocab: Tensor | None = None,
        candidates: str = "sampled",
    ):
        """`candidates`: the tree's children at T > 0, "sampled" (drawn without replacement, with q) or
        "ranked" (each node's top-k, q None); see the module docstring."""
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: must be one of {', '.join(MODES)}")
        self.candidates = check_candidates(candidates)
        for name, value in dict(top_k=top_k, depth=depth, tree_nodes=tree_nodes).items():
            check_int(name, value)
        # The frozen base's output rows for the subset, copied once: (N, d_base), (N,) or None (an EAGLE-3 prophet
        # trained elsewhere: its own rows, over its own draft vocabulary).
        self.vocab, self.weight, self.bias = prophet.output_layer(check_vocab(vocab, prophet.vocab_size))
        ranked = prophet.vocab_size if self.vocab is None else self.vocab.numel()  # tokens the tree ranks
        if top_k > ranked:
            raise ValueError(f"top_k={top_k}: must be at most the vocabulary size {ranked} (trimmed: the subset's)")
        self.prophet = prophet.eval()  # drafting is inference; a training loop switches back with .train()
        self.target_layers = prophet.fuse_layers  # blocks whose states the target hands over (verify/loop/drafter.py)
        self.vocab_size = prophet.vocab_size
        self.mode, self.top_k, self.depth, self.tree_nodes = mode, top_k, depth, tree_nodes
        self.cache = None
        self.compile = compile  # torch.compile the prophet's decoder steps
        self.commit_width = 1  # compiled: the block every commit is padded to (the widest a propose planned)
        self.drafted = 0  # cache entries the last propose added (from predicted features)

    @torch.inference_mode()
    def begin(self, prompts: list[list[int]], prefill: TargetOutput, pending: Tensor) -> None:
        self.cache, self.feature = prefill_cache(self.prophet, prompts, prefill, pending)  # (b, d_base)
        self.drafted = 0

    @torch.inference_mode()
    def propose(self, gamma: int, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        check_int("gamma", gamma)
        # The widest block a commit may feed: compiled, every commit is padded to it (one program), so a shorter
        # path (a tree that stopped early, a budget's last step) never compiles a new one inside a timed run.
        self.commit_width = max(self.commit_width, (gamma if self.mode == "chain" else min(self.depth, gamma)) + 1)
        if self.mode == "chain":
            return self._chain(gamma, sampling, generator)
        return self._tree(min(self.depth, gamma), sampling, generator)

    @torch.inference_mode()
    def commit(self, verdict: Verdict) -> None:
        """Drop the drafted entries; append the true pairs along the accepted path (a + 1 per row).

        Entry i pairs the base's feature at path node i with the token after it: the next accepted
        draft token, or the new pending token at i = a. Rows that have finished get placeholder entries
        that nothing reads."""
        if self.drafted:
            self.cache.commit(
                torch.zeros(verdict.accepted.shape[0], self.drafted, dtype=torch.bool, device=verdict.accepted.device),
                prefix=True,
            )
            self.drafted = 0
        width = verdict.path.shape[1]  # rows accept different counts: feed the padded block, keep a + 1
        features, tokens = self._seed_features(verdict), verdict.tokens[:, :width]
        if self.compile:  # one compiled program (see propose); a wider path (a hybrid's copy) widens it once
            self.commit_width = max(self.commit_width, width)
            features, tokens = pad_block(features, tokens, self.commit_width)
            width = self.commit_width
        out = self._step(features, tokens, self.cache)  # (b, w, d)
        self.cache.commit(torch.arange(width, device=out.device) < (verdict.accepted + 1)[:, None], prefix=True)
        rows = torch.arange(out.shape[0], device=out.device)
        self.feature = out[rows, verdict.accepted]  # predicted feature at the new pending position

    def _step(self, features: Tensor, next_tokens: Tensor, cache, **attn) -> Tensor:
        return self.prophet.step(features, next_tokens, cache, compile=self.compile, **attn)

    def _logits(self, features: Tensor) -> Tensor:
        """(..., d_base) predicted features -> (..., N) logits over the subset (all V untrimmed)."""
        return F.linear(self.prophet.readout(features), self.weight, self.bias)

    def _seed_features(self, verdict: Verdict) -> Tensor:
        return path_features(self.prophet, verdict)  # (b, D + 1, d_base)

    def _chain(self, gamma: int, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        """gamma autoregressive steps in feature space: gamma - 1 one-entry forwards."""
        feature, tokens, qs = self.feature, [], []
        for j in range(gamma):
            if j > 0:
                feature = self._step(feature[:, None], tokens[-1][:, None], self.cache)[:, 0]
            token, q = draft_from_logits(
                self._logits(feature), sampling, generator, vocab=self.vocab, vocab_size=self.vocab_size
            )
            tokens.append(token)
            qs += [] if q is None else [q]  # (b, V), zero outside the subset
        self.drafted = gamma - 1
        return Draft(tokens=torch.stack(tokens, dim=1), q=torch.stack(qs, dim=1) if qs else None)

    def _tree(self, levels: int, sampling: SamplingConfig, generator: torch.Generator | None) -> Draft:
        """EAGLE-2's dynamic tree: grow `levels` levels of k children per frontier node, the next frontier the k
        best-scoring new nodes; keep the `tree_nodes` nodes of highest value of all.

        The pool lists every grown node in level order, each node's children together in draw order: values,
        tokens and parents (pool-indexed, -1 = child of the pending token), each (b, P), and with sampled
        candidates q (b, P, N). Ranked candidates (T = 0) have q None, and value = score = the path's
        cumulative log-probability (EAGLE-2 itself); sampled ones are `_children`'s.
        """
        b, k = self.feature.shape[0], self.top_k
        value, score, token, q = self._children(self._logits(self.feature), None, sampling, generator)  # (b, k)
        pool, qs = [(value, token, torch.full_like(token, -1))], [] if q is None else [q]
        frontier = dict(
            score=score,
            token=token,
            pool=repeat(torch.arange(k, device=token.device), "k -> b k", b=b),
            feature=repeat(self.feature, "b d -> b k d", k=k),
            entry=torch.full_like(token, -1),
        )
        ancestors = torch.zeros(b, 0, 0, dtype=torch.bool, device=token.device)  # among drafted entries
        length0, size = self.cache.lengths.clone(), k  # (b,) each row's cached entries before drafting
        for _ in range(levels - 1):  # level 1 came from self.feature without a forward
            if _settled(pool, frontier["score"], self.tree_nodes):
                break  # no deeper node can make the final cut: the same tree, fewer forwards
            # One forward over the frontier: entry i pairs frontier node i's parent feature with its token.
            entries = ancestors.shape[1]  # index of this level's first entry among drafted entries
            allow, pos, ancestors = _level_attention(frontier["entry"], ancestors, length0)
            if self.compile:  # every level one program: its window over the drafted entries at the deepest level's size
                allow = F.pad(allow, ((self.depth - 1) * k - allow.shape[-1], 0), value=True)
            feature = self._step(frontier["feature"], frontier["token"], self.cache, allow=allow, pos=pos)  # (b, k, d)
            value, score, child, q = self._children(self._logits(feature), frontier["score"], sampling, generator)
            cand_value, cand_score, cand_token = (rearrange(x, "b p c -> b (p c)") for x in (value, score, child))
            cand_parent = repeat(frontier["pool"], "b p -> b (p c)", c=k)
            pool.append((cand_value, cand_token, cand_parent))
            qs += [] if q is None else [rearrange(q, "b p c n -> b (p c) n")]
            best = cand_score.topk(k, dim=-1).indices  # (b, k): the next frontier among k * k candidates
            parent = best // k  # which frontier node (= which entry of this forward) each one extends
            frontier = dict(
                score=cand_score.gather(1, best),
                token=cand_token.gather(1, best),
                pool=size + best,
                feature=feature.gather(1, repeat(parent, "b k -> b k d", d=feature.shape[-1])),
                entry=entries + parent,
            )
            size += k * k
        self.drafted = ancestors.shape[1]
        values, tokens, parents = (torch.cat(x, dim=1) for x in zip(*pool))
        draft = _best_subtree(values, tokens, parents, self.tree_nodes, torch.cat(qs, dim=1) if qs else None)
        if draft.q is not None:
            draft.q = expand_probs(draft.q, self.vocab, self.vocab_size)  # (b, n, V), zero outside the subset
        return draft

    def _children(
        self, logits: Tensor, parent: Tensor | None, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """k children for each frontier node: its logits (..., N) and score (...) (None at the pending token: 0)
        -> value (..., k), what the final cut keeps nodes by; score (..., k), what picks the next frontier;
        tokens (..., k), full ids; q (..., k, N), the distribution each was drawn from, or None.

        Ranked (T = 0, or candidates="ranked"): the top-k tokens; value = score = the path's cumulative
        log-probability, EAGLE-2's own. Sampled: k draws without replacement from the node's distribution
        q_X (the sampling transform), draw j with q_X less draws < j, renormalised (sample_siblings).

        Why sampled trees stay lossless. The rule tries a node's children in node order and accepts child c
        with min(1, r(c) / q_c(c)); that is a valid rejection step only if, given everything before it, c
        follows q_c. A cut that looked at c's own token would break it: keeping the likely draws and dropping
        the unlikely ones makes the kept ones likelier than q_c says (e.g. keep the better of two draws from
        q = (0.9, 0.1): a target r = (0.5, 0.5) then emits the first token 55% of the time). So the value a
        node is kept by is fixed before it is drawn: its parent's score plus the log of the j-th largest
        probability of q_X for draw j (what the j-th child is worth in the ranked tree). Its score, which only
        decides whether its own children are grown, may use its token: the parent's score plus log q_X(token),
        capped at its value. Then every node a node's token can change (its descendants, its later siblings
        and theirs, the nodes grown instead of them) has value and score at most its value: none outranks it
        in the final cut (the `tree_nodes` highest values, ties to the earlier node), and none takes a
        frontier place from a node whose children could. Whether a node is kept is settled by nodes its
        token does not change. The cut keeps a node's earlier siblings whenever it keeps the node (values fall
        with j), so the children the rule tries are draws 0, 1, .. in order, each with its q. (Checked by
        tests/test_prophet.py: chi-square at T = 1 and 0.7, and a cut by the drawn tokens' log q is rejected.)
        """
        if sampling.greedy or self.candidates == "ranked":
            logp, index = logits.float().log_softmax(-1).topk(self.top_k, dim=-1)
            score = logp if parent is None else parent[..., None] + logp
            return score, score, full_ids(index, self.vocab), None
        probs = probs_from_logits(logits, sampling)  # (..., N)
        index, q = sample_siblings(probs, self.top_k, generator)  # (..., k), (..., k, N)
        before = torch.zeros_like(probs[..., :1]) if parent is None else parent[..., None]  # (..., 1)
        value = before + probs.topk(self.top_k, dim=-1).values.log()  # log 0 = -inf: a pick of no probability
        score = torch.minimum(value, before + probs.gather(-1, index).log())
        return value, score, full_ids(index, self.vocab), q


def prefill_cache(
    prophet: Prophet, prompts: list[list[int]], prefill: TargetOutput, pending: Tensor
) -> tuple[StaticCache, Tensor]:
    """A new cache seeded with (f_t, x_{t+1}) for every prompt position, the last pairing f_{L-1} with `pending`
    (f_t the true features as the prophet reads them, `seed`), and the predicted feature at the pending
    position (b, d_base), whose logits give the first draft token."""
    tokens, lengths = pad_prompts(prompts, 0, pending.device)  # (b, W), rows from index 0
    b, width = tokens.shape
    rows = torch.arange(b, device=pending.device)
    next_tokens = torch.cat((tokens[:, 1:], tokens[:, :1]), dim=1)
    next_tokens[rows, lengths - 1] = pending
    # A capacity that does not depend on the prompt width: a compiled step is one program per shape.
    cache = prophet.new_cache(b, max(512, 2 * width))
    # eager even when compiled: every prompt width would be a new program to compile
    layers = None if prefill.layers is None else left_to_right(prefill.layers, lengths)  # (b, W, S, d_base)
    features = prophet.seed(left_to_right(prefill.hidden, lengths), check_target_layers(prophet, layers))
    out = prophet.step(features, next_tokens, cache)  # (b, W, d_base)
    cache.commit(torch.arange(width, device=pending.device) < lengths[:, None])  # drop the padding entries
    return cache, out[rows, lengths - 1]


def path_features(prophet: Prophet, verdict: Verdict) -> Tensor:
    """The true features at the accepted path nodes [old pending, accepted drafts...]: (b, D + 1, d_base),
    from the base's final hidden states and, for a fused prophet, its layer states at the same nodes."""
    hidden, layers = verdict.target.hidden, check_target_layers(prophet, verdict.target.layers)
    hidden = hidden.gather(1, repeat(verdict.path, "b n -> b n d", d=hidden.shape[-1]))
    if layers is not None:  # gathered like hidden: (b, k + 1, S, d) -> (b, D + 1, S, d)
        layers = layers.gather(1, repeat(verdict.path, "b n -> b n s d", s=layers.shape[2], d=layers.shape[3]))
    return prophet.seed(hidden, layers)


def check_target_layers(prophet: Prophet, layers: Tensor | None) -> Tensor | None:
    """A fused prophet needs the target's layer states: say how to get them when they are missing."""
    if prophet.fuse_layers and layers is None:
        raise ValueError(
            f"the target returned no layer states, and this prophet fuses blocks {list(prophet.fuse_layers)}: "
            "decode with verify.loop.speculative.speculative_generate, which asks the target for drafter.target_layers "
            "(a wrapper around this drafter must expose target_layers too)"
        )
    return layers


def pad_block(features: Tensor, tokens: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """Pad a commit's block (b, w, d), (b, w) to `width` entries by repeating its last one: entries past a
    row's accepted path are dropped by the commit anyway, so their content only has to be finite. A block already
    as wide or wider is returned as it is."""
    extra = width - tokens.shape[1]
    if extra <= 0:
        return features, tokens
    features = torch.cat((features, features[:, -1:].expand(-1, extra, -1)), dim=1)
    return features, torch.cat((tokens, tokens[:, -1:].expand(-1, extra)), dim=1)


def _settled(pool: list[tuple[Tensor, Tensor, Tensor]], frontier_score: Tensor, budget: int) -> bool:
    """True when, in every row, no descendant of the frontier (b, k) can enter the best `budget` pool nodes.

    Descendants never outscore their frontier ancestor (a sampled tree: a pool node's value never exceeds
    its frontier ancestor's score), and a tie loses to the earlier pool node, so once the best frontier
    score is at most the budget-th best pool score, growing further changes nothing.
    Costs one host sync per level, against a prophet forward saved when a row's drafts are unsure.
    """
    scores = torch.cat([score for score, _, _ in pool], dim=1)  # (b, P)
    if scores.shape[1] < budget:
        return False
    cutoff = scores.topk(budget, dim=-1).values[:, -1]
    return bool((frontier_score.amax(dim=-1) <= cutoff).all())


def _level_attention(parent: Tensor, ancestors: Tensor, length0: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Attention for one tree level of n new entries after m drafted ones (m / n levels).

    parent (b, n): each new entry's parent among drafted entries (-1 = the cached prefix);
    ancestors (b, m, m): ancestor-or-self among drafted entries; length0 (b,): each row's cached
    entries before drafting. A new entry sees the cached prefix, its drafted ancestors and itself, at
    position length0 + its depth among drafted entries (its position in a chain), as a single-forward
    tree would. Returns `allow` (b, n, m + n) over the drafted and new entries, positions (b, n), and
    the ancestor matrix grown to (b, m + n, m + n).
    """
    b, n = parent.shape
    m, device = ancestors.shape[1], parent.device
    old = torch.zeros(b, n, m, dtype=torch.bool, device=device)  # which drafted entries each new one sees
    if m:
        # the parent's ancestor-or-self row is exactly the drafted entries the child may see
        old = ancestors.gather(1, repeat(parent.clamp(min=0), "b n -> b n m", m=m))
        old &= rearrange(parent >= 0, "b n -> b n 1")
    new = repeat(torch.eye(n, dtype=torch.bool, device=device), "i j -> b i j", b=b)  # self only, not siblings
    pos = repeat(length0 + m // n, "b -> b n", n=n)  # every level adds n entries, one level deeper
    grown = torch.cat(
        (torch.cat((ancestors, torch.zeros(b, m, n, dtype=torch.bool, device=device)), -1), torch.cat((old, new), -1)),
        dim=1,
    )
    return torch.cat((old, new), dim=-1), pos, grown


def _best_subtree(scores: Tensor, tokens: Tensor, parents: Tensor, budget: int, q: Tensor | None = None) -> Draft:
    """Keep the best `budget` pool nodes per row, in topological order, as a draft tree; q (b, P, N) of the pool
    nodes, or None, is kept alike.

    A child's score (a sampled tree: value) is at most its parent's, so it never beats its parent; the
    stable sort breaks ties by pool order, where parents come first. So the kept set is a tree.
    """
    n = min(budget, scores.shape[1])
    best = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n]
    keep = best.sort(dim=1).values  # pool order is level order: parents before children
    draft_index = torch.full_like(scores, -1, dtype=torch.long).scatter_(
        1, keep, repeat(torch.arange(n, device=keep.device), "n -> b n", b=keep.shape[0])
    )
    parent = parents.gather(1, keep)
    parent = torch.where(parent >= 0, draft_index.gather(1, parent.clamp(min=0)), parent)
    if q is not None:
        q = q.gather(1, repeat(keep, "b n -> b n v", v=q.shape[-1]))
    return Draft(tokens=tokens.gather(1, keep), q=q, parents=parent)


def make_drafter(
    module: Prophet, base: torch.nn.Module, *, vocab: Tensor | None = None, **decode_kwargs
) -> ProphetDrafter:
    """decode_kwargs: `decode:` of conf/drafter/prophet.yaml (mode, top_k, depth, tree_nodes, candidates); `vocab` the
    sorted token ids (N,) the drafts may use (verify.common.vocab.frequent_tokens), None for the full vocabulary."""
    check_same_base(module, base)
    return ProphetDrafter(module, vocab=vocab, **decode_kwargs)
