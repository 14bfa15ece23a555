"""Continuous batching: many prompts through a fixed number of rows, a finished row refilled at once.

Plain decoding of a batch runs every row until its longest row ends, and a row that reaches its end-of-turn
token keeps computing. Generating thousands of answers (the drafters' training data) that way wastes most of the
work once lengths differ. Here a row that emits EOS or reaches its budget hands its answer back and takes the
next prompt: the prompt is prefilled into that row alone (`Target.fill_row`), the other rows decode on.

What a prompt gets does not depend on the batch: its prefill runs alone, every decoding product's rows are
computed as if alone (verify/backends/rows.py), the position-ordered attention reads only the row's own keys (the
C++ operator; the pure-torch form adds exact zeros for the others), and at T > 0 each prompt samples from its own
generator, seeded per prompt. So a prompt's answer is the answer `plain_generate` gives it in a batch of one with
that seed, bit for bit, whatever the batch size and whichever prompts share its step: tested
(tests/test_continuous.py, prompts of 64-1,024 tokens, more prompts than rows) on the lean Llama engine with
ordered attention, eager, on a CPU.

Only there: `check_serving` refuses, in one line, any other engine, attention, compiled step or device. The
x-transformers engine's attention is one product over the cached slots up to the longest row's, in no
position order, and its products' rows are not padded (verify/backends/rows.py says why that matters on a
CPU BLAS): a row's bits there may depend on how long the other rows are and how many share the step. A
compiled step and a GPU's kernels are not tested for it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from verify.backends.target import Target
from verify.common.numerics import TARGET_LOGITS, EosId, eos_ids, nonfinite_error
from verify.loop.plain import check_max_new_tokens
from verify.loop.sampling import SamplingConfig, sample_token


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingConfig = SamplingConfig()
    seed: int = 0  # the prompt's generator at T > 0
    remember: bool = False  # a prompt many requests share: prefilled once, copied into later rows (Target.fill_row)


@dataclass
class Answer:
    index: int  # which request, in the order they were taken
    tokens: list[int]  # its new tokens, EOS included when it was emitted
    steps: int  # forwards of the batch while this request held a row (what it shared)


def _per_prompt(value, n: int, name: str) -> list:
    """One value for all prompts, or a list of one per prompt."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts: give one per prompt, or one for all")
        return list(value)
    return [value] * n


def check_request(target: Target, request: Request, *, index: int, capacity: int | None = None) -> None:
    """One-line errors for a request the target cannot serve."""
    check_max_new_tokens(request.max_new_tokens)
    if not isinstance(request.sampling, SamplingConfig):
        raise ValueError(f"sampling={request.sampling!r}: must be a SamplingConfig (or a list of one per prompt)")
    if isinstance(request.seed, bool) or not isinstance(request.seed, int):
        raise ValueError(f"seed={request.seed!r}: each prompt's seed must be an integer")
    try:
        target.check_tokens([request.prompt], max_new_tokens=request.max_new_tokens)
    except ValueError as e:
        raise ValueError(str(e).replace("prompt 0", f"prompt {index}", 1)) from None
    if capacity is not None and len(request.prompt) + request.max_new_tokens > capacity:
        raise ValueError(
            f"prompt {index} has {len(request.prompt)} tokens + max_new_tokens={request.max_new_tokens}: "
            f"more than the rows' capacity={capacity}"
        )


def check_serving(target: Target, batch: int) -> None:
    """One-line errors for a target whose rows are not tested to be independent of the batch, and a bad batch."""
    tested = "the lean Llama engine with ordered attention, eager, on a CPU"
    if not hasattr(target, "fill_row"):
        raise ValueError(
            f"{type(target).__name__} cannot refill one row of its cache: continuous batching runs on {tested} "
            "(make_target of a transformers Llama)"
        )
    if not target.engine.decoder.orders_attention:
        raise ValueError(
            f"engine={type(target.engine.decoder).__name__} (an x-transformers LM): its rows' bits are not tested "
            f"to be independent of the batch; continuous batching runs on {tested}"
        )
    if not target.ordered:
        raise ValueError(f"ordered=False: continuous batching runs on {tested}; give ordered=True")
    if target.mode:
        raise ValueError(f"compile={target.mode!r}: continuous batching runs on {tested}; give compile=False")
    if target.device.type != "cpu":
        raise ValueError(
            f"device={target.device}: continuous batching runs on {tested}; its rows on a "
            f"{target.device.type} device are not tested to be independent of the batch"
        )
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r}: must be an integer >= 1 (rows decoded at once)")


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
    max_new_tokens, sampling and seeds: one for all prompts or one per prompt. Every prompt is checked first."""
    n = len(prompts)
    requests = [
        Request(list(p), m, c, s)
        for p, m, c, s in zip(
            prompts,
            _per_prompt(max_new_tokens, n, "max_new_tokens"),
            _per_prompt(sampling, n, "sampling"),
            _per_prompt(seeds, n, "seeds"),
        )
    ]
    check_serving(target, batch)
    if not requests:
        raise ValueError("prompts=[]: need at least one prompt")
    for i, r in enumerate(requests):
        check_request(target, r, index=i)
    capacity = max(len(r.prompt) + r.max_new_tokens for r in requests)
    queue = iter(requests)
    return serve(target, lambda: next(queue, None), batch=min(batch, n), capacity=capacity, eos_id=eos_id)


@torch.inference_mode()
def serve(
    target: Target, pull: Callable[[], Request | None], *, batch: int, capacity: int, eos_id: EosId = None
) -> Iterator[Answer]:
    """Serve requests as they come, `batch` rows of `capacity` slots (prompt + new tokens) each; yields each
    answer as it finishes. `pull()` gives the next request, or None when there is none now: it is asked again
    whenever a row is free, so a caller may queue a follow-up (a second turn) while it handles an answer. Serving
    ends when every row is idle and `pull()` has nothing. Raises NonFiniteError when a request's logits held NaN
    or inf (naming the request as the row and its token as the step)."""
    check_serving(target, batch)
    eos = eos_ids(eos_id, target.vocab_size, target.device)
    eos = set() if eos is None else set(eos.tolist())
    target.use_layers(())
    target.open_rows(batch, capacity)
    taken = 0  # requests handed to a row so far
    held: list[Request | None] = [None] * batch  # the request each row serves; None: idle (none left)
    index, out = [0] * batch, [[] for _ in range(batch)]
    started, lengths = [0] * batch, [0] * batch  # the step each row took its request at; its cached tokens
    generators: list[torch.Generator | None] = [None] * batch
    logits = torch.empty(batch, target.vocab_size, device=target.device)  # (rows, V) what each row samples next
    step = 0

    def fill(r: int) -> None:
        nonlocal taken
        request = pull()
        held[r], out[r], started[r], lengths[r] = request, [], step, 0
        if request is None:
            return
        check_request(target, request, index=taken, capacity=capacity)
        index[r], taken = taken, taken + 1
        logits[r] = target.fill_row(r, request.prompt, remember=request.remember)
        lengths[r] = len(request.prompt)
        greedy = request.sampling.greedy
        generators[r] = None if greedy else torch.Generator(device=target.device).manual_seed(request.seed)

    for r in range(batch):
        fill(r)
    while any(h is not None for h in held):
        target.cache.set_lengths(lengths)
        nxt = logits.argmax(dim=-1)  # (rows,) the greedy rows' tokens; a sampled row draws alone, from its generator
        for r, h in enumerate(held):
            if h is not None and not h.sampling.greedy:
                nxt[r] = sample_token(logits[r : r + 1], h.sampling, generators[r])[0]
        tokens, peaks = nxt.tolist(), logits.amax(dim=-1).tolist()  # the step's one host read
        finished = []
        for r, h in enumerate(held):
            if h is None:
                continue
            if not math.isfinite(peaks[r]):
                raise nonfinite_error(TARGET_LOGITS, len(out[r]), index[r], peaks[r])
            out[r].append(tokens[r])
            if tokens[r] in eos or len(out[r]) == h.max_new_tokens:
                finished.append(r)
                yield Answer(index=index[r], tokens=out[r], steps=step + 1 - started[r])
        if len(finished) == sum(h is not None for h in held):  # every row done: refill before another step
            for r in range(len(held)):
                fill(r)
            continue
        logits = target.extend(nxt[:, None]).logits[:, -1].float()
        step += 1
        lengths = [length + 1 if h is not None else 0 for length, h in zip(lengths, held)]  # idle rows hold nothing
        for r in [r for r, h in enumerate(held) if h is None or r in finished]:  # idle rows ask again too
            fill(r)
        active = [r for r, h in enumerate(held) if h is not None]
        if len(active) <= len(held) // 2:  # no request now: shed the idle rows (a copy of the cache, so rarely)
            target.cache.keep_rows(active)
            held, index, out, started, lengths, generators = (
                [xs[r] for r in active] for xs in (held, index, out, started, lengths, generators)
            )
            logits = logits[active]
