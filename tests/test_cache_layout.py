"""Keys stored transposed (b, h, dh, S) hold what keys stored (b, h, S, dh) hold, through every cache operation.

The lean Llama engine stores its keys transposed so that a step's scores read contiguous slots. Every operation
that moves cached entries (writes at ragged slots, a tree commit that moves kept entries down, growth, row views
for continuous batching, shedding rows) must treat both layouts alike: run the same script on two caches and
compare after each operation.
"""

from __future__ import annotations

import torch

from verify.backends.cache import StaticCache, key_index, kv_index, write_keys, write_values

B, H, D, LAYERS = 3, 2, 8, 2


def caches(capacity: int) -> tuple[StaticCache, StaticCache]:
    make = lambda transposed: StaticCache(  # noqa: E731
        layers=LAYERS,
        batch=B,
        heads=H,
        dim_head=D,
        capacity=capacity,
        device=torch.device("cpu"),
        dtype=torch.float32,
        keys_transposed=transposed,
    )
    return make(False), make(True)


def write(cache: StaticCache, n: int, seed: int) -> None:
    """n new random entries per row at each row's length, as a forward writes them (every layer)."""
    start = cache.reserve(n)
    slots = start[:, None] + torch.arange(n)
    k_buf, v_buf = cache.buffers(n, full=False)
    g = torch.Generator().manual_seed(seed)
    for layer in range(LAYERS):
        k, v = torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)
        if cache.keys_transposed:
            write_keys(k_buf[layer], k, key_index(slots, k_buf[layer]))
        else:
            write_values(k_buf[layer], k, kv_index(slots, k_buf[layer]))
        write_values(v_buf[layer], v, kv_index(slots, v_buf[layer]))
    cache.advance(n)


def assert_same(plain: StaticCache, transposed: StaticCache) -> None:
    assert plain.capacity == transposed.capacity and torch.equal(plain.lengths, transposed.lengths)
    for a, b in zip(plain.k, transposed.k):
        assert b.shape == (a.shape[0], H, D, a.shape[2])
        assert torch.equal(a, b.transpose(2, 3))
    for a, b in zip(plain.v, transposed.v):
        assert torch.equal(a, b)


def test_writes_commits_growth_rows_and_shedding_keep_both_layouts_alike():
    plain, transposed = caches(capacity=16)
    for cache in (plain, transposed):
        write(cache, 5, seed=0)
    assert_same(plain, transposed)
    keep = torch.tensor([[True, False, True, True, False], [False, True, False, True, True], [True] * 5])
    for cache in (plain, transposed):  # a tree commit: kept entries move down over the gaps
        cache.commit(keep)
    assert_same(plain, transposed)
    for cache in (plain, transposed):  # ragged rows now; 14 more entries overflow 16 slots: the buffers grow
        cache.exact_bound()
        write(cache, 14, seed=1)
    assert plain.capacity > 16
    assert_same(plain, transposed)
    for cache in (plain, transposed):  # continuous batching: a prompt prefilled into row 1 alone
        view = cache.row(1)
        view.reserve(4)
        slots = torch.arange(4)[None]
        k_buf, v_buf = view.buffers(4, full=True)
        k, v = torch.full((1, H, 4, D), 7.0), torch.full((1, H, 4, D), -7.0)
        for layer in range(LAYERS):
            if view.keys_transposed:
                write_keys(k_buf[layer], k, key_index(slots, k_buf[layer]))
            else:
                write_values(k_buf[layer], k, kv_index(slots, k_buf[layer]))
            write_values(v_buf[layer], v, kv_index(slots, v_buf[layer]))
    assert_same(plain, transposed)
    assert torch.equal(transposed.k[0][1, :, :, :4], torch.full((H, D, 4), 7.0))
    for cache in (plain, transposed):
        cache.keep_rows([2, 0])
    assert_same(plain, transposed)


def test_a_pooled_buffer_serves_either_layout():
    plain, transposed = caches(capacity=24)
    write(transposed, 3, seed=2)
    del transposed  # its buffers go back to the pool, zeroed when taken again
    again = caches(capacity=24)[0]
    assert again.k[0].shape == (B, H, 24, D) and not any(t.any() for t in again.k)
    del plain, again
    assert caches(capacity=24)[1].k[0].shape == (B, H, D, 24)
