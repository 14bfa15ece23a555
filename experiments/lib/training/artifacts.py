"""Trained artifacts cached by recipe and code: a second run with the same recipe and code reuses the checkpoint.

`ensure(kind, overrides)` composes the entry point's config (train_base or train_drafter) with the given Hydra
overrides and names the result `<root>/<kind>-<recipe>-<code>`: a hash of the resolved config, and a hash of the
code that trains it (experiments.lib.common.sources.code_manifest: the files the trainer and the family's network,
loss and validation import, by their bytes). It trains only when that checkpoint does not exist yet or is
unfinished (a killed training: the next call resumes it), so an artifact trained by older code is never reused
silently: a changed loss or layer trains anew beside the old artifact, which stays. `reuse_stale=True`
(`artifacts.reuse_stale=true`) reuses a finished artifact of the same recipe trained by other code instead, with a
one-line warning naming the files that changed since (each artifact's code.json records its files' hashes).

Training happens in-process through the same plain `train(cfg)` functions the command-line entry points wrap, so
the cache cannot drift from them. code.json and result.json are written with experiments.lib.common.errors'
write_atomic (the old file or the whole new one, never a part, even on a full disk).
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
from experiments.lib.common.sources import code_changes, code_manifest, code_version
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


CODE_FILE = "code.json"  # in an artifact's directory: the hash of each file of the code that trained it
MAX_NAMED = 6  # changed files a stale artifact's warning names; the rest are counted


def training_modules(kind: str) -> tuple[str, ...]:
    """The modules whose code trains a `kind` artifact: its trainer, and a drafter family's network, loss and
    validation (the modules of its build, loss and evaluate: validation picks the weights kept)."""
    if kind == "base":
        return (base_trainer.__name__,)
    found = FAMILIES[kind]
    own = {found.build.__module__, found.loss.__module__, found.evaluate.__module__}
    return (drafter_trainer.__name__, *sorted(own))


def training_code(kind: str) -> dict[str, str]:
    """Path -> hash of every source file that trains a `kind` artifact (experiments.lib.common.sources)."""
    return code_manifest(training_modules(kind))


def artifact_kind(cfg) -> str:
    """The kind of artifact a composed train_base / train_drafter config trains: base, or the drafter family."""
    return str(cfg.drafter.package) if "drafter" in cfg else "base"


def recipe_key(cfg) -> str:
    """`<recipe>-<code>`, the name of an artifact after its kind: recipe_hash(cfg), and the hash of the code that
    trains it, so a changed loss, layer or data pipeline trains anew instead of reusing what older code trained."""
    return f"{recipe_hash(cfg)}-{code_version(training_code(artifact_kind(cfg)))}"


def recipe_hash(cfg) -> str:
    """Hash of everything in the config that changes the trained weights (not where they are written, not logging).

    A drafter's base enters by the fingerprint of its weights, not only its path: a base retrained at
    the same path gets new drafters. eval_every, patience and min_delta stay in: checkpoint/ holds the weights
    of the best validation, so how often a run validates and when it stops decide which weights it keeps."""
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


def ensure(kind: str, overrides: list[str], *, root: str | Path = "artifacts", reuse_stale: bool = False) -> Path:
    """Checkpoint directory of the `kind` artifact trained with `overrides` by this code; trains it when missing.
    reuse_stale: a finished artifact of the same recipe trained by other code serves instead (with a warning)."""
    if kind not in ENTRY:
        raise ValueError(f"artifact kind={kind!r}: must be one of {', '.join(ENTRY)}")
    if not isinstance(reuse_stale, bool):
        raise ValueError(f"artifacts.reuse_stale={reuse_stale!r}: must be true or false")
    cfg = _compose(ENTRY[kind], list(overrides))
    recipe, code = recipe_hash(cfg), training_code(kind)
    out_dir = Path(root) / f"{kind}-{recipe}-{code_version(code)}"
    ckpt = out_dir / "checkpoint"
    while True:
        RunLock.wait_free(out_dir)  # a parallel job training this very artifact: wait for it, then reuse its result
        if _finished(ckpt):
            log.info("reusing %s artifact %s", kind, out_dir)
            return ckpt
        stale = _stale_artifact(Path(root), kind, recipe, out_dir) if reuse_stale else None
        if stale is not None:
            log.warning("%s", stale_warning(kind, stale, code))
            return stale / "checkpoint"
        with open_dict(cfg):
            cfg.out_dir = str(out_dir)
        log.info("training %s artifact %s (%s)", kind, out_dir, " ".join(overrides))
        out_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(out_dir / CODE_FILE, json.dumps({"kind": kind, "files": code}, indent=1, sort_keys=True) + "\n")
        try:
            result = TRAINERS[ENTRY[kind]].train(cfg)
        except RunDirectoryInUse:  # another job took the lock between our wait and our start: wait again
            continue
        write_atomic(out_dir / "result.json", json.dumps(result, indent=2, default=str))
        return ckpt


def _finished(ckpt: Path) -> bool:
    return checkpoint_exists(ckpt) and read_meta(ckpt).get("finished", True)  # the flag: saved at the end only


def _stale_artifact(root: Path, kind: str, recipe: str, current: Path) -> Path | None:
    """The newest finished artifact of this recipe trained by other code (the artifacts beside `current`)."""
    found = [d for d in root.glob(f"{kind}-{recipe}-*") if d != current and _finished(d / "checkpoint")]
    return max(found, key=lambda d: ((d / "checkpoint" / "meta.json").stat().st_mtime_ns, d.name), default=None)


def stale_warning(kind: str, directory: Path, code: dict[str, str]) -> str:
    """One line: which artifact is reused, and the files of its training code that changed since it was trained."""
    try:
        recorded = json.loads((directory / CODE_FILE).read_text())["files"]
        changes = code_changes(recorded, code)
    except (OSError, ValueError, KeyError, TypeError):
        changes = [f"its code is not recorded ({CODE_FILE} missing or unreadable)"]
    named = ", ".join(changes[:MAX_NAMED]) + (
        f" and {len(changes) - MAX_NAMED} more" if len(changes) > MAX_NAMED else ""
    )
    return (
        f"artifacts.reuse_stale=true: reusing {kind} artifact {directory}, trained by other code than this "
        f"checkout's: {named or 'the same files'}"
    )
