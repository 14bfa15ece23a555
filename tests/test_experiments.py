"""The experiments/ entry points end to end on a tiny base: every config composes, train_drafter trains on a
frozen base and refuses another one, the artifact cache reuses by recipe, benchmark measures every method
against plain decoding (and fails loudly on a non-exact lossless method), and summarize gathers a multirun.

One tiny base (dim 32, depth 2, 512-token BPE on 30 stdlib files) and one drafter of each family are
trained once per module and shared; everything else reuses them."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from experiments import baseline as baseline_mod
from experiments import benchmark as bench_mod
from experiments import summarize as summ_mod
from experiments.lib.families import registry as families
from experiments.lib.methods import decode_checks
from experiments.lib.methods import registry as methods
from experiments.lib.methods.prompt_set import get_prompts
from experiments.lib.report.results import repeated_ngram_share
from experiments.lib.store.checkpoint import (
    RESERVED_META_KEYS,
    CheckpointError,
    fingerprint,
    load_checkpoint,
    load_lm,
    save_checkpoint,
)
from experiments.lib.store.lm import build_lm
from experiments.lib.training import artifacts, base_trainer, drafter_trainer
from verify.backends.target import Target
from verify.loop.plain import plain_generate

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
# The base's data: a 512-token BPE on 30 stdlib files (the tokenizer is trained once per module, in DATA's cache).
DATA = ["data.max_files=30", "data.vocab_size=512"]
BASE = [
    "base.dim=32",
    "base.depth=2",
    "base.heads=2",
    *DATA,
    "logger=none",
    "max_steps=20",
    "optim.warmup_steps=2",
    "batch_size=4",
    "seq_len=64",
    "eval_blocks=2",
    "eval_every=10",
    "checkpoint_every=10",
]
DRAFTER = [
    *DATA,
    "logger=none",
    "max_steps=4",
    "eval_every=2",
    "log_every=1",
    "eval_blocks=2",
    "batch_size=2",
    "seq_len=32",
    "optim.warmup_steps=1",
]
SMALL = {
    "medusa": [],
    "prophet": ["drafter.module.dim=32", "drafter.module.heads=2"],  # a prophet as narrow as the base
    "prophet_block": ["drafter.module.dim=32", "drafter.module.heads=2"],
    "draft": ["drafter.module.dim=32", "drafter.module.depth=1", "drafter.module.heads=2"],
    "sequential": [],
    "early_exit": ["drafter.module.layer=1"],
}  # the base has 2 blocks: exit after the first
FAMILIES = ("medusa", "prophet", "prophet_block", "draft", "sequential", "early_exit")
ROW_KEYS = {
    "name",
    "tau",
    "repeat4",
    "alpha",
    "speedup",
    "tokens_per_s",
    "exact",
    "lossless",
    "temperature",
    "threads",
    "compiled",
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from a second thread, and on a busy 2-core machine two threads spin against
    each other (see tests/test_medusa.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_cfg(config_name: str, *overrides: str, hydra_node: bool = False) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name, overrides=list(overrides), return_hydra_config=hydra_node)


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


# ------------------------------------------------------------------------------------------ fixtures


# cache_dir and tiny_base (a base trained through experiments.lib.training.base_trainer.train): tests/conftest.py


def drafter_cfg(family: str, base: Path, cache_dir: str, out_dir: Path, *overrides: str) -> DictConfig:
    return make_cfg(
        "train_drafter",
        f"drafter={family}",
        f"base_checkpoint={base}",
        *DRAFTER,
        *SMALL[family],
        f"data.cache_dir={cache_dir}",
        f"features.root={cache_dir}/features",
        f"out_dir={out_dir}",
        *overrides,
    )


@pytest.fixture(scope="module")
def drafters(tmp_path_factory: pytest.TempPathFactory, tiny_base: Path, cache_dir: str) -> dict[str, dict]:
    """Medusa and prophet trained on the tiny base: {family: {"result", "base" (the in-memory base the run
    trained against, captured from load_lm), "out_dir"}}."""
    trained = {}
    for family in FAMILIES:
        out_dir = tmp_path_factory.mktemp(family)
        captured = []

        def capturing_load_lm(*args, captured=captured, **kwargs):
            loaded = load_lm(*args, **kwargs)
            captured.append(loaded[0])
            return loaded

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(drafter_trainer, "load_lm", capturing_load_lm)
            result = drafter_trainer.train(drafter_cfg(family, tiny_base, cache_dir, out_dir))
        trained[family] = {"result": result, "base": captured[0], "out_dir": out_dir}
    return trained


def test_a_mapped_cache_trains_the_same_drafter(drafters: dict, tiny_base: Path, cache_dir: str, tmp_path) -> None:
    """features.mapped reads the same cache from its files (memory maps): the prophet trains to
    the same losses and agreement, and the run is the same recipe."""
    from experiments.lib.training import features

    opened = []

    class Recorded(features.FeatureCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            opened.append(type(self.data["hidden"]).__name__)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(features, "FeatureCache", Recorded)
        result = drafter_trainer.train(drafter_cfg("prophet", tiny_base, cache_dir, tmp_path, "features.mapped=true"))
    assert opened == ["MappedRows"]
    loaded = drafters["prophet"]["result"]
    metrics = {k for k, v in loaded.items() if isinstance(v, float) and k not in ("elapsed_s", "positions_per_s")}
    metrics -= {k for k in metrics if k.endswith("_s") or "seconds" in k}
    # the T = 1 acceptance figures sum a softmax over the vocabulary, whose float summation order follows the
    # memory layout of the batch read: equal to float32 rounding; every other figure exactly
    masses = {k for k in metrics if k.endswith("_mass")}
    assert metrics and {k: result[k] for k in metrics - masses} == {k: loaded[k] for k in metrics - masses}
    assert masses and all(result[k] == pytest.approx(loaded[k], rel=1e-6) for k in masses)
    assert result["feature_key"] == loaded["feature_key"]


def bench_overrides(tiny_base: Path, drafters: dict) -> list[str]:
    """A benchmark fast dev run: the tiny base is also its own draft model (so alpha = 1 at T = 0)."""
    return [
        f"base_checkpoint={tiny_base}",
        f"checkpoints.draft={tiny_base}",
        f"checkpoints.medusa={drafters['medusa']['result']['checkpoint']}",
        f"checkpoints.prophet={drafters['prophet']['result']['checkpoint']}",
        f"checkpoints.prophet_block={drafters['prophet_block']['result']['checkpoint']}",
        f"checkpoints.sequential={drafters['sequential']['result']['checkpoint']}",
        f"checkpoints.early_exit={drafters['early_exit']['result']['checkpoint']}",
        "prompts.num_prompts=2",
        "prompts.prompt_len=8",
        "decode.max_new_tokens=8",
        "repeats=1",
        "decode.temperatures=[0,1]",
        "logger=none",
        "threads=1",
    ]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory, tiny_base: Path, drafters: dict) -> tuple[dict, Path]:
    out_dir = tmp_path_factory.mktemp("bench")
    summary = bench_mod.benchmark(make_cfg("benchmark", *bench_overrides(tiny_base, drafters), f"out_dir={out_dir}"))
    return summary, out_dir


# ------------------------------------------------------------------------------- 1. configs compose


def experiment_entry(name: str) -> str:
    """The entry point an experiment file is a delta of: a base recipe overrides /base with a size preset, a
    drafter recipe overrides /drafter, the rest (the demo's pretrained /base among them) are benchmark presets."""
    listed = OmegaConf.to_container(OmegaConf.load(CONF / "experiment" / f"{name}.yaml")).get("defaults", [])
    defaults = " ".join(map(str, listed))
    sizes = [d["override /base"] for d in listed if isinstance(d, dict) and "override /base" in d]
    return (
        "train_base"
        if sizes and sizes[0] != "smollm2"
        else "train_drafter"
        if "override /drafter" in defaults
        else "benchmark"
    )


def assert_keys_exist(delta: dict, cfg: DictConfig, path: str = "") -> None:
    """Every key an experiment file sets exists in its entry point's config (a file merge would add a typo)."""
    for key, value in delta.items():
        if key in ("defaults", "hydra"):
            continue
        assert key in cfg, f"{path}{key} is not a key of the entry point's config"
        if isinstance(value, dict):
            assert_keys_exist(value, cfg[key], f"{path}{key}.")


def test_experiment_files_split_between_entry_points() -> None:
    entries = {name: experiment_entry(name) for name in options("experiment")}
    assert {"base_tiny", "base_small", "base_draft"} <= {n for n, e in entries.items() if e == "train_base"}
    assert "demo" in {n for n, e in entries.items() if e == "benchmark"}


@pytest.mark.parametrize("experiment", options("experiment"))
def test_experiment_composes_for_its_entry_point(experiment: str) -> None:
    entry = experiment_entry(experiment)
    delta = OmegaConf.to_container(OmegaConf.load(CONF / "experiment" / f"{experiment}.yaml"))
    assert_keys_exist(delta, make_cfg(entry, "seed=0" if entry == "train_base" else "base_checkpoint=/b"))
    common = [f"experiment={experiment}", "out_dir=/tmp/unused", *(["base_checkpoint=/b"] * (entry == "train_drafter"))]
    for job in sweep_ends(make_cfg(entry, *common, hydra_node=True)):
        cfg = make_cfg(entry, *common, *job)
        if entry == "train_base":
            base_trainer.validate_config(cfg)
        elif entry == "train_drafter":
            drafter_trainer.validate_config(cfg)
        else:
            check_benchmark_cfg(cfg)


def sweep_ends(cfg: DictConfig) -> list[list[str]]:
    """The first and the last job's overrides of each parameter a preset sweep sets ([[]] for a single run)."""
    jobs = []
    for key, values in (cfg.hydra.sweeper.get("params") or {}).items():
        values = str(values).split(",")
        jobs += [[f"{key}={values[0]}"], [f"{key}={values[-1]}"]]
    return jobs or [[]]


@pytest.mark.parametrize("family", options("drafter"))
def test_train_drafter_composes_with_each_drafter(family: str) -> None:
    assert family in FAMILIES
    cfg = make_cfg("train_drafter", f"drafter={family}", "base_checkpoint=/some/base", "out_dir=/tmp/unused")
    assert cfg.drafter.package == family
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    drafter_trainer.validate_config(cfg)  # also checks the family is registered (experiments.lib.families.registry)


def test_train_drafter_null_base_is_one_line_error() -> None:
    with pytest.raises(ValueError, match="base_checkpoint is required"):
        drafter_trainer.validate_config(make_cfg("train_drafter", "base_checkpoint=null", "out_dir=/tmp/unused"))


def test_train_drafter_missing_base_is_one_line_error() -> None:
    with pytest.raises(ValueError, match="base_checkpoint is required"):
        drafter_trainer.validate_config(make_cfg("train_drafter", "out_dir=/tmp/unused"))


def check_benchmark_cfg(cfg: DictConfig) -> None:
    """What benchmark checks before work, plus: each artifact recipe composes and validates as ensure() would."""
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert set(cfg.methods) <= set(methods.ALL_METHODS)
    decode_checks.check_decode(cfg.decode)
    base_trainer.validate_config(make_cfg("train_base", *cfg.artifacts.base, "out_dir=/tmp/unused"))
    for family in ("draft", *FAMILIES):  # the draft model is distilled from the base like the others
        recipe = make_cfg(
            "train_drafter",
            *cfg.artifacts[family],
            f"drafter={family}",
            "base_checkpoint=/b",
            *methods.drafter_overrides(cfg[family], "drafter"),
            "out_dir=/tmp/unused",
        )
        drafter_trainer.validate_config(recipe)
        assert recipe.drafter.module == cfg[family].module and recipe.drafter.loss == cfg[family].loss


def test_benchmark_default_composes() -> None:
    cfg = make_cfg("benchmark", "out_dir=/tmp/unused")
    check_benchmark_cfg(cfg)
    assert list(cfg.methods) == list(methods.METHODS)
    assert cfg.medusa.package == "medusa" and cfg.prophet.package == "prophet"


@pytest.mark.parametrize("decode", options("decode"))
def test_benchmark_composes_with_each_decode(decode: str) -> None:
    check_benchmark_cfg(make_cfg("benchmark", f"decode={decode}", "out_dir=/tmp/unused"))


def test_hydra_settings_of_new_entry_points() -> None:
    for name in ("train_drafter", "benchmark"):
        cfg = make_cfg(name, "base_checkpoint=/b", hydra_node=True)
        assert cfg.hydra.job.chdir is False
        assert OmegaConf.to_container(OmegaConf.load(CONF / f"{name}.yaml"))["out_dir"] == "${hydra:runtime.output_dir}"


@pytest.mark.parametrize(
    "override, module, target",
    [
        ("hydra/launcher=joblib", "hydra_plugins.hydra_joblib_launcher", "joblib"),
        ("hydra/launcher=submitit_local", "hydra_plugins.hydra_submitit_launcher", "submitit"),
        ("hydra/sweeper=optuna", "hydra_plugins.hydra_optuna_sweeper", "optuna"),
    ],
)
def test_sweep_plugins_compose(override: str, module: str, target: str) -> None:
    pytest.importorskip(module)  # the optional `sweep` extra
    for name in ("benchmark", "train_base", "train_drafter"):
        cfg = make_cfg(name, override, *(["base_checkpoint=/b"] * (name != "train_base")), hydra_node=True)
        node = cfg.hydra.launcher if "launcher" in override else cfg.hydra.sweeper
        assert target in node._target_.lower()


# --------------------------------------------------------------------------- 2. train_drafter


@pytest.mark.parametrize("family", FAMILIES)
def test_train_drafter_fast_dev_run(family: str, drafters: dict, tiny_base: Path) -> None:
    result, out_dir = drafters[family]["result"], drafters[family]["out_dir"]
    assert result["step"] == 4 and result["parameters"] > 0 and Path(result["out_dir"]) == out_dir
    about_the_run = {
        "step",
        "elapsed_s",
        "parameters",
        "checkpoint",
        "last_checkpoint",
        "best_step",
        "out_dir",
        "precision",
        "positions",
        "positions_per_s",
        "features",
        "feature_key",
        "feature_windows",
        "feature_source",
        "feature_teacher",
        "feature_seconds",
        "train_tokens",
        "start_step",
        "stopped_by",
        "world_size",
        "rank",
        "replica_fingerprints",
    }
    assert about_the_run <= set(result), result
    assert result["train_tokens"] == result["feature_windows"] * 32  # a corpus cache: every position (seq_len=32)
    assert result["feature_teacher"] == "fp32"  # teacher=auto on a corpus: fp32
    metric_keys = set(result) - about_the_run
    assert metric_keys and all(isinstance(result[k], float) for k in metric_keys), result
    agreement = {
        "medusa": "head1_agree",
        "prophet": "step1_agree",
        "prophet_block": "head1_agree",
        "draft": "agree",
        "sequential": "head1_agree",
        "early_exit": "agree",
    }[family]
    assert 0 <= result[agreement] <= 1  # agreement with the base's top-1, what acceptance measures
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "val"] == [2, 4]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4]
    meta = load_checkpoint(result["checkpoint"]).meta  # the best validation's drafter
    base_meta = load_checkpoint(tiny_base).meta
    assert load_checkpoint(result["last_checkpoint"]).meta["step"] == 4  # the latest
    assert meta["kind"] == "drafter" and meta["step"] == result["best_step"] and meta["selected"] == "best"
    assert meta["best_value"] == result["best_chain_tau"] == max(r["chain_tau"] for r in rows if r["kind"] == "val")
    assert all(1 <= r["chain_tau"] <= 4 for r in rows if r["kind"] == "val")  # a 3-draft chain's tau
    assert meta["base_fingerprint"] == base_meta["fingerprint"]
    assert meta["model_config"]["package"] == family and meta["base_checkpoint"] == str(tiny_base)
    assert meta["precision"]["used"] in ("bf16", "fp32") and meta["precision"]["requested"] == "auto"
    assert meta["drafter"]["loss"]["target"] == "kl"  # self-distillation is the default recipe


@pytest.mark.parametrize("family", FAMILIES)
def test_base_unchanged_by_drafter_training(family: str, drafters: dict, tiny_base: Path) -> None:
    base = drafters[family]["base"]  # the very module the run trained against
    saved = load_checkpoint(tiny_base)
    state = base.state_dict()
    assert state.keys() == saved.state_dict.keys()
    for name, tensor in saved.state_dict.items():
        assert torch.equal(state[name].cpu(), tensor), name
    assert fingerprint(state) == saved.meta["fingerprint"]
    assert all(p.grad is None and not p.requires_grad for p in base.parameters())


DRAFTER_CLASS = {
    "draft": "DraftModelDrafter",
    "medusa": "MedusaDrafter",
    "prophet": "ProphetDrafter",
    "prophet_block": "BlockProphetDrafter",
    "sequential": "SequentialDrafter",
    "early_exit": "EarlyExitDrafter",
}


@pytest.mark.parametrize("family", FAMILIES)
def test_load_drafter_same_base_and_another_base(family: str, drafters: dict, tiny_base: Path) -> None:
    ckpt = drafters[family]["result"]["checkpoint"]
    base, _, base_meta = load_lm(tiny_base)
    module, package, meta = families.load_drafter(ckpt, base, base_meta)
    assert package is families.FAMILIES[family] and not module.training
    saved = load_checkpoint(ckpt).state_dict
    assert all(torch.equal(module.state_dict()[k], v) for k, v in saved.items())
    decode = dict(make_cfg("train_drafter", f"drafter={family}", "base_checkpoint=/b").drafter.decode)
    drafter = package.make_drafter(module, base, **decode)
    assert type(drafter).__name__ == DRAFTER_CLASS[family]  # the registry pairs each family with its own drafter
    # another base: same architecture, another seed
    torch.manual_seed(1)
    other = build_lm(**base_meta["model_config"]).eval()
    other_meta = {**base_meta, "fingerprint": fingerprint(other.state_dict())}
    assert other_meta["fingerprint"] != base_meta["fingerprint"]
    with pytest.raises(CheckpointError) as excinfo:
        families.load_drafter(ckpt, other, other_meta)
    message = str(excinfo.value)
    assert base_meta["fingerprint"] in message and other_meta["fingerprint"] in message and "\n" not in message


@pytest.mark.parametrize("use_cache", [True, False])
def test_drafter_training_reads_the_cache_instead_of_running_the_base(
    use_cache: bool, tiny_base: Path, cache_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from experiments.lib.training import features

    calls = []
    original = features.base_features
    monkeypatch.setattr(features, "base_features", lambda *a, **k: calls.append(a[1].shape) or original(*a, **k))

    def cfg(out):
        return drafter_cfg(
            "medusa",
            tiny_base,
            cache_dir,
            out,
            f"features.use={str(use_cache).lower()}",
            f"features.root={tmp_path / 'features'}",
            "features.windows=6",
        )

    drafter_trainer.train(cfg(tmp_path / "a"))  # writes the cache (when used) on first use
    calls.clear()
    drafter_trainer.train(cfg(tmp_path / "b"))
    # with the cache the base runs twice: on one window to check the loss settings before any work, and on the
    # validation blocks; without the cache, also once per training step
    assert len(calls) == (2 if use_cache else 2 + 4), calls
    assert calls[0][0] == 1  # the probe: one window


def test_load_drafter_refuses_a_base_checkpoint(tiny_base: Path) -> None:
    base, _, base_meta = load_lm(tiny_base)
    with pytest.raises(CheckpointError, match="not a drafter checkpoint"):
        families.load_drafter(tiny_base, base, base_meta)


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("max_steps=0", "max_steps must be a positive integer, got 0"),
        ("batch_size=0", "batch_size must be a positive integer or null, got 0"),
        ("vocab=0", "vocab must be a positive integer or null, got 0"),
        ("precision=fp16", "precision='fp16': must be one of auto, fp32, bf16"),
        ("features.source=web", "features.source='web'"),
        ("features.windows=0", "features.windows=0"),
        ("eval_blocks=-1", "eval_blocks must be a positive integer"),
        ("max_minutes=0", "max_minutes must be positive or null"),
        ("optim.lr=0", "optim.lr must be positive"),
        ("optim.warmup_steps=5", "optim.warmup_steps (5) must not exceed max_steps (4)"),
        (
            "drafter.package=nonexistent",
            "drafter.package='nonexistent': must be one of "
            "draft, medusa, prophet, prophet_block, sequential, early_exit",
        ),
        ("drafter.package=json", "drafter.package='json': must be one of"),
    ],
)
def test_train_drafter_bad_config_fails_before_work(
    override: str, fragment: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_work(*args, **kwargs):
        raise AssertionError("work started before the config was validated")

    monkeypatch.setattr(drafter_trainer, "load_lm", no_work)
    monkeypatch.setattr(drafter_trainer, "prepare_data", no_work)
    cfg = drafter_cfg("medusa", Path("/no/base"), "unused", tmp_path / "out", override)
    with pytest.raises(ValueError) as excinfo:
        drafter_trainer.train(cfg)
    assert "\n" not in str(excinfo.value) and fragment in str(excinfo.value), str(excinfo.value)
    assert not (tmp_path / "out").exists()


def test_train_drafter_refuses_another_tokenizer(tiny_base: Path, cache_dir: str, tmp_path: Path) -> None:
    cfg = drafter_cfg("medusa", tiny_base, cache_dir, tmp_path, "data.vocab_size=400")
    sizes = (
        r"the data config uses another tokenizer than the base \(\d+ tokens against \d+\): "
        r"use the base's data config \(data.vocab_size=\d+\)"
    )
    with pytest.raises(ValueError, match=sizes):
        drafter_trainer.train(cfg)


@pytest.mark.parametrize("seq_len", [-1, 300])
def test_train_drafter_bad_seq_len_fails_before_data(
    seq_len: int, tiny_base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_work(*args, **kwargs):
        raise AssertionError("data was prepared before seq_len was validated")

    monkeypatch.setattr(drafter_trainer, "prepare_data", no_work)
    with pytest.raises(ValueError, match="seq_len"):
        drafter_trainer.train(drafter_cfg("medusa", tiny_base, "unused", tmp_path, f"seq_len={seq_len}"))


# ------------------------------------------------------------------------------ 3. artifact cache


def test_artifacts_ensure_trains_once_and_keys_by_recipe(
    tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = [
        *BASE,
        f"data.cache_dir={cache_dir}",
        "max_steps=2",
        "optim.warmup_steps=1",
        "eval_every=2",
        "checkpoint_every=2",
    ]
    ckpt = artifacts.ensure("base", recipe, root=tmp_path)
    assert ckpt.parent.parent == tmp_path and ckpt.parent.name.startswith("base-")
    assert load_checkpoint(ckpt).meta["step"] == 2
    assert json.loads((ckpt.parent / "result.json").read_text())["step"] == 2
    mtime = (ckpt / "meta.json").stat().st_mtime_ns

    calls = []

    def no_training(cfg):
        calls.append(cfg.out_dir)
        raise RuntimeError("trained again")

    monkeypatch.setattr(base_trainer, "train", no_training)
    assert artifacts.ensure("base", recipe, root=tmp_path) == ckpt  # same recipe: reused
    assert artifacts.ensure("base", [*recipe, "logger=wandb", "threads=1"], root=tmp_path) == ckpt  # not recipe
    assert (ckpt / "meta.json").stat().st_mtime_ns == mtime
    calls.clear()
    with pytest.raises(RuntimeError, match="trained again"):
        artifacts.ensure("base", [*recipe, "seed=1"], root=tmp_path)  # another recipe trains ...
    assert Path(calls[0]).parent == tmp_path and Path(calls[0]) != ckpt.parent  # ... into another directory


def test_artifacts_kinds_have_their_own_directories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out_dirs = []

    def fake_train(cfg):
        out_dirs.append(Path(cfg.out_dir))
        return {}

    monkeypatch.setattr(base_trainer, "train", fake_train)
    monkeypatch.setattr(drafter_trainer, "train", fake_train)
    artifacts.ensure("base", ["max_steps=3"], root=tmp_path)
    artifacts.ensure("draft", ["max_steps=3"], root=tmp_path)
    artifacts.ensure("medusa", ["base_checkpoint=/b"], root=tmp_path)
    artifacts.ensure("prophet", ["base_checkpoint=/b", "drafter=prophet"], root=tmp_path)
    assert [d.name.split("-")[0] for d in out_dirs] == ["base", "draft", "medusa", "prophet"]
    assert len(set(out_dirs)) == 4 and all(d.parent == tmp_path for d in out_dirs)


def test_artifacts_drafter_follows_the_base_at_its_path(tiny_base: Path, cache_dir: str, tmp_path: Path) -> None:
    base_dir = tmp_path / "base" / "checkpoint"
    shutil.copytree(tiny_base, base_dir)
    recipe = [f"base_checkpoint={base_dir}", *DRAFTER, f"data.cache_dir={cache_dir}", "max_steps=2", "eval_every=2"]
    first = artifacts.ensure("medusa", recipe, root=tmp_path / "artifacts")
    # the base at the same path is retrained: other weights, same config and tokenizer
    model, _, meta = load_lm(base_dir)
    with torch.no_grad():
        next(model.parameters()).add_(0.01)
    save_checkpoint(
        base_dir,
        model=model,
        model_config=meta["model_config"],
        tokenizer_json=meta["tokenizer"],
        step=meta["step"] + 1,
        extra={k: v for k, v in meta.items() if k not in RESERVED_META_KEYS},
    )
    new_base, _, new_meta = load_lm(base_dir)
    assert new_meta["fingerprint"] != meta["fingerprint"]
    second = artifacts.ensure("medusa", recipe, root=tmp_path / "artifacts")
    assert load_checkpoint(first).meta["base_fingerprint"] == meta["fingerprint"]
    families.load_drafter(second, new_base, new_meta)  # raises CheckpointError while the key ignores the base


def test_artifacts_unknown_kind_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="artifact kind='eagle': must be one of base, draft, medusa, prophet"):
        artifacts.ensure("eagle", [], root=tmp_path)
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------------- 4. benchmark


def test_benchmark_summary_schema(bench_run: tuple[dict, Path]) -> None:
    summary, _ = bench_run
    assert set(summary) == {"plain_tokens_per_s", "methods"}
    assert isinstance(summary["plain_tokens_per_s"], float) and summary["plain_tokens_per_s"] > 0
    rows = summary["methods"]
    assert [(r["name"], r["temperature"]) for r in rows] == [(m, t) for t in (0.0, 1.0) for m in methods.METHODS]
    for row in rows:
        assert set(row) == ROW_KEYS, row
        assert isinstance(row["name"], str) and isinstance(row["temperature"], float)
        for key in ("tau", "alpha", "speedup", "tokens_per_s"):
            assert isinstance(row[key], float) and row[key] >= 0, (key, row)
        assert row["tau"] >= 1 and 0 <= row["alpha"] <= 1 and row["speedup"] > 0
        assert isinstance(row["repeat4"], float) and 0 <= row["repeat4"] <= 1, row
        assert row["lossless"] is True  # rule auto, delta 0: greedy at T = 0, speculative sampling at T = 1
        assert row["exact"] is (True if row["temperature"] == 0 else None), row
    json.dumps(summary)  # what main prints


def test_benchmark_draft_model_equal_to_target_accepts_everything(bench_run: tuple[dict, Path]) -> None:
    summary, _ = bench_run
    (row,) = [r for r in summary["methods"] if r["name"] == "draft_model" and r["temperature"] == 0]
    assert row["alpha"] == 1.0 and row["tau"] > 1


def test_benchmark_files(bench_run: tuple[dict, Path], tiny_base: Path) -> None:
    summary, out_dir = bench_run
    for name in ("results.json", "results.md", "speedup_tau.png", "acceptance_by_position.png"):
        assert (out_dir / name).is_file() and (out_dir / name).stat().st_size > 0, name
    results = json.loads((out_dir / "results.json").read_text())
    assert results["base_checkpoint"] == str(tiny_base) and results["prompts"] == 2 and results["repeats"] == 1
    assert results["base_fingerprint"] == load_checkpoint(tiny_base).meta["fingerprint"]
    assert [p["temperature"] for p in results["plain"]] == [0.0, 1.0]
    assert [(r["name"], r["tau"]) for r in results["methods"]] == [(r["name"], r["tau"]) for r in summary["methods"]]
    lines = (out_dir / "results.md").read_text().splitlines()
    base = results["base"]  # the target's size, in the header beside the CPU
    assert base["parameters"] > 0 and {"dim", "depth"} <= set(base)
    # the dtype dtype=auto chose: measured on a CPU with native bf16, so either here
    shape = f"{base['parameters'] / 1e6:.1f}M parameters ({base['dim']} x {base['depth']}), {results['dtype']} decoding"
    assert results["dtype"] in ("float32", "bfloat16") and results["precision"]["requested"] == "auto"
    assert lines[0] == f"CPU: {results['cpu']}; base: {shape}; prompts: 2 from heldout (heldout 2)"
    table = [line for line in lines if line.startswith("|")]
    assert table[0].startswith("| method | mode | T |")
    for t in ("0", "1"):
        for name in ("plain", *methods.METHODS):
            assert sum(line.startswith(f"| {name} | eager 1t | {t} |") for line in table) == 1, (name, t)
    assert len(table) == 2 + 2 * (1 + len(methods.METHODS))
    # rep4, right after tau: plain decoding's repeated-4-gram share, one figure per temperature on every row
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header[header.index("tau") + 1] == "rep4"
    for t in (0.0, 1.0):
        rows = [r for r in results["plain"] + results["methods"] if r["temperature"] == t]
        assert len({r["repeat4"] for r in rows}) == 1 and 0 <= rows[0]["repeat4"] <= 1, rows
    for line in table[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == len(header) and 0 <= float(cells[header.index("rep4")]) <= 1, line
    assert [p["speedup"] for p in results["plain"]] == [1.0, 1.0]  # the only plain setting is the fastest
    # every ratio has its bootstrap interval over the 2 cells (1 round x 2 prompts), and the run its disturbed list
    assert all(r["cells"] == 2 and r["speedup_lo"] <= r["speedup_hi"] for r in results["methods"])
    assert isinstance(results["disturbed"], list) and results["spread"]["resamples"] == 2000


def test_benchmark_rep4_is_plain_greedy_decodings_share(tiny_base: Path, drafters: dict, tmp_path: Path) -> None:
    """rep4 at T=0 is repeated_ngram_share of plain greedy decoding on the benchmark's own prompts (40 new
    tokens, so the barely trained base repeats itself and the figure is not a trivial 0)."""
    cfg = make_cfg(
        "benchmark",
        *bench_overrides(tiny_base, drafters),
        f"out_dir={tmp_path}",
        "methods=[prompt_lookup]",
        "decode.temperatures=[0]",
        "decode.max_new_tokens=40",
    )
    bench_mod.benchmark(cfg)
    base, tokenizer, meta = load_lm(tiny_base)
    prompts = get_prompts(cfg, tokenizer, meta)
    assert cfg.decode.batch_size == 1 and cfg.stop_at_eos  # so: one prompt at a time, stopping at EOS
    results = json.loads((tmp_path / "results.json").read_text())
    base = base.to(getattr(torch, results["dtype"]))  # the precision dtype=auto measured and chose
    greedy = [
        plain_generate(Target(base), [p], max_new_tokens=40, eos_id=meta["data"]["eos_id"]).tokens[0] for p in prompts
    ]
    expected = repeated_ngram_share(prompts, greedy)
    assert 0 < expected and [r["repeat4"] for r in results["plain"] + results["methods"]] == [expected, expected]


def fast_bench_cfg(tiny_base: Path, drafters: dict, out_dir: Path, *overrides: str) -> DictConfig:
    return make_cfg("benchmark", *bench_overrides(tiny_base, drafters), f"out_dir={out_dir}", *overrides)


def test_benchmark_exactness_failure_is_loud(
    tiny_base: Path, drafters: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = bench_mod.speculative_generate

    def wrong_first_token(*args, **kwargs):
        out = real(*args, **kwargs)
        return dataclasses.replace(out, tokens=[[(row[0] + 1) % 512, *row[1:]] for row in out.tokens])

    monkeypatch.setattr(bench_mod, "speculative_generate", wrong_first_token)
    cfg = fast_bench_cfg(tiny_base, drafters, tmp_path, "methods=[prompt_lookup]", "decode.temperatures=[0]")
    with pytest.raises(decode_checks.ExactnessError, match="prompt_lookup at temperature 0 differs from plain"):
        bench_mod.benchmark(cfg)
    assert not (tmp_path / "results.json").exists()


def test_benchmark_lenient_rule_is_not_checked_for_exactness(
    tiny_base: Path, drafters: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rule that is not lossless (delta > 0) is reported, not failed, when it differs."""
    cfg = fast_bench_cfg(
        tiny_base,
        drafters,
        tmp_path,
        "methods=[prompt_lookup]",
        "decode.temperatures=[1]",
        "decode.rule=speculative",
        "decode.delta=0.5",
    )
    (row,) = bench_mod.benchmark(cfg)["methods"]
    assert row["lossless"] is False and row["exact"] is None
    assert "| prompt_lookup | eager 1t | 1 | speculative | no |" in (tmp_path / "results.md").read_text()


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("methods=[nope]", "methods contain ['nope']"),
        ("decode.temperatures=[-1]", "temperature"),
        ("decode.rule=greedy", "greedy acceptance needs temperature 0"),
        ("decode.gamma=0", "gamma=0"),
        ("threads=[1,0]", "threads=0"),
        ("threads=[]", "threads=[]"),
        ("compile=maybe", "compile='maybe'"),
        ("budget=sometimes", "budget='sometimes'"),
        ("budget_search.max_gamma=0", "budget_search.max_gamma=0"),
        ("budget_search.prophet_trees=[{tree_nodes: 4}]", "needs tree_nodes and depth"),
        ("budget_search.medusa_trees=[{tree_nodes: 4, depth: 2, top_k: 3}]", "allowed keys"),
        ("prophet.decode.tree_nodes=lots", "prophet.decode.tree_nodes='lots'"),
    ],
)
def test_benchmark_bad_config_is_one_line_value_error(
    override: str, fragment: str, tiny_base: Path, drafters: dict, tmp_path: Path
) -> None:
    with pytest.raises(ValueError) as excinfo:
        bench_mod.benchmark(fast_bench_cfg(tiny_base, drafters, tmp_path, override))
    assert fragment in str(excinfo.value) and "\n" not in str(excinfo.value), str(excinfo.value)


def test_benchmark_settings_share_rounds_and_the_fastest_plain(tiny_base: Path, drafters: dict, tmp_path: Path) -> None:
    """threads=[1,2]: both settings in one run; every speedup is against the fastest plain of each round."""
    cfg = fast_bench_cfg(
        tiny_base,
        drafters,
        tmp_path,
        "methods=[prompt_lookup]",
        "decode.temperatures=[0]",
        "threads=[1,2]",
        "repeats=2",
    )
    summary = bench_mod.benchmark(cfg)
    results = json.loads((tmp_path / "results.json").read_text())
    plains = results["plain"]
    assert [(p["threads"], p["compiled"]) for p in plains] == [(1, False), (2, False)]
    fastest = [max(p["tokens_per_s_rounds"][r] for p in plains) for r in range(2)]
    for p in plains:
        assert p["speedups"] == pytest.approx([x / f for x, f in zip(p["tokens_per_s_rounds"], fastest)])
        assert p["speedup"] <= 1.0
    assert max(max(p["speedups"]) for p in plains) == pytest.approx(1.0)
    assert [(r["name"], r["threads"], r["exact"]) for r in summary["methods"]] == [
        ("prompt_lookup", 1, True),
        ("prompt_lookup", 2, True),
    ]


def test_benchmark_every_method_in_bf16_and_graph_mode_is_exact(
    tiny_base: Path, drafters: dict, tmp_path: Path
) -> None:
    """dtype=bf16, compile=[false, graph]: the target and every drafter decode in bf16, and every method's T=0
    output equals plain decoding's in bf16 in both modes (on a CPU, graph mode runs each step eagerly on its
    static buffers: everything but the capture itself)."""
    cfg = fast_bench_cfg(
        tiny_base, drafters, tmp_path, "dtype=bf16", "compile=[false,graph]", "decode.temperatures=[0]"
    )
    rows = bench_mod.benchmark(cfg)["methods"]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["dtype"] == "bfloat16" and results["precision"]["used"] == "bf16"
    assert results["ordered"] is False  # the x-transformers engine sums each query's keys in one product
    assert {(r["name"], r["compiled"]) for r in rows} == {(m, c) for m in methods.METHODS for c in (False, "graph")}
    assert all(r["exact"] for r in rows), [(r["name"], r["compiled"]) for r in rows if not r["exact"]]
    assert "graph 1t" in (tmp_path / "results.md").read_text()


def test_benchmark_budget_auto_picks_and_records_budgets(tiny_base: Path, drafters: dict, tmp_path: Path) -> None:
    cfg = fast_bench_cfg(
        tiny_base,
        drafters,
        tmp_path,
        "methods=[prompt_lookup,prophet_tree]",
        "decode.temperatures=[0]",
        "budget=auto",
        "budget_search.max_gamma=3",
        "budget_search.pilot_prompts=1",
        "budget_search.prophet_trees=[{tree_nodes: 2, depth: 2}, {tree_nodes: 4, depth: 3}]",
        f"budget_search.cache_dir={tmp_path / 'calibration'}",
    )
    bench_mod.benchmark(cfg)
    results = json.loads((tmp_path / "results.json").read_text())
    lookup, tree = results["methods"]
    assert (
        1 <= lookup["gamma"] <= 3
        and lookup["budget"]["gamma"] == lookup["gamma"]
        and len(lookup["budget"]["table"]) >= 1
    )
    assert tree["budget"]["tree_nodes"] in (2, 4) and tree["gamma"] == {2: 2, 4: 3}[tree["budget"]["tree_nodes"]]
    assert lookup["exact"] and tree["exact"]
    assert list(results["cost_tables"]) == ["eager 1t"] and "1" in results["cost_tables"]["eager 1t"]
    assert list(results["tree_cost_tables"]) == ["eager 1t"]  # a tree method: trees' own costs, measured on trees
    # the verify costs (chains and trees), cached per machine and model; with dtype=auto on a CPU with native
    # bf16 also the two tables its choice of dtype was measured by
    measured = "8-token verify" in results["precision"]["reason"]
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 2 + 2 * measured


def test_benchmark_hybrids_are_exact_and_draft_at_their_chains_gamma(
    tiny_base: Path, drafters: dict, tmp_path: Path
) -> None:
    """hybrid_<family>_<mode> rows: exact at T=0, sampled at T=1; with budget=auto the hybrid chain's learned side
    drafts at the gamma its family's own chain chose, and its tree searches the family's trees."""
    cfg = fast_bench_cfg(
        tiny_base,
        drafters,
        tmp_path,
        "methods=[medusa_chain,hybrid_medusa_chain,hybrid_sequential_tree]",
        "budget=auto",
        "budget_search.max_gamma=3",
        "budget_search.pilot_prompts=1",
        "budget_search.sequential_trees=[{tree_nodes: 2, depth: 2}, {tree_nodes: 4, depth: 2}]",
        f"budget_search.cache_dir={tmp_path / 'calibration'}",
    )
    bench_mod.benchmark(cfg)
    results = json.loads((tmp_path / "results.json").read_text())
    rows = {(r["name"], r["temperature"]): r for r in results["methods"]}
    assert set(rows) == {
        (m, t) for m in ("medusa_chain", "hybrid_medusa_chain", "hybrid_sequential_tree") for t in (0, 1)
    }
    for t in (0.0, 1.0):
        chain, hybrid, tree = (rows[m, t] for m in ("medusa_chain", "hybrid_medusa_chain", "hybrid_sequential_tree"))
        assert hybrid["budget"]["learned_gamma"] == chain["gamma"] and 1 <= hybrid["gamma"] <= 3
        assert 0 <= hybrid["copied_share"] <= 1 and 0 <= tree["copied_share"] <= 1 and chain["copied_share"] is None
        assert tree["budget"]["tree_nodes"] in (2, 4)
    assert all(rows[m, 0.0]["exact"] for m in ("hybrid_medusa_chain", "hybrid_sequential_tree"))


def test_benchmark_decodes_with_shipped_drafters_beside_its_own(
    tiny_base: Path, drafters: dict, tmp_path: Path
) -> None:
    """shipped_<method> rows draft with the copy under shipped_drafters/<family> (experiments/ship_drafters.py),
    exact at T=0 beside the configured checkpoint's rows; a missing shipped drafter fails before any work."""
    from experiments import ship_drafters

    source = drafters["sequential"]["result"]["checkpoint"]
    shipped = tmp_path / "shipped"
    assert ship_drafters.main([f"sequential={source}", "--out", str(shipped), "--command", "test"]) == 0
    names = "[sequential_chain,shipped_sequential_chain,shipped_hybrid_sequential_chain]"
    cfg = fast_bench_cfg(
        tiny_base,
        drafters,
        tmp_path / "run",
        f"methods={names}",
        "decode.temperatures=[0]",
        f"shipped_drafters={shipped}",
    )
    bench_mod.benchmark(cfg)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert [r["name"] for r in results["methods"]] == names.strip("[]").split(",")
    assert all(r["exact"] for r in results["methods"])
    assert results["checkpoints"]["shipped_sequential"]["checkpoint"] == str(shipped / "sequential")
    assert results["checkpoints"]["sequential"]["checkpoint"] == source
    missing = fast_bench_cfg(
        tiny_base, drafters, tmp_path / "none", f"methods={names}", f"shipped_drafters={tmp_path / 'nowhere'}"
    )
    with pytest.raises(ValueError, match="checkpoint directory not found"):
        bench_mod.benchmark(missing)
    assert not (tmp_path / "none").exists()


def test_bad_hybrid_setting_is_one_line_error_before_work(tmp_path: Path) -> None:
    cfg = make_cfg("benchmark", "hybrid.min_match=5", f"out_dir={tmp_path / 'out'}")
    with pytest.raises(ValueError, match="hybrid min_match=5: must be at most max_ngram=3"):
        bench_mod.benchmark(cfg)
    assert not (tmp_path / "out").exists()


def test_benchmark_trains_missing_drafter_through_the_cache(
    tiny_base: Path, drafters: dict, cache_dir: str, tmp_path: Path
) -> None:
    """checkpoints.medusa=null: the heads are trained by the artifact cache with the benchmark's medusa config
    (two heads, as in the sweep_heads preset, while decode.gamma stays 4), then reused by the next run."""
    recipe = json.dumps([*DRAFTER, f"data.cache_dir={cache_dir}", "max_steps=2", "eval_every=2"])
    overrides = [
        "checkpoints.medusa=null",
        f"artifacts.root={tmp_path / 'artifacts'}",
        f"artifacts.medusa={recipe}",
        "medusa.module.num_heads=2",
        "methods=[medusa_chain,medusa_tree]",
        "decode.temperatures=[0]",
    ]
    summary = bench_mod.benchmark(fast_bench_cfg(tiny_base, drafters, tmp_path / "run1", *overrides))
    assert [(r["name"], r["exact"]) for r in summary["methods"]] == [("medusa_chain", True), ("medusa_tree", True)]
    (heads,) = (tmp_path / "artifacts").glob("medusa-*/checkpoint")
    meta = load_checkpoint(heads).meta
    assert meta["model_config"]["module"]["num_heads"] == 2 and meta["step"] == 2
    assert meta["base_fingerprint"] == load_checkpoint(tiny_base).meta["fingerprint"]
    mtime = (heads / "meta.json").stat().st_mtime_ns
    bench_mod.benchmark(fast_bench_cfg(tiny_base, drafters, tmp_path / "run2", *overrides))
    assert (heads / "meta.json").stat().st_mtime_ns == mtime and len(list((tmp_path / "artifacts").iterdir())) == 1


def test_benchmark_records_the_drafter_config_its_checkpoint_was_trained_with(
    tiny_base: Path, drafters: dict, tmp_path: Path
) -> None:
    """A 4-head checkpoint beside medusa.module.num_heads=2 from a preset or a default (not typed on the command
    line, which is refused: test_bad_inputs): the checkpoint runs, and results.json says what ran."""
    cfg = fast_bench_cfg(
        tiny_base, drafters, tmp_path, "methods=[medusa_chain]", "decode.temperatures=[0]", "medusa.module.num_heads=2"
    )
    bench_mod.benchmark(cfg)
    results = json.loads((tmp_path / "results.json").read_text())
    ckpt = drafters["medusa"]["result"]["checkpoint"]
    meta = load_checkpoint(ckpt).meta
    assert meta["model_config"]["module"]["num_heads"] == 4
    assert results["config"]["medusa"]["module"] == meta["model_config"]["module"]
    assert results["config"]["medusa"]["loss"] == meta["drafter"]["loss"]
    record = results["checkpoints"]["medusa"]
    assert (
        record["checkpoint"] == ckpt
        and record["fingerprint"] == meta["fingerprint"]
        and record["module"]["num_heads"] == 4
    )
    assert list(results["checkpoints"]) == ["medusa"] and results["methods"][0]["exact"]


@pytest.fixture(scope="module")
def base_other_tokenizer(tmp_path_factory: pytest.TempPathFactory, cache_dir: str, tiny_base: Path) -> Path:
    """A tiny base with the same vocabulary size but another tokenizer (trained on 31 files, not 30)."""
    out_dir = tmp_path_factory.mktemp("base31")
    cfg = make_cfg(
        "train_base",
        *BASE,
        "data.max_files=31",
        f"data.cache_dir={cache_dir}",
        f"out_dir={out_dir}",
        "max_steps=2",
        "eval_every=2",
        "checkpoint_every=2",
    )
    ckpt = Path(base_trainer.train(cfg)["checkpoint"])
    assert load_checkpoint(ckpt).meta["tokenizer"] != load_checkpoint(tiny_base).meta["tokenizer"]
    return ckpt


def test_benchmark_refuses_draft_model_with_another_tokenizer(
    tiny_base: Path, drafters: dict, tmp_path: Path, base_other_tokenizer: Path
) -> None:
    cfg = fast_bench_cfg(
        tiny_base,
        drafters,
        tmp_path,
        f"checkpoints.draft={base_other_tokenizer}",
        "methods=[draft_model]",
        "decode.temperatures=[0]",
    )
    with pytest.raises(ValueError, match=r"another tokenizer than the base \(both \d+ tokens, not the same ones\)"):
        bench_mod.benchmark(cfg)


def test_benchmark_unknown_method_fails_before_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_training(*args, **kwargs):
        raise AssertionError("an artifact was trained before the config was validated")

    monkeypatch.setattr(methods, "ensure", no_training)  # where checkpoint_for looks it up
    cfg = make_cfg(
        "benchmark", "methods=[medusa_chian]", f"artifacts.root={tmp_path}", f"out_dir={tmp_path}", "logger=none"
    )
    with pytest.raises(ValueError, match="medusa_chian"):
        bench_mod.benchmark(cfg)


@pytest.mark.parametrize("entry", ["benchmark", "baseline"])
def test_blank_prompt_in_prompts_file_fails_before_loading(
    entry: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_work(*args, **kwargs):
        raise AssertionError("a model was loaded or trained before the prompts file was checked")

    monkeypatch.setattr(methods, "ensure", no_work)
    monkeypatch.setattr(bench_mod, "load_lm", no_work)
    monkeypatch.setattr(baseline_mod, "load_lm", no_work)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):"}) + "\n\n" + json.dumps({"prompt": " \t\n "}) + "\n")
    cfg = make_cfg(
        "benchmark", f"prompts.file={prompts}", f"artifacts.root={tmp_path}", f"out_dir={tmp_path}", "logger=none"
    )
    run = bench_mod.benchmark if entry == "benchmark" else baseline_mod.compare
    with pytest.raises(ValueError) as excinfo:
        run(cfg)
    message = str(excinfo.value)
    assert f"prompts file {str(prompts)!r} line 3: prompt 2=' \\t\\n '" in message, message
    assert "give a non-empty text, not only whitespace" in message and "\n" not in message


# -------------------------------------------------------------------------- 6. main's last line


def run_module(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )


def test_benchmark_main_prints_json_last(tiny_base: Path, drafters: dict, tmp_path: Path) -> None:
    proc = run_module(
        "experiments.benchmark", *bench_overrides(tiny_base, drafters), "threads=1", f"hydra.run.dir={tmp_path}"
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(summary) == {"plain_tokens_per_s", "methods"} and len(summary["methods"]) == 2 * len(methods.METHODS)
    assert "| method | mode | T |" in proc.stdout  # the table comes before the JSON line
    assert (tmp_path / "results.json").is_file() and (tmp_path / ".hydra" / "overrides.yaml").is_file()


# ---------------------------------------------------------------------------------- 7. summarize


def fake_multirun(root: Path, results_file: Path, gammas: list[int], key: str = "decode.gamma") -> Path:
    """Jobs 0..n-1 of a benchmark multirun over `key` (its rows' gamma follows the value only for decode.gamma),
    from one real results.json."""
    results = json.loads(results_file.read_text())
    for job, gamma in enumerate(gammas):
        job_dir = root / str(job)
        (job_dir / ".hydra").mkdir(parents=True)
        rows = [{**row, "gamma": gamma if key == "decode.gamma" else 3} for row in results["methods"]]
        (job_dir / "results.json").write_text(json.dumps({**results, "methods": rows}))
        (job_dir / ".hydra" / "overrides.yaml").write_text(f"- {key}={gamma}\n- repeats=1\n")
    return root


def test_summarize_multirun(bench_run: tuple[dict, Path], tmp_path: Path) -> None:
    summary, out_dir = bench_run
    sweep = fake_multirun(tmp_path / "sweep", out_dir / "results.json", [1, 2])
    rows = summ_mod.summarize(sweep)
    n = len(summary["methods"])
    assert len(rows) == 2 * n
    assert [r["job"] for r in rows] == ["0"] * n + ["1"] * n
    assert {r["overrides"] for r in rows} == {"decode.gamma=1", "decode.gamma=2"}  # the swept values only
    for name in ("summary.md", "summary.json", "speedup_vs_gamma.png"):
        assert (sweep / name).is_file() and (sweep / name).stat().st_size > 0, name
    assert len(json.loads((sweep / "summary.json").read_text())) == 2 * n
    table = (sweep / "summary.md").read_text().splitlines()
    assert table[0] == "| " + " | ".join(summ_mod.COLUMNS) + " |" and len(table) == 2 + 2 * n
    for gamma in (1, 2):
        for row in summary["methods"]:
            line = f"| decode.gamma={gamma} | {row['name']} | eager 1t | {row['temperature']:.2f} | {gamma} |"
            assert sum(line_.startswith(line) for line_ in table) == 1, line


def test_summarize_plots_against_the_swept_setting(bench_run: tuple[dict, Path], tmp_path: Path) -> None:
    """A sweep over head counts is drawn against the head count, not against the (fixed) gamma; the table gives
    each speedup with its interval where the run measured one."""
    _, out_dir = bench_run
    sweep = fake_multirun(tmp_path / "heads", out_dir / "results.json", [1, 2, 5], key="medusa.module.num_heads")
    rows = [row for row in summ_mod.summarize(sweep) if row["status"] == "ok"]
    assert summ_mod.sweep_axis(rows) == "medusa.module.num_heads"
    assert sorted({summ_mod.axis_value(row, "medusa.module.num_heads") for row in rows}) == [1.0, 2.0, 5.0]
    assert (sweep / "speedup_vs_num_heads.png").stat().st_size > 0 and not (sweep / "speedup_vs_gamma.png").exists()
    text = (sweep / "summary.md").read_text()
    for row in rows:  # each speedup as the run reported it: "1.14x [1.02, 1.27]", or "1.14x n=1" for one cell
        assert summ_mod._column(row, "speedup") in text
        assert summ_mod._column(row, "speedup").startswith(f"{row['speedup']:.2f}x")
    assert (
        summ_mod._column({"speedup": 1.14, "speedup_lo": 1.02, "speedup_hi": 1.27}, "speedup") == "1.14x [1.02, 1.27]"
    )
    # two settings swept at once, or a setting that is not a number: the rows' own gamma
    both = [{**rows[0], "overrides": "a=1 b=2"}, {**rows[0], "overrides": "a=2 b=3"}]
    assert summ_mod.sweep_axis(both) == "gamma"
    words = [{**rows[0], "overrides": "prompts=chat_mix"}, {**rows[0], "overrides": "prompts=heldout"}]
    assert summ_mod.sweep_axis(words) == "gamma"


def test_summarize_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ValueError) as excinfo:
        summ_mod.summarize(tmp_path)
    assert "holds no */results.json" in str(excinfo.value) and "\n" not in str(excinfo.value)
    with pytest.raises(FileNotFoundError) as excinfo:
        summ_mod.summarize(tmp_path / "missing")
    assert "does not exist" in str(excinfo.value) and "\n" not in str(excinfo.value)
    assert summ_mod.main([]) == 2
    assert "usage:" in capsys.readouterr().err
    assert summ_mod.main([str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert summ_mod.main([str(tmp_path), "extra"]) == 2


def test_summarize_keeps_job_order(bench_run: tuple[dict, Path], tmp_path: Path) -> None:
    _, out_dir = bench_run
    sweep = fake_multirun(tmp_path / "sweep", out_dir / "results.json", list(range(1, 12)))
    jobs = list(dict.fromkeys(r["job"] for r in summ_mod.summarize(sweep)))
    assert jobs == [str(j) for j in range(11)]


# ------------------------------------------------------------------------------ 8. a real multirun


@pytest.mark.slow
def test_benchmark_multirun_then_summarize(tiny_base: Path, drafters: dict, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_module(
        "experiments.benchmark",
        "-m",
        "decode.gamma=1,2",
        *bench_overrides(tiny_base, drafters),
        "threads=1",
        f"hydra.sweep.dir={sweep}",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert (sweep / "0" / "results.json").is_file() and (sweep / "1" / "results.json").is_file()
    proc = run_module("experiments.summarize", str(sweep))
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("| decode.gamma=")]
    assert {line.split(" | ")[4] for line in lines} == {"1", "2"}  # overrides, name, mode, temperature, gamma
    assert {line.split(" | ")[2] for line in lines} == {"eager 1t"}
    assert len(lines) == 2 * 2 * len(methods.METHODS)
    assert (sweep / "summary.md").is_file() and (sweep / "speedup_vs_gamma.png").is_file()
