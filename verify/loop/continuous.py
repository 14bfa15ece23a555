"""Continuous batching: many prompts through a fixed number of rows, a finished row refilled at once.

Plain decoding of a batch runs every row until its longest row ends, and a row that reaches its end-of-turn
token keeps computing. Generating thousands of answers (the drafters' training data) that way wastes most of the
work once lengths differ. Here a row that emits EOS or reaches its budget hands its answer back and takes the
next prompt: the prompt is prefilled into that row alone (`Target.fill_row`), the other rows decode on.

What a prompt gets does not depend on the batch: its prefill runs alone, every decoding product's rows are
computed as if alone (verify/backends/rows.py), the position-ordered attention adds only its own keys (zeros
elsewhere change no sum), and at T > 0 each prompt samples from its own generator, seeded per prompt. So a
prompt's answer is the answer `plain_generate` gives it in a batch of one with that seed, bit for bit, whatever
the batch size and whichever prompts share its step (tested; on the lean engine's ordered attention).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from verify.backends.target import Target
from verify.common.numerics import TARGET_LOGITS, EosId, eos_ids, nonfinite_error
from verify.loop.plain import check_max_new_tokens
from verify.loop.sampling import SamplingConfig, sample_token


@dataclass
class Answer:
    index: int  # which prompt
    tokens: list[int]  # its new tokens, EOS included when it was emitted
    steps: int  # forwards of the batch while this prompt held a row (what it shared)


def _per_prompt(value, n: int, name: str) -> list:
    """One value for all prompts, or a list of one per prompt."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts: give one per prompt, or one for all")
        return list(value)
    return [value] * n


def check_continuous(
    target: Target, prompts: Sequence[list[int]], *, batch: int, budgets: list[int], samplings: list, seeds: list
) -> None:
    """One-line errors before any work starts."""
    if not hasattr(target, "fill_row"):
        raise ValueError(
            f"{type(target).__name__} cannot refill one row of its cache: continuous batching runs on the lean "
            "engine (engine=lean: x-transformers LMs and transformers' Llama)"
        )
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r}: must be an integer >= 1 (rows decoded at once)")
    for n in budgets:
        check_max_new_tokens(n)
    for cfg in samplings:
        if not isinstance(cfg, SamplingConfig):
            raise ValueError(f"sampling={cfg!r}: must be a SamplingConfig (or a list of one per prompt)")
    for seed in seeds:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed={seed!r}: each prompt's seed must be an integer")
    target.check_tokens(list(prompts), max_new_tokens=max(budgets))


@torch.inference_mode()
def continuous_generate(
    target: Target,
    prompts: Sequence[list[int]],
    *,
    max_new_tokens: int | Sequence[int],
    batch: int = 64,
    sampling: SamplingConfig | Sequence[SamplingConfig] = SamplingConfig(),
    seeds: int | Sequence[int] = 0,
    eos_id: EosId = None,
) -> Iterator[Answer]:
    """Answer every prompt, `batch` rows at a time; yields each answer as it finishes (not in prompt order).

    max_new_tokens, sampling and seeds: one for all prompts or one per prompt; prompt i at T > 0 samples from a
    generator seeded with seeds[i]. Raises NonFiniteError when a prompt's logits held NaN or inf (naming the
    prompt as the row and its token as the step)."""
    n = len(prompts)
    budgets = _per_prompt(max_new_tokens, n, "max_new_tokens")
    samplings = _per_prompt(sampling, n, "sampling")
    seeds = _per_prompt(seeds, n, "seeds")
    check_continuous(target, prompts, batch=batch, budgets=budgets, samplings=samplings, seeds=seeds)
    eos = eos_ids(eos_id, target.vocab_size, target.device)
    eos = set() if eos is None else set(eos.tolist())
    target.use_layers(())
    rows = min(batch, n)
    target.open_rows(rows, max(len(p) + b for p, b in zip(prompts, budgets)))
    taken = 0  # prompts handed to a row so far
    held: list[int | None] = [None] * rows  # the prompt each row holds; None: idle (every prompt taken)
    out: list[list[int]] = [[] for _ in range(rows)]
    started, lengths = [0] * rows, [0] * rows  # the step each row took its prompt at; its cached tokens
    generators: list[torch.Generator | None] = [None] * rows
    logits = torch.empty(rows, target.vocab_size, device=target.device)  # (rows, V) what each row samples next
    step = 0

    def fill(r: int) -> None:
        nonlocal taken
        i = taken if taken < n else None
        held[r], out[r], started[r], lengths[r] = i, [], step, 0
        if i is None:
            return
        taken += 1
        logits[r] = target.fill_row(r, list(prompts[i]))
        lengths[r] = len(prompts[i])
        generators[r] = None if samplings[i].greedy else torch.Generator(device=target.device).manual_seed(seeds[i])

    for r in range(rows):
        fill(r)
    while True:
        target.cache.set_lengths(lengths)
        nxt = logits.argmax(dim=-1)  # (rows,) the greedy rows' tokens; a sampled row draws alone, from its generator
        for r, i in enumerate(held):
            if i is not None and not samplings[i].greedy:
                nxt[r] = sample_token(logits[r : r + 1], samplings[i], generators[r])[0]
        tokens, peaks = nxt.tolist(), logits.amax(dim=-1).tolist()  # the step's one host read
        finished = []
        for r, i in enumerate(held):
            if i is None:
                continue
            if not math.isfinite(peaks[r]):
                raise nonfinite_error(TARGET_LOGITS, len(out[r]), i, peaks[r])
            out[r].append(tokens[r])
            if tokens[r] in eos or len(out[r]) == budgets[i]:
                finished.append(r)
                yield Answer(index=i, tokens=out[r], steps=step + 1 - started[r])
        busy = [r for r, i in enumerate(held) if i is not None and r not in finished]
        if not busy and taken == n:
            return
        logits = target.extend(nxt[:, None]).logits[:, -1].float()
        step += 1
        lengths = [length + 1 if i is not None else 0 for length, i in zip(lengths, held)]  # idle rows hold nothing
        for r in finished:
            fill(r)
        active = [r for r, i in enumerate(held) if i is not None]
        if len(active) <= len(held) // 2:  # every prompt taken: shed the idle rows (a copy of the cache, so rarely)
            target.cache.keep_rows(active)
            held, out, started = [held[r] for r in active], [out[r] for r in active], [started[r] for r in active]
            lengths, generators, logits = [lengths[r] for r in active], [generators[r] for r in active], logits[active]
