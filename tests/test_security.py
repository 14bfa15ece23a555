"""Nothing the project loads can execute code from a file: weights are safetensors, everything else JSON;
no pickle, no torch.load, no numpy pickles, no eval. A static scan of the project's own source."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("verify", "medusa", "prophet", "experiments")
FORBIDDEN = {
    r"\bimport pickle\b|\bfrom pickle\b|\bcPickle\b|\bdill\b|\bjoblib\.load\b": "pickle",
    r"\btorch\.load\(": "torch.load (unpickles unless weights_only=True; the project never needs it)",
    r"allow_pickle\s*=\s*True": "numpy pickles",
    r"(?<![.\w])eval\(|(?<![.\w])exec\(": "eval/exec",
    r"yaml\.load\((?!.*SafeLoader)|yaml\.unsafe_load": "unsafe YAML",
    r"trust_remote_code\s*=\s*True": "remote code from a model or dataset hub",
    r"\.bin[\"']": "pickled .bin weights",
}


def sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("pattern, what", FORBIDDEN.items(), ids=list(FORBIDDEN.values()))
def test_no_code_executing_loader_in_the_source(pattern: str, what: str) -> None:
    hits = []
    for path in sources():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]  # comments may name what is refused
            if re.search(pattern, code) and "refuse" not in line:
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not hits, f"{what} in the source:\n" + "\n".join(hits)


def test_the_scan_sees_the_source() -> None:
    assert len(sources()) > 50 and any(p.name == "checkpoint.py" for p in sources())
