"""Train a drafter (Medusa or sequential heads, a prophet or a block prophet, a draft model, an early-exit
head) on a frozen base, by self-distillation.

    python -m experiments.train_drafter drafter=medusa base_checkpoint=outputs/.../checkpoint
    python -m experiments.train_drafter drafter=prophet base_checkpoint=... drafter.loss.unroll=3
    python -m experiments.train_drafter drafter=prophet_block base_checkpoint=... drafter.module.block=6
    python -m experiments.train_drafter drafter=draft base_checkpoint=...
    torchrun --standalone --nproc_per_node 2 -m experiments.train_drafter drafter=medusa base_checkpoint=...

The work is experiments.lib.training.drafter_trainer.train(cfg); the families are registered in
experiments/lib/families/registry.py.
"""

from __future__ import annotations

import json

import hydra
from omegaconf import DictConfig

from experiments.lib.cli.preflight import hydra_preflight
from experiments.lib.common.errors import exit_on_user_error
from experiments.lib.training.drafter_trainer import train


@hydra_preflight
@hydra.main(version_base="1.3", config_path="../conf", config_name="train_drafter")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    result = train(cfg)
    if result["rank"] == 0:
        print(json.dumps(result))  # one JSON object last, for scripts


if __name__ == "__main__":
    main()
