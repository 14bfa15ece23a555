"""Train a base LM from scratch: the frozen target that every drafter is later trained on and verified by.

    python -m experiments.train_base experiment=base_tiny            # recommended tiny recipe
    python -m experiments.train_base experiment=base_draft           # independent draft model
    python -m experiments.train_base hydra.run.dir=outputs/train_base/<run>   # resume a crashed run

`train(cfg)` is a plain function (tests call it through Hydra's compose API); `main` only wraps it.
Everything the run writes goes into `out_dir`: `checkpoint/` (see experiments/checkpoint.py),
`metrics.jsonl` (one JSON row per log and per validation) and the logger's files.

Resuming needs no data-loader state: the batch of step s is drawn from a generator seeded with
(seed, s), so a resumed run sees exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from experiments.checkpoint import checkpoint_exists, load_checkpoint, save_checkpoint
from experiments.cli import exit_on_user_error, one_line
from experiments.data import PreparedData, prepare_data, sample_batch
from experiments.lm import check_lm_sizes, count_parameters
from experiments.precision import autocast, check_precision, resolve_precision

log = logging.getLogger(__name__)
LN2 = math.log(2.0)


# ---------------------------------------------------------------------------------------------- config


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def model_config(cfg: DictConfig) -> dict[str, Any]:
    """build_lm's keyword arguments: the base group without `_target_` (what the checkpoint records)."""
    config = OmegaConf.to_container(cfg.base, resolve=True)
    config.pop("_target_", None)
    return config


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _validate_optim(optim: DictConfig, max_steps: int) -> None:
    for key in ("lr", "min_lr", "eps", "weight_decay", "grad_clip"):
        _require(_is_number(optim[key]), f"optim.{key} must be a number, got {optim[key]!r}")
    _require(optim.lr > 0, f"optim.lr must be positive, got {optim.lr}")
    _require(0 <= optim.min_lr <= optim.lr, f"optim.min_lr must lie in [0, optim.lr={optim.lr}], got {optim.min_lr}")
    _require(_is_int(optim.warmup_steps) and optim.warmup_steps >= 0,
             f"optim.warmup_steps must be a non-negative integer, got {optim.warmup_steps!r}")
    _require(optim.warmup_steps <= max_steps,
             f"optim.warmup_steps ({optim.warmup_steps}) must not exceed max_steps ({max_steps})")
    betas = list(optim.betas)
    _require(len(betas) == 2 and all(_is_number(b) and 0 <= b < 1 for b in betas),
             f"optim.betas must be two numbers in [0, 1), got {betas}")
    _require(optim.eps > 0, f"optim.eps must be positive, got {optim.eps}")
    _require(optim.weight_decay >= 0, f"optim.weight_decay must be non-negative, got {optim.weight_decay}")
    _require(optim.grad_clip >= 0, f"optim.grad_clip must be non-negative (0 disables), got {optim.grad_clip}")


def validate_config(cfg: DictConfig) -> None:
    """Every check that needs no data or model, so a bad value fails in milliseconds with one line."""
    try:  # surfaces missing values (???) and interpolations that cannot resolve
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise ValueError(f"config cannot be resolved: {one_line(e)}") from None
    check_lm_sizes(**model_config(cfg))
    for key in ("max_steps", "batch_size", "seq_len", "log_every", "eval_every", "eval_blocks", "checkpoint_every"):
        _require(_is_int(cfg[key]) and cfg[key] > 0, f"{key} must be a positive integer, got {cfg[key]!r}")
    _require(_is_int(cfg.seed), f"seed must be an integer, got {cfg.seed!r}")
    _require(cfg.max_minutes is None or (_is_number(cfg.max_minutes) and cfg.max_minutes > 0),
             f"max_minutes must be positive or null, got {cfg.max_minutes!r}")
    _require(isinstance(cfg.resume, bool), f"resume must be true or false, got {cfg.resume!r}")
    _require(cfg.threads is None or (_is_int(cfg.threads) and cfg.threads > 0),
             f"threads must be a positive integer or null, got {cfg.threads!r}")
    _require(cfg.seq_len <= cfg.base.max_seq_len,
             f"seq_len ({cfg.seq_len}) must not exceed base.max_seq_len ({cfg.base.max_seq_len})")
    _validate_optim(cfg.optim, cfg.max_steps)
    check_precision(cfg.precision)
    _require(isinstance(cfg.device, str), f"device must be auto, cpu or cuda[:N], got {cfg.device!r}")
    resolve_device(cfg.device)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {name!r}") from None
    _require(device.type != "cuda" or torch.cuda.is_available(), f"device={name!r} but CUDA is not available")
    return device


# ------------------------------------------------------------------------------------ optimisation parts


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int,
          time_fraction: float = 0.0) -> float:
    """Linear warm-up over warmup_steps (step 0 already gets lr / warmup_steps) times a cosine to min_lr.

    The cosine follows whichever budget is further spent: the steps after warm-up, or wall time
    (`time_fraction` = elapsed / max_minutes, 0 without a time budget), so a time-limited run still
    ends annealed, even one whose budget runs out during warm-up."""
    warmup = min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    step_fraction = max(0, step - warmup_steps) / max(1, max_steps - warmup_steps)
    progress = min(1.0, max(step_fraction, time_fraction))  # 0 -> 1
    return warmup * (min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, *, lr: float, betas: tuple[float, float], eps: float,
                   weight_decay: float) -> torch.optim.AdamW:
    # Decay matrices (linear and embedding weights) only: decaying norm gains and biases pulls them to 0,
    # which only hurts.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    # fused: one kernel per step instead of a dozen elementwise passes over every parameter (Medusa's heads
    # train 8M parameters: the foreach AdamW cost 60 of 600 ms per step on one CPU thread, fused 10)
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=fused)


def batch_for_step(ids: torch.Tensor, *, step: int, seed: int, batch_size: int, seq_len: int,
                   device: torch.device) -> torch.Tensor:
    """(B, T+1) random windows, a pure function of (seed, step): resuming needs no loader state."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return sample_batch(ids, batch_size=batch_size, seq_len=seq_len, generator=generator, device=device)


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats over a (B, T+1) batch."""
    inputs, targets = batch[:, :-1], batch[:, 1:]  # (B, T) each
    logits = model(inputs)  # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor, *,
               lr: float, grad_clip: float, precision: str) -> float:
    """One optimizer step; `precision` is the resolved one ("bf16": autocast forward and loss, else fp32)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    with autocast(precision, batch.device):
        loss = lm_loss(model, batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss.item()


def validation_blocks(val_ids: torch.Tensor, *, seq_len: int, eval_blocks: int) -> torch.Tensor:
    """(n, T+1) windows spread evenly over the whole validation stream, always the same ones.

    Evenly spread rather than the first n: the stream is files in order, so the first blocks would be
    a handful of files only."""
    n_windows = (val_ids.numel() - 1) // seq_len
    _require(n_windows > 0, f"the validation split has {val_ids.numel()} tokens, fewer than seq_len + 1")
    starts = torch.linspace(0, n_windows - 1, min(eval_blocks, n_windows)).round().long() * seq_len  # (n,)
    return val_ids[starts[:, None] + torch.arange(seq_len + 1)].long()  # (n, T+1)


@torch.no_grad()
def evaluate(model: torch.nn.Module, blocks: torch.Tensor, *, batch_size: int, device: torch.device) -> float:
    """Mean validation loss in nats per token, in fp32 so runs with and without bf16 compare."""
    model.eval()
    total, count = 0.0, 0
    for chunk in blocks.split(batch_size):  # (b, T+1)
        loss = lm_loss(model, chunk.to(device))
        total += loss.item() * chunk[:, 1:].numel()
        count += chunk[:, 1:].numel()
    model.train()
    return total / count


def bits_per_byte(val_loss: float, *, tokens: int, data: PreparedData) -> float:
    """Loss over `tokens` evaluated tokens -> bits per UTF-8 byte of the text those tokens cover.

    The bytes covered are estimated as val_bytes scaled by the share of the validation tokens evaluated."""
    covered_bytes = data.val_bytes * tokens / data.val_ids.numel()
    return val_loss * tokens / covered_bytes / LN2


# ------------------------------------------------------------------------------------------ run state


@dataclass
class RunState:
    step: int = 0
    tokens_seen: int = 0
    elapsed_s: float = 0.0  # run wall time before this session (resumes add up): max_minutes budgets it all


class MetricsFile:
    """metrics.jsonl: one row per log ("train") and per validation ("val"); kept in step with resumes."""

    def __init__(self, path: Path, *, resume_step: int) -> None:
        self.path = path
        rows = self.read(path) if path.exists() and resume_step > 0 else []
        # rows written after the checkpoint we resume from would be repeated: drop them
        kept = [r for r in rows if r["step"] <= resume_step]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def write(self, row: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    @staticmethod
    def read(path: Path) -> list[dict[str, Any]]:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _progress() -> Progress:
    console = Console(stderr=True)  # stdout is kept for the final JSON line
    return Progress(
        TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"), console=console, disable=not console.is_terminal,
    )


# ------------------------------------------------------------------------------------------- training


class Trainer:
    """The loop's moving parts; `run` is the loop itself."""

    def __init__(self, cfg: DictConfig, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 data: PreparedData, out_dir: Path, device: torch.device, logger: Any,
                 precision: dict[str, str]) -> None:
        self.cfg, self.model, self.optimizer, self.data = cfg, model, optimizer, data
        self.out_dir, self.device, self.logger = out_dir, device, logger
        self.precision = precision  # resolve_precision's dict: what ran and why (checkpoint and summary record it)
        self.state = RunState()
        self.blocks = validation_blocks(data.val_ids, seq_len=cfg.seq_len, eval_blocks=cfg.eval_blocks)  # (n, T+1)
        self.budget_s = cfg.max_minutes * 60 if cfg.max_minutes is not None else math.inf
        self.log_losses: list[float] = []  # train losses since the last "train" row
        self.val_losses: list[float] = []  # ... since the last "val" row
        self.train_time, self.session_tokens = 0.0, 0

    # -- resume, save

    def resume(self, ckpt_dir: Path) -> None:
        ckpt = load_checkpoint(ckpt_dir, expected_config=model_config(self.cfg))
        _require(ckpt.meta["tokenizer"] == self.data.tokenizer.to_str(),
                 f"checkpoint {ckpt_dir} was trained with another tokenizer (data config changed?); "
                 "use another out_dir or resume=false")
        _require(ckpt.optimizer_state is not None, f"checkpoint {ckpt_dir} has no optimizer state to resume from")
        self.model.load_state_dict(ckpt.state_dict, strict=True)
        self.optimizer.load_state_dict(ckpt.optimizer_state)
        meta = ckpt.meta
        self.state = RunState(step=meta["step"], tokens_seen=meta["tokens_seen"], elapsed_s=meta["elapsed_s"])
        log.info("resumed from %s at step %d", ckpt_dir, meta["step"])

    def save(self, metrics: dict[str, Any]) -> Path:
        cfg, data = self.cfg, self.data
        extra = {
            "kind": "base_lm", "tokens_seen": self.state.tokens_seen, "elapsed_s": self.elapsed(),
            "metrics": metrics, "precision": self.precision,
            "data": {"config": OmegaConf.to_container(cfg.data, resolve=True), "cache_key": data.cache_key, "train_tokens": data.train_ids.numel(),
                     "val_tokens": data.val_ids.numel(), "train_bytes": data.train_bytes,
                     "val_bytes": data.val_bytes, "eos_id": data.eos_id, "vocab_size": data.vocab_size},
            "train": {"seed": cfg.seed, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
                      "max_steps": cfg.max_steps, "optim": OmegaConf.to_container(cfg.optim, resolve=True)},
        }
        return save_checkpoint(self.out_dir / "checkpoint", model=self.model, model_config=model_config(cfg),
                               tokenizer_json=data.tokenizer.to_str(), step=self.state.step, extra=extra,
                               optimizer=self.optimizer)

    # -- measuring

    def elapsed(self) -> float:
        return self.state.elapsed_s + time.perf_counter() - self.session_start

    def lr(self) -> float:
        o = self.cfg.optim
        return lr_at(self.state.step, lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps,
                     max_steps=self.cfg.max_steps, time_fraction=self.elapsed() / self.budget_s)

    def tokens_per_s(self) -> float | None:
        return self.session_tokens / self.train_time if self.train_time > 0 else None

    def row(self, kind: str, **values: Any) -> dict[str, Any]:
        r = {"kind": kind, "step": self.state.step, "tokens": self.state.tokens_seen,
             "elapsed_s": round(self.elapsed(), 3), **values}
        self.metrics_file.write(r)
        self.logger.log({f"{kind}/{k}": v for k, v in values.items() if v is not None}, step=self.state.step)
        return r

    def validate(self) -> dict[str, Any]:
        val_loss = evaluate(self.model, self.blocks, batch_size=self.cfg.batch_size, device=self.device)
        bpb = bits_per_byte(val_loss, tokens=self.blocks[:, 1:].numel(), data=self.data)
        train_loss = sum(self.val_losses) / len(self.val_losses) if self.val_losses else None
        self.val_losses.clear()
        log.info("step %d | val loss %.4f | %.3f bits/byte | %s tokens/s", self.state.step, val_loss, bpb,
                 f"{self.tokens_per_s() or 0:.0f}")
        return self.row("val", train_loss=train_loss, val_loss=val_loss, val_bpb=bpb)

    # -- the loop

    def train_one_step(self) -> float:
        cfg, started = self.cfg, time.perf_counter()
        lr = self.lr()
        batch = batch_for_step(self.data.train_ids, step=self.state.step, seed=cfg.seed,
                               batch_size=cfg.batch_size, seq_len=cfg.seq_len, device=self.device)  # (B, T+1)
        loss = train_step(self.model, self.optimizer, batch, lr=lr, grad_clip=cfg.optim.grad_clip,
                          precision=self.precision["used"])
        self.train_time += time.perf_counter() - started
        self.state.step += 1
        self.state.tokens_seen += batch[:, 1:].numel()
        self.session_tokens += batch[:, 1:].numel()
        self.log_losses.append(loss)
        self.val_losses.append(loss)
        if self.state.step % cfg.log_every == 0:
            self.row("train", lr=lr, train_loss=sum(self.log_losses) / len(self.log_losses),
                     tokens_per_s=self.tokens_per_s())
            self.log_losses.clear()
        return loss

    def run(self) -> dict[str, Any]:
        cfg, state = self.cfg, self.state
        start_step, last_val, stopped_by = state.step, None, "max_steps"
        self.session_start = time.perf_counter()
        self.metrics_file = MetricsFile(self.out_dir / "metrics.jsonl", resume_step=start_step)
        with _progress() as progress:
            task = progress.add_task("train", total=cfg.max_steps, completed=state.step, info="")
            while state.step < cfg.max_steps:
                if self.elapsed() >= self.budget_s:
                    stopped_by = "max_minutes"
                    break
                loss = self.train_one_step()
                progress.update(task, completed=state.step, info=f"loss {loss:.3f}")
                if state.step % cfg.eval_every == 0 and state.step < cfg.max_steps:
                    last_val = self.validate()
                if state.step % cfg.checkpoint_every == 0 and state.step < cfg.max_steps:
                    self.save(last_val or {})
        if last_val is None or last_val["step"] != state.step:
            last_val = self.validate()
        ckpt = self.out_dir / "checkpoint"
        if state.step > start_step or not checkpoint_exists(ckpt):
            self.save(last_val)
        return self.summary(last_val, start_step=start_step, stopped_by=stopped_by)

    def summary(self, last_val: dict[str, Any], *, start_step: int, stopped_by: str) -> dict[str, Any]:
        return {
            "step": self.state.step, "start_step": start_step, "stopped_by": stopped_by,
            "train_loss": last_val["train_loss"], "val_loss": last_val["val_loss"], "val_bpb": last_val["val_bpb"],
            "train_tokens": self.state.tokens_seen, "val_tokens": int(self.blocks[:, 1:].numel()),
            "train_corpus_tokens": int(self.data.train_ids.numel()),
            "val_corpus_tokens": int(self.data.val_ids.numel()),
            "tokens_per_s": self.tokens_per_s(), "elapsed_s": self.elapsed(), "precision": self.precision,
            "parameters": count_parameters(self.model), "checkpoint": str(self.out_dir / "checkpoint"),
            "out_dir": str(self.out_dir),
        }


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train (or resume) a base LM as configured; return the final metrics."""
    validate_config(cfg)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.device)
    precision = resolve_precision(cfg.precision, device)  # once per session; a resume on another machine re-resolves
    log.info("precision: %s (requested %s; %s)", precision["used"], precision["requested"], precision["reason"])
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    data = prepare_data(**OmegaConf.to_container(cfg.data, resolve=True))
    num_tokens = model_config(cfg)["num_tokens"]
    _require(data.vocab_size <= num_tokens,
             f"the tokenizer has {data.vocab_size} tokens but base.num_tokens is {num_tokens}")
    model = instantiate(cfg.base).to(device)
    optimizer = make_optimizer(model, lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps,
                               weight_decay=cfg.optim.weight_decay)
    # _recursive_=False: the run config holds `_target_` nodes (base, logger) that must stay plain data
    logger = instantiate(cfg.logger, dir=str(out_dir), run_config=OmegaConf.to_container(cfg, resolve=True),
                         _convert_="all", _recursive_=False)
    trainer = Trainer(cfg, model=model, optimizer=optimizer, data=data, out_dir=out_dir, device=device,
                      logger=logger, precision=precision)
    try:
        if cfg.resume and checkpoint_exists(out_dir / "checkpoint"):
            trainer.resume(out_dir / "checkpoint")
        return trainer.run()
    finally:
        logger.finish()


@hydra.main(version_base="1.3", config_path="../conf", config_name="train_base")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    result = train(cfg)
    print(json.dumps(result), file=sys.stdout)  # one JSON object last, for scripts


if __name__ == "__main__":
    main()
