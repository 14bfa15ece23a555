"""The C++ position-ordered attention (verify/backends/ordered_kernel.cpp): right against a float64 softmax, a tree
node equal to its path stepped alone and a chain to its steps bit for bit, a batched row equal to itself alone
and blind to every slot it does not see (NaN there changes nothing), and a one-line fallback where it cannot be
built. The engine-level tests (tests/test_ordered_attention.py) run on it too, and on the pure-torch form."""

import os
import subprocess
import sys

import pytest
import torch

from verify.backends import ordered_kernel
from verify.backends.cache import tree_attention
from verify.backends.ordered_kernel import attend_kernel, kernel_available, kernel_plan

pytestmark = pytest.mark.skipif(not kernel_available(), reason="the ordered attention operator could not be built")

PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5, -1, 8]  # two roots' subtrees: node 8 attaches to the cached prefix too
# (q, k, v) dtypes the operator takes: a bf16 model's cache with float32 or bf16 keys, and float32 throughout
DTYPES = [
    (torch.bfloat16, torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float32, torch.float32),
]


def rand(g: torch.Generator, *shape: int, dtype: torch.dtype, s: float = 1.0) -> torch.Tensor:
    # bf16-valued even when stored float32, as a bf16 model's keys are
    return (torch.randn(*shape, generator=g) * s).to(torch.bfloat16).to(dtype)


def path_of(node: int) -> list[int]:
    path = []
    while node >= 0:
        path, node = [node] + path, PARENTS[node]
    return path


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: list[int], scale: float) -> torch.Tensor:
    """float64 softmax attention of one query q (h, d) over slots `seen` of k, v (g, S, d) -> (h d,)."""
    g, h = k.shape[0], q.shape[0]
    qq = q.double().view(g, h // g, -1)
    kk, vv = k[:, seen].double(), v[:, seen].double()
    w = (torch.einsum("grd,gsd->grs", qq, kk) * scale).softmax(-1)
    return torch.einsum("grs,gsd->grd", w, vv).reshape(-1)


@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 2, 32), (4, 4, 16), (8, 2, 128), (6, 1, 64)])
def test_the_operator_is_softmax_attention(dtypes, heads, kv_heads, d):
    qt, kt, vt = dtypes
    g = torch.Generator().manual_seed(d + heads)
    b, n, span = 2, 5, 300
    k, v = rand(g, b, kv_heads, span, d, dtype=kt, s=2.0), rand(g, b, kv_heads, span, d, dtype=vt)
    q = rand(g, b, n, heads, d, dtype=qt, s=2.0)
    start = torch.tensor([17, 250])
    out = attend_kernel(q, k, v, kernel_plan(start, n, None), d**-0.5).view(b, n, -1)
    assert out.dtype == qt
    for r in range(b):
        for i in range(n):
            want = reference(q[r, i], k[r], v[r], list(range(int(start[r]) + i + 1)), d**-0.5)
            # the output is rounded to q's dtype; bf16 weights add about one more bf16 step
            tol = 2e-5 if qt == torch.float32 else 4 * 2.0**-8
            assert (out[r, i].double() - want).abs().max() <= tol * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("prefix", [0, 5, 15, 16, 17, 63, 64, 65, 1000, 2047])
def test_a_tree_node_equals_its_path_stepped_alone_and_a_chain_its_steps(dtypes, prefix):
    qt, kt, vt = dtypes
    g = torch.Generator().manual_seed(prefix)
    heads, kv_heads, d, n = 9, 3, 64, len(PARENTS)
    k_old, v_old = rand(g, 1, kv_heads, prefix, d, dtype=kt, s=3.0), rand(g, 1, kv_heads, prefix, d, dtype=vt)
    k_new, v_new = rand(g, 1, kv_heads, n, d, dtype=kt, s=3.0), rand(g, 1, kv_heads, n, d, dtype=vt)
    q = rand(g, 1, n, heads, d, dtype=qt, s=3.0)
    allow, _ = tree_attention(torch.tensor([PARENTS]))
    start = torch.tensor([prefix])
    k_all, v_all = torch.cat((k_old, k_new), 2), torch.cat((v_old, v_new), 2)
    tree = attend_kernel(q, k_all, v_all, kernel_plan(start, n, allow), d**-0.5)[0]
    for node in range(n):
        path = path_of(node)
        keys, values = torch.cat((k_old, k_new[:, :, path]), 2), torch.cat((v_old, v_new[:, :, path]), 2)
        step = attend_kernel(q[:, node : node + 1], keys, values, kernel_plan(start + len(path) - 1, 1, None), d**-0.5)
        assert torch.equal(tree[node], step[0, 0]), node
    # a chain of the first path's nodes, written in order, against one step per token
    chain = path_of(7)
    keys, values = torch.cat((k_old, k_new[:, :, chain]), 2), torch.cat((v_old, v_new[:, :, chain]), 2)
    together = attend_kernel(q[:, chain], keys, values, kernel_plan(start, len(chain), None), d**-0.5)[0]
    for i in range(len(chain)):
        step = attend_kernel(q[:, chain[i : i + 1]], keys, values, kernel_plan(start + i, 1, None), d**-0.5)
        assert torch.equal(together[i], step[0, 0]), i


@pytest.mark.parametrize("dtypes", DTYPES[1:2] + DTYPES[0:1])
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_a_batched_row_reads_only_its_own_keys_and_equals_itself_alone(dtypes, batch):
    """Rows of 64-2,048 cached slots in one call: every slot past a row's own entries holds NaN, so a row that read
    one, even with weight 0, would be NaN; each row equals its own call alone, bit for bit."""
    qt, kt, vt = dtypes
    g = torch.Generator().manual_seed(batch)
    heads, kv_heads, d, n = 9, 3, 64, len(PARENTS)
    lengths = [(64, 256, 1024, 2048)[i % 4] - int(torch.randint(0, 17, (1,), generator=g)) for i in range(batch)]
    span = max(lengths) + n
    k, v = rand(g, batch, kv_heads, span, d, dtype=kt, s=3.0), rand(g, batch, kv_heads, span, d, dtype=vt)
    for r, length in enumerate(lengths):
        k[r, :, length + n :], v[r, :, length + n :] = float("nan"), float("nan")
    q = rand(g, batch, n, heads, d, dtype=qt, s=3.0)
    start = torch.tensor(lengths)
    allow, _ = tree_attention(torch.tensor([PARENTS] * batch))
    together = attend_kernel(q, k, v, kernel_plan(start, n, allow), d**-0.5)
    assert torch.isfinite(together).all()
    for r in range(batch):
        alone = attend_kernel(
            q[r : r + 1], k[r : r + 1], v[r : r + 1], kernel_plan(start[r : r + 1], n, allow[:1]), d**-0.5
        )
        assert torch.equal(together[r], alone[0]), (r, lengths[r])


def test_the_order_is_what_makes_a_node_equal_its_path():
    """Negative control: one product over the slots (verify/backends/lean_llama.py's attend_grouped, what the
    engine did before the order), on the same kind of tree and context, leaves some node's path in the last
    bits; so the equality above is not vacuous."""
    from verify.backends.cache import visibility
    from verify.backends.lean_llama import attend_grouped, group_bias

    g = torch.Generator().manual_seed(3)
    heads, kv_heads, d, n, prefix = 9, 3, 64, len(PARENTS), 1000
    t = torch.float32
    k_old, v_old = rand(g, 1, kv_heads, prefix, d, dtype=t, s=3.0), rand(g, 1, kv_heads, prefix, d, dtype=t)
    k_new, v_new = rand(g, 1, kv_heads, n, d, dtype=t, s=3.0), rand(g, 1, kv_heads, n, d, dtype=t)
    q = rand(g, 1, n, heads, d, dtype=t, s=3.0)
    allow, _ = tree_attention(torch.tensor([PARENTS]))

    def grouped(queries, keys, values, begin, allowed):
        m = queries.shape[1]
        bias = group_bias(visibility(torch.tensor([begin]), m, allowed, keys.shape[2]), heads, kv_heads)
        return attend_grouped(queries, keys, values, bias, d**-0.5)[0]

    tree = grouped(q, torch.cat((k_old, k_new), 2), torch.cat((v_old, v_new), 2), prefix, allow)
    differ = 0
    for node in range(n):
        path = path_of(node)
        keys, values = torch.cat((k_old, k_new[:, :, path]), 2), torch.cat((v_old, v_new[:, :, path]), 2)
        alone = grouped(q[:, node : node + 1], keys, values, prefix + len(path) - 1, None)[0]
        differ += not torch.equal(tree[node], alone)
    assert differ > 0


def test_bad_shapes_are_named_in_one_line():
    q = torch.zeros(1, 1, 4, 48, dtype=torch.bfloat16)
    k = v = torch.zeros(1, 2, 8, 48, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="dim_head 48 is not one of 16, 32, 64, 128"):
        attend_kernel(q, k, v, kernel_plan(torch.tensor([3]), 1, None), 0.1)
    with pytest.raises(RuntimeError, match="dtypes"):
        half = [t.half()[..., :32] for t in (q, k, v)]
        attend_kernel(*half, kernel_plan(torch.tensor([3]), 1, None), 0.1)


def test_without_a_compiler_one_line_says_why_and_decoding_takes_the_torch_form(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert ordered_kernel._missing() == "no C++ compiler ('/nonexistent/c++' is not on PATH; set CXX)"
    code = (
        "import warnings, torch\n"
        "from verify.backends.ordered_kernel import kernel_name\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    print(kernel_name('cpu', 64))\n"
        "print(len(w), *(str(m.message).replace(chr(10), '|') for m in w))\n"
    )
    run = lambda env: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ, **env), check=True
    ).stdout.splitlines()
    name, line = run({"CXX": "/nonexistent/c++"})
    assert name == "torch"
    assert line == (
        "1 ordered attention: no C++ compiler ('/nonexistent/c++' is not on PATH; set CXX); decoding uses the "
        "pure-torch ordered attention (exact, slower)"
    )
    # chosen, not missing: the torch form without a warning
    assert run({"PROPHET_MEDUSA_KERNEL": "0", "CXX": "c++"}) == ["torch", "0"]
