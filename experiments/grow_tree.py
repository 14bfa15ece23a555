"""Grow a static tree for Medusa or sequential heads, for a node budget, from the head accuracies measured
on validation.

    python -m experiments.grow_tree checkpoint=outputs/reference/medusa/checkpoint tree_nodes=16

train_drafter stores the heads' final validation metrics in the checkpoint, among them
`head{k}_rank{r}`: how often head k's rank-r guess equals the base's own choice. The tree keeps the
nodes whose paths are most likely to be accepted (verify.tree.grow_tree). Prints the rank paths as one
JSON list, ready for `medusa.decode.tree=...` / `sequential.decode.tree=...`. Sequential heads' rank rates
are conditional on an accepted path (they read it), which is what a node's value multiplies.
"""

from __future__ import annotations

import json
import sys

import hydra
from omegaconf import DictConfig

from experiments.lib.checkpoint import load_checkpoint
from experiments.lib.cli import exit_on_user_error
from experiments.lib.preflight import hydra_preflight
from medusa.trees import tree_from_accuracies


def grow(cfg: DictConfig) -> list[list[int]]:
    meta = load_checkpoint(cfg.checkpoint).meta
    if meta.get("kind") != "drafter" or meta["model_config"]["package"] not in ("medusa", "sequential"):
        raise ValueError(
            f"checkpoint={cfg.checkpoint}: not a Medusa or sequential heads checkpoint "
            "(experiments.train_drafter drafter=medusa or drafter=sequential)"
        )
    num_heads = meta["model_config"]["module"]["num_heads"]
    return [list(p) for p in tree_from_accuracies(meta["metrics"], num_heads, cfg.tree_nodes)]


@hydra_preflight
@hydra.main(version_base="1.3", config_path="../conf", config_name="grow_tree")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    print(json.dumps(grow(cfg)), file=sys.stdout)


if __name__ == "__main__":
    main()
