"""compile=graph and the cache pool it relies on, on the CPU: everything but the capture itself (tests/test_cuda.py
replays real CUDA graphs where a GPU is present).

GraphedStep keeps one entry per input signature and runs the step on its own static input buffers, so these
tests see the signatures, the copies, the state captured by address and the outputs; the cache pool hands a
dropped cache's buffers, zeroed, to the next cache of the same shape, so a graph captured on them replays.
"""

import pytest
import torch

from experiments.lib.training import precision
from experiments.lib.training.precision import resolve_decode_dtype
from tests.conftest import make_lm
from verify.backends import cache as cache_module
from verify.backends.cache import StaticCache
from verify.backends.graphs import GraphedStep, check_mode, static_step
from verify.backends.lean import lean
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


def test_a_prefix_commit_rewinds_as_the_checked_one_without_reading_back():
    caches = [new_cache(batch=3, capacity=16) for _ in range(2)]
    for cache in caches:
        cache.reserve(5)
        cache.advance(5)
    keep = torch.arange(5) < torch.tensor([[1], [5], [0]])  # every row a prefix: 1, 5 and 0 entries
    caches[0].commit(keep)
    caches[1].commit(keep, prefix=True)
    assert torch.equal(caches[0].lengths, caches[1].lengths) and caches[0].lengths.tolist() == [1, 5, 0]
    assert caches[1].bound == 5 and caches[1].stale  # still an upper bound; read back only where needed
    assert caches[1].exact_bound() == caches[0].bound == 5 and not caches[1].stale
    caches[1].reserve(2)
    caches[1].advance(2)
    caches[1].commit(torch.tensor([[True, False]] * 3), prefix=True)  # one of two new entries kept per row
    assert caches[1].lengths.tolist() == [2, 6, 1] and caches[1].bound == 7 and caches[1].exact_bound() == 6


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


# ------------------------------------------------------------------------------- host reads per decode step

READS = ("__bool__", "item", "tolist", "__int__", "__float__", "__index__")  # what copies a value to the host


def count_host_reads(run) -> int:
    """Values read back from tensors to Python during run(): on a GPU each one waits for the device."""
    count = 0
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(original):
        def read(self, *args, **kwargs):
            nonlocal count
            count += 1
            return original(self, *args, **kwargs)

        return read

    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, counting(original))
        run()
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return count


# sequential heads build their per-depth tables on the host (2 reads a depth, once per drafter)
CHAINS = {"draft_model": 0, "medusa_chain": 0, "sequential_chain": 2 * 4, "prophet_chain": 0}
CHAINS |= {"prophet_block_chain": 0, "early_exit": 0, "early_exit_own_cache": 0}


@pytest.mark.parametrize("name", list(CHAINS))
def test_a_chain_step_reads_the_device_once(name):
    """In graph mode a chain's decode step reads the device once (whether to go on, whether the last step was
    finite, the fewest tokens left: one read), and its commits none: the loop knows a chain keeps a prefix.
    Per generation add the prefill's padding drop (2 reads per cache) and the output's lists (2)."""
    from tests.test_cuda import GAMMA, METHODS, NEW_TOKENS, PROMPTS, WIDTHS, on_device

    base, module = on_device(name, torch.device("cpu"))
    target = Target(base, compile="graph", widths=WIDTHS)
    outputs = []

    def run():
        drafter = METHODS[name].drafter(module, base, "graph")
        sampling = SamplingConfig(temperature=1.0)
        spec = SpecConfig(gamma=GAMMA)
        out = speculative_generate(
            target, drafter, PROMPTS[:1], max_new_tokens=NEW_TOKENS, spec=spec, sampling=sampling
        )
        outputs.append(out)

    run()  # the first generation builds engines and captures (checks that read values): not counted
    reads = count_host_reads(run)
    steps = int(outputs[-1].stats.forwards.sum()) - 1  # verification steps after the prefill
    assert steps >= 5 and reads <= steps + 1 + 2 * 2 + 2 + CHAINS[name], f"{reads} host reads in {steps} steps"


# ---------------------------------------------------------------------------------------- decode precision


def test_auto_decodes_in_the_measured_faster_dtype_on_a_cpu_and_in_bf16_on_a_gpu_that_has_it(monkeypatch):
    monkeypatch.setattr(precision, "native_bf16", lambda device: (True, "CPU has amx_bf16"))
    cpu = resolve_decode_dtype("auto", torch.device("cpu"))  # nothing measured: fp32
    assert (cpu["used"], cpu["dtype"]) == ("fp32", torch.float32) and "not measured" in cpu["reason"]
    faster = resolve_decode_dtype("auto", torch.device("cpu"), {"fp32": 0.064, "bf16": 0.036})
    assert faster["dtype"] == torch.bfloat16 and "36.0 ms in bf16, 64.0 ms in fp32" in faster["reason"]
    slower = resolve_decode_dtype("auto", torch.device("cpu"), {"fp32": 0.010, "bf16": 0.012})
    assert slower["dtype"] == torch.float32
    monkeypatch.setattr(precision, "native_bf16", lambda device: (False, "CPU lacks amx_bf16 and avx512_bf16"))
    emulated = resolve_decode_dtype("auto", torch.device("cpu"), {"fp32": 0.064, "bf16": 0.036})
    assert emulated["dtype"] == torch.float32 and "emulated" in emulated["reason"]  # never on an emulating CPU
    monkeypatch.setattr(precision, "native_bf16", lambda device: (True, "GPU supports native bf16"))
    assert resolve_decode_dtype("auto", torch.device("cuda"))["dtype"] == torch.bfloat16
    monkeypatch.setattr(precision, "native_bf16", lambda device: (False, "GPU lacks native bf16"))
    assert resolve_decode_dtype("auto", torch.device("cuda"))["dtype"] == torch.float32
    assert resolve_decode_dtype("bf16", torch.device("cpu"))["dtype"] == torch.bfloat16  # asked: obeyed


@pytest.mark.parametrize("bad", ["fp16", "BF16", None, 32, "float32"])
def test_bad_decode_dtypes_are_one_line_errors(bad):
    with pytest.raises(ValueError, match=r"^dtype=.*: must be one of auto, fp32, bf16$"):
        resolve_decode_dtype(bad, torch.device("cpu"))


def test_a_cast_model_gets_a_new_engine_in_its_dtype():
    """module.to(bf16) swaps the parameters' storage without bumping their versions: the engine built before
    (in fp32) must not be handed out again."""
    lm = make_lm()
    assert lean(lm).decoder.dtype == torch.float32
    lm.to(torch.bfloat16)
    assert lean(lm).decoder.dtype == torch.bfloat16 and lean(lm) is lean(lm)
