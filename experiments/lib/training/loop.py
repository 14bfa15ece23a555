"""The one training loop, shared by the base LM, every drafter and the encoder-decoders; the caller supplies
the loss.

`TrainLoop.run` owns what every training needs: the learning-rate schedule, precision (autocast), gradient
accumulation, clipping, the optimizer step, validation, metrics.jsonl and the logger, periodic checkpoints
and resume, time budgets, and DistributedDataParallel under torchrun (experiments/lib/training/distributed.py). The
caller (base_trainer, drafter_trainer, train_seq2seq) supplies the model being trained, `loss_fn(model, batch)
-> (loss, metrics)`, `batch_fn(step)` (this rank's rows of the step's batch), `count_fn` (tokens, positions
or pairs in a batch), `validate_fn()`, `save_fn`, the `Monitor` (which validation figure is better) and
optionally `after_backward` (a check after each backward).

Two checkpoints live in the run directory. `checkpoint/` holds the best weights so far: those of the validation
with the best figure (the base and the encoder-decoders: the lowest val_loss; drafters: the highest mean
agreement with the base, what their validation measures). Every later stage (cache_features, a drafter's
base_checkpoint, benchmark, generate, the artifact cache) reads `checkpoint/`, so it always gets the best
weights. `last/` holds the latest: written every checkpoint_every steps and at the end, it is what a resumed
run continues from. Both are written by save_fn in the same format (weights, optimizer, loop state), and
their meta.json says which they are ("selected": "best" or "last", best_step, best_value, last_step). The best
is written at the validation that found it (the weights move on after it), so a step that is both a new best
and a periodic checkpoint is written twice, once to each: the simplest way for `last/` to be right.
Validations compare like with like: every trainer validates on the same fixed blocks or pairs each time.

Early stopping (optional, `patience`): training stops after `patience` validations in a row without an
improvement of at least `min_delta` over the figure of the last validation that improved (Keras' rule: many
small gains that add up to min_delta still count).

Exact resume needs no loader or RNG state: the batch of step s is drawn from a generator seeded with
(seed, s), and torch's global RNG is reseeded the same way before every step, so a resumed run retraces the
uninterrupted one bit for bit (same machine, same threads) when the schedule follows steps only
(max_minutes=null). With a time budget the cosine follows the wall clock, which a kill interrupts: the
resumed run continues the schedule where the checkpoint left it, not bit for bit. The budgets (max_steps,
max_minutes) may change on resume, which is how a run is extended (the cosine then stretches to the new
end); everything else that decides the weights, the recipe, is checked and may not.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import Tensor, nn

from experiments.lib.common.errors import write_atomic
from experiments.lib.data.pipeline import sample_batch
from experiments.lib.store.checkpoint import checkpoint_exists, fingerprint, read_meta, update_meta
from experiments.lib.store.rundir import RunLock, check_checkpoint_dir, check_writable
from experiments.lib.training.distributed import (
    Dist,
    all_mean,
    batch_rows,
    broadcast_float,
    broadcast_text,
    close_distributed,
    gather_text,
    init_distributed,
    take_rows,
    wrap,
)
from experiments.lib.training.loggers import NullLogger
from experiments.lib.training.precision import autocast
from experiments.lib.training.settings import check_batch_split, require, resolve_device

log = logging.getLogger(__name__)
SEED_STRIDE = 1_000_003  # seed * stride + step: distinct streams for every (seed, step) in practice
# The run directory's two checkpoints, by what they hold. checkpoint/ keeps its name for the best: every stage
# after training reads it, and run directories written before last/ existed keep working.
CHECKPOINT_DIRS = {"best": "checkpoint", "last": "last"}


# ------------------------------------------------------------------------------------------- settings


class NonFiniteLoss(ValueError):
    """The loss turned NaN or infinite: training stops rather than save NaN weights over good ones."""


# ------------------------------------------------------------------------------------ optimisation parts


def lr_at(
    step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int, time_fraction: float = 0.0
) -> float:
    """Linear warm-up over warmup_steps (step 0 already gets lr / warmup_steps) times a cosine to min_lr.

    The cosine follows whichever budget is further spent: the steps after warm-up, or wall time
    (`time_fraction` = elapsed / max_minutes, 0 without a time budget), so a time-limited run still
    ends annealed, even one whose budget runs out during warm-up."""
    warmup = min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    step_fraction = max(0, step - warmup_steps) / max(1, max_steps - warmup_steps)
    progress = min(1.0, max(step_fraction, time_fraction))  # 0 -> 1
    return warmup * (min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress)))


def make_optimizer(
    model: nn.Module, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float
) -> torch.optim.AdamW:
    # Decay matrices (linear and embedding weights) only: decaying norm gains and biases pulls them to 0,
    # which only hurts. A model that starts from pretrained weights (a draft model cut from its base) carries
    # `lr_scale`: at the rate that trains fresh weights, a few dozen Adam steps erase what it copied.
    params = [p for p in model.parameters() if p.requires_grad]
    scale = float(getattr(model, "lr_scale", 1.0))
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay, "lr_scale": scale},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "lr_scale": scale},
    ]
    # fused: one kernel per step instead of a dozen elementwise passes over every parameter (Medusa's heads
    # train 8M parameters: the foreach AdamW cost 60 of 600 ms per step on one CPU thread, fused 10)
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=fused)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The step's learning rate on every parameter group, times the group's `lr_scale` (make_optimizer)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def batch_for_step(ids: Tensor, *, step: int, seed: int, batch_size: int, seq_len: int, device: torch.device) -> Tensor:
    """(B, T+1) random windows, a pure function of (seed, step): resuming needs no state."""
    generator = torch.Generator().manual_seed(seed * SEED_STRIDE + step)
    return sample_batch(ids, batch_size=batch_size, seq_len=seq_len, generator=generator, device=device)


def validation_blocks(val_ids: Tensor, *, seq_len: int, eval_blocks: int) -> Tensor:
    """(n, T+1) windows spread evenly over the whole validation stream, always the same ones.

    Evenly spread rather than the first n: the stream is files in order, so the first blocks would be
    a handful of files only."""
    n_windows = (val_ids.numel() - 1) // seq_len
    require(n_windows > 0, f"the validation split has {val_ids.numel()} tokens, fewer than seq_len + 1")
    starts = torch.linspace(0, n_windows - 1, min(eval_blocks, n_windows)).round().long() * seq_len  # (n,)
    return val_ids[starts[:, None] + torch.arange(seq_len + 1)].long()  # (n, T+1)


# ------------------------------------------------------------------------------------------ run state


@dataclass
class LoopState:
    step: int = 0
    units: int = 0  # tokens (base), positions (drafters) or pairs (seq2seq) trained on, over every rank
    elapsed_s: float = 0.0  # wall time of earlier sessions (resumes add up): max_minutes budgets it all
    best_step: int | None = None  # the step of the best validation so far: its weights are checkpoint/
    best_value: float | None = None  # ... and its figure (Monitor.metric)
    stale: int = 0  # validations in a row without an improvement of min_delta (early stopping)
    reference: float | None = None  # the figure of the last validation that improved: what stale counts against

    @classmethod
    def from_meta(cls, meta: dict[str, Any], unit: str) -> LoopState:
        """The state a checkpoint was saved in. One written before best-checkpoint training (no "selected")
        knows no best: the first validation after resuming writes checkpoint/ anew."""
        state = cls(step=meta["step"], units=meta[f"{unit}_seen"], elapsed_s=meta["elapsed_s"])
        if "selected" in meta:
            stopping = meta["early_stopping"]
            state.best_step, state.best_value = meta["best_step"], meta["best_value"]
            state.stale, state.reference = stopping["stale"], stopping["reference"]
        return state


@dataclass(frozen=True)
class Monitor:
    """The validation figure that picks the best checkpoint and drives early stopping: a key of validate_fn's
    result, and whether lower is better."""

    metric: str = "val_loss"
    lower_is_better: bool = True

    def gain(self, value: float, reference: float) -> float:
        """How much better `value` is than `reference` (> 0: better)."""
        return reference - value if self.lower_is_better else value - reference


def resume_point(out_dir: Path) -> Path | None:
    """The checkpoint a resumed run continues from: `last/`, the latest weights; in a run directory written
    before `last/` existed, `checkpoint/` (there it holds the latest); None when there is neither."""
    for name in (CHECKPOINT_DIRS["last"], CHECKPOINT_DIRS["best"]):
        if checkpoint_exists(out_dir / name):
            return out_dir / name
    return None


class MetricsFile:
    """metrics.jsonl: one row per log ("train") and per validation ("val"); kept in step with resumes."""

    def __init__(self, path: Path, *, resume_step: int) -> None:
        self.path = path
        rows = self.read(path) if path.exists() and resume_step > 0 else []
        # rows written after the checkpoint we resume from would be repeated: drop them
        kept = [r for r in rows if r["step"] <= resume_step]
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))  # a crash here loses no rows

    def write(self, row: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    @staticmethod
    def read(path: Path) -> list[dict[str, Any]]:
        """The rows; a last line cut short (the process was killed while appending it) is dropped."""
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        rows = []
        for i, line in enumerate(lines):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                if i < len(lines) - 1:
                    raise ValueError(
                        f"{path}: line {i + 1} is not JSON (only a last line cut short by a kill is "
                        "expected); repair or remove the file"
                    ) from None
                continue
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError(
                    f"{path}: line {i + 1} is not a metrics row (an object with an integer step); "
                    "repair or remove the file"
                )
            rows.append(row)
        return rows


def progress_bar(*, enabled: bool = True) -> Progress:
    console = Console(stderr=True)  # stdout is kept for the final JSON line
    return Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
        console=console,
        disable=not (enabled and console.is_terminal),
    )


# ------------------------------------------------------------------------------------ run directory


def launch(cfg: Any, *, batch_size: int, body: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """Run a training entry point's `body(ctx=, device=, out_dir=)` as one process or one rank of torchrun:
    join the process group, check the batch split and the run directory, and hold the directory's lock
    on rank 0 for the whole run."""
    ctx, device = init_distributed(resolve_device(cfg.device))
    try:
        check_batch_split(batch_size, cfg.grad_accum, ctx)
        out_dir = prepare_run_dir(cfg.out_dir, ctx, device)
        with RunLock(out_dir) if ctx.main else nullcontext():
            return body(ctx=ctx, device=device, out_dir=out_dir)
    finally:
        close_distributed()


def make_logger(cfg: Any, out_dir: Path, ctx: Dist) -> Any:
    """The configured logger on rank 0; the others log nothing (their metrics reach rank 0 by all-reduce)."""
    if not ctx.main:
        return NullLogger()
    # _recursive_=False: the run config holds `_target_` nodes (base, logger) that must stay plain data
    return instantiate(
        cfg.logger,
        dir=str(out_dir),
        run_config=OmegaConf.to_container(cfg, resolve=True),
        _convert_="all",
        _recursive_=False,
    )


def prepare_run_dir(out_dir: str | Path, ctx: Dist, device: torch.device) -> Path:
    """Rank 0's out_dir on every rank (Hydra names a run directory per process, by its own start time),
    checked writable and free of a half checkpoint before any work."""
    out_dir = Path(broadcast_text(str(out_dir), ctx, device))
    if ctx.main:
        check_writable(out_dir, "out_dir")
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in CHECKPOINT_DIRS.values():
            check_checkpoint_dir(out_dir / name)
    return out_dir


# ------------------------------------------------------------------------------------------- the loop


@dataclass
class LoopSettings:
    max_steps: int
    max_minutes: float | None
    log_every: int
    eval_every: int
    checkpoint_every: int
    seed: int
    grad_accum: int
    optim: Any  # the optim group: lr, min_lr, warmup_steps, grad_clip, ...
    patience: int | None = None  # early stopping: validations without improvement; None: never stop early
    min_delta: float = 0.0  # the improvement that counts, in the units of the monitored figure

    @classmethod
    def from_config(cls, cfg: Any) -> LoopSettings:
        return cls(
            max_steps=cfg.max_steps,
            max_minutes=cfg.max_minutes,
            log_every=cfg.log_every,
            eval_every=cfg.eval_every,
            checkpoint_every=cfg.checkpoint_every,
            seed=cfg.seed,
            grad_accum=cfg.grad_accum,
            optim=cfg.optim,
            patience=cfg.patience,
            min_delta=float(cfg.min_delta),
        )


LossFn = Callable[[nn.Module, Any], "tuple[Tensor, dict[str, float]]"]


class TrainLoop:
    """One optimizer step per `step()`; `run()` is the loop with its logging, validation and checkpoints.

    `save_fn(state, metrics, *, finished, elapsed_s, directory, selection) -> Path` writes one checkpoint of
    the model and optimizer into `directory` (checkpoint/ or last/), with `selection`'s fields (which one it
    is, the best step and figure, early stopping) added to its meta.json."""

    def __init__(
        self,
        *,
        model: nn.Module,
        loss_fn: LossFn,
        batch_fn: Callable[[int], Any],
        count_fn: Callable[[Any, dict[str, float]], int],
        validate_fn: Callable[[], dict[str, float]],
        save_fn: Callable[..., Path],
        optimizer: torch.optim.Optimizer,
        settings: LoopSettings,
        precision: str,
        device: torch.device,
        ctx: Dist,
        out_dir: Path,
        logger: Any,
        state: LoopState,
        unit: str = "tokens",
        monitor: Monitor = Monitor(),
        after_backward: Callable[[], None] | None = None,
        find_unused: bool = False,
    ) -> None:
        self.model, self.optimizer, self.s = model, optimizer, settings
        self.wrapped = wrap(model, loss_fn, ctx, device, find_unused=find_unused)  # DDP when distributed
        self.batch_fn, self.count_fn, self.validate_fn, self.save_fn = batch_fn, count_fn, validate_fn, save_fn
        self.precision, self.device, self.ctx, self.out_dir = precision, device, ctx, out_dir
        self.logger, self.state, self.unit, self.after_backward = logger, state, unit, after_backward
        self.monitor = monitor
        self.budget_s = settings.max_minutes * 60 if settings.max_minutes is not None else math.inf
        self.log_values: list[dict[str, float]] = []  # loss and metrics of each step since the last "train" row
        self.val_losses: list[float] = []  # ... since the last "val" row
        self.train_time, self.session_units = 0.0, 0
        self.session_start = time.perf_counter()

    # -- measuring

    def elapsed(self) -> float:
        return self.state.elapsed_s + time.perf_counter() - self.session_start

    def shared_elapsed(self) -> float:
        """Rank 0's clock on every rank: the schedule and the stop decision must agree across replicas."""
        return broadcast_float(self.elapsed(), self.ctx, self.device) if self.budget_s < math.inf else self.elapsed()

    def units_per_s(self) -> float | None:
        return self.session_units / self.train_time if self.train_time > 0 else None

    def row(self, kind: str, values: dict[str, Any]) -> dict[str, Any]:
        r = {
            "kind": kind,
            "step": self.state.step,
            self.unit: self.state.units,
            "elapsed_s": round(self.elapsed(), 3),
            **values,
        }
        if self.ctx.main:
            self.metrics_file.write(r)
            self.logger.log({f"{kind}/{k}": v for k, v in values.items() if v is not None}, step=self.state.step)
        return r

    # -- one step

    def step(self, elapsed: float) -> float:
        s, o = self.s, self.s.optim
        began = time.perf_counter()
        lr = lr_at(
            self.state.step,
            lr=o.lr,
            min_lr=o.min_lr,
            warmup_steps=o.warmup_steps,
            max_steps=s.max_steps,
            time_fraction=elapsed / self.budget_s,
        )
        set_lr(self.optimizer, lr)
        torch.manual_seed(s.seed * SEED_STRIDE + self.state.step)  # any randomness in a loss: a function of the step
        batch = self.batch_fn(self.state.step)  # this rank's rows
        rows = batch_rows(batch)
        micro = -(-rows // s.grad_accum)  # ceil: the last micro-batch may be smaller
        chunks = [take_rows(batch, slice(i, i + micro)) for i in range(0, rows, micro)]
        self.optimizer.zero_grad(set_to_none=True)
        values: dict[str, float] = {}
        units = 0
        for i, chunk in enumerate(chunks):
            # gradients are averaged across ranks once per step, on the last micro-batch
            sync = self.wrapped.no_sync() if self.ctx.active and i < len(chunks) - 1 else nullcontext()
            with sync, autocast(self.precision, self.device):
                loss, metrics = self.wrapped(chunk)
            weight = batch_rows(chunk) / rows
            self.check_finite(loss.item())  # before backward: the weights never turn NaN
            (loss * weight).backward()
            for k, v in {"train_loss": loss.item(), **metrics}.items():
                values[k] = values.get(k, 0.0) + float(v) * weight
            units += self.count_fn(chunk, metrics) * self.ctx.world  # equal shards: every rank counts alike
        if self.after_backward is not None:
            self.after_backward()
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), o.grad_clip)
        self.optimizer.step()
        self.train_time += time.perf_counter() - began
        self.state.step += 1
        self.state.units += units
        self.session_units += units
        self.log_values.append({"lr": lr, **values})
        self.val_losses.append(values["train_loss"])
        return values["train_loss"]

    def check_finite(self, loss: float) -> None:
        """Stop on a NaN or infinite loss, on every rank at once (a rank stopping alone would leave the others
        waiting in the gradient all-reduce)."""
        if all_mean({"finite": float(math.isfinite(loss))}, self.ctx, self.device)["finite"] != 1.0:
            shown = loss if not math.isfinite(loss) else "NaN or inf on another rank"
            raise NonFiniteLoss(
                f"training loss is {shown} at step {self.state.step}: lower optim.lr, or check the "
                "data; the last checkpoint (if any) is left as it was"
            )

    def check_same_start(self) -> None:
        """Every rank resumes from the step rank 0 does: a rank that saw no checkpoint (its run directory is not
        rank 0's: no shared filesystem) would train a different number of steps and hang the others."""
        first = broadcast_float(float(self.state.step), self.ctx, self.device)
        if all_mean({"same": float(first == self.state.step)}, self.ctx, self.device)["same"] != 1.0:
            raise ValueError(
                f"the ranks resume from different steps (rank 0 from {int(first)}, rank {self.ctx.rank} "
                f"from {self.state.step}): every process must see rank 0's run directory"
            )

    # -- the loop

    def validate(self) -> dict[str, Any]:
        train_loss = (
            all_mean({"train_loss": sum(self.val_losses) / len(self.val_losses)}, self.ctx, self.device)
            if self.val_losses
            else {"train_loss": None}
        )
        self.val_losses.clear()
        values = self.validate_fn() if self.ctx.main else {}  # the other ranks go on to the next all-reduce
        if self.ctx.main:
            log.info("step %d | %s", self.state.step, " | ".join(f"{k} {v:.4f}" for k, v in values.items()))
        row = self.row("val", {**train_loss, **values})
        if self.ctx.main:  # only rank 0 has the figures, and only it writes
            self.track(row)
        return row

    # -- best checkpoint and early stopping

    def track(self, row: dict[str, Any]) -> None:
        """Count this validation for early stopping, and write checkpoint/ when it is the best so far (now:
        the weights move on after it). A NaN or infinite figure is never an improvement."""
        if self.monitor.metric not in row:
            raise ValueError(f"validation returned no {self.monitor.metric!r} to pick the best checkpoint by")
        value, s = float(row[self.monitor.metric]), self.state
        finite = math.isfinite(value)
        gain = None if s.reference is None else self.monitor.gain(value, s.reference)
        if finite and (gain is None or (gain > 0 and gain >= self.s.min_delta)):
            s.reference, s.stale = value, 0
        else:
            s.stale += 1
        if finite and (s.best_value is None or self.monitor.gain(value, s.best_value) > 0):  # ties keep the earlier
            s.best_step, s.best_value = s.step, value
            self.save("best", row, finished=False)

    def patience_spent(self) -> bool:
        """`patience` validations in a row without improvement: rank 0 decides (it alone validates) and every
        rank learns it, so they stop together."""
        if self.s.patience is None:
            return False
        spent = self.ctx.main and self.state.stale >= self.s.patience
        return broadcast_float(float(spent), self.ctx, self.device) == 1.0

    def selection(self, which: str, stopped_by: str | None) -> dict[str, Any]:
        """The meta.json fields that say which checkpoint this is and how the run chose and stopped."""
        s = self.state
        return {
            "selected": which,
            "best_metric": self.monitor.metric,
            "best_step": s.best_step,
            "best_value": s.best_value,
            "last_step": s.step,
            "early_stopping": {
                "patience": self.s.patience,
                "min_delta": self.s.min_delta,
                "stale": s.stale,
                "reference": s.reference,
            },
            "stopped_by": stopped_by,
        }

    def save(
        self,
        which: str,
        metrics: dict[str, Any],
        *,
        finished: bool,
        stopped_by: str | None = None,
        selected: str | None = None,
    ) -> Path:
        """Write checkpoint/ (which="best") or last/ (which="last") through save_fn; rank 0 only."""
        return self.save_fn(
            self.state,
            metrics,
            finished=finished,
            elapsed_s=self.elapsed(),
            directory=self.out_dir / CHECKPOINT_DIRS[which],
            selection=self.selection(selected or which, stopped_by),
        )

    def restore_best(self) -> None:
        """The best figure a resumed run must beat is the one of the weights in checkpoint/, read from its
        meta: it may be newer than the record in last/ (a best written after last/), and a run that beat it
        again only by a worse figure would replace better weights. A checkpoint/ that holds no best (missing,
        or written before best-checkpoint training) is replaced at the next validation."""
        if self.state.best_step is None:  # nothing validated in this run yet: an old checkpoint/ is not ours
            return
        directory = self.out_dir / CHECKPOINT_DIRS["best"]
        meta = read_meta(directory) if checkpoint_exists(directory) else None
        if meta is not None and meta.get("selected") == "best" and meta.get("best_metric") == self.monitor.metric:
            self.state.best_step, self.state.best_value = meta["best_step"], meta["best_value"]
        else:
            log.warning("%s holds no best checkpoint: the next validation writes one", directory)
            self.state.best_step = self.state.best_value = None

    def finish(self, last_val: dict[str, Any], stopped_by: str) -> None:
        """The end of the run (rank 0): last/ with the final weights, then checkpoint/ marked as the finished
        result. In that order: checkpoint/ finished means the run is done (the artifact cache reuses it),
        so it is marked only once last/ is complete; a crash in between is finished again on restart."""
        self.save("last", last_val, finished=True, stopped_by=stopped_by)
        best = self.out_dir / CHECKPOINT_DIRS["best"]
        if self.state.best_step is None:  # no finite validation figure to choose by: the final weights
            self.save("best", last_val, finished=True, stopped_by=stopped_by, selected="last")
        else:
            selection = self.selection("best", stopped_by)
            update_meta(
                best, {"finished": True, **{k: selection[k] for k in ("last_step", "early_stopping", "stopped_by")}}
            )

    def log_train(self) -> None:
        mean = {k: sum(v[k] for v in self.log_values) / len(self.log_values) for k in self.log_values[-1]}
        mean = all_mean(mean, self.ctx, self.device)
        self.log_values.clear()
        self.row("train", {**mean, f"{self.unit}_per_s": self.units_per_s()})

    def run(self) -> dict[str, Any]:
        s, state = self.s, self.state
        start_step, last_val, stopped_by = state.step, None, "max_steps"
        self.check_same_start()
        self.session_start = time.perf_counter()
        if self.ctx.main:
            self.metrics_file = MetricsFile(self.out_dir / "metrics.jsonl", resume_step=start_step)
            self.restore_best()
        # resumed after an early stop (or with a smaller patience): stop again at once; a run that already reached
        # max_steps is not reported as stopped early
        stop_early = state.step < s.max_steps and self.patience_spent()
        with progress_bar(enabled=self.ctx.main) as progress:
            task = progress.add_task("train", total=s.max_steps, completed=state.step, info="")
            while state.step < s.max_steps and not stop_early:
                elapsed = self.shared_elapsed()
                if elapsed >= self.budget_s:
                    stopped_by = "max_minutes"
                    break
                loss = self.step(elapsed)
                progress.update(task, completed=state.step, info=f"loss {loss:.3f}")
                if state.step % s.log_every == 0:
                    self.log_train()
                if state.step % s.eval_every == 0 and state.step < s.max_steps:
                    last_val = self.validate()
                    stop_early = self.patience_spent()
                if state.step % s.checkpoint_every == 0 and state.step < s.max_steps and self.ctx.main:
                    self.save("last", last_val or {}, finished=False)
        if stop_early:
            stopped_by = "patience"
            self.log_stop()
        if last_val is None or last_val["step"] != state.step:
            # nothing trained this session (a finished run started again): its last validation stands
            last_val = (self.previous_val() if state.step == start_step else None) or self.validate()
        if self.ctx.main and (state.step > start_step or not self.checkpoint_complete()):
            self.finish(last_val, stopped_by)
        return {
            "start_step": start_step,
            "stopped_by": stopped_by,
            "last_val": last_val,
            "best_step": state.best_step,
            "best_value": state.best_value,
            "replica_fingerprints": self.replica_fingerprints(),
        }

    def log_stop(self) -> None:
        """One line in the log and a "stop" row in metrics.jsonl (rank 0; one row per step, so a stopped run
        started again adds none)."""
        if not self.ctx.main:
            return
        s = self.state
        log.info(
            "early stop at step %d: %s did not improve by min_delta=%g in %d validations (patience %d); "
            "best %.4f at step %s",
            s.step,
            self.monitor.metric,
            self.s.min_delta,
            s.stale,
            self.s.patience,
            s.best_value if s.best_value is not None else math.nan,
            s.best_step,
        )
        if any(r["kind"] == "stop" and r["step"] == s.step for r in MetricsFile.read(self.metrics_file.path)):
            return
        self.metrics_file.write(
            {
                "kind": "stop",
                "step": s.step,
                "stopped_by": "patience",
                "stale": s.stale,
                "patience": self.s.patience,
                "min_delta": self.s.min_delta,
                "best_step": s.best_step,
                f"best_{self.monitor.metric}": s.best_value,
            }
        )

    def previous_val(self) -> dict[str, Any] | None:
        """The last "val" row already written at this step (rank 0; the others validate nothing anyway)."""
        if not self.ctx.main:
            return None
        rows = [
            r for r in MetricsFile.read(self.metrics_file.path) if r["kind"] == "val" and r["step"] == self.state.step
        ]
        return rows[-1] if rows else None

    def checkpoint_complete(self) -> bool:
        """The run's end is written: checkpoint/ and last/ finished (a run directory from before last/
        existed: checkpoint/ alone)."""

        def finished(name: str) -> bool:
            meta = self.out_dir / name / "meta.json"
            return meta.is_file() and json.loads(meta.read_text()).get("finished", False)

        last_exists = (self.out_dir / CHECKPOINT_DIRS["last"] / "meta.json").is_file()
        return finished(CHECKPOINT_DIRS["best"]) and (finished(CHECKPOINT_DIRS["last"]) or not last_exists)

    def replica_fingerprints(self) -> list[str] | None:
        """Each rank's weight fingerprint: DDP keeps the replicas bit-identical, and this shows it."""
        if not self.ctx.active:
            return None
        return gather_text(fingerprint(self.model.state_dict()), self.ctx, self.device)
