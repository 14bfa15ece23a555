"""Benchmark an encoder-decoder target: plain decoding vs draft-model and prompt-lookup speculative
decoding on held-out sources, `bench.batch` sources at a time (1 by default; larger batches are ragged:
rows accept different numbers of tokens per step), at each configured temperature.

Every method runs in this one process after a warm-up, interleaved per repeat (plain, draft, lookup,
plain, ...), and a speedup is the ratio of tokens/s within one repeat; the table reports the median over
repeats. tau = tokens emitted / target forwards (the prefill included), alpha = accepted / proposed
draft tokens, rep4 = share of output tokens that complete a 4-gram seen earlier in source + output (a
model that loops or copies is easy to draft for). At T=0 every speculative output is checked token for
token against plain decoding.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn

from experiments.lib.common.errors import write_atomic
from experiments.lib.common.machine import cpu_model, device_info, device_line
from experiments.lib.data.seq2seq import Pairs
from experiments.lib.report.results import repeated_ngram_share
from verify.common.numerics import EosId
from verify.drafters.prompt_lookup import PromptLookupDrafter
from verify.encdec.seq2seq import Seq2SeqDraftDrafter, Seq2SeqTarget
from verify.loop.plain import plain_generate
from verify.loop.sampling import SamplingConfig
from verify.loop.speculative import SpecConfig, speculative_generate

METHODS = ("plain", "draft", "lookup")


def _decode_all(
    method: str,
    target: Seq2SeqTarget,
    drafters: dict,
    sources: list[list[int]],
    *,
    cfg: DictConfig,
    sampling: SamplingConfig,
    eos_id: EosId,
    seed: int,
) -> dict[str, Any]:
    """Decode the sources `bench.batch` at a time (a ragged batch); totals of tokens, target forwards (per
    row), drafts and seconds, and the outputs."""
    totals = {
        "tokens": 0,
        "forwards": 0,
        "proposed": 0,
        "accepted": 0,
        "seconds": 0.0,
        "draft_seconds": 0.0,
        "outputs": [],
    }
    for i in range(0, len(sources), cfg.bench.batch):
        batch = sources[i : i + cfg.bench.batch]
        generator = torch.Generator().manual_seed(seed * 100_003 + i)
        kwargs = dict(max_new_tokens=cfg.bench.max_new_tokens, sampling=sampling, eos_id=eos_id, generator=generator)
        if method == "plain":
            out = plain_generate(target, batch, **kwargs)
        else:
            out = speculative_generate(
                target, drafters[method], batch, spec=SpecConfig(gamma=cfg.bench.gamma), **kwargs
            )
        s = out.stats
        totals["tokens"] += int(s.tokens.sum())
        totals["forwards"] += int(s.forwards.sum())
        totals["proposed"] += int(s.proposed.sum())
        totals["accepted"] += int(s.accepted.sum())
        totals["seconds"] += s.time_total
        totals["draft_seconds"] += s.time_draft
        totals["outputs"] += out.tokens
    return totals


def benchmark(
    target_model: nn.Module,
    draft_model: nn.Module,
    val: Pairs,
    cfg: DictConfig,
    *,
    bos_id: int,
    eos_id: EosId,
    out_dir: Path,
) -> dict[str, Any]:
    """Run the comparison, write results.json and results.md into out_dir, return the results."""
    target = Seq2SeqTarget(target_model, bos_id=bos_id)
    drafters = {
        "draft": Seq2SeqDraftDrafter(draft_model, bos_id=bos_id),
        "lookup": PromptLookupDrafter(vocab_size=target.vocab_size, max_ngram=cfg.bench.ngram),
    }
    sources = val.sources[: cfg.bench.pairs]
    rows = []
    for temperature in cfg.bench.temperatures:
        sampling = SamplingConfig(temperature=float(temperature))
        for method in METHODS:  # warm-up: allocator, thread pools, first-call paths
            _decode_all(method, target, drafters, sources[:2], cfg=cfg, sampling=sampling, eos_id=eos_id, seed=cfg.seed)
        runs = {m: [] for m in METHODS}
        for _ in range(cfg.bench.repeats):
            for method in METHODS:  # the same seeds every repeat: the same work, timed again
                runs[method].append(
                    _decode_all(
                        method, target, drafters, sources, cfg=cfg, sampling=sampling, eos_id=eos_id, seed=cfg.seed
                    )
                )
        rows += [_row(method, float(temperature), runs, sources) for method in METHODS]
    result = {
        "rows": rows,
        "sources": len(sources),
        "gamma": cfg.bench.gamma,
        "ngram": cfg.bench.ngram,
        "max_new_tokens": cfg.bench.max_new_tokens,
        "repeats": cfg.bench.repeats,
        "batch": cfg.bench.batch,
        "threads": torch.get_num_threads(),
        "cpu": cpu_model(),  # kept for readers of results written before device_info
        "device_info": device_info(next(target_model.parameters()).device),
        "engine": "lean eager fp32",
    }
    write_atomic(out_dir / "results.json", json.dumps(result, indent=1))
    write_atomic(out_dir / "results.md", _markdown(result))
    return result


def _row(method: str, temperature: float, runs: dict[str, list[dict]], sources: list[list[int]]) -> dict[str, Any]:
    mine, plain = runs[method], runs["plain"]
    first = mine[0]
    speedups = [(m["tokens"] / m["seconds"]) / (p["tokens"] / p["seconds"]) for m, p in zip(mine, plain)]
    row = {
        "method": method,
        "temperature": temperature,
        "tokens": first["tokens"],
        "tau": first["tokens"] / first["forwards"],
        # output tokens completing a 4-gram seen earlier in source + output: what copying can draft
        "rep4": repeated_ngram_share(sources, first["outputs"]),
        "alpha": first["accepted"] / first["proposed"] if first["proposed"] else None,
        "tokens_per_s": statistics.median(m["tokens"] / m["seconds"] for m in mine),
        "draft_share": statistics.median(m["draft_seconds"] / m["seconds"] for m in mine),
        "speedup": statistics.median(speedups),
    }
    if temperature == 0:  # greedy: lossless means token-identical to plain decoding
        row["identical_to_plain"] = all(m["outputs"] == plain[0]["outputs"] for m in mine)
    return row


def _markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# Encoder-decoder speculative decoding: {result['sources']} held-out sources, batch {result['batch']}, "
        f"gamma {result['gamma']}, max_new_tokens {result['max_new_tokens']}",
        "",
        f"{device_line(result)}, {result['threads']} threads, {result['engine']}; speedup = median over "
        f"{result['repeats']} interleaved repeats of tokens/s vs plain in the same repeat.",
        "",
        "| T | method | tokens | rep4 | tau | alpha | tokens/s | speedup | drafting time | T=0 identical to plain |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        alpha = "-" if r["alpha"] is None else f"{r['alpha']:.2f}"
        same = {True: "yes", False: "NO"}.get(r.get("identical_to_plain"), "-")
        lines.append(
            f"| {r['temperature']:g} | {r['method']} | {r['tokens']} | {r['rep4']:.2f} | {r['tau']:.2f} | {alpha} | "
            f"{r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | {r['draft_share']:.0%} | {same} |"
        )
    return "\n".join(lines) + "\n"
