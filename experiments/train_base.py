"""Train a base LM from scratch: the frozen target that every drafter is later trained on and verified by.

    python -m experiments.train_base experiment=base_tiny            # recommended tiny recipe
    python -m experiments.train_base experiment=base_draft           # independent draft model
    python -m experiments.train_base hydra.run.dir=outputs/train_base/<run>   # resume a crashed run
    torchrun --standalone --nproc_per_node 2 -m experiments.train_base hydra.run.dir=outputs/train_base/<run>

The work is experiments.lib.training.base_trainer.train(cfg), a plain function tests call with a composed config.
"""

from __future__ import annotations

import json

import hydra
from omegaconf import DictConfig

from experiments.lib.cli.preflight import hydra_preflight
from experiments.lib.common.errors import exit_on_user_error
from experiments.lib.training.base_trainer import train


@hydra_preflight
@hydra.main(version_base="1.3", config_path="../conf", config_name="train_base")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    result = train(cfg)
    if result["rank"] == 0:
        print(json.dumps(result))  # one JSON object last, for scripts


if __name__ == "__main__":
    main()
