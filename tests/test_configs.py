"""Every config in conf/ for base training composes, validates, and builds what it names."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import get_method, instantiate
from omegaconf import DictConfig, OmegaConf

from experiments.lib.data import prepare_data
from experiments.lib.lm import count_parameters
from experiments.lib.base_trainer import validate_config

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ["base", "data", "optim", "logger", "experiment"]  # the groups train_base composes
REQUIRED = {"data=files": ["data.paths=[experiments]"], "data=hub": ["data.hub_name=some/dataset"]}


def options(group: str) -> list[str]:
    names = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
    # experiment files named base_* are train_base recipes; the others configure the benchmark
    # (composed in tests/test_experiments.py)
    return [n for n in names if n.startswith("base_")] if group == "experiment" else names


def make_cfg(*overrides: str, hydra_node: bool = False) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train_base", overrides=["out_dir=/tmp/unused", *overrides],
                       return_hydra_config=hydra_node)


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


@pytest.mark.parametrize("name", options("base"))
def test_base_presets_build(name: str) -> None:
    cfg = make_cfg(f"base={name}")
    assert cfg.base._target_ == "experiments.lib.lm.build_lm"
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
    assert keys == {"lr", "min_lr", "betas", "eps", "weight_decay", "warmup_steps", "grad_clip"}  # precision is top-level


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


@pytest.mark.parametrize("override", ["no_such_key=1", "base.no_such_size=3", "optim.momentum=0.9",
                                      "base=no_such_preset"])
def test_unknown_override_rejected(override: str) -> None:
    with pytest.raises(ConfigCompositionException):
        make_cfg(override)
