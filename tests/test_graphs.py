"""compile=graph and the cache pool it relies on, on the CPU: everything but the capture itself (tests/test_cuda.py
replays real CUDA graphs where a GPU is present).

GraphedStep keeps one entry per input signature and runs the step on its own static input buffers, so these
tests see the signatures, the copies, the state captured by address and the outputs; the cache pool hands a
dropped cache's buffers, zeroed, to the next cache of the same shape, so a graph captured on them replays.
"""

import pytest
import torch

from tests.conftest import make_lm
from verify.backends import cache as cache_module
from verify.backends.cache import StaticCache
from verify.backends.graphs import GraphedStep, check_mode, static_step
from verify.backends.target import Target
from verify.drafters.draft_model import DraftModelDrafter
from verify.loop.plain import plain_generate
from verify.loop.sampling import SamplingConfig
from verify.loop.speculative import SpecConfig, speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingConfig(temperature=0.0)


def toy_step(x: torch.Tensor, state: list[torch.Tensor], scale: int, bias: torch.Tensor | None) -> torch.Tensor:
    """Writes into its state in place (as a decode step writes keys and values) and returns a new tensor."""
    state[0].add_(x.sum())
    return x * scale + state[0] + (0 if bias is None else bias)


def test_graphed_step_matches_the_step_and_keeps_one_entry_per_signature():
    graphed = GraphedStep(toy_step)
    state, twin = [torch.zeros(3)], [torch.zeros(3)]
    for value in (1.0, 2.0, 5.0):  # new input values: copied into the static buffer, not captured once
        x = torch.full((3,), value)
        assert torch.equal(graphed(x, state, 2, None), toy_step(x, twin, 2, None))
    assert graphed.captures == 1 and len(graphed.graphs) == 1
    assert torch.equal(state[0], twin[0])  # the state was updated in place, as the plain step does
    graphed(torch.ones(4), [torch.zeros(4)], 2, None)  # another shape and another state: a second entry
    graphed(torch.ones(3), state, 3, None)  # another static argument: a third
    graphed(torch.ones(3), state, 3, torch.ones(3))  # a tensor where there was None: a fourth
    assert graphed.captures == 4


def test_state_is_keyed_by_address_and_inputs_are_not():
    graphed = GraphedStep(toy_step)
    a, b = [torch.zeros(3)], [torch.zeros(3)]
    graphed(torch.ones(3), a, 1, None)
    graphed(torch.ones(3) * 7, a, 1, None)  # same state, other input values: replayed
    assert graphed.captures == 1
    graphed(torch.ones(3), b, 1, None)  # same shapes, other buffers: a graph on a must not write into b's place
    assert graphed.captures == 2 and float(b[0][0]) == 3.0 and float(a[0][0]) == 24.0


def test_the_least_recently_used_entry_goes_past_max_graphs():
    graphed = GraphedStep(toy_step, max_graphs=2)
    state = [torch.zeros(1)]
    for scale in (1, 2, 1, 3):  # 1 is used again before 3 arrives: 2 is the one dropped
        graphed(torch.ones(1), state, scale, None)
    assert [key[2] for key in graphed.graphs] == [1, 3] and graphed.captures == 3


@pytest.mark.parametrize("bad", ["Graph", "true", 1, 0, None, "reduce-overhead"])
def test_bad_modes_are_one_line_errors(bad):
    with pytest.raises(ValueError, match=r"compile=.*: must be true, false or graph"):
        check_mode(bad)
    with pytest.raises(ValueError, match="must be true, false or graph"):
        Target(make_lm(), compile=bad)


def test_static_step_modes():
    assert static_step(toy_step, False) is toy_step
    assert isinstance(static_step(toy_step, "graph"), GraphedStep)


def new_cache(**kwargs) -> StaticCache:
    shape = dict(layers=2, batch=1, heads=2, dim_head=4, capacity=8, device="cpu", dtype=torch.float32)
    return StaticCache(**{**shape, **kwargs})


def test_a_dropped_cache_gives_its_buffers_zeroed_to_the_next_of_its_shape():
    cache = new_cache(capacity=24)
    address = cache.k[0].data_ptr()
    cache.k[0].fill_(3.0)
    del cache
    again = new_cache(capacity=24)
    assert again.k[0].data_ptr() == address and not again.k[0].any() and not again.v[1].any()
    other = new_cache(capacity=24)  # the pool is empty again: new buffers, never shared by two live caches
    assert other.k[0].data_ptr() != address
    with torch.inference_mode():  # an inference tensor cannot be updated outside inference mode: another pool
        inside = new_cache(capacity=24)
    del again, inside
    assert not new_cache(capacity=24).k[0].is_inference()


def test_huge_and_grown_caches(monkeypatch):
    monkeypatch.setattr(cache_module, "POOL_BYTES", 1000)
    big = new_cache(capacity=64)  # 2 layers x 2 x 512 floats = 8 KB: over the limit, not kept
    del big
    assert not cache_module._POOL.get((2, (1, 2, 64, 4), torch.device("cpu"), torch.float32, False))
    monkeypatch.undo()
    grown = new_cache(capacity=4)
    grown.reserve(6)  # past its capacity: new, longer buffers; the grown ones return to the pool when dropped
    grown_address = grown.k[0].data_ptr()
    capacity = grown.capacity
    del grown
    assert new_cache(capacity=capacity).k[0].data_ptr() == grown_address


@pytest.mark.parametrize("batch", [1, 3])
def test_graph_mode_decodes_exactly_as_eager_and_reuses_its_graphs(batch):
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [4, 4]][:batch]
    eager = Target(make_lm())
    graph = Target(make_lm(), compile="graph", widths=(1, 5))
    expected = plain_generate(eager, prompts, max_new_tokens=16, sampling=GREEDY).tokens
    assert plain_generate(graph, prompts, max_new_tokens=16, sampling=GREEDY).tokens == expected
    for _ in range(2):  # a second generation replays the first one's graphs: its cache took the same buffers
        drafter = DraftModelDrafter(make_lm(seed=1, depth=1), compile="graph")
        out = speculative_generate(
            graph, drafter, prompts, max_new_tokens=16, spec=SpecConfig(gamma=4), sampling=GREEDY
        )
        assert out.tokens == expected
    assert graph.engine.step.captures == 2  # widths 1 and 5 (gamma 4 + 1), captured once each
    draft_step = drafter.lm.engine.step
    assert isinstance(draft_step, GraphedStep) and draft_step.captures <= 2  # widths 1 and 2 of the draft LM


def test_tree_verification_in_graph_mode_equals_eager():
    tokens = torch.tensor([[5, 6, 7, 8, 9]])
    parents = torch.tensor([-1, 0, 0, 1, 2])
    outs = []
    for mode in (False, "graph"):
        target = Target(make_lm(), compile=mode, widths=(1, 8))
        target.prefill([[1, 2, 3]])
        outs.append(target.extend(tokens, parents=parents).logits)
        outs.append(target.extend(tokens, parents=parents).logits)  # again, on top: a replay at other positions
    assert torch.allclose(outs[0], outs[2], atol=1e-5) and torch.allclose(outs[1], outs[3], atol=1e-5)
