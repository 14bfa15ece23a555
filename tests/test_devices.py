"""Every torch tensor factory in verify/, medusa/ and prophet/ names its device, read from the source (no imports).

A factory without `device=` builds on the CPU (or on torch's default device); on a GPU that tensor then meets CUDA
tensors and the decode crashes, or it is copied over on every call. What counts:

- checked: a call `torch.<name>(...)` for a name in FACTORIES. It passes only with an explicit `device=` keyword
  (not `device=None`). `torch.arange(n).to(device)` does not pass: it builds on the CPU and copies, a transfer
  per call. A `**kwargs` splat does not pass either: the device it may carry cannot be seen here.
- not checked: the `*_like` factories (zeros_like, full_like, ...) and a tensor's own methods (`t.new_zeros`,
  `t.new_full`, ...): both take the device of the tensor they start from. `torch.Generator(...)` is not a
  tensor; where generators live is a separate concern.
- a tensor meant for the host writes `device="cpu"` at its site, so the choice is visible where it is made.
- a factory imported by name (`from torch import zeros`) is reported too: its calls would not be seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("verify", "medusa", "prophet")
FACTORIES = frozenset(
    {
        "zeros",
        "ones",
        "empty",
        "full",
        "arange",
        "range",
        "tensor",
        "as_tensor",
        "scalar_tensor",
        "rand",
        "randn",
        "randint",
        "randperm",
        "eye",
        "linspace",
        "logspace",
        "empty_strided",
        "tril_indices",
        "triu_indices",
    }
)


def names_device(call: ast.Call) -> bool:
    """True if the call passes `device=` explicitly and not as None."""
    return any(
        k.arg == "device" and not (isinstance(k.value, ast.Constant) and k.value.value is None) for k in call.keywords
    )


def violations(source: str, path: str) -> list[str]:
    """`path:line: ...` for each factory call without device= (and each factory imported by name)."""
    found: list[tuple[int, str]] = []  # (line, what): ast.walk is not in line order
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "torch":
            found += [(node.lineno, f"from torch import {a.name}") for a in node.names if a.name in FACTORIES]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
            and node.func.attr in FACTORIES
            and not names_device(node)
        ):
            found.append((node.lineno, f"torch.{node.func.attr}(...) without device="))
    return [f"{path}:{line}: {what}" for line, what in sorted(found)]


def package_files() -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]


def test_every_factory_names_its_device() -> None:
    files = package_files()
    assert len(files) > 40, f"found only {len(files)} files under {PACKAGES}: is ROOT right?"
    found = [v for p in files for v in violations(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, "tensor factories that build on the default device:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source, name",
    [
        ("m = torch.zeros(3, dtype=torch.bool)", "zeros"),  # the bug that crashed the prophet on a GPU
        ("i = torch.arange(n).to(x.device)", "arange"),  # built on the CPU, copied every call
        ("t = torch.tensor(v, **kw)", "tensor"),  # a splat may or may not carry the device
        ("e = torch.eye(4, device=None)", "eye"),  # None is the default device
    ],
)
def test_checker_reports_a_factory_without_device(source: str, name: str) -> None:
    assert violations(source, "planted.py") == [f"planted.py:1: torch.{name}(...) without device="]


def test_checker_reports_a_factory_imported_by_name() -> None:
    assert violations("from torch import Tensor, zeros", "planted.py") == ["planted.py:1: from torch import zeros"]


@pytest.mark.parametrize(
    "source",
    [
        "m = torch.zeros(3, device=x.device)",
        "m = torch.zeros_like(x)",
        "m = x.new_zeros(3)",
        "m = torch.full_like(x, 1.0, dtype=torch.bool)",
        "g = torch.Generator()",
    ],
)
def test_checker_passes_a_device_or_a_tensor_to_copy_it_from(source: str) -> None:
    assert violations(source, "planted.py") == []
