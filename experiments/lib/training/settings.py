"""Settings checked before any work: one-line ValueErrors naming the value and what is allowed (the command
line prints them as `error: ...`, exit 2).

The validators of single values, one of each kind: check_int (an integer >= a minimum, or null), check_bool,
check_number (a finite number in an allowed range), and require for any other condition. They word an error
`<key>=<value>: must be ...`. The training loop's checks here (check_loop_config, check_optim) keep the training
recipes' own wording, `<key> must be ..., got <value>`, which their tests pin: check_positive_int is check_int
in that wording. Also the device and a resumed run's recipe. The decoding entry points' config checks build on
these in experiments/lib/methods/decode_checks.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from experiments.lib.store.checkpoint import CheckpointError
from experiments.lib.training.distributed import Dist
from verify.common.numerics import check_int, is_finite_number, is_int

__all__ = [
    "require",
    "is_int",
    "check_int",
    "check_bool",
    "check_number",
    "check_positive_int",
    "data_recipe",
    "check_optim",
    "check_loop_config",
    "check_batch_split",
    "resolve_device",
    "check_recipe",
]


def require(ok: bool, message: str) -> None:
    """A ValueError(message) unless ok: a condition the validators below do not cover."""
    if not ok:
        raise ValueError(message)


def check_bool(name: str, value: Any) -> bool:
    """`value` if it is true or false (not 0, 1 or a string), else `<name>=<value>: must be true or false`."""
    require(isinstance(value, bool), f"{name}={value!r}: must be true or false")
    return value


def check_number(name: str, value: Any, allowed: str, ok: Callable[[float], bool]) -> float:
    """`value` as a float if it is a finite number (not a bool, a string, NaN or inf) for which ok(value)
    holds, else `<name>=<value>: must be <allowed>`."""
    require(is_finite_number(value) and ok(value), f"{name}={value!r}: must be {allowed}")
    return float(value)


def check_positive_int(name: str, value: Any, *, allow_null: bool = False) -> None:
    """check_int(name, value) in the training recipes' wording, `<name> must be a positive integer[ or null],
    got <value>`: the same test, the words their users and tests read."""
    try:
        check_int(name, value, allow_null=allow_null)
    except ValueError:
        raise ValueError(
            f"{name} must be a positive integer{' or null' if allow_null else ''}, got {value!r}"
        ) from None


def data_recipe(data: Any) -> dict[str, Any]:
    """A data config as part of a training recipe: everything but where its token cache lives."""
    recipe = OmegaConf.to_container(data, resolve=True)
    recipe.pop("cache_dir", None)
    if recipe.get("undecodable") == "replace":  # what every run did before the setting: their recipes still match
        recipe.pop("undecodable")
    return recipe


def check_optim(optim: Any, max_steps: int) -> None:
    """One-line errors for the optim group (conf/optim/adamw.yaml) before any model is built."""
    for key in ("lr", "min_lr", "eps", "weight_decay", "grad_clip"):
        require(is_finite_number(optim[key]), f"optim.{key} must be a number, got {optim[key]!r}")
    require(optim.lr > 0, f"optim.lr must be positive, got {optim.lr}")
    require(0 <= optim.min_lr <= optim.lr, f"optim.min_lr must lie in [0, optim.lr={optim.lr}], got {optim.min_lr}")
    require(
        is_int(optim.warmup_steps) and optim.warmup_steps >= 0,
        f"optim.warmup_steps must be a non-negative integer, got {optim.warmup_steps!r}",
    )
    require(
        optim.warmup_steps <= max_steps,
        f"optim.warmup_steps ({optim.warmup_steps}) must not exceed max_steps ({max_steps})",
    )
    betas = list(optim.betas)
    require(
        len(betas) == 2 and all(is_finite_number(b) and 0 <= b < 1 for b in betas),
        f"optim.betas must be two numbers in [0, 1), got {betas}",
    )
    require(optim.eps > 0, f"optim.eps must be positive, got {optim.eps}")
    require(optim.weight_decay >= 0, f"optim.weight_decay must be non-negative, got {optim.weight_decay}")
    require(optim.grad_clip >= 0, f"optim.grad_clip must be non-negative (0 disables), got {optim.grad_clip}")


def check_loop_config(cfg: Any) -> None:
    """The loop's own settings, shared by every training entry point."""
    for key in ("max_steps", "log_every", "eval_every", "eval_blocks", "checkpoint_every", "grad_accum"):
        check_positive_int(key, cfg[key])
    require(is_int(cfg.seed) and 0 <= cfg.seed < 2**32, f"seed must be an integer in [0, 2**32), got {cfg.seed!r}")
    require(
        cfg.max_minutes is None or (is_finite_number(cfg.max_minutes) and cfg.max_minutes > 0),
        f"max_minutes must be positive or null, got {cfg.max_minutes!r}",
    )
    require(isinstance(cfg.resume, bool), f"resume must be true or false, got {cfg.resume!r}")
    check_positive_int("threads", cfg.threads, allow_null=True)
    # early stopping: validations without improvement before stopping (null: never); 0 would stop at once
    check_positive_int("patience", cfg.patience, allow_null=True)
    require(
        is_finite_number(cfg.min_delta) and cfg.min_delta >= 0,
        f"min_delta must be a number >= 0, got {cfg.min_delta!r}",
    )
    check_optim(cfg.optim, cfg.max_steps)
    require(isinstance(cfg.device, str), f"device must be auto, cpu or cuda[:N], got {cfg.device!r}")
    resolve_device(cfg.device)


def check_batch_split(batch_size: int, grad_accum: int, ctx: Dist) -> None:
    """batch_size is the global batch: split evenly across ranks, then into grad_accum micro-batches."""
    require(
        batch_size % ctx.world == 0,
        f"batch_size={batch_size} must be divisible by the number of processes "
        f"({ctx.world}): it is the global batch, split evenly across ranks",
    )
    rows = batch_size // ctx.world
    require(grad_accum <= rows, f"grad_accum={grad_accum} must not exceed the rows per step and process ({rows})")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {name!r}") from None
    require(device.type != "cuda" or torch.cuda.is_available(), f"device={name!r} but CUDA is not available")
    return device


def check_recipe(directory: Path, found: dict[str, Any] | None, expected: dict[str, Any]) -> None:
    """Resume only a checkpoint trained with the same recipe (seed, data, batch, optimizer, ...)."""
    if found is None:
        raise CheckpointError(
            f"checkpoint {directory} records no training recipe (written by an older version): "
            "it cannot be resumed exactly; use resume=false or another out_dir"
        )
    found, expected = json.loads(json.dumps(found)), json.loads(json.dumps(expected))  # tuples vs lists
    diffs = [
        f"{k}: checkpoint {found.get(k, '<absent>')!r} vs now {expected.get(k, '<absent>')!r}"
        for k in sorted(set(found) | set(expected))
        if found.get(k, "<absent>") != expected.get(k, "<absent>")
    ]
    if diffs:
        raise CheckpointError(
            f"checkpoint {directory} was trained with another recipe ({'; '.join(diffs)}): "
            "resuming would mix two runs; use resume=false or another out_dir"
        )
