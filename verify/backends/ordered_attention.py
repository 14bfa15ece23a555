"""Attention summed in position order: a tree node's output equals its root-to-node path computed alone, bit for bit.

The pure-torch form: decoding runs the C++ operator (ordered_kernel.py) where it builds, and this where it does
not (no compiler, a GPU, a head size the operator lacks, PROPHET_MEDUSA_KERNEL=0). Both are exact; each is
tested on its own (a tree node against its path, a chain against its steps, under the same form).

Why: a draft tree is verified in one forward, each node at its own cache slot (prefix, then node 0, 1, ...).
A node's keys (the prefix and its ancestors) are then not contiguous: siblings and cousins sit between
them, masked. Plain decoding of the same path sees the same keys contiguous. Softmax and the p @ v product
reduce over the key axis, and a vectorised reduction groups its terms by where they lie (SIMD lanes, AMX
tile pairs, blocked K loops): the same terms at other places are added in another order. In float32 that
differs in the last bits and an argmax flips only at exact ties; in bfloat16 the result is rounded to 8
bits of mantissa after every reduction and a flip follows within a few hundred tokens (seen on SmolLM2):
the tree's output was then not the output of plain decoding.

The fix is to make every reduction depend only on each query's own keys in position order. Keys are taken
in chunks of CHUNK positions:
- the shared chunks: positions [0, c0) with c0 the window start rounded down to a multiple of CHUNK, which
  every query of the row sees in slot order (slot = position there);
- the tail: positions [c0, c0 + T) gathered per query, its older keys then its visible window keys in slot
  order (a node's ancestors, then itself), masked past its own keys.
Each chunk is reduced on its own (the exp-sums over CHUNK contiguous values; p @ v as a (rows x CHUNK) @
(CHUNK x d) product), and the chunk results are added in position order, one float32 add after another, so
exact zeros (chunks a query does not see) change nothing. Plain decoding (one query), a chain and a tree thus
add the same terms in the same order; what remains is that a matmul row does not depend on how many rows share
it, which verify/backends/rows.py makes true by padding every product's rows. The scores are float32 products
(SDPA's precision; bf16 scores moved SmolLM2's logits further from float32's). A step or a chain needs no tail:
its keys sit at slot = position, so each chunk of slots already holds every query's keys where a tree's
gathered tail puts them, and all its chunks are computed like the shared ones. Cost: the p @ v product becomes
one small product per chunk, and a tree's tail values are gathered (T x d per query).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import Tensor

from verify.backends.rows import bmm_rows

__all__ = ["CHUNK", "OrderPlan", "attend_in_order", "order_plan"]

CHUNK = 64  # positions per chunk: a multiple of the SIMD width, few enough chunk sums per query


@dataclass(frozen=True)
class OrderPlan:
    """Built once per forward and used by every layer."""

    bias: Tensor  # (b g, r n, S) additive visibility: 0 seen, -inf not (the query's max comes from it)
    shared: Tensor | None  # (b g, 1, C nch) additive: 0 on the shared chunks' slots (< c0), -inf after
    tail: Tensor | None  # (b g, r n, T) the slot of each tail position of each query (0 where masked)
    tail_rows: Tensor | None  # (b g n T,) the same slots as rows of the (b g S, dh) values: an index_select
    tail_bias: Tensor | None  # (b g, r n, T) additive: 0 on the query's own tail keys, -inf past them
    chunks: int  # nch: shared chunks computed (those below the largest c0 of the batch)
    causal: bool = False  # a step or a chain: every query's keys are slots [0, its own], no tail (below)


def order_plan(
    start: Tensor,
    n: int,
    allow: Tensor | None,
    capacity: int,
    *,
    heads: int,
    kv_heads: int,
    bias: Tensor,
    static: bool = False,
) -> OrderPlan:
    """The plan of a forward writing n entries from slot start (b,), visibility as verify.backends.cache's
    `visibility` (allow (b, n, r) over the last r slots; None: causal); bias is its additive `group_bias`.
    static: shapes that depend on the capacity only (a compiled or graph-captured step); else the shared
    chunks stop at the batch's largest c0 (one host read, free on a CPU)."""
    b, device = start.shape[0], start.device
    if allow is None:  # a step or a chain: the bias alone masks, and every chunk is shared (attend_in_order)
        return OrderPlan(bias=bias, shared=None, tail=None, tail_rows=None, tail_bias=None, chunks=0, causal=True)
    r = allow.shape[-1]
    window = start - (r - n)  # (b,) first slot of the window: every query sees all slots before it
    c0 = torch.div(window, CHUNK, rounding_mode="floor") * CHUNK  # (b,)
    length = CHUNK * (-(-(CHUNK - 1 + r) // CHUNK))  # T: covers [c0, window) and the whole window
    # the window slots each query sees, in slot order, first (a stable sort puts the visible ones first)
    order = torch.sort((~allow).to(torch.uint8), dim=-1, stable=True).indices  # (b, n, r)
    count = allow.sum(-1)  # (b, n) keys each query sees in the window
    pos = c0[:, None] + torch.arange(length, device=device)  # (b, T) the tail's positions
    rank = (pos - window[:, None])[:, None, :].expand(b, n, length)  # (b, n, T) index within the window
    in_window = window[:, None, None] + order.gather(2, rank.clamp(0, r - 1))
    slot = torch.where(rank < 0, pos[:, None, :].expand(b, n, length), in_window)
    valid = rank < count[:, :, None]  # older slots (rank < 0) and the query's own window keys
    slot = torch.where(valid, slot, torch.zeros_like(slot))
    g, rows = kv_heads, heads // kv_heads
    tail_bias = torch.zeros(valid.shape, dtype=torch.float32, device=device).masked_fill_(~valid, float("-inf"))
    chunks = (capacity // CHUNK) if static else int(c0.max()) // CHUNK
    shared = torch.arange(chunks * CHUNK, device=device)[None, :] < c0[:, None]  # (b, C nch)
    shared = torch.zeros(shared.shape, dtype=torch.float32, device=device).masked_fill_(~shared, float("-inf"))
    flat = repeat(slot, "b n t -> (b g) (n t)", g=g) + capacity * torch.arange(b * g, device=device)[:, None]
    return OrderPlan(
        bias=bias,
        shared=repeat(shared, "b s -> (b g) 1 s", g=g),
        tail=repeat(slot, "b n t -> (b g) (r n) t", g=g, r=rows),
        tail_rows=flat.reshape(-1),
        tail_bias=repeat(tail_bias, "b n t -> (b g) (r n) t", g=g, r=rows),
        chunks=chunks,
    )


def attend_in_order(q: Tensor, k: Tensor, v: Tensor, plan: OrderPlan, scale: float) -> Tensor:
    """q (b, n, h, dh) over k, v (b, g, S, dh) (g kv heads, h / g queries each) -> (b, n, h dh), every sum
    taken chunk by chunk in position order (module docstring)."""
    b, n, h, d = q.shape
    g, span = k.shape[1], k.shape[2]
    q = rearrange(q, "b n (g r) d -> (b g) (r n) d", g=g)
    keys, values = k.reshape(b * g, span, d), v.reshape(b * g, span, d)
    # float32 scores, as SDPA computes them: rounded to bf16 (8 bits) they would move attention weights by up to
    # ~6% at scores of 16-32 (measured on SmolLM2: bf16 logits 0.87 from float32's at most, 0.58 this way)
    scores = bmm_rows(q.float(), keys.transpose(1, 2).float()).mul_(scale).add_(plan.bias)  # (B, R, S)
    top = scores.amax(dim=-1, keepdim=True)  # each query sees at least itself: finite
    if plan.causal:
        # A step or a chain: slot = position, so each chunk of 64 slots already holds every query's keys at the
        # offsets a tree's gathered tail gives them (zeros where masked): the same chunk sums, without the tail
        e = scores.sub_(top).exp_()  # (B, R, S): 0 where the bias hides a slot
        pad = -span % CHUNK  # a compiled step's capacity need not be a multiple of CHUNK
        if pad:
            e, values = F.pad(e, (0, pad)), F.pad(values, (0, 0, 0, pad))
        total = _sum_in_order(_chunk_products(e, values, per_query=1))
        out = (total[..., :d] / total[..., d:]).to(q.dtype)
        return rearrange(out, "(b g) (r n) d -> b n (g r d)", b=b, n=n)
    # the shared chunks, then the tail (each query's own keys in position order), chunk by chunk
    e = scores[..., : plan.chunks * CHUNK].add(plan.shared).sub_(top).exp_()  # 0 past c0
    shared = _chunk_products(e, values[:, : plan.chunks * CHUNK], per_query=1)
    e = scores.gather(2, plan.tail).add_(plan.tail_bias).sub_(top).exp_()  # (B, R, T)
    gathered = values.reshape(-1, d).index_select(0, plan.tail_rows)  # (B n T, d)
    tail = _chunk_products(e, gathered.view(b * g * n, -1, d), per_query=n)
    # chunk results added in position order (zero chunks change nothing), then normalised once
    total = _sum_in_order(torch.cat((shared, tail), dim=2))
    out = (total[..., :d] / total[..., d:]).to(q.dtype)  # (B, R, d)
    return rearrange(out, "(b g) (r n) d -> b n (g r d)", b=b, n=n)


def _sum_in_order(chunks: Tensor) -> Tensor:
    """(B, R, c, ...) -> (B, R, ...): the c chunk results added one after another in float32. Not cumsum: on a
    CPU it accumulates float32 in float64 and rounds once, so its sum of three chunks is not two float32 adds,
    and a step (all its chunks in one sum) would leave a tree (shared chunks, then tail chunks) in the last bit."""
    total = chunks[:, :, 0].clone()
    for c in range(1, chunks.shape[2]):
        total.add_(chunks[:, :, c])  # in place: the same float32 add, without a new tensor per chunk
    return total


def _chunk_products(e: Tensor, values: Tensor, *, per_query: int) -> Tensor:
    """e (B, R, C c) float32 weights over c chunks of CHUNK keys, values (B Q, C c, d) with Q = per_query value
    sequences per B (query row r n of B reads sequence n) -> (B, R, c, d + 1): each chunk's p @ v, and its
    exp-sum as the last channel (so that one add per chunk sums both), each chunk reduced on its own, in float32."""
    (bg, rows, width), d = e.shape, values.shape[-1]
    c = width // CHUNK
    if c == 0:
        return e.new_zeros(bg, rows, 0, d + 1)
    z = e.view(bg, rows, c, CHUNK).sum(dim=-1, keepdim=True)
    p = rearrange(e.to(values.dtype), "B (r n) (c k) -> (B n c) r k", n=per_query, k=CHUNK)
    out = bmm_rows(p, rearrange(values, "Q (c k) d -> (Q c) k d", k=CHUNK))
    return torch.cat((rearrange(out, "(B n c) r d -> B (r n) c d", n=per_query, c=c).float(), z), dim=-1)
