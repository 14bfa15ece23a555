"""The drafter families: one explicit registry of how each is built, trained, evaluated and decoded with.

A family is four functions and three facts. The training side (build, loss, evaluate) lives in the family's
train module; the inference side (make_drafter) lives beside the drafter class it returns:

    build(base, **module)                       -> nn.Module        (module kwargs are JSON-able: a checkpoint
                                                                     records them and rebuilds the module)
    loss(module, base, batch, *, vocab, **loss) -> (scalar loss, metrics)   batch: a FeatureBatch
    evaluate(module, base, batch, *, vocab)     -> {metric: float}  (agreement with the base, per position)
    make_drafter(module, base, **decode)        -> a Drafter for verify.loop.speculative.speculative_generate

`conf/drafter/<name>.yaml` holds a family's module, loss and decode settings; `drafter.package` names the
family here. Adding a family is one entry below plus that config file; for the decoding entry points, also
its place in conf/models/default.yaml (the drafter config, its checkpoint and its artifact recipe) and, for a
family with a tree mode, its budget=auto candidates in conf/benchmark.yaml (budget_search.<name>_trees). Its
methods are <name>_<mode> (experiments/lib/methods/registry.py FAMILY_METHODS, which maps a method to its family and
mode: a family name may contain "_", so a method name is never split).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from experiments.lib.families import draft as draft_family
from experiments.lib.families import early_exit as exit_family
from experiments.lib.families import sequential as sequential_family
from experiments.lib.formats.common import detect
from experiments.lib.formats.registry import read
from experiments.lib.store.checkpoint import CheckpointError, load_checkpoint
from experiments.lib.store.shipped_drafters import check_sums, expand, is_shipped
from medusa import drafter as medusa_drafter
from medusa import sequential_drafter, sequential_train
from medusa import train as medusa_train
from prophet import block_drafter, block_train
from prophet import drafter as prophet_drafter
from prophet import train as prophet_train
from verify.drafters import draft_model, early_exit


@dataclass(frozen=True)
class Family:
    build: Callable[..., nn.Module]
    loss: Callable[..., tuple[Any, dict]]
    evaluate: Callable[..., dict[str, float]]
    make_drafter: Callable[..., Any]
    # the decoding methods are <family>_<mode> (experiments/lib/methods/registry.py)
    modes: tuple[str, ...] = ("chain",)
    head_tree: bool = False  # static trees of head ranks, grown from the heads' measured rank accuracies
    compiles: bool = False  # has decoder steps of its own that torch.compile can trace


FAMILIES: dict[str, Family] = {
    "draft": Family(draft_family.build, draft_family.loss, draft_family.evaluate, draft_model.make_drafter),
    "medusa": Family(
        medusa_train.build,
        medusa_train.loss,
        medusa_train.evaluate,
        medusa_drafter.make_drafter,
        modes=("chain", "tree"),
        head_tree=True,
    ),
    "prophet": Family(
        prophet_train.build,
        prophet_train.loss,
        prophet_train.evaluate,
        prophet_drafter.make_drafter,
        modes=("chain", "tree"),
        compiles=True,
    ),
    "prophet_block": Family(  # the prophet's network drafting K positions per forward (static trees, like Medusa's)
        block_train.build,
        block_train.loss,
        block_train.evaluate,
        block_drafter.make_drafter,
        modes=("chain", "tree"),
        head_tree=True,
        compiles=True,
    ),
    "sequential": Family(
        sequential_family.build,  # sequential_train.build, and Hydra++'s prefix layer built from prophet/'s layer
        sequential_train.loss,
        sequential_train.evaluate,
        sequential_drafter.make_drafter,
        modes=("chain", "tree"),
        head_tree=True,
    ),
    "early_exit": Family(
        exit_family.build, exit_family.loss, exit_family.evaluate, early_exit.make_drafter, compiles=True
    ),
}
TREE_FAMILIES = tuple(name for name, f in FAMILIES.items() if "tree" in f.modes)


def family(name: str) -> Family:
    """The registered family `name`, with a one-line error for an unknown one."""
    if name not in FAMILIES:
        raise ValueError(f"drafter.package={name!r}: must be one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def call_with_settings(fn, group: str, *args, **settings):
    """fn(*args, **settings) with an unknown setting reported as one line naming the config group, and a
    setting the module refuses (`num_heads=0: ...`) named by its full key (`medusa.module.num_heads=0: ...`)."""
    try:
        return fn(*args, **settings)
    except TypeError as e:
        if "unexpected keyword argument" not in str(e):
            raise
        name = str(e).split("argument")[-1].strip(" '")
        raise ValueError(f"{group}.{name}: not a setting of {fn.__module__}.{fn.__name__}") from None
    except ValueError as e:
        if str(e).split("=")[0] not in settings:
            raise
        raise ValueError(f"{group}.{e}") from None


def load_drafter(directory: str | Path, base: nn.Module, base_meta: dict) -> tuple[nn.Module, Family, dict]:
    """Rebuild a trained drafter against `base`; (module, its family, meta). Another base is an error.
    A directory in a serving format (eagle3, eagle, medusa: experiments/lib/formats/) is read as one."""
    if detect(directory) is not None:
        module, package, meta = read(directory, base, base_meta)
        return module.eval(), family(package), meta
    ckpt = load_checkpoint(directory)
    meta = ckpt.meta
    if meta.get("kind") != "drafter":
        raise CheckpointError(f"{directory} is not a drafter checkpoint (kind={meta.get('kind')!r})")
    if meta["base_fingerprint"] != base_meta["fingerprint"]:
        raise CheckpointError(
            f"drafter {directory} was trained on base {meta['base_fingerprint']}, "
            f"not on this base ({base_meta['fingerprint']}): train it on this base first"
        )
    found = family(meta["model_config"]["package"])
    module = found.build(base, **meta["model_config"]["module"])
    state = ckpt.state_dict
    if is_shipped(meta):  # a trimmed bf16 copy committed with the repository: its rows written into the built module
        check_sums(directory)
        state = expand(module, state, meta)
    module.load_state_dict(state, strict=True)
    weight = next(base.parameters())  # a drafter decodes in the base's device and dtype (fp32 or bf16)
    return module.to(device=weight.device, dtype=weight.dtype).eval(), found, meta
