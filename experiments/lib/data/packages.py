"""The Python source of installed packages as a corpus, split by package.

The project's own virtual environment holds about 270 MB of Python source (torch, transformers, sympy,
pandas, scipy, numpy, ...: ~120 top-level packages and modules, 15,700 distinct .py files), about 25x the
standard library, on every machine that ran `make setup`, with no download. `data=packages` trains on
it; `data.paths=[dir]` points the same source at any other directory tree whose top-level entries are
packages.

Three choices make it a corpus rather than a file dump:
- Deduplicated by content: vendored copies (pip/_vendor, setuptools/_vendor, ...) and the many
  identical `__init__.py` files appear once, under the first path in sorted order.
- Split by package: validation holds whole packages the model never trained on, so the validation loss
  and the held-out prompts measure code from libraries it has not seen, not other files of torch.
  Packages are taken in the order of the SHA-1 of their names, skipping any that would take validation
  past val_fraction of the corpus's bytes, so validation holds close to (never more than) that share and
  one huge package (torch is 17% of the bytes) cannot land there by chance.
- A byte cap (`max_bytes`) keeps a fixed, spread-out subset: files are taken in the order of the SHA-1 of
  their paths until the cap, so every package keeps about the same share.

The listing reads every file once to hash it; the corpus itself is then read one file at a time, like
every file corpus (experiments/lib/data/sources.py).
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import sysconfig
from collections import defaultdict
from pathlib import Path

# Default file filter: Python source only (the .pyi stubs, data files and compiled extensions stay out).
INCLUDE = ("*.py",)
PACKAGE_SPLIT_RULE = (
    "validation = whole top-level packages, taken in sha1(package name) order while validation stays "
    "within val_fraction of the corpus bytes"
)


def site_packages() -> Path:
    """The running interpreter's site-packages: the project's virtual environment under `make`."""
    return Path(sysconfig.get_paths()["purelib"])


def package_of(doc_id: str) -> str:
    """The top-level package a document belongs to: 'torch/nn/linear.py' -> 'torch', 'six.py' -> 'six'."""
    top = doc_id.split("/", 1)[0]
    return top[: -len(".py")] if "/" not in doc_id and top.endswith(".py") else top


def _sha1(text: str) -> int:
    return int(hashlib.sha1(text.encode("utf-8")).hexdigest(), 16)


def _matching_files(root: Path, include: tuple[str, ...]) -> list[tuple[str, str]]:
    """(doc id, path) of the files under root whose names match an include pattern, sorted by doc id.
    Hidden directories and __pycache__ are never entered."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        for name in filenames:
            if any(fnmatch.fnmatch(name, pattern) for pattern in include):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), str(path)))
    return sorted(found)


def package_files(
    root: Path, *, include: tuple[str, ...] = INCLUDE, max_bytes: int | None = None
) -> list[tuple[str, str]]:
    """(doc id, path) of the corpus: matching files, deduplicated by content, capped at max_bytes.

    Doc ids are paths relative to root (posix). The first file in sorted order keeps a content that
    appears again; an empty file is left out (it would only add a lone EOS)."""
    if not root.is_dir():
        raise ValueError(f"packages root {str(root)!r} is not a directory")
    seen: set[bytes] = set()
    kept: list[tuple[str, str, int]] = []
    for doc_id, path in _matching_files(root, include):
        data = Path(path).read_bytes()
        digest = hashlib.sha1(data).digest()
        if data and digest not in seen:
            seen.add(digest)
            kept.append((doc_id, path, len(data)))
    if not kept:
        raise ValueError(f"no non-empty file under {str(root)!r} matches include={list(include)}")
    if max_bytes is not None:
        kept = _cap(kept, max_bytes)
    return [(doc_id, path) for doc_id, path, _ in kept]


def _cap(files: list[tuple[str, str, int]], max_bytes: int) -> list[tuple[str, str, int]]:
    """The files taken in sha1(doc id) order until max_bytes (at least one), back in sorted order."""
    taken, total = [], 0
    for entry in sorted(files, key=lambda f: _sha1(f[0])):
        if taken and total + entry[2] > max_bytes:
            continue  # a smaller file further on may still fit
        taken.append(entry)
        total += entry[2]
    return sorted(taken)


def split_by_package(doc_ids: list[str], sizes: list[int], val_fraction: float) -> tuple[list[int], list[int]]:
    """(train indices, validation indices) into doc_ids: whole packages on each side (PACKAGE_SPLIT_RULE).

    When no package fits within val_fraction, the smallest one is validation: both sides are never empty."""
    bytes_of: dict[str, int] = defaultdict(int)
    for doc_id, size in zip(doc_ids, sizes, strict=True):
        bytes_of[package_of(doc_id)] += size
    if len(bytes_of) < 2:
        raise ValueError(
            f"the corpus holds {len(bytes_of)} top-level package(s) ({', '.join(bytes_of)}); "
            "a split by package needs at least 2"
        )
    budget = val_fraction * sum(sizes)
    held, taken = set(), 0
    for package in sorted(bytes_of, key=_sha1):
        if taken + bytes_of[package] <= budget:
            held.add(package)
            taken += bytes_of[package]
    if not held:
        held.add(min(bytes_of, key=lambda p: (bytes_of[p], p)))
    val = [i for i, d in enumerate(doc_ids) if package_of(d) in held]
    train = [i for i, d in enumerate(doc_ids) if package_of(d) not in held]
    return train, val
