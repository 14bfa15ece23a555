"""Train a drafter (Medusa or sequential heads, a prophet, a draft model, an early-exit head) on a frozen
base, by self-distillation.

    python -m experiments.train_drafter drafter=medusa base_checkpoint=outputs/.../checkpoint
    python -m experiments.train_drafter drafter=prophet base_checkpoint=... drafter.loss.unroll=3
    python -m experiments.train_drafter drafter=draft base_checkpoint=...

A drafter family (FAMILIES below) provides four functions: build(base, **module),
loss(module, base, batch, *, vocab, **loss) -> (loss, metrics), evaluate(module, base, batch, *, vocab)
-> metrics, and drafter(module, base, **decode). `batch` is a FeatureBatch (experiments/features.py): the
tokens and the frozen base's outputs on them, read from the feature cache (written on first use; the base
never runs during training) or, with features.use=false, computed by the base on every step.
This file owns everything else: the optimiser, precision, validation, logging and checkpoints.
A drafter checkpoint records the base's fingerprint; `load_drafter` refuses any other base.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from experiments import draft_family, exit_family
from experiments.checkpoint import CheckpointError, load_checkpoint, load_lm, save_checkpoint
from experiments.cli import exit_on_user_error
from experiments.data import prepare_data, token_counts
from experiments.features import FeatureBatch, check_features_config, feature_spec, open_features, teacher_batch
from experiments.lm import count_parameters
from experiments.precision import autocast, check_precision, resolve_precision
from experiments.train_base import (
    MetricsFile, _progress, _validate_optim, batch_for_step, lr_at, make_optimizer, resolve_device, validation_blocks,
)
from medusa import sequential_train as sequential_family, train as medusa_family
from prophet import train as prophet_family
from verify.vocab import frequent_tokens

log = logging.getLogger(__name__)
FAMILIES: dict[str, ModuleType] = {"medusa": medusa_family, "prophet": prophet_family, "draft": draft_family,
                                   "sequential": sequential_family, "early_exit": exit_family}


def drafter_family(name: str) -> ModuleType:
    """The module of a drafter family (build, loss, evaluate, drafter), with a one-line error for an unknown one."""
    if name not in FAMILIES:
        raise ValueError(f"drafter.package={name!r}: must be one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def _positive_int(cfg: DictConfig, key: str, *, allow_null: bool = False) -> None:
    value = cfg[key]
    if allow_null and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be a positive integer{' or null' if allow_null else ''}, got {value!r}")


def validate_config(cfg: DictConfig) -> None:
    """Checks that need no data or model, so a bad value fails at once with one line."""
    if OmegaConf.is_missing(cfg, "base_checkpoint") or cfg.base_checkpoint is None:
        raise ValueError("base_checkpoint is required: the directory of a trained base (experiments.train_base)")
    for key in ("max_steps", "log_every", "eval_every", "eval_blocks"):
        _positive_int(cfg, key)
    for key in ("batch_size", "vocab"):
        _positive_int(cfg, key, allow_null=True)
    _positive_int(cfg.drafter, "batch_size")
    if cfg.seq_len is not None and (not isinstance(cfg.seq_len, int) or isinstance(cfg.seq_len, bool) or cfg.seq_len < 2):
        raise ValueError(f"seq_len must be an integer >= 2 or null (the base's context), got {cfg.seq_len!r}")
    if cfg.max_minutes is not None and not cfg.max_minutes > 0:
        raise ValueError(f"max_minutes must be positive or null, got {cfg.max_minutes!r}")
    check_features_config(OmegaConf.to_container(cfg.features, resolve=True))
    check_precision(cfg.precision)
    _validate_optim(cfg.optim, cfg.max_steps)
    drafter_family(cfg.drafter.package)


def load_drafter(directory: str | Path, base: nn.Module, base_meta: dict) -> tuple[nn.Module, ModuleType, dict]:
    """Rebuild a trained drafter against `base`; (module, its family, meta). Another base is an error."""
    ckpt = load_checkpoint(directory)
    meta = ckpt.meta
    if meta.get("kind") != "drafter":
        raise CheckpointError(f"{directory} is not a drafter checkpoint (kind={meta.get('kind')!r})")
    if meta["base_fingerprint"] != base_meta["fingerprint"]:
        raise CheckpointError(
            f"drafter {directory} was trained on base {meta['base_fingerprint']}, "
            f"not on this base ({base_meta['fingerprint']}): train it on this base first"
        )
    family = drafter_family(meta["model_config"]["package"])
    module = family.build(base, **meta["model_config"]["module"])
    module.load_state_dict(ckpt.state_dict, strict=True)
    return module.to(next(base.parameters()).device).eval(), family, meta


def check_base_frozen(base: nn.Module) -> None:
    # The drafter's loss must never reach the base: a gradient here means the base is being trained.
    if any(p.grad is not None for p in base.parameters()):
        raise RuntimeError("a base parameter received a gradient: the base must stay frozen")


def layers_needed(cfg: DictConfig) -> tuple[int, ...]:
    """Base blocks whose residual states the drafter reads: the prophet's fuse_layers, the early exit's layer."""
    if cfg.drafter.package == "early_exit":
        return (cfg.drafter.module.layer,)
    return tuple(cfg.drafter.module.get("fuse_layers") or ())


@torch.no_grad()
def validate(family: ModuleType, module: nn.Module, base: nn.Module, batches: list[FeatureBatch], *,
             vocab: Tensor | None) -> dict[str, float]:
    """Drafter metrics over the fixed validation batches, averaged with weights by batch size."""
    module.eval()
    totals: dict[str, float] = {}
    rows = sum(b.tokens.shape[0] for b in batches)
    for batch in batches:
        for key, value in family.evaluate(module, base, batch, vocab=vocab).items():
            totals[key] = totals.get(key, 0.0) + float(value) * batch.tokens.shape[0]
    module.train()
    return {key: value / rows for key, value in totals.items()}


def save(out_dir: Path, cfg: DictConfig, module: nn.Module, base_meta: dict, *, step: int, extra: dict) -> Path:
    config = {"package": cfg.drafter.package, "module": OmegaConf.to_container(cfg.drafter.module, resolve=True)}
    extra = {"kind": "drafter", "base_fingerprint": base_meta["fingerprint"], "base_checkpoint": str(cfg.base_checkpoint),
             "drafter": OmegaConf.to_container(cfg.drafter, resolve=True), **extra}
    return save_checkpoint(out_dir / "checkpoint", model=module, model_config=config, tokenizer_json=None,
                           step=step, extra=extra)


class Batches:
    """Training batches: from the feature cache, or (features.use=false) from the base on every step."""

    def __init__(self, cfg: DictConfig, base: nn.Module, base_meta: dict, data, *, seq_len: int, batch_size: int,
                 device: torch.device) -> None:
        self.cfg, self.base, self.data, self.seq_len, self.batch_size, self.device = cfg, base, data, seq_len, batch_size, device
        self.layers, f = layers_needed(cfg), cfg.features
        self.cache, self.spec = None, None
        if f.use:
            self.spec = feature_spec(OmegaConf.to_container(f), base_meta=base_meta, data=data, seq_len=seq_len,
                                     layers=self.layers)
            started = time.perf_counter()
            self.cache = open_features(base, data.train_ids, self.spec, directory=f.dir, root=f.root)
            self.cache_seconds = time.perf_counter() - started

    def __call__(self, step: int) -> FeatureBatch:
        if self.cache is not None:
            return self.cache.sample(step=step, seed=self.cfg.seed, batch_size=self.batch_size).to(self.device)
        tokens = batch_for_step(self.data.train_ids, step=step, seed=self.cfg.seed, batch_size=self.batch_size,
                                seq_len=self.seq_len, device=self.device)  # (B, T + 1)
        return teacher_batch(self.base, tokens, layers=self.layers, top_k=self.cfg.features.top_k)

    def describe(self) -> dict[str, Any]:
        if self.cache is None:
            return {"features": "computed by the base every step"}
        return {"features": str(self.cache.directory), "feature_key": self.spec.key(), "feature_windows": self.spec.windows,
                "feature_source": self.spec.source, "feature_seconds": round(self.cache_seconds, 1)}


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train the configured drafter on the frozen base; return the final validation metrics."""
    validate_config(cfg)
    family = drafter_family(cfg.drafter.package)
    out_dir, device = Path(cfg.out_dir), resolve_device(cfg.device)
    precision = resolve_precision(cfg.precision, device)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    base, tokenizer, base_meta = load_lm(cfg.base_checkpoint, device=str(device))
    base.requires_grad_(False)
    seq_len = cfg.seq_len if cfg.seq_len is not None else base.max_seq_len
    if seq_len > base.max_seq_len:
        raise ValueError(f"seq_len={seq_len} exceeds the base's context max_seq_len={base.max_seq_len}")
    module = family.build(base, **OmegaConf.to_container(cfg.drafter.module, resolve=True)).to(device)
    data_cfg = OmegaConf.to_container(cfg.data, resolve=True)
    if (base_meta.get("data") or {}).get("tokenizer_path"):  # a Hugging Face directory brings its own tokenizer
        data_cfg["tokenizer"] = base_meta["data"]["tokenizer_path"]
    data = prepare_data(**data_cfg)
    if data.tokenizer.to_str() != tokenizer.to_str():
        raise ValueError(f"data config gives another tokenizer than base {cfg.base_checkpoint}'s: use the base's data config")
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = frequent_tokens(token_counts(data, base.num_tokens), cfg.vocab)
    vocab = None if vocab is None else vocab.to(device)
    log.info("precision %s (%s); training vocabulary %s", precision["used"], precision["reason"],
             "full" if vocab is None else f"the {vocab.numel()} most frequent training tokens")
    batches = Batches(cfg, base, base_meta, data, seq_len=seq_len, batch_size=cfg.batch_size or cfg.drafter.batch_size,
                      device=device)
    blocks = validation_blocks(data.val_ids, seq_len=seq_len, eval_blocks=cfg.eval_blocks)
    val_batches = [teacher_batch(base, chunk.to(device), layers=batches.layers, top_k=cfg.features.top_k)
                   for chunk in blocks.split(16)]  # computed once: the base is frozen
    optimizer = make_optimizer(module, lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps,
                               weight_decay=cfg.optim.weight_decay)
    logger = instantiate(cfg.logger, dir=str(out_dir), run_config=OmegaConf.to_container(cfg, resolve=True),
                         _convert_="all", _recursive_=False)
    metrics_file = MetricsFile(out_dir / "metrics.jsonl", resume_step=0)
    loss_kwargs = OmegaConf.to_container(cfg.drafter.loss, resolve=True)
    budget_s = cfg.max_minutes * 60 if cfg.max_minutes is not None else float("inf")
    start, step, val, train_s, positions = time.perf_counter(), 0, {}, 0.0, 0

    def row(kind: str, values: dict) -> dict:
        metrics_file.write({"kind": kind, "step": step, "elapsed_s": round(time.perf_counter() - start, 3), **values})
        logger.log({f"{kind}/{k}": v for k, v in values.items()}, step=step)
        return values

    try:
        with _progress() as progress:
            task = progress.add_task("train", total=cfg.max_steps, info="")
            while step < cfg.max_steps and time.perf_counter() - start < budget_s:
                began, o = time.perf_counter(), cfg.optim
                lr = lr_at(step, lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps, max_steps=cfg.max_steps,
                           time_fraction=(time.perf_counter() - start) / budget_s)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                batch = batches(step)
                with autocast(precision["used"], device):
                    loss, metrics = family.loss(module, base, batch, vocab=vocab, **loss_kwargs)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                check_base_frozen(base)
                if o.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(module.parameters(), o.grad_clip)
                optimizer.step()
                step += 1
                train_s += time.perf_counter() - began
                positions += int(metrics.get("positions", batch.hidden.shape[0] * batch.hidden.shape[1]))
                progress.update(task, completed=step, info=f"loss {loss.item():.3f}")
                if step % cfg.log_every == 0:
                    row("train", {"lr": lr, **metrics, "positions_per_s": positions / train_s})
                if step % cfg.eval_every == 0:
                    val = row("val", validate(family, module, base, val_batches, vocab=vocab))
        if not val or step % cfg.eval_every != 0:
            val = row("val", validate(family, module, base, val_batches, vocab=vocab))
        speed = {"positions": positions, "positions_per_s": positions / train_s if train_s else None}
        extra = {"metrics": val, "precision": precision, "train_vocab": None if vocab is None else vocab.numel(),
                 **batches.describe(), **speed}
        ckpt = save(out_dir, cfg, module, base_meta, step=step, extra=extra)
    finally:
        logger.finish()
    return {"step": step, "elapsed_s": time.perf_counter() - start, "parameters": count_parameters(module),
            "checkpoint": str(ckpt), "out_dir": str(out_dir), "precision": precision["used"], **speed,
            **batches.describe(), **val}


@hydra.main(version_base="1.3", config_path="../conf", config_name="train_drafter")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    print(json.dumps(train(cfg)), file=sys.stdout)  # one JSON object last, for scripts


if __name__ == "__main__":
    main()
