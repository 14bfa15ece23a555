"""Every config in conf/ for base training composes, validates, and builds what it names; the groups every entry
point shares (conf/hydra_dirs, and conf/models for benchmark, baseline and generate) say one thing everywhere."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import get_method, instantiate
from omegaconf import DictConfig, OmegaConf

from experiments.lib.data.pipeline import prepare_data
from experiments.lib.store.lm import count_parameters
from experiments.lib.training.base_trainer import validate_config
from experiments.lib.training.settings import data_recipe

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ["base", "data", "optim", "logger", "experiment"]  # the groups train_base composes
REQUIRED = {"data=files": ["data.paths=[experiments]"], "data=hub": ["data.hub_name=some/dataset"]}


PRETRAINED = {"smollm2"}  # conf/base/ files that name a pretrained base (base_checkpoint), not sizes


def options(group: str) -> list[str]:
    names = sorted(p.stem for p in (CONF / group).glob("*.yaml") if not (group == "base" and p.stem in PRETRAINED))
    # experiment files named base_* are train_base recipes; the others configure the benchmark
    # (composed in tests/test_experiments.py)
    return [n for n in names if n.startswith("base_")] if group == "experiment" else names


def make_cfg(*overrides: str, hydra_node: bool = False) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train_base", overrides=["out_dir=/tmp/unused", *overrides], return_hydra_config=hydra_node)


ALL = [f"{group}={name}" for group in GROUPS for name in options(group)]


def test_every_group_has_options() -> None:
    for group in GROUPS:
        assert options(group), group
    assert {"tiny", "small", "draft"} <= set(options("base"))
    assert {"stdlib", "files", "hub"} <= set(options("data"))
    assert {"wandb", "none"} <= set(options("logger"))
    assert {"base_tiny", "base_small"} <= set(options("experiment"))


@pytest.mark.parametrize("choice", ALL)
def test_every_option_composes_and_validates(choice: str) -> None:
    cfg = make_cfg(choice, *REQUIRED.get(choice, []))
    validate_config(cfg)  # resolves every interpolation, checks every value, builds nothing


@pytest.mark.parametrize("name", sorted(PRETRAINED))
def test_a_pretrained_base_is_every_entry_points_base_checkpoint_and_not_trained(name: str) -> None:
    for entry in ("benchmark", "generate", "train_drafter", "cache_features", "peer"):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose(entry, overrides=[f"base={name}"])
        assert OmegaConf.to_container(cfg)["base_checkpoint"] == f"${{pretrained:{name},artifacts}}", entry
        if entry in ("benchmark", "generate"):  # every family trains on its own answers: one answer set for all
            data = {kind: [r for r in cfg.artifacts[kind] if r.startswith("features.")] for kind in DRAFTER_KINDS}
            for kind in DRAFTER_KINDS:
                assert "features.source=generated" in data[kind], (entry, kind)
                assert data[kind] == data["medusa"], (entry, kind)
        if entry == "benchmark":  # early exit runs on the lean Llama engine: benchmarked beside the others
            assert "early_exit_chain" in cfg.methods
    assert (CONF / "base" / f"{name}.yaml").read_text().startswith("# @package _global_")
    with pytest.raises(ValueError, match="this base is pretrained .*: train_base trains from scratch"):
        validate_config(make_cfg(f"base={name}"))


@pytest.mark.parametrize("name", options("base"))
def test_base_presets_build(name: str) -> None:
    cfg = make_cfg(f"base={name}")
    assert cfg.base._target_ == "experiments.lib.store.lm.build_lm"
    assert cfg.base.num_tokens == cfg.data.vocab_size and cfg.base.max_seq_len == 256
    model = instantiate(cfg.base)
    assert 1e6 < count_parameters(model) < 12e6


@pytest.mark.parametrize("name", options("data"))
def test_data_keys_are_prepare_data_arguments(name: str) -> None:
    keys = set(OmegaConf.load(CONF / "data" / f"{name}.yaml").keys())
    assert keys == set(inspect.signature(prepare_data).parameters)


@pytest.mark.parametrize("name", options("logger"))
def test_logger_targets_exist(name: str) -> None:
    target = OmegaConf.load(CONF / "logger" / f"{name}.yaml")["_target_"]
    assert callable(get_method(target))


def test_optim_keys() -> None:
    keys = set(OmegaConf.load(CONF / "optim" / "adamw.yaml").keys())
    assert keys == {
        "lr",
        "min_lr",
        "betas",
        "eps",
        "weight_decay",
        "warmup_steps",
        "grad_clip",
    }  # precision is top-level


def test_defaults_and_recipes() -> None:
    cfg = make_cfg()
    assert cfg.base.dim == 128 and cfg.base.depth == 4 and cfg.data.source == "stdlib"
    assert cfg.logger.mode == "offline" and cfg.resume is True and cfg.precision == "auto"
    tiny = make_cfg("experiment=base_tiny")
    assert tiny.optim.lr == 3e-3 and tiny.batch_size == 16 and tiny.seq_len == 256 and tiny.base.dim == 128
    small = make_cfg("experiment=base_small")
    assert small.optim.lr == 1.5e-3 and small.base.dim == 256 and small.base.depth == 8
    for recipe in (tiny, small, make_cfg("experiment=base_draft")):  # the machine chooses, not the recipe
        assert recipe.precision == "auto" and "bf16" not in recipe.optim
    assert make_cfg("experiment=base_small", "optim.lr=1e-4").optim.lr == 1e-4  # command line wins


def test_hydra_settings() -> None:
    cfg = make_cfg(hydra_node=True)
    assert cfg.hydra.job.chdir is False
    assert cfg.hydra.run.dir.startswith("outputs/train_base/")
    assert cfg.hydra.sweep.dir.startswith("multirun/train_base/")
    raw = OmegaConf.to_container(OmegaConf.load(CONF / "train_base.yaml"))  # unresolved
    assert raw["out_dir"] == "${hydra:runtime.output_dir}"


@pytest.mark.parametrize(
    "override", ["no_such_key=1", "base.no_such_size=3", "optim.momentum=0.9", "base=no_such_preset"]
)
def test_unknown_override_rejected(override: str) -> None:
    with pytest.raises(ConfigCompositionException):
        make_cfg(override)


# ----------------------------------------------------------------- the entry points' shared config groups


def compose_entry(config_name: str, *overrides: str, hydra_node: bool = False) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name, overrides=list(overrides), return_hydra_config=hydra_node)


# Every primary config's run and multirun directories (conf/hydra_dirs/default.yaml): named after the config,
# so experiments.baseline (config benchmark) writes beside the benchmark and train_seq2seq under seq2seq.
HYDRA_DIRS = {
    "benchmark": ("outputs/benchmark/", "multirun/benchmark/"),
    "generate": ("outputs/generate/", "multirun/generate/"),
    "peer": ("outputs/peer/", "multirun/peer/"),
    "seq2seq": ("outputs/seq2seq/", "multirun/seq2seq/"),
    "train_base": ("outputs/train_base/", "multirun/train_base/"),
    "train_drafter": ("outputs/train_drafter/prophet/", "multirun/train_drafter/"),
    "cache_features": ("outputs/cache_features/", "multirun/cache_features/"),
    "grow_tree": (".", "multirun/grow_tree/"),
}


@pytest.mark.parametrize("name", HYDRA_DIRS)
def test_hydra_dirs_of_every_entry_point(name: str) -> None:
    cfg = compose_entry(name, *(["drafter=prophet"] * (name == "train_drafter")), hydra_node=True)
    run, sweep = HYDRA_DIRS[name]
    assert cfg.hydra.job.chdir is False
    stamp = r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d"
    if name == "grow_tree":  # prints a tree, writes nothing: no run directory
        assert cfg.hydra.run.dir == "."
    else:
        assert re.fullmatch(re.escape(run) + stamp, cfg.hydra.run.dir), cfg.hydra.run.dir
    assert re.fullmatch(re.escape(sweep) + stamp, cfg.hydra.sweep.dir), cfg.hydra.sweep.dir
    assert (
        OmegaConf.to_container(cfg.hydra.sweep)["subdir"] == "${hydra.job.num}"
    )  # unresolved: no job outside a multirun
    assert (cfg.hydra.output_subdir is None) == (name == "grow_tree")  # grow_tree only prints: no .hydra/
    raw = OmegaConf.load(CONF / f"{name}.yaml")
    assert "hydra_dirs: default" in [
        f"{k}: {v}" for d in raw.defaults if isinstance(d, DictConfig) for k, v in d.items()
    ]


DRAFTER_KINDS = ("draft", "medusa", "prophet", "prophet_block", "sequential", "early_exit")
FAKE_BASE = (
    "/nonexistent/base/checkpoint",
    {"fingerprint": "f00d", "data": {"config": {"source": "stdlib", "vocab_size": 8192}}},
)


def test_generate_after_make_demo_trains_nothing() -> None:
    """`make demo` (benchmark experiment=demo) and the README's next command (generate base=smollm2) name the
    same artifact of every kind: same recipe, same overrides of train_base / train_drafter, same hash, and the
    same drafters and vocabulary, so generate reuses the demo's artifacts/<kind>-<hash> instead of training."""
    from experiments.lib.methods.registry import artifact_overrides
    from experiments.lib.training.artifacts import ENTRY, _compose, recipe_key

    demo = compose_entry("benchmark", "experiment=demo")
    generate = compose_entry("generate", "base=smollm2")
    assert demo.vocab == generate.vocab == 2048  # the trimmed vocabulary is checked against the drafter's training
    assert demo.artifacts.root == generate.artifacts.root
    assert OmegaConf.to_container(demo.checkpoints) == OmegaConf.to_container(generate.checkpoints)
    assert demo.prompt_lookup == generate.prompt_lookup
    keys = {}
    for kind in ENTRY:
        assert list(demo.artifacts[kind]) == list(generate.artifacts[kind]), kind
        if kind in DRAFTER_KINDS:
            assert demo[kind].module == generate[kind].module and demo[kind].loss == generate[kind].loss, kind
        overrides = artifact_overrides(demo, kind, *FAKE_BASE)
        assert overrides == artifact_overrides(generate, kind, *FAKE_BASE), kind
        with initialize_config_dir(
            config_dir=str(CONF), version_base="1.3"
        ):  # _compose then uses it, as in an entry point
            keys[kind] = {
                recipe_key(_compose(ENTRY[kind], artifact_overrides(cfg, kind, *FAKE_BASE))) for cfg in (demo, generate)
            }
    assert all(len(key) == 1 for key in keys.values()), keys  # the same artifacts/<kind>-<hash>


def test_one_source_of_the_models_and_recipes() -> None:
    """benchmark, baseline and generate take checkpoints, drafters, recipes, vocab and prompt lookup from
    conf/models/default.yaml alone (a copy in a primary config could drift); the recipes there are the demo's
    (experiment=demo sets none of its own); decoding settings come from conf/decode alone."""
    shared = {"base_checkpoint", "checkpoints", "artifacts", "vocab", "prompt_lookup", *DRAFTER_KINDS}
    for name in ("benchmark", "generate"):
        raw = OmegaConf.load(CONF / f"{name}.yaml")
        assert not shared & set(raw), (name, shared & set(raw))
        assert "models: default" in [
            f"{k}: {v}" for d in raw.defaults if isinstance(d, DictConfig) for k, v in d.items()
        ]
        cfg = compose_entry(name)
        assert cfg.decode.typical_epsilon == 0.09 and cfg.decode.typical_alpha == 0.3  # conf/decode/default.yaml
        assert "typical_epsilon" not in cfg and "typical_alpha" not in cfg
    assert not {"artifacts", "vocab"} & set(OmegaConf.load(CONF / "experiment" / "demo.yaml"))


def test_command_line_overrides_of_the_shared_models() -> None:
    cfg = compose_entry(
        "benchmark",
        "base_checkpoint=/b",
        "checkpoints.medusa=/m",
        'artifacts.prophet=["max_steps=2"]',
        "vocab=null",
        "medusa.module.num_heads=3",
        "drafter@sequential=medusa",
    )
    assert (
        cfg.checkpoints.base == "/b"
        and cfg.checkpoints.medusa == "/m"
        and list(cfg.artifacts.prophet) == ["max_steps=2"]
    )
    assert cfg.vocab is None and cfg.medusa.module.num_heads == 3 and cfg.sequential.package == "medusa"
    gen = compose_entry("generate", "checkpoints.prophet=/p", "vocab=512", "prophet.loss.unroll=2")
    assert gen.checkpoints.prophet == "/p" and gen.vocab == 512 and gen.prophet.loss.unroll == 2
    reference = compose_entry("benchmark", "experiment=reference", hydra_node=True)  # an experiment wins over the group
    assert reference.checkpoints.base == "outputs/reference/base_small/checkpoint"
    assert reference.checkpoints.prophet == "outputs/reference/prophet_unroll1/checkpoint"
    assert reference.prophet.module.dim == 256 and reference.hydra.run.dir == "outputs/reference/benchmark"


def test_baseline_and_peer_compose(tmp_path: Path) -> None:
    from experiments import baseline

    cfg = compose_entry("benchmark", f"artifacts.root={tmp_path}")  # baseline's config is the benchmark's
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):  # checks the base's recipe composes
        baseline.check_config(cfg)
    peer = compose_entry("peer")  # its own Llama base and assistant, not the shared models
    assert list(peer.artifacts.base) == ["experiment=base_llama"] and list(peer.artifacts.assistant) == [
        "experiment=base_llama_draft"
    ]
    assert not {"vocab", "medusa", "base_checkpoint"} & set(peer)


def test_data_recipe_of_replace_matches_a_recipe_recorded_before_undecodable() -> None:
    assert data_recipe(make_cfg().data)["undecodable"] == "skip"  # the default: files that are not UTF-8 left out
    old = data_recipe(make_cfg().data)
    old.pop("undecodable")  # what a checkpoint trained before the setting recorded: it decoded with U+FFFD
    assert data_recipe(make_cfg("data.undecodable=replace").data) == old
