"""The static KV cache of a decoder for a batch of rows, and its one rollback function.

The target owns one of these; a drafter with its own decoder (the draft model, the prophet) owns
another. `StaticCache.commit` is the only code in the project that moves cached keys and values.
"""

from __future__ import annotations

import weakref

import torch
from einops import rearrange
from torch import Tensor


def tree_attention(parents: Tensor) -> tuple[Tensor, Tensor]:
    """parents (b, n) (-1 for a root) -> ancestor-or-self mask (b, n, n) and depth (b, n).

    Nodes are in topological order (parents before children). The ancestor relation is closed by squaring:
    after round r every node knows its ancestors up to 2^r levels up, so ceil(log2 n) rounds of a small
    matrix product suffice, with no read of the device to learn the tree's depth (a GPU cycle waits on none).
    """
    b, n = parents.shape
    eye = torch.eye(n, dtype=torch.bool, device=parents.device)
    up = torch.nn.functional.one_hot(parents.clamp(min=0), n).bool() & rearrange(parents >= 0, "b n -> b n 1")
    mask = (up | eye).float()  # (b, n, n): node i, then its ancestors j
    for _ in range(max(n - 1, 1).bit_length()):
        mask = (torch.bmm(mask, mask) > 0).float()  # exact: sums of at most n ones
    mask = mask.bool()
    return mask, mask.sum(-1) - 1


def visibility(start: Tensor, n: int, allow: Tensor | None, capacity: int) -> Tensor:
    """Attention mask (b, 1, n, capacity) for n new entries written from slot start (b,) of each row.

    allow (b, n, r): which of the last r slots (the r - n newest cached entries, then the n new ones)
    each new entry sees; older entries are always visible, later slots never; None = causal among the
    new entries.
    """
    b, device = start.shape[0], start.device
    if allow is None:
        allow = torch.ones(n, n, dtype=torch.bool, device=device).tril().expand(b, n, n)
    r = allow.shape[-1]
    rel = torch.arange(capacity, device=device)[None, :] - (start - (r - n))[:, None]  # (b, S) index in the window
    window = (rel >= 0) & (rel < r)
    seen = allow.gather(2, rel.clamp(0, r - 1)[:, None, :].expand(b, n, capacity)) & window[:, None, :]
    return rearrange(seen | (rel < 0)[:, None, :], "b n s -> b 1 n s")


def keeps_prefix(keep: Tensor) -> Tensor:
    """Whether every row of keep (b, k) keeps a prefix of its k entries, slots 0..count-1 (keeping none is one too):
    a 0-dim bool left on keep's device, for a caller to read with a host read it makes anyway and then commit
    with `StaticCache.commit(keep, prefix=...)`."""
    first = torch.arange(keep.shape[1], device=keep.device) < keep.sum(dim=1, keepdim=True)
    return (keep == first).all()


def kv_index(slots: Tensor, buf: Tensor) -> Tensor:
    """slots (b, n) -> the rows (b h n,) that `write_kv` fills in `rows(buf)`, for a layer's buffer (b, h, S, dh)
    or its eager span (a view of the first slots): the same for every layer of a forward, so a decoder builds
    it once per forward."""
    b, h = buf.shape[:2]
    (sb, sh, ss, sd), d = buf.stride(), buf.shape[3]
    assert ss == d and sd == 1, f"a cache buffer holds each slot's {d} values contiguously, got strides {buf.stride()}"
    first = (sb * torch.arange(b, device=slots.device)[:, None] + sh * torch.arange(h, device=slots.device)) // d
    return (first[:, :, None] + slots[:, None, :]).reshape(-1)


def rows(buf: Tensor) -> Tensor:
    """A layer's buffer (b, h, S, dh), or a view of its first slots, as the (rows, dh) matrix of its storage
    from its first element: slot s of (b, h) is row kv_index's (b sb + h sh) / dh + s."""
    (sb, sh, _, _), (b, h, span, d) = buf.stride(), buf.shape
    return buf.as_strided(((sb * (b - 1) + sh * (h - 1)) // d + span, d), (d, 1))


def write_kv(
    k_buf: Tensor, v_buf: Tensor, k: Tensor, v: Tensor, slots: Tensor, index: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Store new keys/values (b, h, n, dh) at slots (b, n) of one layer's buffers (b, h, S, dh), in place;
    `index` is kv_index(slots, k_buf) when the caller has it already. Rows are copied with index_copy_: a
    scatter_ along the slot axis rewrote the whole buffer on a CPU (22 us for 448 slots against 1.6)."""
    index = kv_index(slots, k_buf) if index is None else index
    d = k.shape[-1]
    rows(k_buf).index_copy_(0, index, k.reshape(-1, d).to(k_buf.dtype))  # float32 keys of a bf16 model: exact
    rows(v_buf).index_copy_(0, index, v.reshape(-1, d).to(v_buf.dtype))
    return k_buf, v_buf


# Buffers of dropped caches, by (layers, shape, device, dtype, inference or not), for the next cache of
# that shape. A decode step replayed as a CUDA graph (verify/backends/graphs.py) is captured on its cache's
# buffer addresses: a new cache per generation would capture again every time, a recycled one replays. Each
# shape keeps at most POOL_SETS sets of at most POOL_BYTES, so a huge batch's cache is not held after it is
# dropped.
_POOL: dict[tuple, list[tuple[list[Tensor], list[Tensor]]]] = {}
POOL_SETS, POOL_BYTES = 2, 1 << 27


def _key(k: list[Tensor], v: list[Tensor]) -> tuple:
    # inference tensors (made under torch.inference_mode) cannot be updated outside it: a pool of their own
    return len(k), tuple(k[0].shape), k[0].device, k[0].dtype, v[0].dtype, k[0].is_inference()


def _take(layers: int, shape: tuple[int, ...], device: torch.device, dtypes: tuple[torch.dtype, torch.dtype]):
    """Zeroed key and value buffers (of dtypes (keys', values')): a dropped cache's of the same shape, or new ones."""
    if device.type == "cuda" and device.index is None:  # the same device named two ways is one key
        device = torch.device("cuda", torch.cuda.current_device())
    free = _POOL.get((layers, shape, device, *dtypes, torch.is_inference_mode_enabled()))
    if free:
        k, v = free.pop()
        for t in k + v:
            t.zero_()  # as a new cache: the slots a mask hides hold zeros, never another run's values
        return k, v
    return tuple([torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)] for dtype in dtypes)


def _give_back(k: list[Tensor], v: list[Tensor]) -> None:
    if not k or len(k) * (k[0].numel() * k[0].element_size() + v[0].numel() * v[0].element_size()) > POOL_BYTES:
        return
    free = _POOL.setdefault(_key(k, v), [])
    if len(free) < POOL_SETS:
        free.append((k, v))


class StaticCache:
    """Per-layer key/value buffers (b, heads, capacity, dim_head), preallocated, and each row's length (b,).

    One tensor per layer, not one for all layers: a compiled step then updates each buffer in place,
    where a slice of one big tensor would make it copy the whole cache every layer.

    Row b's entry at position p lives in slot p: rows need no padding, and a forward writes its n new
    entries at slots [length_b, length_b + n). Keys are stored already rotated (at the position the
    writer gave them), so a kept entry must end in the slot of its position: true for a chain, and for a
    tree when the kept nodes are a root-to-node path (node at depth d at slot start + d), which is what
    the decode loop keeps.
    """

    def __init__(
        self,
        *,
        layers: int,
        batch: int,
        heads: int,
        dim_head: int,
        capacity: int,
        device: torch.device,
        dtype: torch.dtype,
        key_dtype: torch.dtype | None = None,
    ):
        # key_dtype: float32 keys for a bf16 model whose attention scores are float32 products (the lean Llama
        # engine's): stored once, exactly, instead of converted over the whole span by every layer of every step
        dtypes = (key_dtype or dtype, dtype)
        self.k, self.v = _take(layers, (batch, heads, capacity, dim_head), torch.device(device), dtypes)
        self._release = weakref.finalize(self, _give_back, self.k, self.v)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # (b,) valid entries per row
        # A host-side upper bound of lengths.max(), to grow the buffers before they overflow. A commit that
        # is known to keep a prefix leaves it as it was (still an upper bound) instead of reading the lengths
        # back: the exact value is read only where it matters (eager spans, growth), see `exact_bound`.
        self.bound, self.stale = 0, False
        self.span = 0  # the last eager span (slots attended): a wider one is taken only after an exact read

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def reserve(self, n: int) -> Tensor:
        """Make room for n new entries per row; returns each row's first new slot (b,)."""
        if self.bound + n > self.capacity and self.exact_bound() + n > self.capacity:
            # rare: grow by doubling (shapes change once, not every step)
            extra = max(self.bound + n, 2 * self.capacity) - self.capacity
            pad = lambda t: torch.cat((t, t.new_zeros(*t.shape[:2], extra, t.shape[3])), dim=2)  # noqa: E731
            self.k, self.v = [pad(t) for t in self.k], [pad(t) for t in self.v]
            self._release.detach()  # the old buffers go; the grown ones return to the pool in their turn
            self._release = weakref.finalize(self, _give_back, self.k, self.v)
        return self.lengths

    def buffers(self, n: int, *, full: bool) -> tuple[list[Tensor], list[Tensor]]:
        """The key/value buffers a forward of n new entries attends over: all `capacity` slots (fixed
        shapes for a compiled step) or, in eager mode, only the slots in use, rounded up to 64 so that
        attention does not read hundreds of empty slots per step. Views: writes land in the cache."""
        if full:
            return self.k, self.v
        # The upper bound gives a span that covers every row; only where it would cross into a further chunk of 64
        # (rejected drafts left it above the lengths) is the exact bound read: a host read every few dozen
        # tokens, not one per forward. Slots past a row's length are masked, so a wider span changes no result.
        span = -(-(self.bound + n) // 64) * 64
        if self.stale and span > self.span:
            span = -(-(self.exact_bound() + n) // 64) * 64
        self.span = span = min(self.capacity, span)
        return [t[:, :, :span] for t in self.k], [t[:, :, :span] for t in self.v]

    def advance(self, n: int) -> None:
        """The n entries just written are now part of every row."""
        self.lengths = self.lengths + n
        self.bound += n

    def exact_bound(self) -> int:
        """lengths.max() on the host: one read of the device, only after a commit that skipped it."""
        if self.stale:
            self.bound, self.stale = int(self.lengths.max()), False
        return self.bound

    def row(self, b: int) -> StaticCache:
        """Row b as a cache of one row, empty, over the same storage: a forward on it writes row b's slots.
        Continuous batching (verify/loop/continuous.py) prefills a new prompt into a finished row this way, alone,
        so the prompt gets the bits a batch of one gives it. The view never grows: its caller sized the cache."""
        view = object.__new__(StaticCache)
        view.k, view.v = [t[b : b + 1] for t in self.k], [t[b : b + 1] for t in self.v]
        view._release = weakref.finalize(view, lambda: None)  # the storage is this cache's, not the view's
        view.lengths = torch.zeros(1, dtype=torch.long, device=self.lengths.device)
        view.bound, view.stale, view.span = 0, False, 0
        return view

    def set_lengths(self, lengths: list[int]) -> None:
        """Every row's length, known on the host (a continuous batch counts them): exact bound, no read."""
        self.lengths = torch.tensor(lengths, dtype=torch.long, device=self.lengths.device)
        self.bound, self.stale = max(lengths), False

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only these rows (in this order): a continuous batch whose queue ran dry sheds finished rows.
        Copies every buffer once, so a caller does it rarely (when half the rows are idle)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.lengths.device)
        self._release.detach()  # the old buffers are dropped: a pool holds caches of one batch size each
        self.k, self.v = [t.index_select(0, index) for t in self.k], [t.index_select(0, index) for t in self.v]
        self._release = weakref.finalize(self, _give_back, self.k, self.v)
        self.lengths = self.lengths.index_select(0, index)

    @torch.inference_mode()
    def commit(self, keep: Tensor, *, prefix: bool = False) -> None:
        """Roll back: of the last k entries of each row, keep those where keep (b, k) is True, in order.

        `prefix=True`: the caller knows that every row keeps a prefix, slots 0..count-1 (a chain's accepted
        tokens; a tree whose kept nodes come first in its node order, which the decode loop learns from
        `keeps_prefix` with the host read it makes anyway), and this is a length rewind. Otherwise the kept
        entries move down to fill the gaps: one gather and one scatter over the k newest slots of each layer's
        buffers. Neither reads anything back to the host: on a GPU the decode loop waits for the device once
        per step, not at every commit.
        """
        b, k = keep.shape
        counts = keep.sum(dim=1)
        start = self.lengths - k
        if prefix:
            self.lengths, self.stale = start + counts, True
            return
        # The kept entries move down to fill the gaps (a no-op where a row keeps a prefix), without first reading
        # back whether any row needs it. Rows of each buffer's storage are copied by index (`kv_index`): over
        # SmolLM2's 60 buffers, for a 17-node tree, 0.46 ms, where a gather and a scatter along the slot axis took
        # 3.2 ms (0.15 of a step; AMD EPYC, 2 threads).
        steps = torch.arange(k, device=keep.device)
        order = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices  # kept first, in order
        for bufs in (self.k, self.v):
            src, dst = (kv_index(start[:, None] + s, bufs[0]) for s in (order, steps.expand(b, k)))
            for buf in bufs:
                storage = rows(buf)
                storage.index_copy_(0, dst, storage.index_select(0, src))
        self.lengths, self.stale = start + counts, True  # the bound stays an upper bound
