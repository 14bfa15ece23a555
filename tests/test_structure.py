"""The package layout's rules, read from the source (no imports run):

- layers, lowest first (LAYERS): a module imports only from its own layer and the layers below it, so
  verify/'s subpackages stack one way, medusa/ builds on verify/, prophet/ on both, and neither imports
  anything from experiments/; every module sits in a layer (a new flat verify/*.py or a new subpackage
  must be given its place);
- experiments/*.py are entry points (`python -m experiments.<name>`); nothing imports an entry point;
- the project's imports form no cycle, counting imports inside functions and under `if TYPE_CHECKING:`
  (an import inside a function is how a loop hides; one of an optional third-party package is fine);
- every package's __init__ says what it holds in a docstring and imports nothing.

The checkers take a root directory, so a planted violation in a scratch tree shows that each can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("experiments", "verify", "medusa", "prophet")
LAYERS = (  # lowest first; verify/__init__.py's docstring lists its subpackages in this order
    "verify.common",  # argument checks, non-finite guards, vocabulary subsets
    "verify.plan",  # budgets from measured costs
    "verify.training",  # FeatureBatch, self-distillation: what every family's loss reads
    "verify.backends",  # what runs a target: cache, lean engine, Target, HF adapter
    "verify.loop",  # the decode loop and its rules
    "verify.drafters",  # drafters without a family of their own
    "verify.encdec",  # encoder-decoder targets
    "medusa",
    "prophet",
    "experiments.lib",
    "experiments",  # the entry points
)
ROOTS = ("verify",)  # bare namespace packages: a docstring, no imports, no layer


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


def project_imports(root: Path) -> dict[str, set[str]]:
    """Each module's imports of the project's modules, anywhere in the file (functions and `if TYPE_CHECKING:`
    included); `from pkg import name` counts as importing pkg.name when that is a module, else pkg."""
    modules = project_modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    return {
        name: {m for m in map(resolve, imports(path, module_level=False)) if m and m != name}
        for name, path in modules.items()
    }


def layer_of(name: str) -> str | None:
    """The longest layer `name` falls in (verify.loop.plain -> verify.loop), None where it falls in none."""
    found = [layer for layer in LAYERS if name == layer or name.startswith(layer + ".")]
    return max(found, key=len) if found else None


def layer_violations(root: Path) -> list[str]:
    """'<module> (<layer>) imports <module> (<higher layer>)' for every import against the layers, and
    '<module>: in no layer' for a module outside them (except the bare roots)."""
    bad = []
    for name, imported in sorted(project_imports(root).items()):
        layer = layer_of(name)
        if layer is None:
            if name not in ROOTS:
                bad.append(f"{name}: in no layer")
            continue
        for other in sorted(imported):
            theirs = layer_of(other)
            if theirs is not None and LAYERS.index(theirs) > LAYERS.index(layer):
                bad.append(f"{name} ({layer}) imports {other} ({theirs})")
    return bad


def package_docs(root: Path) -> list[str]:
    """'<package>: ...' for every package __init__ without a docstring, or with an import."""
    bad = []
    for name, path in project_modules(root).items():
        if path.name != "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        if not ast.get_docstring(tree):
            bad.append(f"{name}: no docstring saying what it holds")
        if any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(tree)):
            bad.append(f"{name}: imports (a package's __init__ holds its docstring only)")
    return bad


def import_cycles(root: Path) -> list[list[str]]:
    """Cycles of imports among the project's modules, at any level (each cycle once, as a path)."""
    graph = {name: sorted(imported) for name, imported in project_imports(root).items()}
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


def test_imports_have_no_cycle_at_any_level() -> None:
    assert import_cycles(ROOT) == []


def test_imports_follow_the_layers() -> None:
    """verify/'s subpackages one way, then medusa/, prophet/, experiments/: medusa/ and prophet/ import
    nothing from experiments/, and every module has a place."""
    assert {layer_of(name) for name in project_modules(ROOT)} - {None} == set(LAYERS)
    assert layer_violations(ROOT) == []


def test_every_package_says_what_it_holds() -> None:
    assert package_docs(ROOT) == []
    doc = ast.get_docstring(ast.parse((ROOT / "verify" / "__init__.py").read_text()))
    subpackages = [layer.split(".")[1] for layer in LAYERS if layer.startswith("verify.")]
    listed = [line.split()[0] for line in doc.splitlines() if line.strip() and line.split()[0] in subpackages]
    assert listed == subpackages, "verify/__init__.py lists its subpackages lowest first, as LAYERS orders them"


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


def test_a_planted_cycle_is_found_even_when_an_import_hides_in_a_function(scratch: Path) -> None:
    lib = scratch / "experiments" / "lib"
    (lib / "data.py").write_text("from experiments.lib.prompts import load_prompts\n")
    (lib / "prompts.py").write_text("import json\n")
    assert import_cycles(scratch) == []
    (lib / "prompts.py").write_text("def f():\n    from experiments.lib import data\n")
    assert import_cycles(scratch) == [["experiments.lib.data", "experiments.lib.prompts", "experiments.lib.data"]]
    (lib / "prompts.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from experiments.lib.data import PreparedData\n"
    )
    assert import_cycles(scratch) == [["experiments.lib.data", "experiments.lib.prompts", "experiments.lib.data"]]


def _plant(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@pytest.fixture()
def layered(scratch: Path) -> Path:
    """A scratch tree that follows every layer rule."""
    _plant(
        scratch,
        {
            "verify/common/__init__.py": '"""Checks."""\n',
            "verify/common/numerics.py": "import torch\n",
            "verify/backends/__init__.py": '"""Engines."""\n',
            "verify/backends/engine.py": "from verify.common.numerics import check_int\n",
            "verify/loop/__init__.py": '"""The loop."""\n',
            "verify/loop/speculative.py": "from verify.backends import engine\nfrom verify.common import numerics\n",
            "medusa/__init__.py": '"""Medusa."""\n',
            "medusa/train.py": "from verify.loop.speculative import speculative_generate\n",
            "prophet/__init__.py": '"""The prophet."""\n',
            "prophet/drafter.py": "from medusa.train import loss\nfrom verify.backends.engine import lean\n",
        },
    )
    for name in ("experiments/__init__.py", "experiments/lib/__init__.py", "verify/__init__.py"):
        (scratch / name).write_text('"""A package."""\n')
    assert layer_violations(scratch) == [] and import_cycles(scratch) == [] and package_docs(scratch) == []
    return scratch


@pytest.mark.parametrize(
    "module, text, found",
    [
        (  # a backend reaching up into the loop, hidden in a function
            "verify/backends/engine.py",
            "def f():\n    from verify.loop.speculative import x\n",
            "verify.backends.engine (verify.backends) imports verify.loop.speculative (verify.loop)",
        ),
        (  # the bottom layer importing anything of the project
            "verify/common/numerics.py",
            "from verify.backends import engine\n",
            "verify.common.numerics (verify.common) imports verify.backends.engine (verify.backends)",
        ),
        (  # a drafter family importing the experiment harness
            "medusa/train.py",
            "from experiments.lib.features import FeatureBatch\n",
            "medusa.train (medusa) imports experiments.lib.features (experiments.lib)",
        ),
        (
            "prophet/drafter.py",
            "import experiments.lib.features\n",
            "prophet.drafter (prophet) imports experiments.lib.features (experiments.lib)",
        ),
        (  # medusa/ below prophet/: one way only
            "medusa/train.py",
            "from prophet.drafter import Prophet\n",
            "medusa.train (medusa) imports prophet.drafter (prophet)",
        ),
        (  # verify/ below every family
            "verify/loop/speculative.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from medusa.train import loss\n",
            "verify.loop.speculative (verify.loop) imports medusa.train (medusa)",
        ),
        ("verify/flat.py", "import torch\n", "verify.flat: in no layer"),  # verify/ holds subpackages only
        ("verify/sketches/idea.py", "import torch\n", "verify.sketches.idea: in no layer"),
    ],
)
def test_a_planted_layer_violation_is_found(layered: Path, module: str, text: str, found: str) -> None:
    _plant(layered, {module: text})
    (layered / "experiments" / "lib" / "features.py").write_text("import torch\n")
    assert found in layer_violations(layered)


def test_a_planted_undocumented_or_importing_package_is_found(layered: Path) -> None:
    _plant(layered, {"verify/plan/__init__.py": "", "verify/loop/__init__.py": '"""Loop."""\nfrom . import tree\n'})
    assert package_docs(layered) == [
        "verify.loop: imports (a package's __init__ holds its docstring only)",
        "verify.plan: no docstring saying what it holds",
    ]
