"""The block prophet as a family of experiments/: registered with its chain and tree methods (a name with an
underscore, mapped by FAMILY_METHODS, never split), its conf/drafter/prophet_block.yaml sections are exactly the
settings of its build, loss and make_drafter and are accepted by them, a bad setting is one line naming its key,
its measured rank accuracies grow its trees (head_accuracies, grow_tree, budget=auto's head-tree candidates),
and a block prophet trained by train_drafter decodes through the benchmark's method factories exactly as
plain greedy decoding does."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from experiments import benchmark as bench_mod
from experiments.grow_tree import HEADS, grow
from experiments.lib.families import registry as families
from experiments.lib.methods import decode_checks
from experiments.lib.methods import registry as methods
from experiments.lib.store.checkpoint import load_lm
from experiments.lib.store.lm import build_lm
from experiments.lib.training import drafter_trainer
from experiments.lib.training.features import teacher_batch
from prophet import block_drafter, block_train
from prophet.block import BlockProphet
from prophet.block_drafter import BlockProphetDrafter
from prophet.model import Prophet
from tests.test_experiments import drafter_cfg, make_cfg
from verify.backends.target import Target
from verify.loop.plain import plain_generate
from verify.loop.sampling import SamplingConfig
from verify.loop.speculative import SpecConfig, speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")
NAME = "prophet_block"


@pytest.fixture(scope="module")
def tiny():
    """A random tiny base and a teacher batch of it (the full 97-token distribution as the top-k)."""
    torch.manual_seed(0)
    base = build_lm(num_tokens=97, dim=32, depth=2, heads=2, max_seq_len=96).eval()
    tokens = torch.randint(0, 97, (2, 25))
    return base, teacher_batch(base, tokens, top_k=97)


@pytest.fixture(scope="module")
def settings() -> dict[str, dict]:
    """The module, loss and decode sections of conf/drafter/prophet_block.yaml, as train_drafter composes them."""
    cfg = make_cfg("train_drafter", f"drafter={NAME}", "base_checkpoint=/b", "out_dir=/tmp/unused")
    assert cfg.drafter.package == NAME
    return {part: OmegaConf.to_container(cfg.drafter[part], resolve=True) for part in ("module", "loss", "decode")}


# ------------------------------------------------------------------------------------------- registry


def test_the_family_is_registered_with_its_chain_and_tree_methods() -> None:
    found = families.family(NAME)
    assert found.modes == ("chain", "tree") and found.head_tree and found.compiles
    assert found.build is block_train.build and found.make_drafter is block_drafter.make_drafter
    assert NAME in families.TREE_FAMILIES and NAME in methods.DRAFTER_KINDS
    assert methods.FAMILY_METHODS["prophet_block_chain"] == (NAME, "chain")
    assert methods.FAMILY_METHODS["prophet_block_tree"] == (NAME, "tree")
    assert methods.FAMILY_METHODS["prophet_tree"] == ("prophet", "tree")  # the prefix still names the prophet
    assert methods.check_methods(["prophet_block_tree"]) == ["prophet_block_tree"]
    assert methods.method_kind("prophet_block_chain") == NAME
    assert methods.checkpoint_kinds(["prophet_chain", "prophet_block_tree", "prophet_block_chain"]) == [
        "base",
        "prophet",
        NAME,
    ]
    order = list(methods.METHODS)
    assert order.index("prophet_block_chain") == order.index("prophet_tree") + 1  # the results tables' order
    assert decode_checks.BUDGET_TREE_KEYS[NAME] == {"tree_nodes", "depth"}  # a head tree: no top_k
    assert set(HEADS) == {n for n, f in families.FAMILIES.items() if f.head_tree}  # grow_tree reads every head tree


def test_the_entry_points_compose_the_family() -> None:
    bench = make_cfg("benchmark", "base_checkpoint=/b")
    assert list(bench.methods) == list(methods.METHODS)
    assert bench.checkpoints[NAME] is None and bench[NAME].package == NAME
    assert list(bench.artifacts[NAME]) == list(bench.artifacts.prophet)  # the prophet's training budget
    assert [dict(c) for c in bench.budget_search.prophet_block_trees] == [
        dict(c) for c in bench.budget_search.medusa_trees
    ]
    decode_checks.check_budget(bench)
    decode_checks.check_family_decode(bench)
    generate = make_cfg("generate", "method=prophet_block_tree")
    assert generate[NAME] == bench[NAME]


def test_the_config_sections_are_exactly_the_functions_settings(settings: dict) -> None:
    """Every setting of the family's functions is in its config file, and nothing else is."""
    params = lambda fn: set(inspect.signature(fn).parameters)  # noqa: E731
    module = params(BlockProphet.__init__) | params(Prophet.__init__)  # BlockProphet passes the rest on
    # head: the base's, borrowed; layer: the EAGLE layer's shape, read from the base by Prophet.from_base
    assert set(settings["module"]) == module - {"self", "prophet_kwargs", "head", "layer"}
    assert set(settings["loss"]) == params(block_train.loss) - {"module", "base", "batch", "vocab"}
    decode = params(BlockProphetDrafter.__init__) - {"self", "prophet", "vocab"}
    assert set(settings["decode"]) == decode - {"accuracies", "compile"}  # both given by make_methods


def test_the_config_sections_are_accepted_by_build_loss_and_make_drafter(tiny, settings: dict) -> None:
    base, batch = tiny
    family = families.family(NAME)
    torch.manual_seed(0)
    module = families.call_with_settings(family.build, f"{NAME}.module", base, **settings["module"])
    assert isinstance(module, BlockProphet) and module.num_heads == module.block == settings["module"]["block"] == 4
    loss, metrics = families.call_with_settings(
        family.loss, f"{NAME}.loss", module, base, batch, vocab=None, **settings["loss"]
    )
    assert torch.isfinite(loss) and metrics["starts"] == 24 // (2 * 3)  # T // (2 (K - 1)) blocks at null starts
    assert {f"pos{j}_agree" for j in range(1, 5)} <= set(metrics)
    loss.backward()
    assert all(p.grad is None for p in base.parameters())  # the base stays frozen
    drafter = families.call_with_settings(
        family.make_drafter, f"{NAME}.decode", module, base, vocab=None, **settings["decode"]
    )
    assert isinstance(drafter, BlockProphetDrafter) and drafter.mode == "tree" and drafter.max_depth <= 4


@pytest.mark.parametrize(
    "part, setting, message",
    [
        ("module", {"blocks": 3}, "prophet_block.module.blocks: not a setting of prophet.block_train.build"),
        ("module", {"block": 1}, "prophet_block.module.block=1: a block drafts at least 2 positions"),
        ("loss", {"unroll": 3}, "prophet_block.loss.unroll: not a setting of prophet.block_train.loss"),
        ("decode", {"top_k": 4}, "prophet_block.decode.top_k: not a setting of prophet.block_drafter.make_drafter"),
    ],
)
def test_a_bad_setting_is_one_line_naming_its_key(tiny, settings: dict, part: str, setting: dict, message: str) -> None:
    base, batch = tiny
    family = families.family(NAME)
    module = block_train.build(base, **settings["module"])
    given = {**settings[part], **setting}
    with pytest.raises(ValueError) as excinfo:
        if part == "module":
            families.call_with_settings(family.build, f"{NAME}.module", base, **given)
        elif part == "loss":
            families.call_with_settings(family.loss, f"{NAME}.loss", module, base, batch, vocab=None, **given)
        else:
            families.call_with_settings(family.make_drafter, f"{NAME}.decode", module, base, vocab=None, **given)
    assert str(excinfo.value).startswith(message) and "\n" not in str(excinfo.value)


def test_a_module_setting_is_refused_before_the_base_loads_or_trains() -> None:
    """benchmark's check on a weightless stand-in of the base (base_checkpoint=null: nothing trains)."""
    cfg = make_cfg(
        "benchmark", "base_checkpoint=null", "methods=[prophet_block_tree]", "+prophet_block.module.blocks=3"
    )
    with pytest.raises(
        ValueError, match=r"^prophet_block\.module\.blocks: not a setting of prophet\.block_train\.build"
    ):
        methods.check_drafters_before_base(cfg)
    good = make_cfg("benchmark", "base_checkpoint=null", "methods=[prophet_block_chain,prophet_block_tree]")
    methods.check_drafters_before_base(good)


# ------------------------------------------------------------------------------------ trees and budgets


def test_head_accuracies_come_from_evaluate_one_row_per_position(tiny, settings: dict) -> None:
    base, batch = tiny
    module = block_train.build(base, **{**settings["module"], "block": 3}).eval()
    metrics = families.family(NAME).evaluate(module, base, batch, vocab=None)
    accuracies = methods.head_accuracies(NAME, module, {"metrics": metrics})["accuracies"]
    assert len(accuracies) == module.num_heads == 3
    assert all(len(row) == 10 and all(0 <= a <= 1 for a in row) for row in accuracies)
    assert accuracies[0][0] == metrics["head1_agree"] and accuracies[2][1] == metrics["head3_rank1"]
    assert methods.head_accuracies(NAME, module, {"metrics": {}}) == {}  # no measurement: typical accuracies
    drafter = block_drafter.make_drafter(module, base, mode="tree", tree_nodes=6, accuracies=accuracies)
    assert len(drafter.paths) == 6 and drafter.max_depth <= 3


def test_the_verify_widths_cover_the_block_trees() -> None:
    cfg = make_cfg("benchmark", "base_checkpoint=/b", "prophet_block.decode.tree_nodes=12", "budget_search.max_gamma=3")
    assert 13 in methods.verify_widths(cfg, [4])
    spec = decode_checks.spec_from(cfg.decode)
    assert 13 in bench_mod.compile_widths(cfg, spec)
    auto = make_cfg(
        "benchmark",
        "base_checkpoint=/b",
        "budget=auto",
        "budget_search.prophet_block_trees=[{tree_nodes: 7, depth: 2}]",
    )
    assert 8 in bench_mod.compile_widths(auto, spec)
    bad = make_cfg("benchmark", "base_checkpoint=/b", "budget_search.prophet_block_trees=[{tree_nodes: 4, top_k: 2}]")
    with pytest.raises(ValueError, match="budget_search.prophet_block_trees entry .* needs tree_nodes and depth"):
        decode_checks.check_budget(bad)


# ------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_base: Path, cache_dir: str) -> dict:
    """A block prophet trained by train_drafter on the tiny base (tests/test_experiments.py's fast dev run)."""
    out_dir = tmp_path_factory.mktemp(NAME)
    return drafter_trainer.train(drafter_cfg(NAME, tiny_base, cache_dir, out_dir))


def prompts_of(base_meta: dict, n: int = 3) -> list[list[int]]:
    torch.manual_seed(1)
    vocab = base_meta["model_config"]["num_tokens"]
    return [torch.randint(1, vocab, (length,)).tolist() for length in (9, 6, 11)[:n]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_trained_block_prophet_decodes_through_the_method_factories(
    trained: dict, tiny_base: Path, temperature: float
) -> None:
    """train_drafter -> load_drafter -> make_methods' factories (the benchmark's and generate's path): greedy
    chain and tree equal plain greedy decoding, batched and ragged; at T = 1 both decode every row in full."""
    assert trained["step"] == 4 and 0 <= trained["head1_agree"] <= 1
    base, tokenizer, base_meta = load_lm(tiny_base)
    module, found, meta = families.load_drafter(trained["checkpoint"], base, base_meta)
    assert found is families.FAMILIES[NAME] and isinstance(module, BlockProphet) and module.block == 4
    assert meta["model_config"]["package"] == NAME and meta["model_config"]["module"]["block"] == 4
    cfg = make_cfg(
        "benchmark",
        f"base_checkpoint={tiny_base}",
        f"checkpoints.{NAME}={trained['checkpoint']}",
        "methods=[prophet_block_chain,prophet_block_tree]",
        "vocab=null",
    )
    made, loaded = methods.make_methods(cfg, base, base_meta, str(tiny_base), tokenizer)
    assert set(made) == {"prophet_block_chain", "prophet_block_tree"} and set(loaded) == {NAME}
    assert loaded[NAME]["module"]["block"] == 4
    prompts = prompts_of(base_meta)
    target = Target(base)
    sampling = SamplingConfig(temperature=temperature)
    plain = plain_generate(target, prompts, max_new_tokens=12, sampling=sampling)
    cases = [("prophet_block_chain", {}), ("prophet_block_tree", {}), ("prophet_block_tree", {"tree_nodes": 4})]
    for name, over in cases:  # the last as budget=auto makes a head-tree candidate: its tree_nodes, tree None
        drafter = made[name](compile=False, **over, **({"tree": None} if over else {}))
        assert isinstance(drafter, BlockProphetDrafter) and drafter.mode == methods.FAMILY_METHODS[name][1]
        if name == "prophet_block_tree":  # grown from the checkpoint's measured rank accuracies
            assert len(drafter.paths) == over.get("tree_nodes", cfg[NAME].decode.tree_nodes)
        out = speculative_generate(
            target,
            drafter,
            prompts,
            max_new_tokens=12,
            spec=SpecConfig(gamma=6),  # above the block: drafts 4
            sampling=sampling,
            generator=torch.Generator().manual_seed(0),
        )
        if temperature == 0:
            assert out.tokens == plain.tokens, name
        assert [len(row) for row in out.tokens] == [12] * len(prompts)
        depth = out.stats.proposed_by_position.shape[0]  # the deepest draft: min(gamma, block) at most
        assert depth == 4 if name == "prophet_block_chain" else 1 <= depth <= 4


def test_grow_tree_reads_a_block_prophet_checkpoint(trained: dict) -> None:
    paths = grow(OmegaConf.create({"checkpoint": trained["checkpoint"], "tree_nodes": 5}))
    assert len(paths) == 5 and max(map(len, paths)) <= 4 and [0] in paths
