"""Every decoding method on a CUDA GPU: the draft model, prompt lookup, Medusa (chain and tree), the prophet
(chain and tree), the block prophet (chain and tree), sequential heads (chain and tree) and early exit, each
in the one speculative loop on a ragged batch and on one prompt, eager, compiled (compile=True) and replayed
as CUDA graphs (compile=graph), in fp32 and in bf16, plus the Hugging Face adapter. At T = 0 every output
must be token-identical to plain decoding on the same device (in the same dtype); at T = 1 (a seeded
torch.Generator on the device) the loop's invariants must hold: every row gets its budget of tokens, every id
is in the vocabulary, the target's cache holds exactly each row's prompt and emitted tokens
(all but the pending last one), and the same seed gives the same tokens.

The models are the CPU tests' small random-weight ones, built by their builders (tests/conftest.py's make_lm,
test_medusa.py's perturb, test_early_exit.py's noisy_head, test_hf.py's Llama) on the CPU and then moved to the
device, as a checkpoint's modules are. The head and prophet families are distilled briefly from the base first
(their family's own build and loss, experiments/lib/families/registry.py): random ones are never right at T = 0, and
then no accepted draft would ever be committed. With one prompt, a drafter's own cache (draft model, early
exit on its own cache, the prophets' feature caches) must hold the emitted context too.

Every test is marked `cuda`: tests/conftest.py skips them where torch.cuda.is_available() is False. The test
bodies take their device from the `device` fixture, CUDA_TESTS_DEVICE (default "cuda"), so

    CUDA_TESTS_DEVICE=cpu pytest tests/test_cuda.py

dry-runs the whole file on the CPU (the skip does not apply then): it checks the tests' own logic on a machine
without a GPU. The compiled variants are marked `slow` too: on a CPU each compiles for tens of seconds, so the
fast tier (`-m "not slow"`) runs the eager ones only; on a GPU `pytest -m cuda tests/test_cuda.py` runs all.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from experiments.lib.families.registry import FAMILIES
from medusa import drafter as medusa_drafter
from medusa import sequential_drafter
from prophet import block_drafter
from prophet import drafter as prophet_drafter
from prophet.block_drafter import BlockProphetDrafter
from prophet.drafter import ProphetDrafter
from tests.conftest import make_lm
from tests.test_early_exit import noisy_head
from tests.test_medusa import batch_of, perturb
from tests.test_speculative import PROMPTS
from verify.backends.choose import make_target
from verify.backends.target import Target
from verify.drafters import early_exit
from verify.drafters.draft_model import DraftModelDrafter
from verify.drafters.early_exit import EarlyExitDrafter
from verify.drafters.prompt_lookup import PromptLookupDrafter
from verify.loop.plain import Generation, plain_generate
from verify.loop.sampling import SamplingConfig
from verify.loop.speculative import SpecConfig, speculative_generate

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("one_thread")]

DEVICE_ENV = "CUDA_TESTS_DEVICE"
NEW_TOKENS = 24
GAMMA = 3
TREE_NODES = 8
# A compiled target pads every extend to one of these widths: plain decoding's 1, a chain's gamma + 1 and a
# tree's nodes + 1 (experiments/lib/methods/registry.py verify_widths), so each test compiles a few programs only.
WIDTHS = (1, GAMMA + 1, TREE_NODES + 1)
BATCHES = {"one": PROMPTS[:1], "ragged": PROMPTS}  # PROMPTS: four prompts of 8, 5, 11 and 3 tokens


@pytest.fixture(scope="module")
def device() -> torch.device:
    """The device every test here runs on: CUDA_TESTS_DEVICE, by default "cuda" ("cpu" dry-runs the file)."""
    return torch.device(os.environ.get(DEVICE_ENV, "cuda"))


# ----------------------------------------------------------------------------------------------- the methods


@dataclass(frozen=True)
class Method:
    """How a test builds one decoding method: `module(base)` builds its weights on the CPU base (None: it has
    none); `drafter(module, base, compile)` makes a fresh drafter once both are on the device."""

    module: Callable[[nn.Module], nn.Module] | None
    drafter: Callable[[nn.Module | None, nn.Module, bool], object]


def noisy_copy(base: nn.Module) -> nn.Module:
    """The base's weights with a little noise: a draft LM that agrees often, so accepted drafts are rolled
    forward, and sometimes not, so rejected ones are rolled back."""
    copy = make_lm()  # the base's architecture
    copy.load_state_dict(base.state_dict())
    return perturb(copy, seed=1, scale=0.02)


_DISTILLED: dict[str, dict[str, torch.Tensor]] = {}  # (family, module settings) -> weights, once per process


def distilled(family: str, base: nn.Module, steps: int = 60, **module_kwargs) -> nn.Module:
    """FAMILIES[family].build(base, **module_kwargs) distilled briefly on the CPU from the base's own greedy
    continuations (test_medusa.py's recipe), so that its drafts are accepted at T = 0 and the loop's
    multi-token commits run: random heads are never right. Distilled once, then loaded into every new build
    (conftest's base has the same weights every time), as a checkpoint is."""
    key = f"{family} {sorted(module_kwargs.items())}"
    torch.manual_seed(1)
    module = FAMILIES[family].build(base, **module_kwargs)
    if key in _DISTILLED:
        module.load_state_dict(_DISTILLED[key])
        return module.eval()
    prompts = torch.randint(1, base.num_tokens, (8, 6), generator=torch.Generator().manual_seed(1)).tolist()
    continuations = plain_generate(Target(base), prompts, max_new_tokens=40).tokens
    batch = batch_of(base, torch.tensor([p + c for p, c in zip(prompts, continuations)]))
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    for _ in range(steps):
        loss, _ = FAMILIES[family].loss(module, base, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    _DISTILLED[key] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return module.eval()


def medusa(base: nn.Module) -> nn.Module:
    return distilled("medusa", base, num_heads=3)


def sequential(base: nn.Module) -> nn.Module:
    return distilled("sequential", base, num_heads=3)


def prophet(base: nn.Module) -> nn.Module:
    return distilled("prophet", base, dim=32, depth=1, heads=2)


def block_prophet(base: nn.Module) -> nn.Module:
    return distilled("prophet_block", base, dim=32, depth=1, heads=2, block=4)


def exit_head(base: nn.Module) -> nn.Module:
    return noisy_head(base, layer=1)  # conftest's base has 2 blocks: draft from the first


# Every method of experiments/lib/methods/registry.py, its drafter made by its family's make_drafter as the benchmark
# makes it; early exit both on the target's own cache and on a cache of its own (allocated on the device).
METHODS: dict[str, Method] = {
    "draft_model": Method(noisy_copy, lambda m, base, c: DraftModelDrafter(m, compile=c)),
    "prompt_lookup": Method(None, lambda m, base, c: PromptLookupDrafter(vocab_size=base.num_tokens)),
    "medusa_chain": Method(medusa, lambda m, base, c: medusa_drafter.make_drafter(m, base, mode="chain")),
    "medusa_tree": Method(
        medusa, lambda m, base, c: medusa_drafter.make_drafter(m, base, mode="tree", tree_nodes=TREE_NODES)
    ),
    "sequential_chain": Method(sequential, lambda m, base, c: sequential_drafter.make_drafter(m, base, mode="chain")),
    "sequential_tree": Method(
        sequential, lambda m, base, c: sequential_drafter.make_drafter(m, base, mode="tree", tree_nodes=TREE_NODES)
    ),
    "prophet_chain": Method(prophet, lambda m, base, c: prophet_drafter.make_drafter(m, base, mode="chain", compile=c)),
    "prophet_tree": Method(
        prophet,
        lambda m, base, c: prophet_drafter.make_drafter(
            m, base, mode="tree", top_k=3, depth=GAMMA, tree_nodes=TREE_NODES, compile=c
        ),
    ),
    "prophet_block_chain": Method(
        block_prophet, lambda m, base, c: block_drafter.make_drafter(m, base, mode="chain", compile=c)
    ),
    "prophet_block_tree": Method(
        block_prophet,
        lambda m, base, c: block_drafter.make_drafter(m, base, mode="tree", tree_nodes=TREE_NODES, compile=c),
    ),
    "early_exit": Method(exit_head, lambda m, base, c: early_exit.make_drafter(m, base, compile=c)),
    "early_exit_own_cache": Method(
        exit_head, lambda m, base, c: early_exit.make_drafter(m, base, share_cache=False, compile=c)
    ),
}


def on_device(
    name: str, device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, nn.Module | None]:
    """The method's base (conftest's small LM) and its module, built on the CPU from fixed seeds (the same
    weights on every device) and moved to `device` in `dtype` (what dtype=bf16 decodes in)."""
    base = make_lm()
    module = METHODS[name].module(base) if METHODS[name].module is not None else None
    base.to(device=device, dtype=dtype)
    if module is not None:
        module.to(device=device, dtype=dtype)
    return base, module


# -------------------------------------------------------------------------------------------- the checks


def decode(
    base: nn.Module,
    drafter: object,
    prompts: list[list[int]],
    *,
    temperature: float = 0.0,
    seed: int = 0,
    compile: bool | str = False,
) -> tuple[Generation, list[int]]:
    """One speculative run on a fresh target; its output and the target's cache length per row after it."""
    target = make_target(base, compile=compile, widths=WIDTHS) if compile else make_target(base)
    generator = torch.Generator(device=target.device).manual_seed(seed)
    out = speculative_generate(
        target,
        drafter,
        prompts,
        max_new_tokens=NEW_TOKENS,
        spec=SpecConfig(gamma=GAMMA),
        sampling=SamplingConfig(temperature=temperature),
        generator=generator,
    )
    return out, target.row_lengths.tolist()


def plain(base: nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    return plain_generate(make_target(base), prompts, max_new_tokens=NEW_TOKENS).tokens


def check_invariants(out: Generation, cache_lengths: list[int], prompts: list[list[int]], vocab_size: int) -> None:
    """What every run must satisfy whatever was sampled: each row its budget of tokens (no EOS here), ids in
    the vocabulary, the target's cache exactly the row's prompt and emitted tokens but the pending last one
    (nothing rejected left behind, nothing accepted lost), and consistent counts."""
    assert [len(row) for row in out.tokens] == [NEW_TOKENS] * len(prompts)
    assert all(0 <= t < vocab_size for row in out.tokens for t in row)
    assert cache_lengths == [len(p) + len(row) - 1 for p, row in zip(prompts, out.tokens)]
    assert out.stats.tokens.tolist() == [NEW_TOKENS] * len(prompts)
    assert bool((out.stats.accepted <= out.stats.proposed).all())


def drafter_context(drafter: object) -> list[int] | None:
    """The context a drafter with a cache of its own holds per row: its cached entries plus the tokens it has
    queued to feed next (draft model, early exit), or one feature entry per token the target cached plus the
    pending token's (the prophets); None for a drafter without a cache."""
    if isinstance(drafter, DraftModelDrafter):
        return (drafter.lm.row_lengths + drafter.uncached.shape[1]).tolist()
    if isinstance(drafter, EarlyExitDrafter):
        return (drafter.cache.lengths + drafter.uncached.shape[1]).tolist()
    if isinstance(drafter, (ProphetDrafter, BlockProphetDrafter)):
        return (drafter.cache.lengths + 1).tolist()
    return None


def check_drafter_cache(drafter: object, out: Generation, prompts: list[list[int]]) -> None:
    """A drafter's own cache holds exactly the emitted context after a run of ONE prompt. In a batch, a row
    that finished before the others is no longer rolled back (the loop ignores its drafts), so only rows
    that decode to the end would hold it."""
    assert len(prompts) == 1
    context = drafter_context(drafter)
    if context is not None:
        assert context == [len(prompts[0]) + len(out.tokens[0])]


def check_exact(
    name: str, device: torch.device, prompts: list[list[int]], *, compile: bool | str, dtype=torch.float32
) -> Generation:
    """At T = 0 the method's output equals plain decoding's on the same device in the same dtype (eager), and
    the invariants hold."""
    base, module = on_device(name, device, dtype)
    reference = plain(base, prompts)
    drafter = METHODS[name].drafter(module, base, compile)
    out, lengths = decode(base, drafter, prompts, compile=compile)
    assert out.tokens == reference
    check_invariants(out, lengths, prompts, base.num_tokens)
    if len(prompts) == 1:
        check_drafter_cache(drafter, out, prompts)
    assert int(out.stats.accepted.sum()) > 0  # accepted drafts were committed, not only rejected ones rolled back
    return out


def check_sampling(
    name: str, device: torch.device, prompts: list[list[int]], *, compile: bool | str, dtype=torch.float32
) -> None:
    """At T = 1 the invariants hold and a second run with the same seed (fresh target, fresh drafter) emits
    the same tokens."""
    base, module = on_device(name, device, dtype)
    runs = []
    for _ in range(2):
        drafter = METHODS[name].drafter(module, base, compile)
        out, lengths = decode(base, drafter, prompts, temperature=1.0, seed=7, compile=compile)
        check_invariants(out, lengths, prompts, base.num_tokens)
        if len(prompts) == 1:
            check_drafter_cache(drafter, out, prompts)
        runs.append(out.tokens)
    assert runs[0] == runs[1]


# --------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("name", list(METHODS))
def test_greedy_equals_plain(device: torch.device, name: str, batch: str) -> None:
    check_exact(name, device, BATCHES[batch], compile=False)


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("name", list(METHODS))
def test_sampling_keeps_the_invariants(device: torch.device, name: str, batch: str) -> None:
    check_sampling(name, device, BATCHES[batch], compile=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(METHODS))
def test_compiled_greedy_equals_plain_and_sampling_keeps_the_invariants(device: torch.device, name: str) -> None:
    """compile=True: the target's extends and the drafter's own steps (draft model, prophets, early exit)
    through torch.compile, on the ragged batch; T = 0 then T = 1 with the same shapes (no second compile)."""
    check_exact(name, device, BATCHES["ragged"], compile=True)
    check_sampling(name, device, BATCHES["ragged"], compile=True)


@pytest.mark.parametrize("name", list(METHODS))
def test_graph_greedy_equals_plain_and_sampling_keeps_the_invariants(device: torch.device, name: str) -> None:
    """compile=graph: every extend of the target and every step of the drafter's own decoder replayed from a
    CUDA graph (on a CPU dry run: the same static buffers, run eagerly), ragged batch, T = 0 then T = 1."""
    check_exact(name, device, BATCHES["ragged"], compile="graph")
    check_sampling(name, device, BATCHES["ragged"], compile="graph")


def test_graph_mode_captures_real_graphs_and_replays_them(device: torch.device) -> None:
    """On a GPU every entry of the target's step holds a captured CUDA graph, and a second generation of the
    same shapes replays them (its cache took the first one's buffers) instead of capturing again."""
    base, module = on_device("draft_model", device)
    target = make_target(base, compile="graph", widths=WIDTHS)
    for _ in range(2):
        drafter = METHODS["draft_model"].drafter(module, base, "graph")
        speculative_generate(target, drafter, PROMPTS[:1], max_new_tokens=NEW_TOKENS, spec=SpecConfig(gamma=GAMMA))
    step = target.engine.step
    assert step.captures == len(step.graphs) <= len(WIDTHS)
    assert all((entry.graph is not None) == (device.type == "cuda") for entry in step.graphs.values())


@pytest.mark.parametrize("compile", [False, "graph"])
@pytest.mark.parametrize("name", list(METHODS))
def test_bf16_greedy_equals_bf16_plain(device: torch.device, name: str, compile: bool | str) -> None:
    """dtype=bf16: the target and the drafter in bf16; T = 0 output identical to plain decoding in bf16 (what a
    bf16 result is exact against), ragged batch, eager and graph."""
    check_exact(name, device, BATCHES["ragged"], compile=compile, dtype=torch.bfloat16)


@pytest.mark.parametrize("engine", ["hf", "lean"])
@pytest.mark.parametrize("drafter", ["draft_model", "medusa_tree"])
def test_hf_greedy_equals_plain(device: torch.device, engine: str, drafter: str) -> None:
    """A tiny transformers Llama (tests/test_hf.py) as the target, through transformers' own forward and
    cache (hf) and through the lean engine: speculative equals plain decoding on the device, ragged batch."""
    pytest.importorskip("transformers")
    from medusa.heads import MedusaHeads
    from tests.test_hf import PROMPTS as HF_PROMPTS
    from tests.test_hf import llama, noisy, perturbed

    base = llama()
    if drafter == "draft_model":
        module = perturbed(base)  # agrees often, not always
    else:
        module = noisy(MedusaHeads.from_base(base, num_heads=3, num_layers=1))
    base.to(device)
    module.to(device)
    reference = plain_generate(make_target(base, engine=engine), HF_PROMPTS, max_new_tokens=NEW_TOKENS).tokens
    make = {
        "draft_model": lambda: DraftModelDrafter(module, engine=engine),
        "medusa_tree": lambda: medusa_drafter.MedusaDrafter(module, tree_nodes=TREE_NODES),
    }[drafter]
    target = make_target(base, engine=engine)
    out = speculative_generate(target, make(), HF_PROMPTS, max_new_tokens=NEW_TOKENS, spec=SpecConfig(gamma=GAMMA))
    assert out.tokens == reference
    check_invariants(out, target.row_lengths.tolist(), HF_PROMPTS, base.num_tokens)
    if drafter == "draft_model":  # a perturbed copy agrees often: accepted drafts were committed
        assert int(out.stats.accepted.sum()) > 0
