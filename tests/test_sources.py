"""The source hash that names cached artifacts and cost tables: it moves with the code that decides them, and a
trained artifact's key moves with it (an artifact trained by older code is never reused)."""

from __future__ import annotations

from pathlib import Path

from experiments.lib.common import sources
from experiments.lib.common.sources import ROOT, TRAINING_SOURCES, source_version
from experiments.lib.methods.calibrate import engine_version
from experiments.lib.training import artifacts


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def _version(root: Path) -> str:
    source_version.cache_clear()  # the real function caches per (directories, root); these roots change in place
    return source_version(("pkg",), root)


def test_hash_moves_with_every_python_byte_and_name(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"pkg/a.py": "x = 1\n", "pkg/sub/b.py": "y = 2\n", "pkg/notes.txt": "n"})
    first = _version(root)
    assert _version(root) == first  # deterministic
    (root / "pkg/notes.txt").write_text("other")  # not source: same hash
    assert _version(root) == first
    (root / "pkg/sub/b.py").write_text("y = 3\n")  # a nested file's bytes
    changed = _version(root)
    assert changed != first
    (root / "pkg/sub/b.py").rename(root / "pkg/sub/c.py")  # same bytes, another name
    assert _version(root) not in (first, changed)
    (root / "pkg/sub/c.py").write_text("y = 2\n")
    (root / "pkg/sub/c.py").rename(root / "pkg/sub/b.py")  # back as it was
    assert _version(root) == first
    (root / "pkg/new.py").write_text("")  # an added (even empty) module
    assert _version(root) != first


def test_training_sources_exist_and_hold_the_families() -> None:
    """A renamed package would silently leave the hash: every listed directory exists and holds Python files, and
    the family code that shapes weights (losses, modules, the loop, the data) lies under one of them."""
    for directory in TRAINING_SOURCES:
        assert any((ROOT / directory).rglob("*.py")), directory
    shaping = [
        "prophet/train.py",
        "medusa/train.py",
        "experiments/lib/training/loop.py",
        "experiments/lib/training/answers.py",
        "experiments/lib/families/draft.py",
        "verify/training/distill.py",
    ]
    for path in shaping:
        assert (ROOT / path).exists() and any(path.startswith(d + "/") for d in TRAINING_SOURCES), path


def test_engine_version_hashes_the_backends(tmp_path: Path) -> None:
    assert engine_version() == source_version(("verify/backends",))
    assert engine_version() != sources.training_version()


def test_artifact_key_changes_with_the_training_code(monkeypatch) -> None:
    """The same recipe under other training code names another artifact directory; under the same code, the same."""
    cfg = artifacts.compose_recipe("medusa", ["base_checkpoint=/nonexistent", "logger=none"])
    monkeypatch.setattr(artifacts, "training_version", lambda: "a" * 16)
    key = artifacts.recipe_key(cfg)
    assert artifacts.recipe_key(cfg) == key
    monkeypatch.setattr(artifacts, "training_version", lambda: "b" * 16)
    assert artifacts.recipe_key(cfg) != key
