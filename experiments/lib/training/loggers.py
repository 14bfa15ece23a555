"""Metric loggers built from conf/logger/*.yaml: every entry point logs through one of these.

logger=wandb writes an offline run under <out_dir>/wandb (upload later with `wandb sync`);
logger=none keeps metrics in the run's metrics.jsonl only.
"""

from __future__ import annotations

from pathlib import Path


class NullLogger:
    """logger=none: metrics go to metrics.jsonl only."""

    def __init__(self, *, dir: str | None = None, run_config: dict | None = None) -> None:
        pass

    def log(self, metrics: dict[str, float], *, step: int) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbLogger:
    """logger=wandb: offline by default, files under <out_dir>/wandb (upload later with `wandb sync`)."""

    def __init__(
        self, *, project: str, mode: str = "offline", name: str | None = None, dir: str, run_config: dict | None = None
    ) -> None:
        import wandb  # imported here: slow to import, and not needed with logger=none

        Path(dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project, mode=mode, name=name, dir=dir, config=run_config, settings=wandb.Settings(silent=True)
        )

    def log(self, metrics: dict[str, float], *, step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        self.run.finish()
