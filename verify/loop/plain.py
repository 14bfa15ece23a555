"""Plain autoregressive decoding: the baseline every speedup is measured against and the reference
for every exactness test. One token per target forward, with the same cache and sampling transform
the speculative loop uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from verify.backends.target import Target
from verify.common.numerics import TARGET_LOGITS, EosId, eos_ids, nonfinite_error
from verify.loop.sampling import SamplingConfig, sample_token
from verify.loop.stats import DecodeStats


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per row, EOS included when it was emitted
    stats: DecodeStats


def check_max_new_tokens(max_new_tokens: int) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be an integer >= 1")


def rows_to_lists(out: Tensor, lengths: Tensor) -> list[list[int]]:
    """(b, T) token buffer and (b,) lengths -> one list of ids per row (a single host transfer)."""
    out, lengths = out.cpu().tolist(), lengths.cpu().tolist()
    return [row[:n] for row, n in zip(out, lengths)]


@torch.inference_mode()
def plain_generate(
    target: Target,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_id: EosId = None,
    generator: torch.Generator | None = None,
) -> Generation:
    """Decode each prompt token by token; a row stops at EOS (any of the ids, when eos_id is a list) or after
    max_new_tokens.

    Raises NonFiniteError (verify/common/numerics.py) when the logits a row sampled from held NaN or inf."""
    check_max_new_tokens(max_new_tokens)
    eos = eos_ids(eos_id, target.vocab_size, target.device)
    target.check_tokens(prompts, max_new_tokens=max_new_tokens)
    target.use_layers(())  # a target reused after speculative decoding: return no layer states, pay nothing for them
    b, device = len(prompts), target.device
    stats = DecodeStats.zeros(b, device)
    out = torch.zeros(b, max_new_tokens, dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    with stats.timed("total"):
        with stats.timed("target"):
            logits = target.prefill(prompts, last_logits=True).logits[:, -1]  # (b, V)
        # peaks[i, row]: the max of the logits step i sampled from, NaN or inf when they held NaN/inf
        # (verify/common/numerics.py). One reduction into a preallocated row per step, read once after the loop:
        # without EOS this loop makes no host read to share, and a GPU should not wait on one per token.
        peaks = logits.new_empty(max_new_tokens, b)
        for i in range(max_new_tokens):
            torch.amax(logits, dim=-1, out=peaks[i])
            nxt = sample_token(logits, sampling, generator)  # (b,)
            out[:, i] = nxt
            stats.tokens += ~done
            stats.forwards += ~done
            if eos is not None:
                done |= torch.isin(nxt, eos)
            if i == max_new_tokens - 1 or (eos is not None and bool(done.all())):
                break
            with stats.timed("target"):
                logits = target.extend(nxt[:, None]).logits[:, -1]
    check_peaks(peaks[: i + 1], stats.tokens)
    return Generation(tokens=rows_to_lists(out, stats.tokens), stats=stats)


def check_peaks(peaks: Tensor, tokens: Tensor) -> None:
    """peaks (steps, b) logit maxima per step and row, tokens (b,) tokens each row emitted: raise
    NonFiniteError for the first step (then row) that sampled from NaN or inf. Row r sampled at step i
    iff i < tokens[r] (a row stops after its EOS; later steps run it but discard what it samples)."""
    sampled = torch.arange(peaks.shape[0], device=peaks.device)[:, None] < tokens[None, :]  # (steps, b)
    bad = ~torch.isfinite(peaks) & sampled
    if bool(bad.any()):
        step, row = (int(i) for i in bad.nonzero()[0])
        raise nonfinite_error(TARGET_LOGITS, step, row, float(peaks[step, row]))
