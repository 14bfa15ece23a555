"""The lean Llama engine's attention in position order: a tree node's logits equal, bit for bit, those of
decoding its root-to-node path one token at a time, in bfloat16 too, wherever the prefix ends relative to the
chunks. Every engine-level test runs on both forms: the C++ operator (verify/backends/ordered_kernel.py) and
the pure-torch form (verify/backends/ordered_attention.py), which decoding takes where the operator cannot be
built. The negative control (without the order, SmolLM2's bf16 tree
nodes leave their paths) needs real weights and a long prefix: tests/test_smollm2.py, in the slow tier."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from verify.backends.choose import make_target  # noqa: E402
from verify.backends.hf import HFBase  # noqa: E402
from verify.backends.ordered_attention import CHUNK  # noqa: E402

V = 211
# parents of an 8-node tree: two children of the root (nodes 0), grandchildren, one depth-3 leaf; node 0 attaches
# to the cached prefix
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5]


def bf16_llama(*, seed: int, hidden: int, layers: int, positions: int) -> HFBase:
    """A random bf16 Llama with grouped-query attention (4 query, 2 key-value heads)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return HFBase(transformers.LlamaForCausalLM(config)).eval().to(torch.bfloat16)


@pytest.fixture(params=["cpp", "torch"])
def form(request, monkeypatch):
    """Which ordered attention the engine runs (a cache made under one form keeps its key dtype)."""
    from verify.backends import lean_llama, ordered_kernel

    if request.param == "cpp" and not ordered_kernel.kernel_available():
        pytest.skip("the ordered attention operator could not be built here")
    if request.param == "torch":
        monkeypatch.setattr(lean_llama, "kernel_name", lambda device, dim_head: "torch")
    return request.param


@pytest.fixture(scope="module")
def base():
    return bf16_llama(seed=0, hidden=128, layers=3, positions=512)


def path_of(node: int, tokens: list[int]) -> list[int]:
    path = []
    while node >= 0:
        path, node = [tokens[node]] + path, PARENTS[node]
    return path


def stepwise_logits(base, prompt: list[int], path: list[int]) -> torch.Tensor:
    """The last logits of decoding `path` after `prompt` one token per forward, as plain decoding does."""
    target = make_target(base)
    target.prefill([prompt])
    for token in path:
        out = target.extend(torch.tensor([[token]]))
    return out.logits[0, -1]


def tree_mismatches(base, prompt_len: int, seed: int) -> int:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, V, (prompt_len,), generator=g).tolist()
    tokens = torch.randint(0, V, (len(PARENTS),), generator=g).tolist()
    target = make_target(base)
    target.prefill([prompt])
    out = target.extend(torch.tensor([tokens]), parents=torch.tensor(PARENTS)).logits[0]
    return sum(
        not torch.equal(out[node], stepwise_logits(base, prompt, path_of(node, tokens))) for node in range(len(PARENTS))
    )


@pytest.mark.usefixtures("form")
@pytest.mark.parametrize("prompt_len", [3, CHUNK - 2, CHUNK, 2 * CHUNK - 2, 3 * CHUNK - 1, 5 * CHUNK - 2])
def test_tree_nodes_equal_their_paths_decoded_alone_bit_for_bit(base, prompt_len):
    with torch.inference_mode():
        assert tree_mismatches(base, prompt_len, seed=prompt_len) == 0


@pytest.mark.usefixtures("form")
def test_chain_equals_one_token_steps_bit_for_bit(base):
    g = torch.Generator().manual_seed(7)
    prompt, chain = torch.randint(0, V, (CHUNK + 30,), generator=g).tolist(), [3, 1, 4, 1, 5, 9]
    with torch.inference_mode():
        target = make_target(base)
        target.prefill([prompt])
        out = target.extend(torch.tensor([chain])).logits[0]
        for i in range(len(chain)):
            assert torch.equal(out[i], stepwise_logits(base, prompt, chain[: i + 1]))


def attention_case(prefix: int, dtype: torch.dtype, seed: int, static: bool = False):
    """Random queries / keys / values of a tree forward behind `prefix` cached slots, and of each node's path
    decoded alone: (tree output (n, h d), [the path's last-step output (h d) per node]). static: the tree's shared
    chunks run to the span, as the engine's plan has them (its tail chunks then lie past them)."""
    from verify.backends.cache import tree_attention, visibility
    from verify.backends.lean_llama import group_bias
    from verify.backends.ordered_attention import attend_in_order, order_plan

    heads, kv_heads, d, n = 6, 2, 16, len(PARENTS)
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape, s=1.0: (torch.randn(*shape, generator=g) * s).to(dtype)  # noqa: E731
    k_old, v_old = rand(1, kv_heads, prefix, d, s=3.0), rand(1, kv_heads, prefix, d)
    k_new, v_new, q = rand(1, kv_heads, n, d, s=3.0), rand(1, kv_heads, n, d), rand(1, n, heads, d, s=3.0)

    def attend(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, start: int, allow) -> torch.Tensor:
        span = -(-keys.shape[2] // CHUNK) * CHUNK  # the eager engine's span: slots in use, rounded up to CHUNK
        pad = lambda t: torch.cat((t, t.new_zeros(1, kv_heads, span - t.shape[2], d)), dim=2)  # noqa: E731
        m, begin = queries.shape[1], torch.tensor([start])
        bias = group_bias(visibility(begin, m, allow, span), heads, kv_heads)
        plan = order_plan(begin, m, allow, span, heads=heads, kv_heads=kv_heads, bias=bias, static=static)
        return attend_in_order(queries, pad(keys), pad(values), plan, d**-0.5)[0]

    allow, _ = tree_attention(torch.tensor([PARENTS]))
    tree = attend(torch.cat((k_old, k_new), 2), torch.cat((v_old, v_new), 2), q, prefix, allow)
    paths = []
    for node in range(n):
        path = path_of(node, list(range(n)))  # node ids, root first
        keys, values = torch.cat((k_old, k_new[:, :, path]), 2), torch.cat((v_old, v_new[:, :, path]), 2)
        paths.append(attend(keys, values, q[:, node : node + 1], prefix + len(path) - 1, None)[0])
    return tree, paths


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix", [5, CHUNK - 2, 2 * CHUNK - 2, 4 * CHUNK - 1, 6 * CHUNK + 5])
def test_a_tree_node_attends_as_its_path_stepped_alone_bit_for_bit(prefix, dtype, static):
    # float32 shows what bf16's rounding of the output can hide: a step sums all its chunks, a tree its shared
    # chunks then its gathered tail; the sums must be the same float32 adds (a cumsum, accumulated in float64 on
    # a CPU, made every node of these trees leave its path in the last bit); static: the engine's plan, whose shared
    # chunks run to the span (zeros past c0) before the tail's
    for seed in range(3):
        tree, paths = attention_case(prefix, dtype, seed, static)
        assert [node for node in range(len(PARENTS)) if not torch.equal(tree[node], paths[node])] == []


@pytest.mark.usefixtures("form")
def test_a_tree_past_128_nodes_stays_exact_and_the_fused_mode_is_a_setting(base):
    """No size limit hides a mode: a 150-node tree (more than the 128 a prefill-sized forward once switched
    order at) still equals its paths bit for bit; ordered=False is the target's own setting, recorded on it."""
    g = torch.Generator().manual_seed(11)
    n = 150
    parents = [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, n)]
    prompt = torch.randint(0, V, (CHUNK + 9,), generator=g).tolist()
    tokens = torch.randint(0, V, (n,), generator=g).tolist()
    with torch.inference_mode():
        target = make_target(base)
        assert target.ordered
        target.prefill([prompt])
        out = target.extend(torch.tensor([tokens]), parents=torch.tensor(parents)).logits[0]
        for node in (n - 1, n - 7, n // 2, 1):
            path, j = [], node
            while j >= 0:
                path, j = [tokens[j]] + path, parents[j]
            assert torch.equal(out[node], stepwise_logits(base, prompt, path)), node
    assert make_target(base, ordered=False).ordered is False


@pytest.fixture(scope="module")
def long_base():
    """A smaller Llama with room for 2,048-token contexts."""
    return bf16_llama(seed=1, hidden=64, layers=2, positions=4096)


@pytest.mark.usefixtures("form")
@pytest.mark.parametrize("batch", [1, 16, pytest.param(64, marks=pytest.mark.slow)])  # 64 rows x 1,000 tokens: ~15 s
def test_a_chain_equals_its_steps_in_batches_of_rows_at_contexts_up_to_2048(long_base, batch):
    """Rows of contexts 64-2,048 in one batch: a 4-token verification gives every row's every token the bits four
    one-token steps give it, in bf16 (the products' rows padded, the sums in position order over spans of
    different lengths)."""
    g = torch.Generator().manual_seed(batch)
    lengths = [(64, 256, 1024, 2048)[i % 4] - int(torch.randint(0, 5, (1,), generator=g)) for i in range(batch)]
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]
    chain = torch.randint(0, V, (batch, 4), generator=g)
    with torch.inference_mode():
        verify = make_target(long_base)
        verify.prefill(prompts)
        together = verify.extend(chain).logits  # (b, 4, V)
        stepped = make_target(long_base)
        stepped.prefill(prompts)
        steps = torch.stack([stepped.extend(chain[:, i : i + 1]).logits[:, -1] for i in range(4)], dim=1)
    rows = [r for r in range(batch) if not torch.equal(together[r], steps[r])]
    assert rows == [], [lengths[r] for r in rows]


@pytest.mark.usefixtures("form")
@pytest.mark.parametrize("prompt_len", [1024 - 3, 2048 - 7])
def test_a_tree_node_equals_its_path_after_a_long_context(long_base, prompt_len):
    with torch.inference_mode():
        assert tree_mismatches(long_base, prompt_len, seed=prompt_len) == 0
