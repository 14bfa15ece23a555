"""bf16 weights prepacked for oneDNN, for eager decoding on a CPU that computes bf16 natively.

A decode step multiplies a few rows (1 token, or a draft of k) by every weight matrix. In bf16 on a CPU,
`F.linear` hands that to a GEMM that re-lays the whole weight out into the kernel's blocked format at every
call, which at a few rows costs more than the arithmetic: measured here (Intel Xeon with AMX, 2 threads) a
bf16 576 x 3072 linear took about 2x the fp32 one at 1 row, while oneDNN with the weight packed once for
its AMX kernel (`torch.ops.mkldnn._reorder_linear_weight`, then `_linear_pointwise`, what Inductor's
freezing emits) took about 0.6x of fp32. Packing is done once, when the engine is built, and only in eager
mode: a compiled step gets the same from Inductor's freezing.

A packed weight is opaque (oneDNN's layout): `Packed` keeps it with the number of output features, and
`linear` applies either a packed or a plain weight, so an engine's forward is written once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from verify.backends.rows import padded_rows

__all__ = ["Packed", "can_pack", "linear", "pack"]


def can_pack(weight: Tensor) -> bool:
    """A 2-D bf16 CPU weight where this torch has oneDNN's prepacked linear and the CPU computes bf16 natively."""
    return (
        isinstance(weight, Tensor)
        and weight.ndim == 2
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class Packed:
    """A weight (out, in) in oneDNN's blocked layout; `rows` is the batch size its layout is chosen for."""

    __slots__ = ("weight", "out_features", "in_features")

    def __init__(self, weight: Tensor, rows: int = 1):
        self.out_features, self.in_features = weight.shape
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), rows)


def pack(weight: Tensor | None) -> Tensor | Packed | None:
    """`weight` packed where `can_pack` says it pays, else unchanged (biases, gains, fp32 weights, a GPU's)."""
    return Packed(weight) if weight is not None and can_pack(weight) else weight


def linear(x: Tensor, weight: Tensor | Packed, bias: Tensor | None = None) -> Tensor:
    """F.linear(x (..., in), weight, bias) for a plain or a packed weight -> (..., out); each row's result does
    not depend on how many rows share the call (the rows are padded: verify/backends/rows.py)."""
    flat = x.reshape(-1, x.shape[-1])
    rows = padded_rows(flat)
    if isinstance(weight, Packed):
        out = torch.ops.mkldnn._linear_pointwise(rows, weight.weight, bias, "none", [], "")
    else:
        out = F.linear(rows, weight, bias)
    return out[: flat.shape[0]].reshape(*x.shape[:-1], out.shape[-1])
