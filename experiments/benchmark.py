"""Benchmark every drafter against plain decoding on the same held-out prompts, in one process.

    python -m experiments.benchmark base_checkpoint=outputs/reference/base_small/checkpoint
    python -m experiments.benchmark experiment=demo                      # what `make demo` runs
    python -m experiments.benchmark -m decode.gamma=1,2,4,8 medusa.module.num_heads=2,3,4,5

Protocol: the same prompts, decoding settings and process for plain decoding and every
method; each method (plain included) is warmed up first; then `repeats` rounds, in which every batch of
prompts is decoded by plain decoding and every method, at every temperature, back to back, in an order
that rotates from batch to batch (experiments/lib/methods/rounds.py), so a slow patch of the shared
machine hits all of them; speedup = method tokens/s over plain tokens/s within a round, median over
rounds, with a paired bootstrap interval over the (round, batch) cells (experiments/lib/report/spread.py).
A ratio that cannot be marks the run as disturbed (experiments/lib/report/disturbed.py), and the verdict
then names no winner; otherwise it names one only where the interval lies above 1.0. At
temperature 0, a method whose rule is lossless must reproduce plain decoding token for token, or the
run fails loudly. A progress bar (a log line every 30 s off a terminal) follows the timed work. Writes
results.json, results.md and PNG plots into its run directory, logs to wandb and prints one JSON object
as the last line of standard output.

This file holds the protocol itself (timing rounds, table rows, budget=auto's choices). The methods and
their drafters come from experiments/lib/methods/registry.py; every setting is checked first by
experiments/lib/methods/decode_checks.py (check_benchmark); the figures of a round are verify/loop/stats.py's
DecodeStats pooled over the round's batches; the report is experiments/lib/report/results.py's.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from experiments.lib.cli.preflight import hydra_preflight
from experiments.lib.common.errors import exit_on_user_error
from experiments.lib.common.machine import cpu_model, device_info
from experiments.lib.families.registry import FAMILIES, TREE_FAMILIES
from experiments.lib.methods.calibrate import (
    cached_verify_cost,
    choose_chain_budget,
    choose_tree_budget,
    decode_precision,
    format_cost_table,
)
from experiments.lib.methods.decode_checks import check_benchmark, check_exact, sampling_for
from experiments.lib.methods.prompt_set import add_second_turns, check_pilot_room, get_prompt_set, get_prompts
from experiments.lib.methods.registry import (
    HYBRID_METHODS,
    SHIPPED,
    check_drafters_before_base,
    checkpoint_for,
    family_mode,
    make_methods,
    recorded_config,
    verify_widths,
)
from experiments.lib.methods.rounds import RoundsProgress, interleaved_rounds, middle_rounds
from experiments.lib.report.by_category import category_batches, category_figures, per_category
from experiments.lib.report.disturbed import MIN_CELL_PROMPTS, MIN_CELL_TOKENS, PLAIN_SPREAD, TOLERANCE, judge
from experiments.lib.report.results import mode, repeated_ngram_share, write_report
from experiments.lib.report.spread import LEVEL, RESAMPLES, cell_times, speedup_interval
from experiments.lib.report.spread import SEED as SPREAD_SEED
from experiments.lib.store.checkpoint import load_lm
from experiments.lib.store.lm import count_parameters
from experiments.lib.training.precision import decode_in
from experiments.lib.training.settings import resolve_device
from verify.backends.choose import make_target
from verify.backends.target import Target
from verify.common.numerics import EosId
from verify.loop.plain import Generation, plain_generate
from verify.loop.sampling import SamplingConfig
from verify.loop.speculative import SpecConfig, speculative_generate
from verify.loop.stats import DecodeStats

log = logging.getLogger(__name__)


def run_once(
    target: Target,
    factory: Callable[[], Any] | None,
    batch: list[list[int]],
    *,
    sampling: SamplingConfig,
    spec: SpecConfig,
    cfg: DictConfig,
    generator: torch.Generator,
    eos_id: EosId,
) -> Generation:
    """Decode one batch with plain decoding (factory None) or a fresh drafter, drawing from `generator`."""
    kwargs = dict(max_new_tokens=cfg.decode.max_new_tokens, sampling=sampling, eos_id=eos_id, generator=generator)
    if factory is None:
        return plain_generate(target, batch, **kwargs)
    return speculative_generate(target, factory(), batch, spec=spec, **kwargs)


def summarize_stats(stats: list[DecodeStats]) -> dict[str, Any]:
    """One round's figures: DecodeStats' own over all its batches (tokens, tokens/s, tau, alpha, acceptance
    by position, time split, per-row tau), plus the drafter's and the target's seconds per verification
    step, counted per batch (a batch's rows share its target forwards), the target forwards of every row
    (`forwards`) and those of each batch's longest-running row (`call_forwards`, summed over batches: the
    forwards a batch's time follows, which experiments/lib/report/disturbed.py bounds a speedup with)."""
    merged = DecodeStats.merge(stats)
    steps = max(sum(s.verify_steps for s in stats), 1)
    return {
        **merged.as_dict(),
        "forwards": int(merged.forwards.sum()),
        "call_forwards": sum(int(s.forwards.max()) for s in stats),
        "calls": len(stats),  # decode calls (batches): a cell timed in one call a round is one stall away from noise
        "draft_seconds_per_step": merged.time_draft / steps,
        "target_seconds_per_step": merged.time_target / steps,
    }


def pooled_rounds(entry: dict, rounds: list[int]) -> dict[str, Any]:
    """summarize_stats of an entry's batches in these rounds, pooled: a row's figures over the rounds its
    median speedup takes (experiments/lib/methods/rounds.py middle_rounds)."""
    return summarize_stats([g.stats for r in rounds for g in entry["cells"][r]])


def bench_temperatures(
    cfg: DictConfig,
    setups: list[dict],
    batches: list[list[list[int]]],
    temperatures: list[float],
    eos_id: EosId,
    labels: list[str],
    progress: RoundsProgress | None = None,
) -> tuple[list[dict], list[dict]]:
    """Plain and every method in every setting at every temperature: warm-up, interleaved rounds, medians.
    Returns (plain rows, method rows), temperature by temperature.

    Every batch is decoded by every entry, at every temperature, back to back (experiments/lib/methods/rounds.py),
    so a change of machine load lands on plain decoding and the methods alike, and plain decoding at T=0 and
    at T=1 are timed side by side. Speedup is against the FASTEST plain decoding of the same temperature and
    round (over all settings), so a method only counts as faster if it beats the best plain decoder a user
    could pick instead; its interval is spread.py's paired bootstrap over the cells. `labels` is each batch's
    prompt category: with several, every row also carries its figures per category."""
    entries = bench_entries(cfg, setups, temperatures, eos_id)
    time_entries(cfg, entries, batches, eos_id, labels, progress)
    plains, rows = [], []
    for t in temperatures:
        plain, method_rows = temperature_rows(cfg, [e for e in entries if e["temperature"] == t], batches, labels)
        plains += plain
        rows += method_rows
    return plains, rows


def bench_entries(cfg: DictConfig, setups: list[dict], temperatures: list[float], eos_id: EosId) -> list[dict]:
    """Every (temperature, setting, plain or method) the benchmark times; budget=auto first picks each
    method's budget per setting and temperature (choose_budgets)."""
    entries = []
    for t in temperatures:
        sampling, rule = sampling_for(cfg.decode, t)
        for s in setups:
            chosen = choose_budgets(cfg, s, sampling, eos_id) if cfg.budget == "auto" else {}
            for name, factory in {"plain": None, **s["methods"]}.items():
                own = chosen.get(name, dict(factory=factory, spec=s["spec"]))
                entries.append(dict(temperature=t, sampling=sampling, rule=rule, setup=s, name=name, **own))
    return entries


def time_entries(
    cfg: DictConfig,
    entries: list[dict],
    batches: list[list[list[int]]],
    eos_id: EosId,
    labels: list[str],
    progress: RoundsProgress | None,
) -> None:
    """Decode every batch with every entry in interleaved rounds; each entry gets its `cells` (Generations per
    round and batch), `warmup_s`, `rounds` (the tokens and summarize_stats figures of each round) and
    `category_rounds` (the same per category)."""

    def decode(i: int, batch: list[list[int]], generator: torch.Generator) -> Generation:
        e = entries[i]
        torch.set_num_threads(e["setup"]["threads"])
        kwargs = dict(sampling=e["sampling"], spec=e["spec"], cfg=cfg, generator=generator, eos_id=eos_id)
        return run_once(e["setup"]["target"], e["factory"], batch, **kwargs)

    cells, warmup_s = interleaved_rounds(
        decode,
        len(entries),
        batches,
        repeats=cfg.repeats,
        seed=cfg.seed,
        device=entries[0]["setup"]["target"].device,
        progress=progress,
        names=[f"{e['name']} ({mode(e['setup'])}, T={e['temperature']:g})" for e in entries],
    )
    for e, entry_cells, seconds in zip(entries, cells, warmup_s):
        e["warmup_s"], e["cells"] = seconds, entry_cells
        stats = [[g.stats for g in gens] for gens in entry_cells]
        e["rounds"] = [
            ([row for g in gens for row in g.tokens], summarize_stats(st)) for gens, st in zip(entry_cells, stats)
        ]
        e["category_rounds"] = [per_category(st, labels, summarize_stats) for st in stats]


def temperature_rows(
    cfg: DictConfig, entries: list[dict], batches: list[list[list[int]]], labels: list[str]
) -> tuple[list[dict], list[dict]]:
    """The table rows of one temperature's timed entries: (plain rows, method rows)."""
    temperature, rule = entries[0]["temperature"], entries[0]["rule"]
    fastest = [
        max(e["rounds"][r][1]["tokens_per_s"] for e in entries if e["factory"] is None) for r in range(cfg.repeats)
    ]
    plain_of = {id(e["setup"]): e for e in entries if e["factory"] is None}
    plain_entries = list(plain_of.values())
    plain_times = [cell_times(p["cells"]) for p in plain_entries]
    # How much of plain decoding's own output at this temperature repeats an earlier 4-gram of its row: a
    # base looping at T=0 makes drafting trivially easy, so every row carries this figure beside its tau.
    # One figure per temperature (the first setting's plain decoding, its rounds pooled: at T=0 they are
    # identical, at T>0 they are more samples); other settings decode the same prompts with the same seeds.
    first_plain = next(e for e in entries if e["factory"] is None)
    prompts = [p for batch in batches for p in batch]
    repeat4 = repeated_ngram_share(
        prompts * len(first_plain["rounds"]), [row for tokens, _ in first_plain["rounds"] for row in tokens], n=4
    )
    plains, rows = [], []
    for e in entries:
        per_round = [m for _, m in e["rounds"]]
        speedups = [m["tokens_per_s"] / f for m, f in zip(per_round, fastest)]
        middle = middle_rounds(speedups)  # the rounds the median speedup takes: tau and the rest from them too
        median = pooled_rounds(e, middle)
        lo, hi, n = speedup_interval(cell_times(e["cells"]), plain_times)
        common = {
            "temperature": temperature,
            "threads": e["setup"]["threads"],
            "compiled": e["setup"]["compiled"],
            "repeat4": repeat4,
            "tokens_per_s": statistics.median(m["tokens_per_s"] for m in per_round),
            "speedup": statistics.median(speedups),
            "speedup_lo": lo,
            "speedup_hi": hi,
            "cells": n,
            "speedups": speedups,
            "warmup_s": e["warmup_s"],
            "categories": category_spreads(e, plain_entries, plain_times, labels),
            "rounds": len(middle),
            "tokens": median["tokens"],
            "call_forwards": median["call_forwards"],  # the forwards the batches' time followed
        }
        if e["factory"] is None:
            plains.append({**common, "tokens_per_s_rounds": [m["tokens_per_s"] for m in per_round]})
            continue
        plain = plain_of[id(e["setup"])]
        same = pooled_rounds(plain, middle)  # plain decoding's forwards on the same rounds: disturbed.py's bound
        common |= {"plain_tokens": same["tokens"], "plain_call_forwards": same["call_forwards"]}
        rows.append(method_row(e, common, median, rule, plain, cfg))
    return plains, rows


def category_spreads(e: dict, plain_entries: list[dict], plain_times: list, labels: list[str]) -> dict[str, dict]:
    """by_category's figures of one entry, each with the bootstrap interval over that category's cells
    (speedup_lo, speedup_hi: None for a single cell), its cell count and its number of prompts."""
    figures = category_figures(e, plain_entries)
    for category, figure in figures.items():
        batches = [b for b, label in enumerate(labels) if label == category]
        lo, hi, n = speedup_interval(cell_times(e["cells"]), plain_times, batches=batches)
        prompts = sum(len(e["cells"][0][b].tokens) for b in batches)  # a one-question cell is not judged
        figure.update(speedup_lo=lo, speedup_hi=hi, cells=n, prompts=prompts)
    return figures


def method_row(e: dict, common: dict, best: dict, rule: str, plain: dict, cfg: DictConfig) -> dict:
    """One table row; at temperature 0 a lossless method must equal plain decoding of the same setting."""
    exact, lossless = check_exact(
        e["name"],
        plain["rounds"][0][0],
        e["rounds"][0][0],
        rule=rule,
        delta=cfg.decode.delta,
        greedy=common["temperature"] == 0,
    )
    return {
        "name": e["name"],
        **common,
        "rule": rule,
        "lossless": lossless,
        "exact": exact,
        "gamma": e["spec"].gamma,
        "verify_width": verify_width(cfg, e["name"], e["spec"], e.get("budget")),
        "budget": e.get("budget"),
        "tau": best["tau"],
        "alpha": best["alpha"],
        "efficiency": common["speedup"] / best["tau"],
        "acceptance_by_position": best["acceptance_by_position"],
        "copied_share": best["copied_share"],  # a hybrid's share of row-cycles drafted by copying; None otherwise
        "draft_share": best["time_draft"] / best["time_total"],
        "target_share": best["time_target"] / best["time_total"],
        "draft_seconds_per_step": best["draft_seconds_per_step"],
        "target_seconds_per_step": best["target_seconds_per_step"],
        "row_tau": best["row_tau"],
    }


def verify_width(cfg: DictConfig, name: str, spec: SpecConfig, budget: dict | None) -> int:
    """Tokens a method's target forward verifies: a tree's nodes plus the pending token, a chain's gamma + 1
    (with adaptive gamma the narrowest, 2: the bound it sets, tau / v(width), is then the loosest)."""
    family, method_mode = family_mode(name)
    if method_mode == "tree":
        given = cfg[family].decode.get("tree")  # an explicit tree of rank paths: one node per path
        nodes = (budget or {}).get("tree_nodes") or (len(given) if given else cfg[family].decode.tree_nodes)
        return int(nodes) + 1
    return 2 if spec.adaptive_gamma else spec.gamma + 1


def benchmark(cfg: DictConfig) -> dict[str, Any]:
    """Run the configured benchmark; returns the summary that main prints as its last line."""
    settings, temperatures, spec = check_benchmark(cfg)  # before anything loads or trains
    if cfg.budget == "auto":
        check_pilot_room(cfg)  # a prompts file the benchmark takes whole leaves the pilots nothing: say so now
    widths = compile_widths(cfg, spec)
    device = resolve_device(cfg.device)
    check_drafters_before_base(cfg)  # a drafter setting its training would refuse, before the base loads or trains
    base_ckpt = checkpoint_for(cfg, "base")
    base, tokenizer, base_meta = load_lm(base_ckpt, device=str(device))
    precision = decode_precision(
        cfg.dtype,
        base,
        device,
        key_parts={"base": base_meta["fingerprint"]},
        cache_dir=cfg.budget_search.cache_dir,
    )
    log.info("decoding in %s (dtype=%s: %s)", precision["used"], precision["requested"], precision["reason"])
    decode_in(base, precision)  # drafters load in the base's dtype (make_methods)
    # an id or a list of ids (a Hugging Face model's generation_config may list several: checkpoint.hf_eos_id)
    eos_id = base_meta.get("data", {}).get("eos_id", 0) if cfg.stop_at_eos else None
    prompt_set = get_prompt_set(cfg, tokenizer, base_meta)
    # Every target before any drafter trains: bad prompts, or compile on a base that cannot, fail first.
    ordered = cfg.decode.get("ordered", True)
    targets = [make_target(base, compile=compiled, widths=widths, ordered=ordered) for _, compiled in settings]
    targets[0].check_tokens(prompt_set.ids, max_new_tokens=cfg.decode.max_new_tokens)
    if cfg.prompts.turns == 2:  # the model's own first answers, then the second turns
        prompt_set = add_second_turns(
            prompt_set, tokenizer, target=targets[0], max_new_tokens=cfg.decode.max_new_tokens, eos_id=eos_id
        )
        targets[0].check_tokens(prompt_set.ids, max_new_tokens=cfg.decode.max_new_tokens)
    prompts = prompt_set.ids
    methods, loaded = make_methods(cfg, base, base_meta, base_ckpt, tokenizer)
    batches, labels = category_batches(prompts, prompt_set.categories, cfg.decode.batch_size)
    setups = []
    for (threads, compiled), target in zip(settings, targets):
        threads = threads if threads is not None else torch.get_num_threads()
        setup = dict(threads=threads, compiled=compiled, target=target, spec=spec, makers=methods)
        setup["methods"] = {name: (lambda f=f, c=compiled: f(compile=c)) for name, f in methods.items()}
        if cfg.budget == "auto":
            torch.set_num_threads(threads)
            start = time.perf_counter()
            measure = lambda tree, target=target: cached_verify_cost(  # noqa: E731  as the pilots decode
                target,
                key_parts={"base": base_meta["fingerprint"], "dtype": str(precision["dtype"]).removeprefix("torch.")},
                cache_dir=cfg.budget_search.cache_dir,
                batch_size=cfg.decode.batch_size,
                prompt_len=calibration_context(prompts),  # the contexts this run decodes at, not a fixed 64
                tree=tree,
            )
            setup["verify_cost"] = measure(False)
            if any(family_mode(name)[1] == "tree" for name in methods):
                setup["tree_cost"] = measure(True)  # trees are budgeted on what a tree forward costs
            setup["calibration_s"] = time.perf_counter() - start  # compiled: includes compiling every width
            table = format_cost_table(setup["verify_cost"], tree_cost=setup.get("tree_cost"))
            log.info("target cost by new tokens (%s):\n%s", mode(setup), table)
            setup["pilot_prompts"] = pilot_prompts(cfg, tokenizer, base_meta, prompts)
        setups.append(setup)
    entries = len(setups) * (1 + len(methods))  # plain decoding and every method, in every setting
    with RoundsProgress(len(temperatures) * entries * (1 + cfg.repeats * len(batches))) as progress:
        plains, rows = bench_temperatures(cfg, setups, batches, temperatures, eos_id, labels, progress)
    disturbed, small_cells = judge(plains, rows, costs_of(setups, precision))
    for reason in disturbed:
        log.warning("disturbed: %s", reason)
    for line in small_cells:
        log.warning("above its bound, too small to judge: %s", line)
    results = {
        "cost_tables": {mode(s): s["verify_cost"] for s in setups if "verify_cost" in s},
        "tree_cost_tables": {mode(s): s["tree_cost"] for s in setups if "tree_cost" in s},
        "calibration_s": {mode(s): s["calibration_s"] for s in setups if "calibration_s" in s},
        "base_checkpoint": base_ckpt,
        "base_fingerprint": base_meta["fingerprint"],
        # its step, and whether it is its run's best validation or its latest
        "base_record": {"checkpoint": base_ckpt, **{k: base_meta.get(k) for k in ("step", "selected", "last_step")}},
        "cpu": cpu_model(),  # kept for readers of results written before device_info
        "device_info": device_info(device),  # the GPU's name, memory, torch and CUDA versions on a GPU
        "prompts": len(prompts),
        "prompt_set": {
            "source": cfg.prompts.set or cfg.prompts.file or "heldout",
            "chat": bool(cfg.prompts.chat),
            "turns": cfg.prompts.turns,
            "categories": dict(sorted(Counter(prompt_set.categories).items())),
        },
        "batch_size": cfg.decode.batch_size,
        "max_new_tokens": cfg.decode.max_new_tokens,
        "repeats": cfg.repeats,
        "device": str(device),
        "dtype": str(next(base.parameters()).dtype).removeprefix("torch."),  # what the target decoded in
        "precision": {k: precision[k] for k in ("requested", "used", "reason")},
        # attention summed in position order (decode.ordered on the lean Llama engine): what makes T=0 exact in bf16
        "ordered": targets[0].ordered,
        "ordered_attention": targets[0].ordered_attention,  # "cpp" (the C++ operator), "torch" (its fallback), "-"
        # the target's shape, printed in the table's header: the regime every speedup below belongs to
        "base": {
            "parameters": count_parameters(base),
            **{k: v for k, v in (base_meta.get("model_config") or {}).items() if k in ("arch", "dim", "depth")},
        },
        "plain": plains,
        "methods": rows,
        # figures that cannot be (disturbed.py): the machine's load changed while they were timed; no winner then
        "disturbed": disturbed,
        # category cells too small to judge (one question, or few tokens a round) that lie above their bound
        "disturbed_warnings": small_cells,
        "spread": {
            "method": "paired bootstrap over (round, batch) cells",
            "resamples": RESAMPLES,
            "level": LEVEL,
            "seed": SPREAD_SEED,
            "tolerance": TOLERANCE,
            "plain_spread": PLAIN_SPREAD,
            "min_cell_prompts": MIN_CELL_PROMPTS,
            "min_cell_tokens": MIN_CELL_TOKENS,
        },
        "checkpoints": loaded,
        "config": recorded_config(cfg, loaded),
    }
    out_dir = Path(cfg.out_dir)
    write_report(results, out_dir)
    logger = instantiate(cfg.logger, dir=str(out_dir), run_config=results["config"], _convert_="all", _recursive_=False)
    try:
        for i, row in enumerate(rows):
            key = f"{row['name']}/t{row['temperature']}/{mode(row).replace(' ', '/')}"
            logger.log({f"{key}/{k}": v for k, v in row.items() if isinstance(v, (int, float))}, step=i)
    finally:
        logger.finish()
    fastest = max(plains, key=lambda p: (p["temperature"] == plains[0]["temperature"], p["tokens_per_s"]))
    keys = (
        "name",
        "temperature",
        "threads",
        "compiled",
        "tau",
        "repeat4",
        "alpha",
        "speedup",
        "tokens_per_s",
        "exact",
        "lossless",
    )
    return {"plain_tokens_per_s": fastest["tokens_per_s"], "methods": [{k: row[k] for k in keys} for row in rows]}


def costs_of(setups: list[dict], precision: dict) -> Callable[[dict], dict[int, float] | None]:
    """row -> the measured verify cost table of its setting: budget=auto's (a tree row: the tree table), else
    dtype=auto's eager probe {1, 8} for an eager setting (a tree of k nodes costs at least a chain of k, so a
    chain table bounds a tree loosely), else None (no table: only efficiency <= 1 is checked)."""
    by_mode = {mode(s): s for s in setups}

    def costs(row: dict) -> dict[int, float] | None:
        setup = by_mode[mode(row)]
        tree = family_mode(row["name"])[1] == "tree"
        if "verify_cost" in setup:
            return setup.get("tree_cost", setup["verify_cost"]) if tree else setup["verify_cost"]
        return None if setup["compiled"] else precision.get("verify_cost")

    return costs


def compile_widths(cfg: DictConfig, spec: SpecConfig) -> tuple[int, ...]:
    """Verify widths a compiled target pads to (experiments/lib/methods/registry.py verify_widths): at a fixed budget
    the chains' decode.gamma; with budget=auto every gamma and tree size its search may try instead."""
    if cfg.budget != "auto":
        return verify_widths(cfg, [spec.gamma])
    trees = [c.tree_nodes for f in TREE_FAMILIES for c in cfg.budget_search[f"{f}_trees"]]
    return (*verify_widths(cfg, range(1, cfg.budget_search.max_gamma + 1)), *(n + 1 for n in trees))


def calibration_context(prompts: list[list[int]]) -> int:
    """The context verify costs are measured at: the prompt set's median length (a step's cost grows with it)."""
    return max(1, int(statistics.median(len(p) for p in prompts)))


def pilot_prompts(cfg: DictConfig, tokenizer, base_meta: dict, taken: list[list[int]]) -> list[list[int]]:
    """Prompts for `budget=auto`'s pilot runs: drawn with another seed, none equal to a benchmark prompt."""
    n = cfg.budget_search.pilot_prompts
    draw = OmegaConf.merge(cfg, {"seed": cfg.seed + 1, "prompts": {"num_prompts": cfg.prompts.num_prompts + n}})
    pilots = [p for p in get_prompts(draw, tokenizer, base_meta) if p not in taken][:n]
    if not pilots:  # check_pilot_room passed, but the spare questions repeat benchmark prompts word for word
        raise ValueError(
            f"budget=auto: every question past prompts.num_prompts={cfg.prompts.num_prompts} repeats a benchmarked "
            "one, leaving none for its pilot runs; give fewer prompts.num_prompts, or budget=fixed"
        )
    return pilots


def choose_budgets(cfg: DictConfig, setup: dict, sampling: SamplingConfig, eos_id: EosId) -> dict[str, dict]:
    """budget=auto: per method, the gamma (chains) or tree size (trees) with the highest predicted
    tokens/s from this setting's measured verify costs and a pilot run on held-out prompts."""
    search, chosen = cfg.budget_search, {}
    common = dict(
        verify_cost=setup["verify_cost"],
        sampling=sampling,
        eos_id=eos_id,
        seed=cfg.seed,
        max_new_tokens=cfg.decode.max_new_tokens,
        spec=setup["spec"],
        batch_size=cfg.decode.batch_size,
    )
    torch.set_num_threads(setup["threads"])
    # hybrids last: a hybrid's learned side drafts at its own chain's chosen gamma (hybrid.learned_gamma null)
    hybrid = lambda name: name.removeprefix(SHIPPED) in HYBRID_METHODS  # noqa: E731
    for name, make in sorted(setup["makers"].items(), key=lambda item: hybrid(item[0])):
        compile_ = setup["compiled"]
        family, method_mode = family_mode(name)
        if method_mode == "tree":
            candidates = [dict(c) for c in search[f"{family}_trees"]]
            # A head tree's depth is the loop's gamma (one head per level), not a drafter argument
            heads = FAMILIES[family].head_tree
            over = (lambda c: {k: v for k, v in c.items() if k != "depth"} | {"tree": None}) if heads else dict
            result = choose_tree_budget(
                setup["target"],
                lambda c, make=make, compile_=compile_, over=over: lambda: make(compile=compile_, **over(c)),
                setup["pilot_prompts"],
                candidates=candidates,
                **common | {"verify_cost": setup.get("tree_cost", setup["verify_cost"])},
            )
            kwargs, gamma = over(result["drafter_kwargs"]), result["gamma"]
            factory = lambda make=make, kwargs=kwargs, compile_=compile_: make(compile=compile_, **kwargs)  # noqa: E731
        else:
            kwargs = {}
            own_chain = name.replace("hybrid_", "", 1)  # [shipped_]hybrid_<family>_chain -> [shipped_]<family>_chain
            if hybrid(name) and cfg.hybrid.learned_gamma is None and own_chain in chosen:
                kwargs = {"learned_gamma": chosen[own_chain]["budget"]["gamma"]}
            factory = lambda make=make, kwargs=kwargs, compile_=compile_: make(compile=compile_, **kwargs)  # noqa: E731
            result = choose_chain_budget(
                setup["target"], factory, setup["pilot_prompts"], max_gamma=search.max_gamma, **common
            )
            gamma = result["gamma"]
        spec = replace(setup["spec"], gamma=gamma, max_gamma=max(setup["spec"].max_gamma, gamma))
        chosen[name] = dict(factory=factory, spec=spec, budget={"gamma": gamma, **kwargs, "table": result["table"]})
        log.info("budget=auto %s (%s, T=%g): gamma %d %s", name, mode(setup), sampling.temperature, gamma, kwargs)
    return chosen


@hydra_preflight
@hydra.main(version_base="1.3", config_path="../conf", config_name="benchmark")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    summary = benchmark(cfg)
    print((Path(cfg.out_dir) / "results.md").read_text(), file=sys.stdout)
    print(json.dumps(summary), file=sys.stdout)  # the last line of standard output


if __name__ == "__main__":
    main()
