"""Encoder-decoder targets end to end: train a target and a smaller draft encoder-decoder on stdlib
function -> docstring summary (experiments/lib/data/seq2seq.py), then benchmark plain decoding against
draft-model and prompt-lookup speculative decoding on held-out pairs (experiments/lib/report/seq2seq_bench.py).

    python -m experiments.train_seq2seq                                  # mode=all: train both, benchmark
    python -m experiments.train_seq2seq mode=train train.target_minutes=3 train.draft_minutes=1
    python -m experiments.train_seq2seq mode=bench checkpoints=outputs/seq2seq/<run>

`run(cfg)` is a plain function (tests call it through Hydra's compose API); `main` only wraps it. The
run directory gets target/ and draft/, each a training run of the shared loop (experiments/lib/training/loop.py:
checkpoint/ the weights of the lowest validation loss, validated every train.eval_every steps; last/ the
latest, written every train.checkpoint_every steps; metrics.jsonl), and the benchmark's results.md /
results.json. Rerun with the same run directory after a crash: a finished model is reused, an unfinished
one resumes exactly where last/ left it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from x_transformers import XTransformer

from experiments.lib.cli.preflight import hydra_preflight
from experiments.lib.common.errors import exit_on_user_error
from experiments.lib.data.pipeline import prepare_data
from experiments.lib.data.seq2seq import Pairs, pad_batch, seq2seq_pairs
from experiments.lib.report.seq2seq_bench import benchmark
from experiments.lib.store.checkpoint import checkpoint_exists, load_checkpoint, load_model, read_meta, save_checkpoint
from experiments.lib.store.rundir import RunLock, check_checkpoint_dir
from experiments.lib.training.distributed import Dist
from experiments.lib.training.loop import (
    CHECKPOINT_DIRS,
    SEED_STRIDE,
    LoopSettings,
    LoopState,
    TrainLoop,
    make_logger,
    make_optimizer,
    prepare_run_dir,
    resume_point,
)
from experiments.lib.training.settings import (
    check_bool,
    check_int,
    check_number,
    check_recipe,
    data_recipe,
    require,
    resolve_device,
)
from verify.common.numerics import is_finite_number
from verify.loop.sampling import SamplingConfig

log = logging.getLogger(__name__)
MODES = ("train", "bench", "all")
SIZE_KEYS = ("dim", "enc_depth", "dec_depth", "heads")


def build_seq2seq(
    *, num_tokens: int, dim: int, enc_depth: int, dec_depth: int, heads: int, max_source_len: int, max_target_len: int
) -> XTransformer:
    """An x-transformers encoder-decoder the lean engine serves: rotary positions on both sides (no
    absolute embedding), pre-norm, GELU feed-forward, one token embedding shared by both sides."""
    return XTransformer(
        dim=dim,
        tie_token_emb=True,
        enc_num_tokens=num_tokens,
        enc_depth=enc_depth,
        enc_heads=heads,
        enc_max_seq_len=max_source_len,
        enc_rotary_pos_emb=True,
        dec_num_tokens=num_tokens,
        dec_depth=dec_depth,
        dec_heads=heads,
        dec_max_seq_len=max_target_len,
        dec_rotary_pos_emb=True,
    )


def model_config(cfg: DictConfig, size: DictConfig, num_tokens: int) -> dict[str, Any]:
    """build_seq2seq's keyword arguments (what a checkpoint records)."""
    return dict(
        num_tokens=num_tokens,
        **{k: int(size[k]) for k in SIZE_KEYS},
        max_source_len=int(cfg.pairs.max_source_tokens),
        max_target_len=int(cfg.pairs.max_target_tokens) + 1,
    )


def validate_config(cfg: DictConfig) -> None:
    """One-line errors naming the value and what is allowed, before any work starts."""
    require(cfg.mode in MODES, f"mode={cfg.mode!r}: use one of {', '.join(MODES)}")
    require(
        cfg.data.source == "stdlib",
        f"data.source={cfg.data.source!r}: the function -> docstring task reads the stdlib only (data=stdlib)",
    )
    require(
        cfg.mode != "bench" or cfg.checkpoints is not None,
        "mode=bench needs checkpoints=<a run directory with target/ and draft/>",
    )
    for name in ("target", "draft"):
        for key in SIZE_KEYS:
            check_int(f"{name}.{key}", cfg[name][key])
        require(
            cfg[name].dim % cfg[name].heads == 0,
            f"{name}.dim={cfg[name].dim} must be a multiple of {name}.heads={cfg[name].heads}",
        )
    for key, low in (("max_source_tokens", 1), ("max_target_tokens", 2)):
        check_int(f"pairs.{key}", cfg.pairs[key], minimum=low)
    t = cfg.train
    check_bool("resume", cfg.resume)
    for key in (
        "batch_size",
        "target_steps",
        "draft_steps",
        "log_every",
        "eval_every",
        "eval_pairs",
        "checkpoint_every",
    ):
        check_int(f"train.{key}", t[key])
    check_int("train.patience", t.patience, allow_null=True)
    check_number("train.min_delta", t.min_delta, "a finite number >= 0", lambda x: x >= 0)
    check_int("train.warmup_steps", t.warmup_steps, minimum=0)
    check_number("train.lr", t.lr, "a finite number > 0", lambda x: x > 0)
    for key in ("target_minutes", "draft_minutes"):
        if t[key] is not None:
            check_number(f"train.{key}", t[key], "a number > 0, or null for the step budget only", lambda x: x > 0)
    b = cfg.bench
    for key in ("pairs", "batch", "max_new_tokens", "gamma", "ngram", "repeats"):
        check_int(f"bench.{key}", b[key])
    require(
        b.max_new_tokens <= cfg.pairs.max_target_tokens,
        f"bench.max_new_tokens={b.max_new_tokens}: must be at most "
        f"pairs.max_target_tokens={cfg.pairs.max_target_tokens} (the decoder's length)",
    )
    temps = list(b.temperatures)
    require(
        len(temps) > 0 and all(is_finite_number(x) and x >= 0 for x in temps),
        f"bench.temperatures={temps!r}: must be a non-empty list of finite numbers >= 0",
    )
    for x in temps:
        SamplingConfig(temperature=float(x))  # the sampler's own checks, now rather than after training
    resolve_device(cfg.device)


@dataclass
class PairBatch:
    """B (source, target) pairs, right-padded; the masks mark real tokens."""

    source: torch.Tensor  # (B, S) long
    source_mask: torch.Tensor  # (B, S) bool
    target: torch.Tensor  # (B, T) long, EOS last
    target_mask: torch.Tensor  # (B, T) bool

    @classmethod
    def of(cls, sources: list[list[int]], targets: list[list[int]]) -> PairBatch:
        return cls(*pad_batch(sources, 0), *pad_batch(targets, 0))


def seq2seq_loss(model: XTransformer, batch: PairBatch, *, bos_id: int, device: torch.device) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of the targets given the sources; the decoder reads
    [bos, target[:-1]] and predicts target (EOS last), padding ignored."""
    source, source_mask = batch.source.to(device), batch.source_mask.to(device)
    target = batch.target.to(device)
    inputs = torch.cat((torch.full_like(target[:, :1], bos_id), target[:, :-1]), dim=1)
    labels = target.masked_fill(~batch.target_mask.to(device), -100)
    encoded = model.encoder(source, mask=source_mask, return_embeddings=True)
    logits = model.decoder.net(inputs, context=encoded, context_mask=source_mask)  # (B, T, V)
    return F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100)


@torch.no_grad()
def evaluate(
    model: XTransformer, pairs: Pairs, *, count: int, batch_size: int, bos_id: int, device: torch.device
) -> float:
    """Mean loss over the first `count` held-out pairs (token-weighted)."""
    model.eval()
    total = tokens = 0.0
    for i in range(0, min(count, len(pairs.sources)), batch_size):
        src, tgt = pairs.sources[i : i + batch_size], pairs.targets[i : i + batch_size]
        n = sum(len(t) for t in tgt)
        total += float(seq2seq_loss(model, PairBatch.of(src, tgt), bos_id=bos_id, device=device)) * n
        tokens += n
    model.train()
    return total / tokens


def recipe(cfg: DictConfig, config: dict[str, Any]) -> dict[str, Any]:
    """What decides a model's weights (checked on resume); not the budgets, not where the data cache lives."""
    t = cfg.train
    return {
        "seed": cfg.seed,
        "model_config": config,
        "pairs": OmegaConf.to_container(cfg.pairs, resolve=True),
        "data": data_recipe(cfg.data),
        "batch_size": t.batch_size,
        "lr": t.lr,
        "warmup_steps": t.warmup_steps,
    }


def train_model(
    name: str,
    cfg: DictConfig,
    config: dict[str, Any],
    train: Pairs,
    val: Pairs,
    *,
    bos_id: int,
    device: torch.device,
    tokenizer_json: str,
    out_dir: Path,
) -> tuple[XTransformer, dict[str, Any]]:
    """Train (or resume, or reuse when finished) one model in out_dir/<name>/ with the shared loop: AdamW,
    warm-up and cosine decay for the step or time budget, whichever ends first."""
    run_dir, t = out_dir / name, cfg.train
    ckpt_dir, expected = run_dir / CHECKPOINT_DIRS["best"], recipe(cfg, config)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    model = build_seq2seq(**config).to(device)
    optimizer = make_optimizer(model, lr=t.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    state = LoopState()
    resume_dir = resume_point(run_dir) if cfg.resume else None  # last/, or checkpoint/ in an older run directory
    if resume_dir is not None:  # finished with the same budgets: the loop has nothing to do
        ckpt = load_checkpoint(resume_dir, expected_config=config)
        check_recipe(resume_dir, ckpt.meta.get("recipe"), expected)
        model.load_state_dict(ckpt.state_dict, strict=True)
        optimizer.load_state_dict(ckpt.optimizer_state)
        state = LoopState.from_meta(ckpt.meta, "pairs")
    steps = int(t[f"{name}_steps"])
    minutes = t[f"{name}_minutes"]
    settings = LoopSettings(
        max_steps=steps,
        max_minutes=minutes,
        log_every=t.log_every,
        eval_every=t.eval_every,
        checkpoint_every=t.checkpoint_every,
        seed=cfg.seed,
        grad_accum=1,
        optim=OmegaConf.create({"lr": t.lr, "min_lr": t.lr / 10, "warmup_steps": t.warmup_steps, "grad_clip": 1.0}),
        patience=t.patience,
        min_delta=float(t.min_delta),
    )

    def batch(step: int) -> PairBatch:  # a pure function of (seed, step): resuming needs no sampler state
        generator = torch.Generator().manual_seed(cfg.seed * SEED_STRIDE + step)
        rows = torch.randint(0, len(train.sources), (t.batch_size,), generator=generator).tolist()
        return PairBatch.of([train.sources[i] for i in rows], [train.targets[i] for i in rows])

    def validate() -> dict[str, float]:
        val_loss = evaluate(model, val, count=t.eval_pairs, batch_size=t.batch_size, bos_id=bos_id, device=device)
        return {"val_loss": val_loss, "val_ppl": math.exp(val_loss)}

    def save(
        state: LoopState,
        metrics: dict,
        *,
        finished: bool,
        elapsed_s: float,
        directory: Path,
        selection: dict[str, Any],
    ) -> Path:
        result = {
            "model": name,
            "steps": state.step,
            "minutes": elapsed_s / 60,
            "val_loss": metrics.get("val_loss"),
            "val_ppl": metrics.get("val_ppl"),
            "parameters": sum(p.numel() for p in model.parameters()),
        }
        extra = {
            "task": "function -> docstring summary",
            **result,
            "result": result,
            "recipe": expected,
            "finished": finished,
            "pairs_seen": state.units,
            "elapsed_s": elapsed_s,
            **selection,
        }
        return save_checkpoint(
            directory,
            model=model,
            model_config=config,
            tokenizer_json=tokenizer_json,
            step=state.step,
            extra=extra,
            optimizer=optimizer,
        )

    logger = make_logger(cfg, run_dir, Dist())
    loop = TrainLoop(
        model=model,
        loss_fn=lambda m, b: (seq2seq_loss(m, b, bos_id=bos_id, device=device), {}),
        batch_fn=batch,
        count_fn=lambda b, _: b.target.shape[0],
        validate_fn=validate,
        save_fn=save,
        optimizer=optimizer,
        settings=settings,
        precision="fp32",
        device=device,
        ctx=Dist(),
        out_dir=run_dir,
        logger=logger,
        state=state,
        unit="pairs",
    )
    try:
        loop.run()
    finally:
        logger.finish()
    result = read_meta(ckpt_dir)["result"]
    log.info("%s: %s", name, result)
    return model.eval(), result


def load_seq2seq(directory: Path, device: torch.device) -> tuple[XTransformer, dict[str, Any]]:
    """Rebuild a model saved by this entry point: (model in eval mode, meta). `directory` is a model's run
    directory (<run>/target, holding checkpoint/) or, as runs before the shared loop wrote it, the checkpoint."""
    nested = Path(directory) / "checkpoint"
    return load_model(nested if checkpoint_exists(nested) else directory, build_seq2seq, device=device)


def run(cfg: DictConfig) -> dict[str, Any]:
    """Train (mode train/all) and benchmark (mode bench/all) as configured; returns the results."""
    validate_config(cfg)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("train_seq2seq runs in one process: start it with python -m, not torchrun")
    device = resolve_device(cfg.device)
    out_dir = prepare_run_dir(cfg.out_dir, Dist(), device)
    for name in ("target", "draft"):
        for directory in CHECKPOINT_DIRS.values():
            check_checkpoint_dir(out_dir / name / directory)
    with RunLock(out_dir):
        return _run(cfg, out_dir=out_dir, device=device, benchmark=benchmark)


def _run(cfg: DictConfig, *, out_dir: Path, device: torch.device, benchmark) -> dict[str, Any]:
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    data = prepare_data(**OmegaConf.to_container(cfg.data, resolve=True))
    train, val = seq2seq_pairs(
        data,
        max_source_tokens=cfg.pairs.max_source_tokens,
        max_target_tokens=cfg.pairs.max_target_tokens,
        max_files=cfg.data.max_files,
    )
    if not train.sources or not val.sources:
        raise ValueError(
            f"the corpus gave {len(train.sources)} training and {len(val.sources)} held-out pairs: need both (more "
            "data.max_files?)"
        )
    log.info("pairs: %d train, %d held out", len(train.sources), len(val.sources))
    results: dict[str, Any] = {"pairs": {"train": len(train.sources), "val": len(val.sources)}}
    if cfg.mode in ("train", "all"):
        for name in ("target", "draft"):
            config = model_config(cfg, cfg[name], data.vocab_size)
            _, results[name] = train_model(
                name,
                cfg,
                config,
                train,
                val,
                bos_id=data.eos_id,
                device=device,
                tokenizer_json=data.tokenizer.to_str(),
                out_dir=out_dir,
            )
    if cfg.mode in ("bench", "all"):
        where = out_dir if cfg.checkpoints is None else Path(cfg.checkpoints)
        target, _ = load_seq2seq(where / "target", device)
        draft, _ = load_seq2seq(where / "draft", device)
        results["bench"] = benchmark(target, draft, val, cfg, bos_id=data.eos_id, eos_id=data.eos_id, out_dir=out_dir)
    return results


@hydra_preflight
@hydra.main(version_base="1.3", config_path="../conf", config_name="seq2seq")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    result = run(cfg)
    print(json.dumps(result), file=sys.stdout)  # one JSON object last, for scripts


if __name__ == "__main__":
    main()
