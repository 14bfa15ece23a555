"""Benchmark every drafter against plain decoding on the same held-out prompts, in one process.

    python -m experiments.benchmark base_checkpoint=outputs/reference/base_small/checkpoint
    python -m experiments.benchmark experiment=demo                      # what `make demo` runs
    python -m experiments.benchmark -m decode.gamma=1,2,4,8 medusa.module.num_heads=2,3,4,5

Protocol (DESIGN §3): the same prompts, decoding settings and process for plain decoding and every
method; each method (plain included) is warmed up first; then `repeats` rounds, each timing plain
decoding and every method back to back (interleaved, so a slow patch of the shared machine hits all
of them); speedup = method tokens/s over plain tokens/s within a round, median over rounds. At
temperature 0, a method whose rule is lossless must reproduce plain decoding token for token, or the
run fails loudly. Writes results.json, results.md and PNG plots into its run directory, logs to wandb
and prints one JSON object as the last line of standard output.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from experiments.artifacts import ensure
from experiments.checkpoint import load_lm
from experiments.cli import exit_on_user_error
from experiments.data import prepare_data
from experiments.prompts import heldout_prompts, load_prompts
from experiments.report import write_report
from experiments.train_base import resolve_device
from experiments.train_drafter import load_drafter
from verify.acceptance import check_rule, is_lossless
from verify.draft_model import DraftModelDrafter
from verify.plain import plain_generate
from verify.prompt_lookup import PromptLookupDrafter
from verify.sampling import SamplingConfig
from verify.speculative import SpecConfig, speculative_generate
from verify.target import Target

log = logging.getLogger(__name__)
METHODS = ("draft_model", "prompt_lookup", "medusa_chain", "medusa_tree", "prophet_chain", "prophet_tree")


class ExactnessError(RuntimeError):
    """A lossless method did not reproduce plain greedy decoding."""


def _overrides(node: DictConfig, prefix: str) -> list[str]:
    """The parts of a drafter config that change its training (module, loss) as Hydra overrides."""
    out = []
    for part in ("module", "loss"):
        items = OmegaConf.to_container(node[part], resolve=True).items()
        out += [f"{prefix}.{part}.{key}={json.dumps(value)}" for key, value in sorted(items)]
    return out


def checkpoint_for(cfg: DictConfig, kind: str, base_ckpt: str | None = None, base_meta: dict | None = None) -> str:
    """An explicit checkpoint from the config, or the artifact cache's (trained on first use).

    Every recipe trained beside a base uses the base's own data config, so the tokenizers match."""
    given = cfg.checkpoints[kind]
    if given is not None:
        return given
    overrides = list(cfg.artifacts[kind])
    data_cfg = (base_meta or {}).get("data", {}).get("config")
    if data_cfg:
        overrides += [f"data.{key}={json.dumps(value)}" for key, value in sorted(data_cfg.items())]
    if kind in ("medusa", "prophet"):
        overrides += [f"drafter={kind}", f"base_checkpoint={base_ckpt}"]
        overrides += _overrides(cfg[kind], "drafter")
    return str(ensure(kind, overrides, root=cfg.artifacts.root))


def check_methods(methods) -> None:
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"methods contain {unknown}: each must be one of {', '.join(METHODS)}")


def make_methods(cfg: DictConfig, base, base_meta: dict, base_ckpt: str, tokenizer) -> dict[str, Callable[[], Any]]:
    """Method name -> a factory of a fresh drafter (state is per batch, so one per generate call)."""
    check_methods(cfg.methods)
    device = next(base.parameters()).device
    methods: dict[str, Callable[[], Any]] = {}
    trained: dict[str, tuple] = {}  # family -> (module, package): chain and tree share one checkpoint
    for name in cfg.methods:
        if name == "draft_model":
            draft_lm, draft_tokenizer, _ = load_lm(checkpoint_for(cfg, "draft", base_meta=base_meta), device=str(device))
            if draft_tokenizer.to_str() != tokenizer.to_str():
                raise ValueError("the draft model uses another tokenizer than the base: train it on the base's data config")
            methods[name] = lambda lm=draft_lm: DraftModelDrafter(lm)
        elif name == "prompt_lookup":
            methods[name] = lambda: PromptLookupDrafter(vocab_size=base.num_tokens, **cfg.prompt_lookup)
        else:
            family, mode = name.split("_")
            if family not in trained:
                trained[family] = load_drafter(checkpoint_for(cfg, family, base_ckpt, base_meta), base, base_meta)[:2]
            module, package = trained[family]
            decode = {**OmegaConf.to_container(cfg[family].decode, resolve=True), "mode": mode}
            if mode == "chain" and "tree" in decode:  # a static tree configures the tree method only
                decode["tree"] = None
            methods[name] = lambda m=module, p=package, d=decode: p.drafter(m, base, **d)
    return methods


def get_prompts(cfg: DictConfig, tokenizer, base_meta: dict) -> list[list[int]]:
    if cfg.prompts.file:
        prompts = load_prompts(cfg.prompts.file, tokenizer)
        return prompts[: cfg.prompts.num_prompts]
    data_cfg = base_meta.get("data", {}).get("config") or OmegaConf.to_container(cfg.data, resolve=True)
    data = prepare_data(**data_cfg)
    if data.tokenizer.to_str() != tokenizer.to_str():
        raise ValueError("the data config gives another tokenizer than the base's: pass the base's data config")
    return heldout_prompts(data, num_prompts=cfg.prompts.num_prompts, prompt_len=cfg.prompts.prompt_len, seed=cfg.seed)


def run_once(target: Target, factory, batches, *, sampling: SamplingConfig, spec: SpecConfig, cfg, seed: int, eos_id):
    """Decode every batch with plain decoding (factory None) or a drafter; (tokens, stats list, seconds)."""
    tokens, stats, seconds = [], [], 0.0
    generator = torch.Generator(device=target.device).manual_seed(seed)
    kwargs = dict(max_new_tokens=cfg.decode.max_new_tokens, sampling=sampling, eos_id=eos_id, generator=generator)
    for batch in batches:
        if factory is None:
            out = plain_generate(target, batch, **kwargs)
        else:
            out = speculative_generate(target, factory(), batch, spec=spec, **kwargs)
        tokens += out.tokens
        stats.append(out.stats)
        seconds += out.stats.time_total
    return tokens, stats, seconds


def summarize_stats(stats: list, seconds: float) -> dict[str, Any]:
    tokens = sum(int(s.tokens.sum()) for s in stats)
    forwards = sum(int(s.forwards.sum()) for s in stats)
    proposed = sum(int(s.proposed.sum()) for s in stats)
    accepted = sum(int(s.accepted.sum()) for s in stats)
    k = max(s.proposed_by_position.shape[0] for s in stats)
    pad = lambda t: torch.cat((t, torch.zeros(k - t.shape[0], dtype=torch.long)))  # noqa: E731
    prop = sum(pad(s.proposed_by_position) for s in stats)
    acc = sum(pad(s.accepted_by_position) for s in stats)
    draft, target = sum(s.time_draft for s in stats), sum(s.time_target for s in stats)
    return {
        "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
        "tau": tokens / max(forwards, 1), "alpha": accepted / max(proposed, 1),
        "acceptance_by_position": (acc.float() / prop.clamp(min=1).float()).tolist() if k else [],
        "time_draft": draft, "time_target": target, "time_other": max(seconds - draft - target, 0.0),
        "row_tau": [t for s in stats for t in s.row_tau],
    }


def bench_temperature(cfg, target, methods, batches, temperature: float, eos_id) -> tuple[dict, list[dict]]:
    """Plain and every method at one temperature: warm-up, interleaved repeats, medians."""
    sampling = SamplingConfig(temperature=temperature, top_k=cfg.decode.top_k, top_p=cfg.decode.top_p)
    d = cfg.decode
    spec = SpecConfig(gamma=d.gamma, rule=d.rule, delta=d.delta, adaptive_gamma=d.adaptive_gamma, max_gamma=max(d.max_gamma, d.gamma))
    rule = check_rule(d.rule, delta=d.delta, temperature=temperature)
    everyone = {"plain": None, **methods}
    for factory in everyone.values():  # warm-up: allocator, caches, lazy inits
        run_once(target, factory, batches[:1], sampling=sampling, spec=spec, cfg=cfg, seed=cfg.seed, eos_id=eos_id)
    rounds: dict[str, list] = {name: [] for name in everyone}
    for r in range(cfg.repeats):
        for name, factory in everyone.items():
            rounds[name].append(
                run_once(target, factory, batches, sampling=sampling, spec=spec, cfg=cfg, seed=cfg.seed + r, eos_id=eos_id)
            )
    plain_tps = [summarize_stats(s, sec)["tokens_per_s"] for _, s, sec in rounds["plain"]]
    plain_tokens = rounds["plain"][0][0]
    rows = []
    for name in methods:
        per_round = [summarize_stats(s, sec) for _, s, sec in rounds[name]]
        speedups = [m["tokens_per_s"] / p for m, p in zip(per_round, plain_tps)]
        exact = rounds[name][0][0] == plain_tokens if temperature == 0 else None
        lossless = is_lossless(rule, delta=d.delta)
        if exact is False and lossless:
            raise ExactnessError(f"{name} at temperature 0 differs from plain greedy decoding: a lossless rule must not")
        best = per_round[sorted(range(len(speedups)), key=speedups.__getitem__)[len(speedups) // 2]]  # the median round
        rows.append({
            "name": name, "temperature": temperature, "rule": rule, "lossless": lossless, "exact": exact,
            "gamma": d.gamma, "speedup": statistics.median(speedups), "speedups": speedups,
            "tokens_per_s": statistics.median(m["tokens_per_s"] for m in per_round),
            "tau": best["tau"], "alpha": best["alpha"], "efficiency": statistics.median(speedups) / best["tau"],
            "acceptance_by_position": best["acceptance_by_position"],
            "draft_share": best["time_draft"] / best["seconds"], "target_share": best["time_target"] / best["seconds"],
            "row_tau": best["row_tau"],
        })
    plain = {"temperature": temperature, "tokens_per_s": statistics.median(plain_tps), "tokens_per_s_rounds": plain_tps}
    return plain, rows


def benchmark(cfg: DictConfig) -> dict[str, Any]:
    """Run the configured benchmark; returns the summary that main prints as its last line."""
    device = resolve_device(cfg.device)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    for t in cfg.decode.temperatures:
        SamplingConfig(temperature=t, top_k=cfg.decode.top_k, top_p=cfg.decode.top_p)  # fail before any work
        check_rule(cfg.decode.rule, delta=cfg.decode.delta, temperature=t)
    SpecConfig(gamma=cfg.decode.gamma, rule=cfg.decode.rule, delta=cfg.decode.delta)
    check_methods(cfg.methods)
    base_ckpt = checkpoint_for(cfg, "base")
    base, tokenizer, base_meta = load_lm(base_ckpt, device=str(device))
    eos_id = base_meta.get("data", {}).get("eos_id", 0) if cfg.stop_at_eos else None
    prompts = get_prompts(cfg, tokenizer, base_meta)
    target = Target(base)
    target.check_tokens(prompts, max_new_tokens=cfg.decode.max_new_tokens)  # before any drafter trains
    methods = make_methods(cfg, base, base_meta, base_ckpt, tokenizer)
    batches = [prompts[i : i + cfg.decode.batch_size] for i in range(0, len(prompts), cfg.decode.batch_size)]
    plains, rows = [], []
    for temperature in cfg.decode.temperatures:
        plain, method_rows = bench_temperature(cfg, target, methods, batches, float(temperature), eos_id)
        plains.append(plain)
        rows += method_rows
    results = {
        "base_checkpoint": base_ckpt, "base_fingerprint": base_meta["fingerprint"],
        "prompts": len(prompts), "batch_size": cfg.decode.batch_size, "max_new_tokens": cfg.decode.max_new_tokens,
        "repeats": cfg.repeats, "device": str(device), "dtype": "float32", "compiled": False,
        "plain": plains, "methods": rows, "config": OmegaConf.to_container(cfg, resolve=True),
    }
    out_dir = Path(cfg.out_dir)
    write_report(results, out_dir)
    logger = instantiate(cfg.logger, dir=str(out_dir), run_config=results["config"], _convert_="all", _recursive_=False)
    try:
        for i, row in enumerate(rows):
            logger.log({f"{row['name']}/t{row['temperature']}/{k}": v for k, v in row.items() if isinstance(v, (int, float))}, step=i)
    finally:
        logger.finish()
    return {
        "plain_tokens_per_s": plains[0]["tokens_per_s"],
        "methods": [{k: row[k] for k in ("name", "temperature", "tau", "alpha", "speedup", "tokens_per_s", "exact", "lossless")} for row in rows],
    }


@hydra.main(version_base="1.3", config_path="../conf", config_name="benchmark")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    summary = benchmark(cfg)
    print((Path(cfg.out_dir) / "results.md").read_text(), file=sys.stdout)
    print(json.dumps(summary), file=sys.stdout)  # the last line of standard output


if __name__ == "__main__":
    main()
