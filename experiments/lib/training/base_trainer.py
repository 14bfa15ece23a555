"""Train a base LM from scratch: the frozen target that every drafter is later trained on and verified by.
The library side of `python -m experiments.train_base` and of the artifact cache (same `train(cfg)`).

Everything the run writes goes into `out_dir`: `checkpoint/` (the weights of the lowest validation loss; see
experiments/lib/store/checkpoint.py for the format), `last/` (the latest weights, resumed from), `metrics.jsonl` (one
JSON row per log and per validation) and the logger's files. The loop itself (schedule, best and latest
checkpoints, early stopping, exact resume, DDP) is experiments/lib/training/loop.py's, shared with the drafters.
"""

from __future__ import annotations

import functools
import logging
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from tokenizers import Tokenizer

from experiments.lib.common.errors import one_line
from experiments.lib.data.id_cache import PreparedData
from experiments.lib.data.pipeline import prepare_data
from experiments.lib.store.checkpoint import (
    load_checkpoint,
    read_meta,
    save_checkpoint,
    tokenizer_mismatch,
)
from experiments.lib.store.lm import check_lm_sizes, count_parameters
from experiments.lib.training.distributed import Dist, main_first, shard
from experiments.lib.training.loop import (
    LoopSettings,
    LoopState,
    TrainLoop,
    batch_for_step,
    launch,
    make_logger,
    make_optimizer,
    resume_point,
    validation_blocks,
)
from experiments.lib.training.precision import check_precision, resolve_precision
from experiments.lib.training.settings import check_loop_config, check_recipe, data_recipe, is_int, require

log = logging.getLogger(__name__)
LN2 = math.log(2.0)


# ---------------------------------------------------------------------------------------------- config


def model_config(cfg: DictConfig) -> dict[str, Any]:
    """build_lm's keyword arguments: the base group without `_target_` (what the checkpoint records)."""
    config = OmegaConf.to_container(cfg.base, resolve=True)
    config.pop("_target_", None)
    return config


def validate_config(cfg: DictConfig) -> None:
    """Every check that needs no data or model, so a bad value fails in milliseconds with one line."""
    if "base" not in cfg:  # base=smollm2 (conf/base/smollm2.yaml) names a pretrained model, not sizes
        raise ValueError(
            "this base is pretrained (it sets base_checkpoint, not sizes): train_base trains from scratch, "
            "use base=tiny|small|llama_small|..., or give the pretrained one to train_drafter or benchmark"
        )
    try:  # surfaces missing values (???) and interpolations that cannot resolve
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise ValueError(f"config cannot be resolved: {one_line(e)}") from None
    check_lm_sizes(**model_config(cfg))
    for key in ("batch_size", "seq_len"):
        require(is_int(cfg[key]) and cfg[key] > 0, f"{key} must be a positive integer, got {cfg[key]!r}")
    check_loop_config(cfg)
    require(
        cfg.seq_len <= cfg.base.max_seq_len,
        f"seq_len ({cfg.seq_len}) must not exceed base.max_seq_len ({cfg.base.max_seq_len})",
    )
    check_precision(cfg.precision)


def recipe(cfg: DictConfig) -> dict[str, Any]:
    """What decides the trained weights besides the model config (checked on resume): not the budgets
    (max_steps, max_minutes extend a run), not where the data cache lives, not the number of processes."""
    return {
        "seed": cfg.seed,
        "batch_size": cfg.batch_size,
        "seq_len": cfg.seq_len,
        "data": data_recipe(cfg.data),
        "optim": OmegaConf.to_container(cfg.optim, resolve=True),
    }


# ------------------------------------------------------------------------------------ optimisation parts


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats over a (B, T+1) batch."""
    inputs, targets = batch[:, :-1], batch[:, 1:]  # (B, T) each
    logits = model(inputs)  # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


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


# ------------------------------------------------------------------------------------------- training


def resume(
    ckpt_dir: Path, cfg: DictConfig, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: PreparedData
) -> LoopState:
    """Load weights, optimizer and loop state from `ckpt_dir`, after checking it is this run's."""
    ckpt = load_checkpoint(ckpt_dir, expected_config=model_config(cfg))
    if ckpt.meta["tokenizer"] != data.tokenizer.to_str():
        raise ValueError(
            tokenizer_mismatch(
                "this run's data config",
                data.tokenizer,
                Tokenizer.from_str(ckpt.meta["tokenizer"]),
                "use another out_dir or resume=false",
                reference=f"checkpoint {ckpt_dir}",
            )
        )
    check_recipe(ckpt_dir, ckpt.meta.get("recipe"), recipe(cfg))
    require(ckpt.optimizer_state is not None, f"checkpoint {ckpt_dir} has no optimizer state to resume from")
    model.load_state_dict(ckpt.state_dict, strict=True)
    optimizer.load_state_dict(ckpt.optimizer_state)
    log.info("resumed from %s at step %d", ckpt_dir, ckpt.meta["step"])
    return LoopState.from_meta(ckpt.meta, "tokens")


def saver(
    cfg: DictConfig,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: PreparedData,
    precision: dict[str, str],
    ctx: Dist,
):
    """The loop's save_fn: a checkpoint (checkpoint/ or last/, as the loop says) with its optimizer, loop state,
    recipe and provenance."""

    def save(
        state: LoopState,
        metrics: dict[str, Any],
        *,
        finished: bool,
        elapsed_s: float,
        directory: Path,
        selection: dict[str, Any],
    ) -> Path:
        extra = {
            "kind": "base_lm",
            "tokens_seen": state.units,
            "elapsed_s": elapsed_s,
            "metrics": metrics,
            "precision": precision,
            "recipe": recipe(cfg),
            "finished": finished,
            "world_size": ctx.world,
            "data": {
                "config": OmegaConf.to_container(cfg.data, resolve=True),
                "cache_key": data.cache_key,
                "train_tokens": data.train_ids.numel(),
                "val_tokens": data.val_ids.numel(),
                "train_bytes": data.train_bytes,
                "val_bytes": data.val_bytes,
                "undecodable": data.undecodable,  # corpus files that were not UTF-8, and whether left out
                "eos_id": data.eos_id,
                "vocab_size": data.vocab_size,
            },
            "train": {
                "seed": cfg.seed,
                "batch_size": cfg.batch_size,
                "seq_len": cfg.seq_len,
                "max_steps": cfg.max_steps,
                "optim": OmegaConf.to_container(cfg.optim, resolve=True),
            },
            **selection,
        }
        return save_checkpoint(
            directory,
            model=model,
            model_config=model_config(cfg),
            tokenizer_json=data.tokenizer.to_str(),
            step=state.step,
            extra=extra,
            optimizer=optimizer,
        )

    return save


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train (or resume) a base LM as configured, alone or as one rank of torchrun; return the final metrics."""
    validate_config(cfg)
    return launch(cfg, batch_size=cfg.batch_size, body=functools.partial(_train, cfg))


def _train(cfg: DictConfig, *, ctx: Dist, device: torch.device, out_dir: Path) -> dict[str, Any]:
    precision = resolve_precision(cfg.precision, device)  # once per session; a resume on another machine re-resolves
    log.info("precision: %s (requested %s; %s)", precision["used"], precision["requested"], precision["reason"])
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    ckpt_dir = resume_point(out_dir) if cfg.resume else None  # last/, or checkpoint/ in an older run directory
    if ckpt_dir is not None:  # another recipe is refused now, before the corpus is tokenized
        check_recipe(ckpt_dir, read_meta(ckpt_dir).get("recipe"), recipe(cfg))
    with main_first(ctx):  # rank 0 tokenizes and caches the corpus; the others read its cache
        data = prepare_data(**OmegaConf.to_container(cfg.data, resolve=True))
    num_tokens = model_config(cfg)["num_tokens"]
    require(
        data.vocab_size <= num_tokens, f"the tokenizer has {data.vocab_size} tokens but base.num_tokens is {num_tokens}"
    )
    model = instantiate(cfg.base).to(device)
    optimizer = make_optimizer(
        model, lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay
    )
    state = LoopState()
    if ckpt_dir is not None:
        state = resume(ckpt_dir, cfg, model=model, optimizer=optimizer, data=data)
    blocks = validation_blocks(data.val_ids, seq_len=cfg.seq_len, eval_blocks=cfg.eval_blocks)  # (n, T+1)

    def validate() -> dict[str, float]:
        val_loss = evaluate(model, blocks, batch_size=cfg.batch_size, device=device)
        return {"val_loss": val_loss, "val_bpb": bits_per_byte(val_loss, tokens=blocks[:, 1:].numel(), data=data)}

    def batch(step: int) -> torch.Tensor:  # (B / world, T+1): this rank's rows of the step's batch
        return shard(
            batch_for_step(
                data.train_ids, step=step, seed=cfg.seed, batch_size=cfg.batch_size, seq_len=cfg.seq_len, device=device
            ),
            ctx,
        )

    logger = make_logger(cfg, out_dir, ctx)
    loop = TrainLoop(
        model=model,
        loss_fn=lambda m, b: (lm_loss(m, b), {}),
        batch_fn=batch,
        count_fn=lambda b, _: b[:, 1:].numel(),
        validate_fn=validate,
        save_fn=saver(cfg, model=model, optimizer=optimizer, data=data, precision=precision, ctx=ctx),
        optimizer=optimizer,
        settings=LoopSettings.from_config(cfg),
        precision=precision["used"],
        device=device,
        ctx=ctx,
        out_dir=out_dir,
        logger=logger,
        state=state,
        unit="tokens",
    )
    try:
        result = loop.run()
    finally:
        logger.finish()
    last_val = result["last_val"]
    return {
        "step": loop.state.step,
        "start_step": result["start_step"],
        "stopped_by": result["stopped_by"],
        "train_loss": last_val["train_loss"],
        "val_loss": last_val.get("val_loss"),
        "val_bpb": last_val.get("val_bpb"),
        "train_tokens": loop.state.units,
        "val_tokens": int(blocks[:, 1:].numel()),
        "train_corpus_tokens": int(data.train_ids.numel()),
        "val_corpus_tokens": int(data.val_ids.numel()),
        "undecodable_files": data.undecodable["files"],  # corpus files that were not UTF-8 (data.undecodable)
        "tokens_per_s": loop.units_per_s(),
        "elapsed_s": loop.elapsed(),
        "precision": precision,
        "parameters": count_parameters(model),
        "checkpoint": str(out_dir / "checkpoint"),  # the best: lowest val_loss
        "best_step": result["best_step"],
        "best_val_loss": result["best_value"],
        "last_checkpoint": str(out_dir / "last"),
        "out_dir": str(out_dir),
        "world_size": ctx.world,
        "rank": ctx.rank,
        "replica_fingerprints": result["replica_fingerprints"],
    }
