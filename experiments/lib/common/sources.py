"""A hash of the project's own source files: what a cached result was computed by.

Two caches need it. A trained artifact (artifacts/<kind>-<hash>) is named by its recipe, and a recipe alone
does not see a changed loss or a changed drafter layer: an artifact trained by older code was reused silently
(seen with the base-initialised draft model). A verify-cost table is measured on one engine and must be measured
again on another. Both hash the bytes of every .py file under the directories that decide their result, by
path, so a renamed or deleted file changes the hash too, and a comment edit retrains (cheap to explain, never
stale).
"""

from __future__ import annotations

import functools
from hashlib import sha256
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # experiments/lib/common/ -> the project root

# What decides a trained artifact's weights: the drafters' modules and losses, the training loop, the data
# (questions, the base's answers, the feature cache), checkpoints. Not the decode engine (verify/backends): the
# answers it generates are plain decoding's bit for bit, whatever engine change the tests let through.
TRAINING_SOURCES = (
    "prophet",
    "medusa",
    "verify/training",
    "verify/drafters",
    "experiments/lib/families",
    "experiments/lib/training",
    "experiments/lib/data",
    "experiments/lib/store",
)


@functools.cache
def source_version(directories: tuple[str, ...], root: Path = ROOT) -> str:
    """16 hex digits over the relative path and bytes of every .py file under the given directories of root."""
    digest = sha256()
    for directory in directories:
        for path in sorted((root / directory).rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def training_version() -> str:
    """The hash of TRAINING_SOURCES: part of every artifact's recipe key."""
    return source_version(TRAINING_SOURCES)
