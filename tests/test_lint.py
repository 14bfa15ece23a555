"""ruff's linter and formatter pass on the whole repository (configured in pyproject.toml [tool.ruff]);
`make lint` runs the same two commands, `make format` applies the fixes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize(
    "args", [("check", "--no-cache", "."), ("format", "--check", "--no-cache", ".")], ids=["check", "format"]
)
def test_ruff_passes(args: tuple[str, ...]) -> None:
    done = ruff(*args)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_ruff_finds_a_planted_fault(tmp_path: Path) -> None:
    """The same configuration rejects an unused import and a badly formatted line (the test can fail)."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nx = [1,2]\n")
    config = ("--config", str(ROOT / "pyproject.toml"))
    assert "F401" in ruff("check", "--no-cache", *config, str(bad)).stdout
    assert ruff("format", "--check", "--no-cache", *config, str(bad)).returncode == 1
