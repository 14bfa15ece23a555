"""The package layout's rules, read from the source (no imports run):

- experiments/*.py are entry points (`python -m experiments.<name>`); they import the library
  (experiments.lib) and the engine and drafter packages, never another entry point;
- nothing else imports an entry point (the library, verify/, medusa/, prophet/);
- module-level imports among the project's modules form no cycle (an import inside a function, e.g. of
  an optional dependency, is not module-level and is allowed).

The checkers take a root directory, so a planted violation in a scratch tree shows that they can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("experiments", "verify", "medusa", "prophet")


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(root: Path) -> dict[str, Path]:
    """Every module of the project's packages by dotted name (experiments/results holds no code of the package)."""
    return {
        module_name(root, p): p for pkg in PACKAGES for p in sorted((root / pkg).rglob("*.py")) if (root / pkg).is_dir()
    }


def entry_points(root: Path) -> set[str]:
    return {f"experiments.{p.stem}" for p in (root / "experiments").glob("*.py") if p.stem != "__init__"}


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(path: Path, *, module_level: bool) -> set[str]:
    """Dotted names imported by the file (`from a.b import c` gives a.b and a.b.c); with module_level, only
    statements that run on import (not inside functions or an `if TYPE_CHECKING:` block)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                if not module_level:
                    visit(node.body)
            elif isinstance(node, ast.If) and module_level and _type_checking(node):
                visit(node.orelse)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    visit([n for n in getattr(node, field, []) if isinstance(n, ast.stmt)])

    visit(tree.body)
    return found


def entry_point_imports(root: Path) -> list[str]:
    """'<importer> imports <entry point>' for every import of an entry point, anywhere in a file."""
    entries = entry_points(root)
    bad = []
    for name, path in project_modules(root).items():
        for imported in sorted(imports(path, module_level=False) & entries):
            if imported != name:
                bad.append(f"{name} imports {imported}")
    return bad


def import_cycles(root: Path) -> list[list[str]]:
    """Cycles of module-level imports among the project's modules (each cycle once, as a path)."""
    modules = project_modules(root)
    graph = {
        name: sorted(m for m in imports(path, module_level=True) if m in modules and m != name)
        for name, path in modules.items()
    }
    cycles, state = [], {}  # state: 1 on the current path, 2 done

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                walk(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name, [name])
    return cycles


# ------------------------------------------------------------------------------------------------- the repo


def test_no_entry_point_is_imported_by_another_module() -> None:
    assert entry_points(ROOT) >= {"experiments.benchmark", "experiments.train_base", "experiments.generate"}
    assert entry_point_imports(ROOT) == []


def test_module_level_imports_have_no_cycle() -> None:
    assert import_cycles(ROOT) == []


def test_every_entry_point_runs_as_a_module() -> None:
    """An entry point is runnable (`python -m experiments.<name>`) and the library holds none."""
    for path in (ROOT / "experiments").glob("*.py"):
        if path.stem != "__init__":
            assert 'if __name__ == "__main__":' in path.read_text(), path
    for path in (ROOT / "experiments" / "lib").glob("*.py"):
        assert not hydra_mains(path), f"{path} is library code but holds an entry point"


def hydra_mains(path: Path) -> list[str]:
    """Functions of the file decorated with @hydra.main(...)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef):
            for deco in node.decorator_list:
                call = deco.func if isinstance(deco, ast.Call) else deco
                if isinstance(call, ast.Attribute) and call.attr == "main" and getattr(call.value, "id", "") == "hydra":
                    found.append(node.name)
    return found


def test_committed_results_live_outside_the_packages() -> None:
    assert (ROOT / "results" / "reference").is_dir()
    assert not (ROOT / "experiments" / "results").exists()


def test_hydra_mains_finds_a_decorated_main(tmp_path: Path) -> None:
    (tmp_path / "entry.py").write_text('import hydra\n@hydra.main(config_name="x")\ndef main(cfg):\n    pass\n')
    (tmp_path / "doc.py").write_text('"""Put it inside @hydra.main(...)."""\n')
    assert hydra_mains(tmp_path / "entry.py") == ["main"] and hydra_mains(tmp_path / "doc.py") == []


# ------------------------------------------------------------------------------ the checkers can fail


@pytest.fixture()
def scratch(tmp_path: Path) -> Path:
    (tmp_path / "experiments" / "lib").mkdir(parents=True)
    for name in ("experiments/__init__.py", "experiments/lib/__init__.py", "verify/__init__.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / "experiments" / "lib" / "methods.py").write_text("import json\n")
    (tmp_path / "experiments" / "benchmark.py").write_text("from experiments.lib.methods import x\n")
    return tmp_path


def test_a_planted_entry_point_import_is_found(scratch: Path) -> None:
    assert entry_point_imports(scratch) == []
    (scratch / "experiments" / "generate.py").write_text("from experiments.benchmark import METHODS\n")
    (scratch / "experiments" / "lib" / "report.py").write_text("def f():\n    from experiments import benchmark\n")
    assert entry_point_imports(scratch) == [
        "experiments.generate imports experiments.benchmark",
        "experiments.lib.report imports experiments.benchmark",
    ]


def test_a_planted_cycle_is_found_and_lazy_or_typing_imports_are_not(scratch: Path) -> None:
    lib = scratch / "experiments" / "lib"
    (lib / "data.py").write_text("from experiments.lib.prompts import load_prompts\n")
    (lib / "prompts.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from experiments.lib.data import PreparedData\n"
        "def f():\n    from experiments.lib import data\n"
    )
    assert import_cycles(scratch) == []
    (lib / "prompts.py").write_text("from experiments.lib.data import PreparedData\n")
    assert import_cycles(scratch) == [["experiments.lib.data", "experiments.lib.prompts", "experiments.lib.data"]]
