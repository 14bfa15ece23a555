"""Host reads of the speculative cycle: what a GPU waits for. The loop reads the device once per cycle (whether any
row goes on, whether the last values were finite, the budget left); a chain cycle of a drafter that drafts on the
device (Medusa heads) reads nothing else, a tree cycle only the tree's shape its rule loops over. Counted by
wrapping every Tensor method that copies a value to the host; a change that adds a read to the cycle fails here.
"""

from __future__ import annotations

import collections

import pytest
import torch

from medusa import train
from medusa.drafter import MedusaDrafter
from tests.test_hf import llama
from tests.test_medusa import make_base, perturb
from verify.backends.target import Target
from verify.loop.sampling import SamplingConfig
from verify.loop.speculative import SpecConfig, speculative_generate

READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")  # each waits for the device


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> collections.Counter:
    counts: collections.Counter = collections.Counter()

    def wrap(name: str):
        real = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            counts[name] += 1
            return real(self, *args, **kwargs)

        return read

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, wrap(name))
    return counts


@pytest.mark.parametrize("base", ["x-transformers", "llama"])
@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_device_drafter_cycle_reads_the_host_once(base, mode, temperature, counted) -> None:
    model = make_base() if base == "x-transformers" else llama(dim=32)
    heads = perturb(train.build(model, num_heads=3, num_layers=1), seed=1)
    drafter = MedusaDrafter(heads, mode=mode, tree_nodes=6)
    target = Target(model)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10]]
    sampling = SamplingConfig(temperature=temperature)

    def run(new: int):
        generator = torch.Generator().manual_seed(0)
        spec = SpecConfig(gamma=3)
        return speculative_generate(
            target, drafter, prompts, spec=spec, sampling=sampling, max_new_tokens=new, generator=generator
        )

    run(2)  # builds the engine (its one-time check against the model reads a few values)
    counted.clear()
    new = 48
    out = run(new)
    counts = dict(counted)  # before the assertions below read anything themselves
    cycles = int(out.stats.forwards.max()) - 1  # verification forwards after the prefill
    assert cycles >= 12
    # Per cycle: the loop's one read. A tree's acceptance also reads the tree's shape its loops run over (the
    # depth: the accepted path's width, which the budget check and the statistics need on the host; sampled, the
    # widest node's child count and the sibling draws' ranks). Measured here; a drafter could hand the shape over
    # as host numbers with its draft, next.
    per_cycle = 1 if mode == "chain" else (2 if temperature == 0 else 4)
    # Outside the cycles: the loop's last read (no row goes on), the tokens handed back (2); and the cache's
    # exact length, read only when its attended span would grow past a chunk of 64 slots (here at most once per
    # 4 cycles: rejected drafts leave the upper bound up to 7 slots ahead a cycle)
    assert sum(counts.values()) <= per_cycle * cycles + 3 + cycles // 4, counts
