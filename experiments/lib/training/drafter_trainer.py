"""Train a drafter (Medusa or sequential heads, a prophet or a block prophet, a draft model, an early-exit
head) on a frozen base, by self-distillation: the library side of `python -m experiments.train_drafter` (and of
the artifact cache, which trains missing drafters in-process through the same `train(cfg)`).

The family (experiments/lib/families/registry.py) supplies build, loss and evaluate; `batch` is a FeatureBatch
(experiments/lib/training/features.py): the tokens and the frozen base's outputs on them, read from the feature
cache (written on first use; the base never runs during training) or, with features.use=false, computed by
the base on every step. The loop (optimiser, schedule, precision, periodic checkpoints and exact resume,
DDP under torchrun) is experiments/lib/training/loop.py's, shared with the base; this file supplies the
drafter's loss, batches and validation. A drafter checkpoint records the base's fingerprint;
families.load_drafter refuses any other base.

`checkpoint/` holds the drafter of the best validation: the highest `chain_tau`, the tau a greedy chain of 3
drafts would reach at T = 0 on the validation text, teacher-forced in one pass (verify/training/distill.py
`chain_tau`): the figure speed follows. `mean_agree` (the mean over draft positions of how often the drafter's
top-1 is the base's) is logged beside it; it counts a draft after a rejected one as if it mattered. The
training loss is a surrogate for both (the prophet's is mostly feature regression). With generated answers the
validation text is the base's answers to held-out bank questions. `last/` holds the latest, which a resumed run
continues from.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from experiments.lib.data.pipeline import base_data_fix, prepare_data, token_counts
from experiments.lib.families.registry import Family, call_with_settings
from experiments.lib.families.registry import family as find_family
from experiments.lib.store.checkpoint import (
    load_checkpoint,
    load_lm,
    read_meta,
    save_checkpoint,
    tokenizer_mismatch,
)
from experiments.lib.store.lm import count_parameters
from experiments.lib.training.distributed import Dist, main_first, shard
from experiments.lib.training.features import (
    check_features_config,
    default_seq_len,
    feature_spec,
    open_features,
    teacher_batch,
)
from experiments.lib.training.generated import conversation_windows, generated_records, generated_windows
from experiments.lib.training.loop import (
    LoopSettings,
    LoopState,
    Monitor,
    TrainLoop,
    batch_for_step,
    launch,
    make_logger,
    make_optimizer,
    resume_point,
    validation_blocks,
)
from experiments.lib.training.precision import cast_copy, check_precision, resolve_precision
from experiments.lib.training.settings import check_loop_config, check_positive_int, check_recipe, data_recipe, require
from verify.common.vocab import frequent_tokens
from verify.training.features import FeatureBatch

log = logging.getLogger(__name__)
# Module settings added after runs were recorded, with the values those runs had: left out of the recipe.
LATER_MODULE_DEFAULTS = {"arch": ("xtransformers", "x-transformers"), "kv_heads": (None,)}
MONITOR = Monitor("chain_tau", lower_is_better=False)  # what picks checkpoint/ (see the module docstring)


def validate_config(cfg: DictConfig) -> None:
    """Checks that need no data or model, so a bad value fails at once with one line."""
    if OmegaConf.is_missing(cfg, "base_checkpoint") or cfg.base_checkpoint is None:
        raise ValueError("base_checkpoint is required: the directory of a trained base (experiments.train_base)")
    for key in ("batch_size", "vocab"):
        check_positive_int(key, cfg[key], allow_null=True)
    check_positive_int("batch_size", cfg.drafter.batch_size)
    if cfg.seq_len is not None and (
        not isinstance(cfg.seq_len, int) or isinstance(cfg.seq_len, bool) or cfg.seq_len < 2
    ):
        raise ValueError(f"seq_len must be an integer >= 2 or null (the base's context up to 512), got {cfg.seq_len!r}")
    check_loop_config(cfg)
    check_features_config(OmegaConf.to_container(cfg.features, resolve=True))
    check_precision(cfg.precision)
    find_family(cfg.drafter.package)


def recipe(cfg: DictConfig, *, base_meta: dict, seq_len: int, batch_size: int) -> dict[str, Any]:
    """What decides the drafter's weights (checked on resume): the base, the drafter config, data, batches,
    optimizer, feature cache settings; not the budgets, not where caches live, not the number of processes."""
    container = lambda node: OmegaConf.to_container(node, resolve=True)  # noqa: E731
    features = container(cfg.features)
    for key in ("dir", "root", "mapped"):  # where the cache lives and how it is read change no weight
        features.pop(key, None)
    if features.get("batch") == 16:  # the caching batch before it was a setting: older runs still resume
        del features["batch"]
    drafter = container(cfg.drafter)
    for key, default in LATER_MODULE_DEFAULTS.items():  # runs from before these were settings still resume
        if key in drafter["module"] and drafter["module"][key] in default:
            del drafter["module"][key]
    return {
        "base_fingerprint": base_meta["fingerprint"],
        "drafter": drafter,
        "seed": cfg.seed,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "vocab": cfg.vocab,
        "data": data_recipe(cfg.data),
        "features": features,
        "optim": container(cfg.optim),
    }


@torch.no_grad()
def probe_loss(
    family: Family,
    module: nn.Module,
    base: nn.Module,
    ids: Tensor,
    *,
    seq_len: int,
    layers: tuple[int, ...],
    top_k: int,
    vocab: Tensor | None,
    loss_kwargs: dict,
    device: torch.device,
) -> None:
    """The loss on one window, so a bad drafter.loss setting fails now, not after the feature cache is written."""
    window = ids[: seq_len + 1].long()[None].to(device)  # (1, T + 1)
    probe = teacher_batch(base, window, layers=layers, top_k=top_k)
    call_with_settings(family.loss, "drafter.loss", module, base, probe, vocab=vocab, **loss_kwargs)


def share(loss_kwargs: dict, batch: FeatureBatch, batch_size: int) -> dict:
    """The loss settings for a part of the step's batch (one rank's rows, one micro-batch): a loss that samples
    `positions` per call (Medusa, sequential heads) samples its share of them, so a step trains on as many
    positions whatever the number of processes or micro-batches."""
    if loss_kwargs.get("positions") is None:
        return loss_kwargs
    rows = batch.tokens.shape[0]
    return {**loss_kwargs, "positions": max(1, round(loss_kwargs["positions"] * rows / batch_size))}


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
def validate(
    family: Family,
    module: nn.Module,
    base: nn.Module,
    batches: list[FeatureBatch],
    *,
    vocab: Tensor | None,
    categories: list[str | None] | None = None,
) -> dict[str, float]:
    """Drafter metrics over the fixed validation batches, averaged with weights by batch size (by answer positions
    for masked batches), `chain_tau` (every family reports it: the figure the best checkpoint is picked by) and
    `mean_agree`: the mean of the per-position agreements (`agree`, `head{k}_agree`, `step{j}_agree`). Batches
    with a category (`categories`, one per batch: held-out questions') also give `chain_tau/<category>`:
    acceptance differs by task, and a mean over the categories can hide one the drafter fails."""
    module.eval()
    categories = categories or [None] * len(batches)
    totals: dict[str, float] = {}
    weights: dict[str | None, float] = {}
    taus: dict[str | None, float] = {}
    for category, batch in zip(categories, batches):
        for key, value in family.evaluate(module, base, batch, vocab=vocab).items():
            totals[key] = totals.get(key, 0.0) + float(value) * eval_weight(batch)
            if key == MONITOR.metric:
                taus[category] = taus.get(category, 0.0) + float(value) * eval_weight(batch)
        weights[category] = weights.get(category, 0.0) + eval_weight(batch)
    module.train()
    rows = sum(weights.values())
    metrics = {key: value / max(rows, 1) for key, value in totals.items()}
    agree = [value for key, value in metrics.items() if key == "agree" or key.endswith("_agree")]
    if not agree or MONITOR.metric not in metrics:
        raise ValueError(f"the drafter's evaluate reports no agreement or {MONITOR.metric} (got {sorted(metrics)})")
    by_category = {f"{MONITOR.metric}/{c}": tau / max(weights[c], 1) for c, tau in taus.items() if c is not None}
    return {**metrics, "mean_agree": sum(agree) / len(agree), **by_category}


def validation_batches(
    cfg, base: nn.Module, data, batches, *, seq_len: int, device: torch.device
) -> list[tuple[str | None, FeatureBatch]]:
    """The fixed validation batches, each with its category: with generated answers, the base's answers to
    cfg.eval_blocks held-out questions (the text a drafter drafts, masked to the answers; the categories take
    turns among them), batched by category; else cfg.eval_blocks windows of the corpus's validation split
    (category None). Computed by the teacher the training features came from (its dtype)."""
    if batches.spec is not None and batches.spec.source == "generated":
        records = batches.held_out(cfg.eval_blocks)
        chunks = []
        for category in dict.fromkeys(r["category"] for r in records):
            windows, mask = batches.windows([r for r in records if r["category"] == category])
            chunks += [(category, w, m) for w, m in zip(windows.split(16), mask.split(16))]
        log.info("validation: %d held-out turns of %d categories", len(records), len({c for c, _, _ in chunks}))
    else:
        blocks = validation_blocks(data.val_ids, seq_len=seq_len, eval_blocks=cfg.eval_blocks)
        chunks = [(None, chunk, None) for chunk in blocks.split(16)]
    out, teacher = [], base if batches.spec is None else cast_copy(base, batches.spec.teacher)
    for category, chunk, m in chunks:
        batch = teacher_batch(teacher, chunk.to(device), layers=batches.layers, top_k=cfg.features.top_k)
        batch.mask = None if m is None else m.to(device)
        out.append((category, batch))
    return out


def coverage(vocab: Tensor, batches: list[FeatureBatch]) -> float:
    """The share of the batches' answer tokens (every target token where a batch has no mask) inside vocab."""
    inside = total = 0
    for b in batches:
        targets = b.tokens[:, 1:] if b.mask is None else b.tokens[:, 1:][b.mask]
        inside += int(torch.isin(targets, vocab.to(targets.device)).sum())
        total += targets.numel()
    return inside / max(total, 1)


def eval_weight(batch: FeatureBatch) -> int:
    """A validation batch's weight in the average: its rows, or with a mask its answer positions (a family's
    metrics are means over those; a batch of prompts alone weighs nothing)."""
    return batch.tokens.shape[0] if batch.mask is None else int(batch.mask.sum())


def positions_trained(batch: FeatureBatch, metrics: dict[str, float]) -> int:
    """The training units of a step's batch: the positions the loss reports having sampled, else every position
    (with a mask, every answer position)."""
    if "positions" in metrics:
        return int(metrics["positions"])
    return batch.hidden.shape[0] * batch.hidden.shape[1] if batch.mask is None else int(batch.mask.sum())


def save(
    directory: Path,
    cfg: DictConfig,
    module: nn.Module,
    base_meta: dict,
    *,
    step: int,
    extra: dict,
    optimizer: torch.optim.Optimizer | None = None,
) -> Path:
    config = {"package": cfg.drafter.package, "module": OmegaConf.to_container(cfg.drafter.module, resolve=True)}
    extra = {
        "kind": "drafter",
        "base_fingerprint": base_meta["fingerprint"],
        "base_checkpoint": str(cfg.base_checkpoint),
        "drafter": OmegaConf.to_container(cfg.drafter, resolve=True),
        **extra,
    }
    return save_checkpoint(
        directory,
        model=module,
        model_config=config,
        tokenizer_json=None,
        step=step,
        extra=extra,
        optimizer=optimizer,
    )


def resume(
    ckpt_dir: Path, cfg: DictConfig, *, module: nn.Module, optimizer: torch.optim.Optimizer, expected_recipe: dict
) -> LoopState:
    """Load the drafter, its optimizer and the loop state from `ckpt_dir`, after checking it is this run's."""
    config = {"package": cfg.drafter.package, "module": OmegaConf.to_container(cfg.drafter.module, resolve=True)}
    ckpt = load_checkpoint(ckpt_dir, expected_config=config)
    require(
        ckpt.meta.get("kind") == "drafter", f"{ckpt_dir} is not a drafter checkpoint (kind={ckpt.meta.get('kind')!r})"
    )
    check_recipe(ckpt_dir, ckpt.meta.get("recipe"), expected_recipe)
    require(ckpt.optimizer_state is not None, f"checkpoint {ckpt_dir} has no optimizer state to resume from")
    module.load_state_dict(ckpt.state_dict, strict=True)
    optimizer.load_state_dict(ckpt.optimizer_state)
    log.info("resumed from %s at step %d", ckpt_dir, ckpt.meta["step"])
    return LoopState.from_meta(ckpt.meta, "positions")


class Batches:
    """Training batches: from the feature cache, or (features.use=false) from the base on every step."""

    def __init__(
        self,
        cfg: DictConfig,
        base: nn.Module,
        base_meta: dict,
        data,
        *,
        seq_len: int,
        batch_size: int,
        device: torch.device,
        ctx: Dist,
    ) -> None:
        self.cfg, self.base, self.data, self.seq_len, self.batch_size, self.device = (
            cfg,
            base,
            data,
            seq_len,
            batch_size,
            device,
        )
        self.ctx, self.base_meta = ctx, base_meta
        self.layers, f = layers_needed(cfg), cfg.features
        self.cache, self.spec = None, None
        if f.use:
            self.spec = feature_spec(
                OmegaConf.to_container(f), base_meta=base_meta, data=data, seq_len=seq_len, layers=self.layers,
                device=device,
            )  # fmt: skip
            started = time.perf_counter()
            with main_first(ctx):  # rank 0 writes the cache; the others open it after
                answered = self.answered() if self.spec.source == "generated" else None
                self.cache = open_features(
                    base, data.train_ids, self.spec, answered=answered, directory=f.dir, root=f.root, mapped=f.mapped
                )
            self.cache_seconds = time.perf_counter() - started

    def answered(self, *, held_out: int = 0) -> tuple[Tensor, Tensor]:
        """The base's answered turns as windows (N, T + 1) and answer masks (N, T): the training windows, or those
        of the first `held_out` held-out questions (generated first where missing)."""
        return self.windows(self.held_out(held_out)) if held_out else self._generated(generated_windows)

    def held_out(self, n: int) -> list[dict]:
        """The answered turns of the first n held-out questions (generated first where missing), with categories."""
        return self._generated(generated_records, held_out=n)

    def windows(self, records: list[dict]) -> tuple[Tensor, Tensor]:
        pad = self.data.tokenizer.token_to_id("<|im_end|>")
        return conversation_windows(records, seq_len=self.spec.seq_len, pad_id=0 if pad is None else pad)

    def _generated(self, read, **kwargs):
        f = self.cfg.features
        return read(
            self.spec, self.base, self.data.tokenizer, self.base_meta, root=f.answers_root,
            max_new_tokens=self.spec.answer_tokens, batch=f.answer_batch, shipped=f.answers_shipped, **kwargs,
        )  # fmt: skip

    def __call__(self, step: int) -> FeatureBatch:
        """This rank's rows of step `step`'s batch (all of it in a single process)."""
        if self.cache is not None:
            batch = self.cache.sample(step=step, seed=self.cfg.seed, batch_size=self.batch_size)
            return shard(batch, self.ctx).to(self.device)
        tokens = batch_for_step(
            self.data.train_ids,
            step=step,
            seed=self.cfg.seed,
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            device=self.device,
        )  # (B, T + 1)
        return teacher_batch(self.base, shard(tokens, self.ctx), layers=self.layers, top_k=self.cfg.features.top_k)

    def describe(self) -> dict[str, Any]:
        if self.cache is None:
            return {"features": "computed by the base every step"}
        return {
            "features": str(self.cache.directory),
            "feature_key": self.spec.key(),
            "feature_windows": self.spec.windows,
            "feature_source": self.spec.source,
            "feature_teacher": self.spec.teacher,  # what the base computed the features in
            "feature_seconds": round(self.cache_seconds, 1),
            # the answer tokens the drafter learns from (every cached position without a mask)
            "train_tokens": int(self.cache.data["mask"].sum())
            if "mask" in self.cache.data
            else self.spec.windows * self.spec.seq_len,
        }


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train (or resume) the configured drafter on the frozen base, alone or as one rank of torchrun."""
    validate_config(cfg)
    return launch(cfg, batch_size=cfg.batch_size or cfg.drafter.batch_size, body=functools.partial(_train, cfg))


def _train(cfg: DictConfig, *, ctx: Dist, device: torch.device, out_dir: Path) -> dict[str, Any]:
    family = find_family(cfg.drafter.package)
    precision = resolve_precision(cfg.precision, device)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)  # the same initial drafter on every rank
    base, tokenizer, base_meta = load_lm(cfg.base_checkpoint, device=str(device))
    base.requires_grad_(False)
    seq_len = default_seq_len(cfg.seq_len, base.max_seq_len)
    if seq_len > base.max_seq_len:
        raise ValueError(f"seq_len={seq_len} exceeds the base's context max_seq_len={base.max_seq_len}")
    batch_size = cfg.batch_size or cfg.drafter.batch_size
    expected_recipe = recipe(cfg, base_meta=base_meta, seq_len=seq_len, batch_size=batch_size)
    ckpt_dir = resume_point(out_dir) if cfg.resume else None  # last/, or checkpoint/ in an older run directory
    if ckpt_dir is not None:  # another recipe is refused now, before data and feature cache
        found = read_meta(ckpt_dir)
        require(
            found.get("kind") == "drafter",
            f"{ckpt_dir} is not a drafter checkpoint (kind={found.get('kind')!r}): use another out_dir or resume=false",
        )
        check_recipe(ckpt_dir, found.get("recipe"), expected_recipe)
    module = call_with_settings(
        family.build, "drafter.module", base, **OmegaConf.to_container(cfg.drafter.module, resolve=True)
    ).to(device)
    data_cfg = OmegaConf.to_container(cfg.data, resolve=True)
    if (base_meta.get("data") or {}).get("tokenizer_path"):  # a Hugging Face directory brings its own tokenizer
        data_cfg["tokenizer"] = base_meta["data"]["tokenizer_path"]
    with main_first(ctx):  # rank 0 tokenizes and caches the corpus; the others read its cache
        data = prepare_data(**data_cfg)
    if data.tokenizer.to_str() != tokenizer.to_str():
        raise ValueError(
            tokenizer_mismatch("the data config", data.tokenizer, tokenizer, base_data_fix(base_meta, data_cfg))
        )
    vocab = frequent_tokens(token_counts(data, base.num_tokens), cfg.vocab)
    vocab = None if vocab is None else vocab.to(device)
    log.info(
        "precision %s (%s); training vocabulary %s",
        precision["used"],
        precision["reason"],
        "full" if vocab is None else f"the {vocab.numel()} most frequent training tokens",
    )
    loss_kwargs = OmegaConf.to_container(cfg.drafter.loss, resolve=True)
    probe_loss(
        family,
        module,
        base,
        data.val_ids,
        seq_len=seq_len,
        layers=layers_needed(cfg),
        top_k=cfg.features.top_k,
        vocab=vocab,
        loss_kwargs=loss_kwargs,
        device=device,
    )  # before the feature cache takes minutes
    batches = Batches(cfg, base, base_meta, data, seq_len=seq_len, batch_size=batch_size, device=device, ctx=ctx)
    if cfg.vocab is not None and batches.cache is not None and batches.spec.source == "generated":
        # The base's own answers are the text the drafter drafts: its vocabulary is counted over their tokens only,
        # not over a corpus (on SmolLM2 the 2048 most frequent stdlib tokens held 71% of its greedy answers' tokens)
        # nor over the questions.
        cached = batches.cache.data
        counts = torch.bincount(cached["tokens"][:, 1:][cached["mask"]].long(), minlength=base.num_tokens)
        vocab = frequent_tokens(counts, cfg.vocab)
        vocab = None if vocab is None else vocab.to(device)
        log.info("training vocabulary: the %d most frequent tokens of the base's own answers", cfg.vocab)
    val_batches = []
    if ctx.main:  # only rank 0 validates; computed once: the base is frozen
        val_batches = validation_batches(cfg, base, data, batches, seq_len=seq_len, device=device)
        if batches.spec is not None and batches.spec.source == "generated" and vocab is not None:
            covered = coverage(vocab, [b for _, b in val_batches])
            log.info("training vocabulary covers %.1f%% of the held-out answers' tokens", 100 * covered)
    optimizer = make_optimizer(
        module, lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay
    )
    state = LoopState()
    if ckpt_dir is not None:
        state = resume(ckpt_dir, cfg, module=module, optimizer=optimizer, expected_recipe=expected_recipe)

    def save_fn(
        state: LoopState,
        metrics: dict,
        *,
        finished: bool,
        elapsed_s: float,
        directory: Path,
        selection: dict[str, Any],
    ) -> Path:
        extra = {
            "metrics": metrics,
            "precision": precision,
            "train_vocab": None if vocab is None else vocab.numel(),
            "train_vocab_ids": None if vocab is None else vocab.tolist(),  # the drafter drafts from exactly these
            **batches.describe(),
            "positions_seen": state.units,
            "elapsed_s": elapsed_s,
            "positions_per_s": loop.units_per_s(),
            "recipe": expected_recipe,
            "finished": finished,
            "world_size": ctx.world,
            **selection,
        }
        return save(directory, cfg, module, base_meta, step=state.step, extra=extra, optimizer=optimizer)

    logger = make_logger(cfg, out_dir, ctx)
    loop = TrainLoop(
        model=module,
        loss_fn=lambda m, b: family.loss(m, base, b, vocab=vocab, **share(loss_kwargs, b, batch_size)),
        batch_fn=batches,
        count_fn=positions_trained,
        validate_fn=lambda: validate(
            family, module, base, [b for _, b in val_batches], vocab=vocab, categories=[c for c, _ in val_batches]
        ),
        save_fn=save_fn,
        optimizer=optimizer,
        settings=LoopSettings.from_config(cfg),
        precision=precision["used"],
        device=device,
        ctx=ctx,
        out_dir=out_dir,
        logger=logger,
        state=state,
        unit="positions",
        monitor=MONITOR,
        after_backward=lambda: check_base_frozen(base),
        find_unused=True,
    )
    try:
        result = loop.run()
    finally:
        logger.finish()
    val = {k: v for k, v in result["last_val"].items() if k not in ("kind", "step", "positions", "elapsed_s")}
    return {
        "step": loop.state.step,
        "start_step": result["start_step"],
        "stopped_by": result["stopped_by"],
        "elapsed_s": loop.elapsed(),
        "parameters": count_parameters(module),
        "checkpoint": str(out_dir / "checkpoint"),  # the best: highest chain_tau
        "best_step": result["best_step"],
        "best_chain_tau": result["best_value"],
        "last_checkpoint": str(out_dir / "last"),
        "out_dir": str(out_dir),
        "precision": precision["used"],
        "positions": loop.state.units,
        "positions_per_s": loop.units_per_s(),
        **batches.describe(),
        "world_size": ctx.world,
        "rank": ctx.rank,
        "replica_fingerprints": result["replica_fingerprints"],
        **val,
    }
