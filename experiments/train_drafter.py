"""Train a drafter (Medusa heads, a prophet, ...) on a frozen base.

    python -m experiments.train_drafter drafter=medusa base_checkpoint=outputs/.../checkpoint
    python -m experiments.train_drafter drafter=prophet base_checkpoint=... drafter.loss.unroll=3

The drafter's package (`cfg.drafter.package`) provides four functions in `<package>/train.py`:
build(base, **module), loss(module, base, *, tokens, hidden, logits, **loss) -> (loss, metrics),
evaluate(module, base, *, tokens, hidden, logits) -> metrics, and drafter(module, base, **decode).
This file owns everything else: the frozen base's teacher-forced forward (its final hidden states and
logits, computed once per batch, under no_grad), the optimiser, validation, logging and checkpoints.
A drafter checkpoint records the base's fingerprint; `load_drafter` refuses any other base.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from experiments.checkpoint import CheckpointError, load_checkpoint, load_lm, save_checkpoint
from experiments.cli import exit_on_user_error
from experiments.data import prepare_data
from experiments.lm import count_parameters
from experiments.train_base import (
    MetricsFile, _progress, _validate_optim, batch_for_step, lr_at, make_optimizer, resolve_device, validation_blocks,
)

log = logging.getLogger(__name__)


def drafter_package(name: str):
    """The `<package>.train` module of a drafter family, with a one-line error for an unknown one."""
    try:
        module = importlib.import_module(f"{name}.train")
    except ModuleNotFoundError:
        raise ValueError(f"drafter.package={name!r}: no module {name}.train (known: medusa, prophet)") from None
    for fn in ("build", "loss", "evaluate", "drafter"):
        if not callable(getattr(module, fn, None)):
            raise ValueError(f"{name}.train lacks {fn}(): a drafter package provides build, loss, evaluate, drafter")
    return module


def validate_config(cfg: DictConfig) -> None:
    """Checks that need no data or model, so a bad value fails at once with one line."""
    if OmegaConf.is_missing(cfg, "base_checkpoint") or cfg.base_checkpoint is None:
        raise ValueError("base_checkpoint is required: the directory of a trained base (experiments.train_base)")
    for key in ("max_steps", "batch_size", "log_every", "eval_every", "eval_blocks"):
        if not isinstance(cfg[key], int) or isinstance(cfg[key], bool) or cfg[key] < 1:
            raise ValueError(f"{key} must be a positive integer, got {cfg[key]!r}")
    if cfg.seq_len is not None and (not isinstance(cfg.seq_len, int) or isinstance(cfg.seq_len, bool) or cfg.seq_len < 2):
        raise ValueError(f"seq_len must be an integer >= 2 or null (the base's context), got {cfg.seq_len!r}")
    if cfg.max_minutes is not None and not cfg.max_minutes > 0:
        raise ValueError(f"max_minutes must be positive or null, got {cfg.max_minutes!r}")
    _validate_optim(cfg.optim, cfg.max_steps)
    drafter_package(cfg.drafter.package)


def load_drafter(directory: str | Path, base: nn.Module, base_meta: dict) -> tuple[nn.Module, Any, dict]:
    """Rebuild a trained drafter against `base`; (module, its package, meta). Another base is an error."""
    ckpt = load_checkpoint(directory)
    meta = ckpt.meta
    if meta.get("kind") != "drafter":
        raise CheckpointError(f"{directory} is not a drafter checkpoint (kind={meta.get('kind')!r})")
    if meta["base_fingerprint"] != base_meta["fingerprint"]:
        raise CheckpointError(
            f"drafter {directory} was trained on base {meta['base_fingerprint']}, "
            f"not on this base ({base_meta['fingerprint']}): train it on this base first"
        )
    package = drafter_package(meta["model_config"]["package"])
    module = package.build(base, **meta["model_config"]["module"])
    module.load_state_dict(ckpt.state_dict, strict=True)
    return module.to(next(base.parameters()).device).eval(), package, meta


@torch.no_grad()
def base_outputs(base: nn.Module, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """Teacher-forced frozen base on tokens[:, :-1] -> final hidden (B, T, d), logits (B, T, V), float32."""
    logits, hidden = base(tokens[:, :-1], return_logits_and_embeddings=True)
    return hidden.float(), logits.float()


def check_base_frozen(base: nn.Module) -> None:
    # The drafter's loss must never reach the base: a gradient here means the base is being trained.
    if any(p.grad is not None for p in base.parameters()):
        raise RuntimeError("a base parameter received a gradient: the base must stay frozen")


@torch.no_grad()
def validate(package, module: nn.Module, base: nn.Module, blocks: Tensor, *, batch_size: int) -> dict[str, float]:
    """Drafter metrics over the fixed validation blocks, averaged over batches weighted by size."""
    module.eval()
    totals: dict[str, float] = {}
    for chunk in blocks.split(batch_size):
        chunk = chunk.to(next(base.parameters()).device)
        hidden, logits = base_outputs(base, chunk)
        for key, value in package.evaluate(module, base, tokens=chunk, hidden=hidden, logits=logits).items():
            totals[key] = totals.get(key, 0.0) + float(value) * chunk.shape[0]
    module.train()
    return {key: value / blocks.shape[0] for key, value in totals.items()}


def save(out_dir: Path, cfg: DictConfig, module: nn.Module, base_meta: dict, *, step: int, metrics: dict) -> Path:
    config = {"package": cfg.drafter.package, "module": OmegaConf.to_container(cfg.drafter.module, resolve=True)}
    extra = {
        "kind": "drafter", "base_fingerprint": base_meta["fingerprint"], "base_checkpoint": str(cfg.base_checkpoint),
        "metrics": metrics, "drafter": OmegaConf.to_container(cfg.drafter, resolve=True),
    }
    return save_checkpoint(out_dir / "checkpoint", model=module, model_config=config, tokenizer_json=None,
                           step=step, extra=extra)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train the configured drafter on the frozen base; return the final validation metrics."""
    validate_config(cfg)
    package = drafter_package(cfg.drafter.package)
    out_dir, device = Path(cfg.out_dir), resolve_device(cfg.device)
    out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    base, tokenizer, base_meta = load_lm(cfg.base_checkpoint, device=str(device))
    base.requires_grad_(False)
    seq_len = cfg.seq_len if cfg.seq_len is not None else base.max_seq_len
    if seq_len > base.max_seq_len:
        raise ValueError(f"seq_len={seq_len} exceeds the base's context max_seq_len={base.max_seq_len}")
    data = prepare_data(**OmegaConf.to_container(cfg.data, resolve=True))
    if data.tokenizer.to_str() != tokenizer.to_str():
        raise ValueError(f"data config gives another tokenizer than base {cfg.base_checkpoint}'s: use the base's data config")
    module = package.build(base, **OmegaConf.to_container(cfg.drafter.module, resolve=True)).to(device)
    optimizer = make_optimizer(module, lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps,
                               weight_decay=cfg.optim.weight_decay)
    blocks = validation_blocks(data.val_ids, seq_len=seq_len, eval_blocks=cfg.eval_blocks)
    logger = instantiate(cfg.logger, dir=str(out_dir), run_config=OmegaConf.to_container(cfg, resolve=True),
                         _convert_="all", _recursive_=False)
    metrics_file = MetricsFile(out_dir / "metrics.jsonl", resume_step=0)
    loss_kwargs = OmegaConf.to_container(cfg.drafter.loss, resolve=True)
    budget_s = cfg.max_minutes * 60 if cfg.max_minutes is not None else float("inf")
    start, step, val = time.perf_counter(), 0, {}

    def row(kind: str, values: dict) -> dict:
        metrics_file.write({"kind": kind, "step": step, "elapsed_s": round(time.perf_counter() - start, 3), **values})
        logger.log({f"{kind}/{k}": v for k, v in values.items()}, step=step)
        return values

    try:
        with _progress() as progress:
            task = progress.add_task("train", total=cfg.max_steps, info="")
            while step < cfg.max_steps and time.perf_counter() - start < budget_s:
                o = cfg.optim
                lr = lr_at(step, lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps, max_steps=cfg.max_steps,
                           time_fraction=(time.perf_counter() - start) / budget_s)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                tokens = batch_for_step(data.train_ids, step=step, seed=cfg.seed, batch_size=cfg.batch_size,
                                        seq_len=seq_len, device=device)  # (B, T+1)
                hidden, logits = base_outputs(base, tokens)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=o.bf16):
                    loss, metrics = package.loss(module, base, tokens=tokens, hidden=hidden, logits=logits, **loss_kwargs)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                check_base_frozen(base)
                if o.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(module.parameters(), o.grad_clip)
                optimizer.step()
                step += 1
                progress.update(task, completed=step, info=f"loss {loss.item():.3f}")
                if step % cfg.log_every == 0:
                    row("train", {"lr": lr, "loss": loss.item(), **metrics})
                if step % cfg.eval_every == 0:
                    val = row("val", validate(package, module, base, blocks, batch_size=cfg.batch_size))
        if not val or step % cfg.eval_every != 0:
            val = row("val", validate(package, module, base, blocks, batch_size=cfg.batch_size))
        ckpt = save(out_dir, cfg, module, base_meta, step=step, metrics=val)
    finally:
        logger.finish()
    return {"step": step, "elapsed_s": time.perf_counter() - start, "parameters": count_parameters(module),
            "checkpoint": str(ckpt), "out_dir": str(out_dir), **val}


@hydra.main(version_base="1.3", config_path="../conf", config_name="train_drafter")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    print(json.dumps(train(cfg)), file=sys.stdout)  # one JSON object last, for scripts


if __name__ == "__main__":
    main()
