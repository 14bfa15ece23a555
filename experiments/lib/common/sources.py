"""Hashes of the project's own source files: what a cached result was computed by.

Two caches need them. A trained artifact (artifacts/<kind>-<recipe>-<code>) is named by its recipe, and a recipe
alone does not see a changed loss or a changed drafter layer: an artifact trained by older code was reused silently
(seen with the base-initialised draft model). Its code is the project files its training imports, directly or not
(`code_manifest`): the family's network, loss and validation, the shared training loop, the data pipeline, the
feature cache; read from their syntax, so the same on every machine and for every entry point. A verify-cost table
is measured on one engine and must be measured again on another (`source_version` over verify/backends).

Both hash file bytes (line endings as LF: a checkout with CRLF gets the same key), never modification times, and
name each file by its path, so a fresh clone computes the same hashes, a renamed file changes them, and a comment
edit retrains (cheap to explain, never stale).
"""

from __future__ import annotations

import ast
import functools
from hashlib import sha256
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # experiments/lib/common/ -> the project root
PACKAGES = ("experiments", "verify", "medusa", "prophet")  # the project's own top-level packages

# Imported by training code, but not followed: they do not decide a trained artifact's weights.
NOT_FOLLOWED = {
    # the decode engine: the answers it generates are plain decoding's bit for bit, whatever change the tests let by
    "verify/backends/": "the decode engine",
    "experiments/lib/common/": "errors, progress and the machine a run reports: how it reports, not what it computes",
}
# Hashed, but their imports not followed: the registry imports every family; each artifact follows only its own.
NOT_ENTERED = ("experiments/lib/families/registry.py",)


def _file(module: str, root: Path) -> Path | None:
    """The source file of a project module, or None (a name imported from a module, not a module itself)."""
    path = root.joinpath(*module.split("."))
    if (path / "__init__.py").is_file():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else None


def _reads(path: Path, module: str) -> tuple[set[str], set[Path]]:
    """(every project module `path` (the module `module`) may import, the data files beside it that it names).

    Imports: `from a import b` names a.b too (b may be a module), relative imports resolved, imports inside
    functions included. Data: a string constant that is the name of a file in the module's directory (the question
    bank's question_topics.yaml: its word lists shape what the drafters learn from as much as code would)."""
    found: set[str] = set()
    data: set[Path] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _is_data(path.parent, node.value):
            data.add(path.parent / node.value)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from .x import y, from .. import z
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parts, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in PACKAGES}, data


def _is_data(directory: Path, name: str) -> bool:
    """A file name (no directory part) of a file in `directory` that is not Python source."""
    if not name or len(name) > 255 or "/" in name or "\\" in name or name.startswith(".") or name.endswith(".py"):
        return False
    return (directory / name).is_file()


@functools.cache
def module_files(modules: tuple[str, ...], root: Path = ROOT) -> tuple[str, ...]:
    """Relative paths of the project files that `modules` import, directly or not, themselves and their packages'
    __init__.py included, and the data files beside them that they name; NOT_FOLLOWED's are left out, NOT_ENTERED's
    are kept but their imports not followed."""
    seen: set[str] = set()
    todo = list(modules)
    while todo:
        module = todo.pop()
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # importing a.b.c runs a and a.b first
        path = _file(module, root)
        if path is None:
            continue
        rel = path.relative_to(root).as_posix()
        if rel in seen or rel.startswith(tuple(NOT_FOLLOWED)):
            continue
        seen.add(rel)
        if rel not in NOT_ENTERED:
            imported, data = _reads(path, module)
            todo += sorted(imported)
            seen.update(p.relative_to(root).as_posix() for p in data)
    return tuple(sorted(seen))


def _digest(path: Path) -> str:
    return sha256(path.read_bytes().replace(b"\r\n", b"\n")).hexdigest()[:16]


def code_manifest(modules: tuple[str, ...], root: Path = ROOT) -> dict[str, str]:
    """Path -> hash of the bytes of every file of module_files(modules): what an artifact was trained by."""
    return {rel: _digest(root / rel) for rel in module_files(tuple(modules), root)}


def code_version(manifest: dict[str, str]) -> str:
    """12 hex digits naming a manifest: the code part of an artifact's directory name."""
    text = "".join(f"{path}\0{digest}\0" for path, digest in sorted(manifest.items()))
    return sha256(text.encode()).hexdigest()[:12]


def code_changes(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """What differs between the code an artifact was trained by (old) and this checkout's (new), file by file."""
    changes = [f"{path} changed" for path in sorted(old.keys() & new.keys()) if old[path] != new[path]]
    changes += [f"{path} new" for path in sorted(new.keys() - old.keys())]
    changes += [f"{path} gone" for path in sorted(old.keys() - new.keys())]
    return changes


@functools.cache
def source_version(directories: tuple[str, ...], root: Path = ROOT) -> str:
    """16 hex digits over the relative path and bytes of every .py and .cpp file (the ordered attention operator's
    source is C++) under the given directories of root."""
    digest = sha256()
    for directory in directories:
        for path in sorted(p for p in (root / directory).rglob("*") if p.suffix in (".py", ".cpp")):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]
