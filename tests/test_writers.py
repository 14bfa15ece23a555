"""One atomic writer for every file the project writes (experiments.lib.common.errors: write_atomic, atomic_path):
fsync'd, renamed into place, its temporary file removed on failure, so a reader, a resumed run or the next command
sees the old file or the whole new one, never a part.

The project's sources are read as syntax trees and every raw write is found: write_text, write_bytes, open for
writing, os.open for writing, safetensors' save_file, savefig, torch.save / np.save, and renames (os.replace,
os.rename). A write is the atomic writer's when it writes the temporary path of an enclosing
`with atomic_path(...) as tmp`, or renders into an io.BytesIO that write_atomic then writes; every other one must
be on ALLOWED, with the reason it need not be atomic.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("experiments", "verify", "medusa", "prophet")
WRITER = "experiments/lib/common/errors.py"  # the atomic writer itself
WRITE_MODES = set("wax+")

# (file, kind of write) -> why it need not go through the atomic writer
ALLOWED: dict[tuple[str, str], str] = {
    ("experiments/lib/store/checkpoint.py", "os.replace"): "the checkpoint directory's swap: its files are written "
    "atomically into a temporary directory, which then replaces the old checkpoint by rename (a directory: "
    "atomic_path renames files)",
    ("experiments/lib/data/id_cache.py", "open"): "the id cache's arrays, streamed chunk by chunk into a fresh "
    "temporary directory (gigabytes: no copy in memory), fsync'd with it before the directory's rename",
    ("experiments/lib/data/id_cache.py", "write_text"): "meta.json inside that temporary directory, fsync'd with it",
    ("experiments/lib/data/id_cache.py", "os.rename"): "the finished temporary directory renamed into place: a "
    "directory (atomic_path renames files); a rename onto one another process finished first fails, and its copy wins",
    ("experiments/lib/store/pretrained.py", "write_text"): "provenance.json inside the conversion's temporary "
    "directory, fsync'd with it before the rename",
    ("experiments/lib/store/pretrained.py", "os.open"): "the conversion's lock file: flock'd, never read for data",
    ("experiments/lib/store/pretrained.py", "os.rename"): "the finished conversion's directory renamed into place "
    "(a directory; another process finishing first keeps its copy)",
    ("experiments/lib/store/rundir.py", "write_bytes"): "a probe: an empty file made and removed at once to learn "
    "whether a directory is writable",
    ("experiments/lib/store/rundir.py", "os.open"): "the run directory's lock file: flock'd, never read for data",
    ("experiments/lib/cli/preflight.py", "os.open"): "a probe: a file made, fsync'd and removed to learn whether a "
    "directory is writable before Hydra writes into it",
    ("experiments/lib/store/served_dir.py", "os.rename"): "an export directory's swap: its files are written "
    "atomically into a temporary directory, which is renamed onto out= (the kernel refuses a directory filled "
    "meanwhile); an earlier export is moved aside and back by rename, a killed export's restored by one",
    ("experiments/lib/store/served_dir.py", "os.open"): "out='s export lock file: flock'd, holding only the pid "
    "its refusal names",
    ("experiments/lib/training/loop.py", "open"): "metrics.jsonl is appended a row at a time (rewriting it per row "
    "would be quadratic); its reader drops a last line cut short, and a resume rewrites it atomically",
}

# Files other parts of issue 59 are moving onto the atomic writer: any raw write in them passes until then. Each is
# removed from here when its file is done; what stays raw in it then goes on ALLOWED, with its reason.
IN_PROGRESS: dict[str, str] = {}


def _in_progress(path: str) -> bool:
    return any(path == p or (p.endswith("/") and path.startswith(p)) for p in IN_PROGRESS)


def _name(node: ast.expr) -> str:
    """Dotted name of a call's function: os.replace, fig.savefig -> savefig (methods by their attribute)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id in ("os", "np", "torch", "shutil"):
            return f"{node.value.id}.{node.attr}"
        return node.attr
    return ""


def _arg(call: ast.Call, index: int, keyword: str) -> ast.expr | None:
    if len(call.args) > index:
        return call.args[index]
    return next((k.value for k in call.keywords if k.arg == keyword), None)


def _writes_mode(mode: ast.expr | None) -> bool:
    return isinstance(mode, ast.Constant) and isinstance(mode.value, str) and bool(WRITE_MODES & set(mode.value))


def raw_write(call: ast.Call) -> tuple[str, ast.expr | None] | None:
    """(kind, the path it writes) of a raw write, None for anything else; the path is None for a rename."""
    name = _name(call.func)
    if name in ("write_text", "write_bytes") and isinstance(call.func, ast.Attribute):
        return name, call.func.value
    if name == "savefig":
        return name, _arg(call, 0, "fname")
    if name == "save_file":
        return name, _arg(call, 1, "filename")
    if name in ("torch.save", "np.save"):
        return name, _arg(call, 1 if name == "torch.save" else 0, "f" if name == "torch.save" else "file")
    if name == "open" and isinstance(call.func, ast.Name) and _writes_mode(_arg(call, 1, "mode")):
        return name, _arg(call, 0, "file")
    if name == "open" and isinstance(call.func, ast.Attribute) and _writes_mode(_arg(call, 0, "mode")):
        return name, call.func.value  # Path.open("w")
    if name == "os.fdopen" and _writes_mode(_arg(call, 1, "mode")):
        return "fdopen", None
    if name == "os.open" and any(f in ast.dump(call) for f in ("O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND")):
        return name, _arg(call, 0, "path")
    if name in ("os.replace", "os.rename", "shutil.move"):
        return name, None
    return None


def _atomic_targets(scope: ast.AST) -> set[str]:
    """Names in `scope` that are an atomic_path's temporary path or an in-memory buffer (io.BytesIO)."""
    names = set()
    for node in ast.walk(scope):
        if isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                call = item.context_expr
                if isinstance(call, ast.Call) and _name(call.func) == "atomic_path":
                    if isinstance(item.optional_vars, ast.Name):
                        names.add(item.optional_vars.id)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and _name(node.value.func) == "BytesIO":
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _unwrap(target: ast.expr | None) -> ast.expr | None:
    while isinstance(target, ast.Call) and _name(target.func) == "str" and target.args:  # str(tmp)
        target = target.args[0]
    return target


def raw_writes(source: str, filename: str = "<source>") -> Iterator[tuple[str, int]]:
    """(kind, line) of every raw write in Python `source` that is not the atomic writer's."""
    tree = ast.parse(source, filename=filename)
    scopes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]
    innermost: dict[int, ast.AST] = {}
    for scope in scopes:  # functions come after the module and after their enclosing functions: the last wins
        for node in ast.walk(scope):
            innermost[id(node)] = scope
    allowed = {id(scope): _atomic_targets(scope) for scope in scopes}
    for node in ast.walk(tree):
        found = isinstance(node, ast.Call) and raw_write(node)
        if not found:
            continue
        kind, target = found
        target = _unwrap(target)
        if isinstance(target, ast.Name) and target.id in allowed[id(innermost[id(node)])]:
            continue
        yield kind, node.lineno


def project_writes() -> dict[tuple[str, str], list[int]]:
    found: dict[tuple[str, str], list[int]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == WRITER:
                continue
            for kind, line in raw_writes(path.read_text(), rel):
                found.setdefault((rel, kind), []).append(line)
    return found


def test_every_write_goes_through_the_atomic_writer() -> None:
    """A new raw write fails here: use write_atomic (data in memory) or atomic_path (a writer that needs a file
    name), or add it to ALLOWED with the reason it need not be atomic."""
    raw = {key: lines for key, lines in project_writes().items() if key not in ALLOWED and not _in_progress(key[0])}
    assert not raw, "raw writes outside the atomic writer: " + ", ".join(
        f"{path}:{','.join(map(str, lines))} {kind}" for (path, kind), lines in sorted(raw.items())
    )


def test_the_allowed_writes_are_still_there() -> None:
    """An entry of ALLOWED whose file no longer writes that way is removed, so the list stays the exceptions."""
    stale = sorted(set(ALLOWED) - set(project_writes()))
    assert not stale, f"remove from tests/test_writers.py ALLOWED (no such write any more): {stale}"
    assert all((ROOT / path).exists() for path in IN_PROGRESS), "a file of IN_PROGRESS is gone: remove it there"


def test_the_scan_finds_raw_writes_and_passes_the_atomic_writers() -> None:
    """The scanner itself: raw writes of each kind are found; writes into atomic_path's temporary path or into a
    buffer are not."""
    source = """
import io, os
def raw(path, fig, tensors):
    path.write_text("x")
    with open(path, "w") as f: f.write("x")
    with path.open("ab") as f: f.write(b"x")
    save_file(tensors, str(path))
    fig.savefig(path)
    os.replace(path, path)
def atomic(path, fig, tensors):
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp))
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    png = io.BytesIO()
    fig.savefig(png, format="png")
    with open(path) as f: f.read()
    with path.open("rb") as f: f.read()
"""
    assert sorted(raw_writes(source)) == [
        ("open", 5),
        ("open", 6),
        ("os.replace", 9),
        ("save_file", 7),
        ("savefig", 8),
        ("write_text", 4),
    ]
