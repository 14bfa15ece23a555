"""Trained artifacts cached by config: a second run with the same recipe reuses the checkpoint.

`ensure(kind, overrides)` composes the entry point's config (train_base or train_drafter) with the
given Hydra overrides, names the result by a hash of the resolved config, and trains only when
`<root>/<kind>-<hash>/checkpoint` does not exist yet or is unfinished (a killed training: the next call
resumes it). Training happens in-process through the same plain `train(cfg)` functions the command-line
entry points wrap, so the cache cannot drift from them. result.json is written with
experiments.lib.common.errors.write_atomic (the old file or the whole new one, never a part, even on a full disk).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from hydra import compose
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from experiments.lib.common.errors import one_line, write_atomic
from experiments.lib.common.sources import training_version
from experiments.lib.families.registry import FAMILIES
from experiments.lib.store.checkpoint import checkpoint_exists, read_meta
from experiments.lib.store.rundir import RunDirectoryInUse, RunLock
from experiments.lib.training import base_trainer, drafter_trainer

log = logging.getLogger(__name__)
CONF_DIR = str(Path(__file__).resolve().parents[3] / "conf")  # experiments/lib/<package>/ -> the root
# artifact kind -> the entry point that trains it: the base, and every drafter family (the draft model's among them)
ENTRY = {"base": "train_base", **dict.fromkeys(FAMILIES, "train_drafter")}
TRAINERS = {"train_base": base_trainer, "train_drafter": drafter_trainer}  # config name -> its validate_config, train


def compose_recipe(kind: str, overrides: list[str]):
    """The config the `kind` artifact's recipe trains with (the entry point's, composed with `overrides`)."""
    return _compose(ENTRY[kind], list(overrides))


def _compose(config_name: str, overrides: list[str]):
    if GlobalHydra.instance().is_initialized():  # inside a @hydra.main app or a test's initialize()
        return compose(config_name=config_name, overrides=overrides)
    from hydra import initialize_config_dir

    with initialize_config_dir(version_base="1.3", config_dir=CONF_DIR):
        return compose(config_name=config_name, overrides=overrides)


def recipe_key(cfg) -> str:
    """Hash of everything that changes the trained weights (not where they are written, not logging).

    A drafter's base enters by the fingerprint of its weights, not only its path: a base retrained at
    the same path gets new drafters. eval_every, patience and min_delta stay in: checkpoint/ holds the weights
    of the best validation, so how often a run validates and when it stops decide which weights it keeps. So
    does the code: the hash of the training sources (experiments.lib.common.sources), so that a changed loss,
    layer or data pipeline trains anew instead of reusing what older code trained."""
    recipe = OmegaConf.to_container(cfg, resolve=False)
    for key in (
        "out_dir",
        "logger",
        "hydra",
        "threads",
        "device",
        "resume",
        "checkpoint_every",
        "log_every",
        "grad_accum",
    ):  # where and how often it reports, not what it trains
        recipe.pop(key, None)
    if "base_checkpoint" in recipe:
        meta = Path(str(recipe["base_checkpoint"])) / "meta.json"
        recipe["base_fingerprint"] = json.loads(meta.read_text())["fingerprint"] if meta.exists() else None
    recipe["code"] = training_version()
    return hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:12]


def check_artifact(kind: str, overrides: list[str]) -> None:
    """Compose and validate the recipe of a `kind` artifact without training it: a bad recipe (an unknown key,
    a value the training entry point refuses) is one line before any artifact trains."""
    try:
        cfg = _compose(ENTRY[kind], list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ValueError(f"artifacts.{kind} does not compose: {one_line(e)}") from None
    with open_dict(cfg):
        cfg.out_dir = "unused"  # ensure() names it; its default needs a running Hydra app
    try:
        TRAINERS[ENTRY[kind]].validate_config(cfg)
    except ValueError as e:
        raise ValueError(f"artifacts.{kind} (the recipe training {kind}): {one_line(e)}") from None


def ensure(kind: str, overrides: list[str], *, root: str | Path = "artifacts") -> Path:
    """Checkpoint directory of the `kind` artifact trained with `overrides`; trains it when missing."""
    if kind not in ENTRY:
        raise ValueError(f"artifact kind={kind!r}: must be one of {', '.join(ENTRY)}")
    cfg = _compose(ENTRY[kind], list(overrides))
    out_dir = Path(root) / f"{kind}-{recipe_key(cfg)}"
    ckpt = out_dir / "checkpoint"
    while True:
        RunLock.wait_free(out_dir)  # a parallel job training this very artifact: wait for it, then reuse its result
        if checkpoint_exists(ckpt) and read_meta(ckpt).get("finished", True):  # before the flag: saved at the end only
            log.info("reusing %s artifact %s", kind, out_dir)
            return ckpt
        with open_dict(cfg):
            cfg.out_dir = str(out_dir)
        log.info("training %s artifact %s (%s)", kind, out_dir, " ".join(overrides))
        out_dir.mkdir(parents=True, exist_ok=True)
        try:
            result = TRAINERS[ENTRY[kind]].train(cfg)
        except RunDirectoryInUse:  # another job took the lock between our wait and our start: wait again
            continue
        write_atomic(out_dir / "result.json", json.dumps(result, indent=2, default=str))
        return ckpt
