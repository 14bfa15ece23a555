"""Matrix products whose every row is computed as if it were alone: the rows are padded to a multiple of ROWS.

Why: a k-token verification must give each token the bits a one-token step gives it (a tree node those of its
path decoded alone), or a bf16 draft that plain decoding would keep could be rejected, and the output would not
be plain decoding's. A CPU BLAS chooses its kernel by the number of rows, and kernels add their products in
other orders. Measured on an AMD EPYC (AVX-512 with bf16, no AMX, PyTorch 2.13, 2 threads):
- a bf16 linear of 1,536 inputs (SmolLM2's down projection), plain or prepacked for oneDNN: one row differs in
  the last bit from the same row among two or more; with 576 inputs, none does;
- float32 products: a row of a 1- to 3-row product differs from the same row among 4 or more, and rows past a
  multiple of 4 (5, 9, ...) from those inside it;
- padded with zero rows to a multiple of 4, every row of 1..96-row products (inner sizes 16..2,048, outputs
  16..49,152, batches 1..40) equals, bf16 and float32.
On an Intel Xeon with AMX none of these differed unpadded; the padding costs the few-row products little (their
time is reading the weights).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ROWS", "bmm_rows", "padded_rows"]

ROWS = 4


def padded_rows(x: Tensor, dim: int = 0) -> Tensor:
    """x with zero rows appended along `dim` up to a multiple of ROWS (x itself when it is one)."""
    pad = -x.shape[dim] % ROWS
    if not pad:
        return x
    return F.pad(x, (0, 0) * (x.ndim - 1 - dim % x.ndim) + (0, pad))


def bmm_rows(a: Tensor, b: Tensor) -> Tensor:
    """a (B, R, k) @ b (B, k, d) -> (B, R, d), each row's result independent of R."""
    return torch.bmm(padded_rows(a, 1), b)[:, : a.shape[1]]
