"""NaN and inf guards for the decode loops: a number decoding uses that is NaN or inf stops it in one line.

A model whose weights or inputs hold NaN gives NaN logits, and argmax and the exponential race still
return *a* token: without a check, decoding emits garbage that looks like output, and a speculative
method "agrees" with plain decoding on it. So the loops check what they actually use: the target's
logits at the positions a token was chosen from, and a drafter's q where an acceptance rule divided by
it.

The check is the row maximum, one fused reduction per step: it is NaN if any entry is NaN, +inf if any
is +inf, and -inf only if every entry is -inf: exactly the rows that sampling and argmax cannot use
(a lone -inf logit is a mask, p = 0, and harmless). The speculative loop reads the result with the
host read that opens each of its steps, so it stops at the next step; plain decoding, which has no
per-step read without EOS, keeps one value per step and reads them once after its loop, so a plain call
decodes to its budget and then raises (verify/loop/speculative.py, verify/loop/plain.py).

Rows are independent, but within a row a NaN spreads: the lean engine attends over its whole static
cache buffer, a masked weight is 0 and 0 * NaN is NaN, so a NaN-making token written anywhere in a row's
cache (a rejected draft token's included) reaches every later logit of that row. On the same broken
model, speculative decoding can therefore stop at an earlier step than plain decoding.

The checks of settings' numbers live here too (is_finite_number, is_int, check_int, eos_ids), one of each:
verify is the package every other one imports, so medusa, prophet and experiments take them from here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

TARGET_LOGITS = "target logits"
DRAFT_Q = "drafter q"


class NonFiniteError(ValueError):
    """NaN or inf in numbers decoding used. A ValueError, so the command line prints it as one line."""


def is_finite_number(x: object) -> bool:
    """For settings: a finite int or float (not NaN, not inf, not a bool: True would pass as 1)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def is_int(value: Any) -> bool:
    """An int, not a bool (True would pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: Any, *, minimum: int = 1, allow_null: bool = False) -> int | None:
    """`value` if it is an integer >= minimum (or None, when allow_null), else
    `<name>=<value>: must be [null or ]an integer >= <minimum>`."""
    if allow_null and value is None:
        return None
    if not (is_int(value) and value >= minimum):
        raise ValueError(f"{name}={value!r}: must be {'null or ' if allow_null else ''}an integer >= {minimum}")
    return value


# What the decode loops take as `eos_id`: one id, several (a row ends at any of them: transformers takes
# eos_token_id as an int or a list, and Llama 3 ships several), or None (no EOS: rows run to their budget).
EosId = int | Sequence[int] | None


def eos_ids(eos_id: EosId, vocab_size: int, device: torch.device | str) -> Tensor | None:
    """The EOS ids as an (n,) long tensor on `device`, for torch.isin in the loops (no host read per step);
    None for no EOS. Checked once, before any work: each id an int (not a bool) in [0, vocab_size)."""
    if eos_id is None:
        return None
    ids = [eos_id] if is_int(eos_id) else eos_id
    fine = isinstance(ids, Sequence) and not isinstance(ids, (str, bytes)) and len(ids) > 0
    if not (fine and all(is_int(i) and 0 <= i < vocab_size for i in ids)):
        raise ValueError(
            f"eos_id={eos_id!r}: must be null, a token id or a non-empty list of token ids in [0, {vocab_size})"
        )
    return torch.tensor(list(ids), dtype=torch.long, device=device)


def usable(x: Tensor, used: Tensor) -> Tensor:
    """x (b, n, V) logits or probabilities, used (b, n) bool -> () True when no used position holds NaN or
    inf (no host sync: the caller reads it with a read it already makes)."""
    return (torch.isfinite(x.amax(dim=-1)) | ~used).all()


def nonfinite_error(what: str, step: int, row: int, peak: float) -> NonFiniteError:
    """The one-line error for `what` (TARGET_LOGITS or DRAFT_Q) at a decode step (0 = the prefill) and row,
    given the bad position's row maximum (NaN, or +-inf)."""
    kind = "NaN" if peak != peak else "inf"
    whose = "the model's" if what == TARGET_LOGITS else "the drafter's"
    return NonFiniteError(
        f"non-finite {what} at decode step {step} (0 = the prefill), row {row} ({kind}): "
        f"{whose} weights or inputs hold NaN/inf"
    )


def check_usable(what: str, step: int, x: Tensor, used: Tensor) -> None:
    """The slow path of `usable`: raise NonFiniteError naming the first bad row of x (b, n, V), else return."""
    peak = x.amax(dim=-1).float()  # (b, n)
    bad = ~torch.isfinite(peak) & used
    if bool(bad.any()):
        row, pos = (int(i) for i in bad.nonzero()[0])
        raise nonfinite_error(what, step, row, float(peak[row, pos]))
