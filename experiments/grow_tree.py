"""Grow a static tree for Medusa or sequential heads or a block prophet, for a node budget, from the head
(draft position) accuracies measured on validation.

    python -m experiments.grow_tree checkpoint=outputs/reference/medusa/checkpoint tree_nodes=16

train_drafter stores the heads' final validation metrics in the checkpoint, among them
`head{k}_rank{r}`: how often head k's rank-r guess equals the base's own choice. The tree keeps the
nodes whose paths are most likely to be accepted (verify.loop.tree.grow_tree). Prints the rank paths as one
JSON list, ready for `medusa.decode.tree=...` / `sequential.decode.tree=...` / `prophet_block.decode.tree=...`.
Sequential heads' rank rates are conditional on an accepted path (they read it), which is what a node's value
multiplies; a block prophet's positions, like Medusa's heads, read no drafted token.
"""

from __future__ import annotations

import json
import sys

import hydra
from omegaconf import DictConfig

from experiments.lib.cli.preflight import hydra_preflight
from experiments.lib.common.errors import exit_on_user_error
from experiments.lib.store.checkpoint import load_checkpoint
from medusa.trees import tree_from_accuracies

# The families whose trees are static trees of head ranks (FAMILIES[...].head_tree), and the module setting
# that counts their heads (draft positions).
HEADS = {"medusa": "num_heads", "sequential": "num_heads", "prophet_block": "block"}


def grow(cfg: DictConfig) -> list[list[int]]:
    meta = load_checkpoint(cfg.checkpoint).meta
    if meta.get("kind") != "drafter" or meta["model_config"]["package"] not in HEADS:
        raise ValueError(
            f"checkpoint={cfg.checkpoint}: not a Medusa, sequential heads or block prophet checkpoint "
            "(experiments.train_drafter drafter=medusa, drafter=sequential or drafter=prophet_block)"
        )
    num_heads = meta["model_config"]["module"][HEADS[meta["model_config"]["package"]]]
    return [list(p) for p in tree_from_accuracies(meta["metrics"], num_heads, cfg.tree_nodes)]


@hydra_preflight
@hydra.main(version_base="1.3", config_path="../conf", config_name="grow_tree")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    print(json.dumps(grow(cfg)), file=sys.stdout)


if __name__ == "__main__":
    main()
