"""A feature cache's large fields read through memory maps of its shards, a batch's rows at a time.

A drafter reads 8-16 windows per step, but a cache of a million answer tokens holds 9 GB of hidden and layer states
(two million: 18 GB), and two trainings side by side each loading it would not fit in 24 GB. Mapped, the states stay
in the files: the operating system pages in the rows a batch asks for, keeps what fits in its page cache and shares
those pages between every process reading the same cache, and opening the cache takes no time at all.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and
byte range after the header, then the tensors' bytes: a tensor is a numpy memmap of its range, viewed as torch.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

# safetensors dtype -> (numpy type of the same width, torch dtype): numpy has no bfloat16, so its bits are read as
# uint16 and viewed as bfloat16
DTYPES = {
    "BF16": (np.uint16, torch.bfloat16),
    "F16": (np.float16, torch.float16),
    "F32": (np.float32, torch.float32),
    "I32": (np.int32, torch.int32),
    "U8": (np.uint8, torch.uint8),
}


def mapped_tensors(path: str | Path, names: set[str]) -> dict[str, Tensor]:
    """The tensors `names` of the safetensors file `path` (those it holds), each over a memory map of its bytes."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    out = {}
    for name in names & header.keys():
        info = header[name]
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{path}: tensor {name} is {info['dtype']}, which cannot be mapped ({', '.join(DTYPES)})")
        start, _ = info["data_offsets"]
        np_type, torch_type = DTYPES[info["dtype"]]
        # copy-on-write: a writable array (torch refuses read-only ones), whose pages stay the shared file pages
        # as long as nothing writes to them, and nothing does
        array = np.memmap(path, dtype=np_type, mode="c", offset=8 + size + start, shape=tuple(info["shape"]))
        out[name] = torch.from_numpy(array).view(torch_type)
    return out


class MappedRows:
    """One field of a cache's windows over the shards' maps: `rows[index]` gathers windows, like a tensor's rows.
    keep: the indices along dim 2 to return (the asked layers of a cache that holds more), None for all."""

    def __init__(self, keep: list[int] | None = None) -> None:
        self.parts: list[Tensor] = []
        self.starts: list[int] = []  # first window of each part
        self.rows = 0
        self.keep = keep

    def append(self, part: Tensor) -> None:
        self.parts.append(part)
        self.starts.append(self.rows)
        self.rows += part.shape[0]

    @property
    def shape(self) -> tuple[int, ...]:
        rest = list(self.parts[0].shape[1:])
        if self.keep is not None:
            rest[1] = len(self.keep)
        return (self.rows, *rest)

    def __getitem__(self, index: Tensor) -> Tensor:
        """index: (B,) window indices -> (B, ...) in memory."""
        picked = []
        for row in index.tolist():
            if not -self.rows <= row < self.rows:
                raise IndexError(f"window {row} asked of a cache of {self.rows}")
            row %= self.rows
            part = bisect.bisect_right(self.starts, row) - 1
            picked.append(self.parts[part][row - self.starts[part]])
        out = torch.stack(picked)
        return out if self.keep is None else out[:, :, self.keep]
