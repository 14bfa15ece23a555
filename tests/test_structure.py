"""The package layout's rules, read from the source (no imports run):

- layers, lowest first (LAYERS): a module imports only from its own layer and the layers below it, so
  verify/'s subpackages stack one way, medusa/ builds on verify/, prophet/ on both, neither imports
  anything from experiments/, and experiments/lib/'s subpackages stack one way on all three; every module
  sits in a layer (a new flat verify/*.py or experiments/lib/*.py, or a new subpackage, must be given its
  place);
- experiments/*.py are entry points (`python -m experiments.<name>`); nothing imports an entry point;
- the project's imports form no cycle, counting imports inside functions and under `if TYPE_CHECKING:`
  (an import inside a function is how a loop hides; one of an optional third-party package is fine);
- every package's __init__ says what it holds in a docstring and imports nothing; verify/__init__.py and
  experiments/lib/__init__.py list their subpackages in the order of LAYERS.

The checkers take a root directory, so a planted violation in a scratch tree shows that each can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("experiments", "verify", "medusa", "prophet")
LAYERS = (  # lowest first; verify/__init__.py and experiments/lib/__init__.py list their subpackages in this order
    "verify.common",  # argument checks, non-finite guards, vocabulary subsets
    "verify.plan",  # budgets from measured costs
    "verify.training",  # FeatureBatch, self-distillation: what every family's loss reads
    "verify.backends",  # what runs a target: cache, lean engine, Target, HF adapter
    "verify.loop",  # the decode loop and its rules
    "verify.drafters",  # drafters without a family of their own
    "verify.encdec",  # encoder-decoder targets
    "medusa",
    "prophet",
    "experiments.lib.common",  # one-line errors and exit statuses, sweep failures, atomic writes, the machine
    "experiments.lib.data",  # corpus, split, tokenizer, token-id cache, prompts
    "experiments.lib.store",  # build_lm, checkpoints, pretrained bases, the run directory's lock
    "experiments.lib.formats",  # the serving formats (vLLM's, speculators'), a module each: written and read
    "experiments.lib.families",  # the drafter-family registry
    "experiments.lib.training",  # the training loop, the trainers, feature and artifact caches
    "experiments.lib.methods",  # decoding methods, their prompts and checks, calibration
    "experiments.lib.report",  # results files, per-category figures, the encoder-decoder benchmark
    "experiments.lib.cli",  # the command line checked before Hydra
    "experiments",  # the entry points
)
ROOTS = ("verify", "experiments.lib")  # bare namespace packages of subpackages: a docstring, no imports, no layer


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
    """The longest layer `name` falls in (verify.loop.plain -> verify.loop), None where it falls in none; a
    module under a bare root falls only in that root's subpackages (experiments.lib.x is not an entry point)."""
    roots = [root for root in ROOTS if name == root or name.startswith(root + ".")]
    found = [
        layer
        for layer in LAYERS
        if (name == layer or name.startswith(layer + ".")) and all(layer.startswith(root + ".") for root in roots)
    ]
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


def subpackage_listings(root: Path) -> list[str]:
    """'<root>/__init__.py: ...' for each of ROOTS whose docstring does not list its subpackages (a line each,
    starting with the name) in the order of LAYERS."""
    bad = []
    for pkg in ROOTS:
        subpackages = [layer.removeprefix(pkg + ".") for layer in LAYERS if layer.startswith(pkg + ".")]
        doc = ast.get_docstring(ast.parse((root / pkg.replace(".", "/") / "__init__.py").read_text())) or ""
        listed = [line.split()[0] for line in doc.splitlines() if line.strip() and line.split()[0] in subpackages]
        if listed != subpackages:
            bad.append(f"{pkg.replace('.', '/')}/__init__.py lists {listed}, not {subpackages} (LAYERS' order)")
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
    """verify/'s subpackages one way, then medusa/, prophet/, experiments/lib/'s subpackages one way, the entry
    points: medusa/ and prophet/ import nothing from experiments/, and every module has a place."""
    assert {layer_of(name) for name in project_modules(ROOT)} - {None} == set(LAYERS)
    assert layer_violations(ROOT) == []


def test_every_package_says_what_it_holds() -> None:
    assert package_docs(ROOT) == []
    assert subpackage_listings(ROOT) == []


def test_every_entry_point_runs_as_a_module() -> None:
    """An entry point is runnable (`python -m experiments.<name>`) and the library holds none."""
    for path in (ROOT / "experiments").glob("*.py"):
        if path.stem != "__init__":
            assert 'if __name__ == "__main__":' in path.read_text(), path
    for path in (ROOT / "experiments" / "lib").rglob("*.py"):
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


INITS = (
    "experiments/__init__.py",
    "experiments/lib/__init__.py",
    "experiments/lib/methods/__init__.py",
    "verify/__init__.py",
)


@pytest.fixture()
def scratch(tmp_path: Path) -> Path:
    for name in INITS:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / "experiments" / "lib" / "methods" / "registry.py").write_text("import json\n")
    (tmp_path / "experiments" / "benchmark.py").write_text("from experiments.lib.methods.registry import x\n")
    return tmp_path


def test_a_planted_entry_point_import_is_found(scratch: Path) -> None:
    assert entry_point_imports(scratch) == []
    (scratch / "experiments" / "generate.py").write_text("from experiments.benchmark import METHODS\n")
    _plant(scratch, {"experiments/lib/report/results.py": "def f():\n    from experiments import benchmark\n"})
    assert entry_point_imports(scratch) == [
        "experiments.generate imports experiments.benchmark",
        "experiments.lib.report.results imports experiments.benchmark",
    ]


def test_a_planted_cycle_is_found_even_when_an_import_hides_in_a_function(scratch: Path) -> None:
    data = scratch / "experiments" / "lib" / "data"
    cycle = ["experiments.lib.data.pipeline", "experiments.lib.data.prompts", "experiments.lib.data.pipeline"]
    _plant(scratch, {"experiments/lib/data/__init__.py": '"""Data."""\n'})
    (data / "pipeline.py").write_text("from experiments.lib.data.prompts import load_prompts\n")
    (data / "prompts.py").write_text("import json\n")
    assert import_cycles(scratch) == []
    (data / "prompts.py").write_text("def f():\n    from experiments.lib.data import pipeline\n")
    assert import_cycles(scratch) == [cycle]
    (data / "prompts.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from experiments.lib.data.pipeline import Data\n"
    )
    assert import_cycles(scratch) == [cycle]


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
            "experiments/lib/common/__init__.py": '"""Shared."""\n',
            "experiments/lib/common/errors.py": "import sys\n",
            "experiments/lib/data/__init__.py": '"""Data."""\n',
            "experiments/lib/data/prompts.py": "from experiments.lib.common.errors import one_line\n",
            "experiments/lib/store/__init__.py": '"""Checkpoints."""\n',
            "experiments/lib/store/checkpoint.py": "from experiments.lib.data import prompts\nimport verify.common\n",
            "experiments/lib/training/__init__.py": '"""Training."""\n',
            "experiments/lib/training/features.py": "from experiments.lib.store.checkpoint import x\nimport prophet\n",
            "experiments/lib/methods/registry.py": "from experiments.lib.training.features import x\n",
            "experiments/lib/cli/__init__.py": '"""Command line."""\n',
            "experiments/lib/cli/preflight.py": "from experiments.lib.store.checkpoint import x\n",
        },
    )
    for name in INITS:
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
            "from experiments.lib.training.features import FeatureBatch\n",
            "medusa.train (medusa) imports experiments.lib.training.features (experiments.lib.training)",
        ),
        (
            "prophet/drafter.py",
            "import experiments.lib.training.features\n",
            "prophet.drafter (prophet) imports experiments.lib.training.features (experiments.lib.training)",
        ),
        (  # verify/ below even the library's lowest layer
            "verify/loop/speculative.py",
            "from experiments.lib.common.errors import one_line\n",
            "verify.loop.speculative (verify.loop) imports experiments.lib.common.errors (experiments.lib.common)",
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
        (  # the library's data reaching up into the store, hidden in a function
            "experiments/lib/data/prompts.py",
            "def f():\n    from experiments.lib.store.checkpoint import x\n",
            "experiments.lib.data.prompts (experiments.lib.data) imports experiments.lib.store.checkpoint"
            " (experiments.lib.store)",
        ),
        (  # the lowest layer of the library importing anything of it
            "experiments/lib/common/errors.py",
            "from experiments.lib.data.prompts import x\n",
            "experiments.lib.common.errors (experiments.lib.common) imports experiments.lib.data.prompts"
            " (experiments.lib.data)",
        ),
        (
            "experiments/lib/store/checkpoint.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from experiments.lib.training import features\n",
            "experiments.lib.store.checkpoint (experiments.lib.store) imports experiments.lib.training.features"
            " (experiments.lib.training)",
        ),
        (  # training below the decoding methods
            "experiments/lib/training/features.py",
            "from experiments.lib.methods.registry import METHODS\n",
            "experiments.lib.training.features (experiments.lib.training) imports experiments.lib.methods.registry"
            " (experiments.lib.methods)",
        ),
        (  # the command line's front above the library it checks for
            "experiments/lib/training/features.py",
            "from experiments.lib.cli.preflight import hydra_preflight\n",
            "experiments.lib.training.features (experiments.lib.training) imports experiments.lib.cli.preflight"
            " (experiments.lib.cli)",
        ),
        (  # the library below the entry points
            "experiments/lib/methods/registry.py",
            "import experiments.benchmark\n",
            "experiments.lib.methods.registry (experiments.lib.methods) imports experiments.benchmark (experiments)",
        ),
        ("experiments/lib/flat.py", "import torch\n", "experiments.lib.flat: in no layer"),  # subpackages only
        ("experiments/lib/sketches/idea.py", "import torch\n", "experiments.lib.sketches.idea: in no layer"),
    ],
)
def test_a_planted_layer_violation_is_found(layered: Path, module: str, text: str, found: str) -> None:
    _plant(layered, {module: text})
    assert found in layer_violations(layered)


def test_a_planted_undocumented_or_importing_package_is_found(layered: Path) -> None:
    _plant(
        layered,
        {
            "verify/plan/__init__.py": "",
            "verify/loop/__init__.py": '"""Loop."""\nfrom . import tree\n',
            "experiments/lib/report/__init__.py": "",
            "experiments/lib/data/__init__.py": '"""Data."""\nfrom experiments.lib.data import prompts\n',
        },
    )
    assert package_docs(layered) == [
        "experiments.lib.data: imports (a package's __init__ holds its docstring only)",
        "experiments.lib.report: no docstring saying what it holds",
        "verify.loop: imports (a package's __init__ holds its docstring only)",
        "verify.plan: no docstring saying what it holds",
    ]


def test_a_planted_listing_out_of_order_is_found(layered: Path) -> None:
    """Each root's docstring lists its subpackages in the order of LAYERS."""
    verify = [layer.split(".")[1] for layer in LAYERS if layer.startswith("verify.")]
    lib = [layer.split(".")[2] for layer in LAYERS if layer.startswith("experiments.lib.")]
    listing = "\n".join(f"    {name}  what it holds" for name in lib)
    _plant(layered, {"verify/__init__.py": '"""Verify.\n\n' + "\n".join(verify) + '\n"""\n'})
    _plant(layered, {"experiments/lib/__init__.py": f'"""The library.\n\n{listing}\n"""\n'})
    assert subpackage_listings(layered) == []
    swapped = [lib[1], lib[0], *lib[2:]]
    _plant(layered, {"experiments/lib/__init__.py": '"""The library.\n\n' + "\n".join(swapped) + '\n"""\n'})
    assert subpackage_listings(layered) == [f"experiments/lib/__init__.py lists {swapped}, not {lib} (LAYERS' order)"]
