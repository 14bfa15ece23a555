"""A serving-format drafter directory on disk (config.json + model.safetensors): written atomically, never over
anything but an earlier export, and read with every fault a one-line FormatError that names the file.

Where an export may go (`check_out`, before any work): a new directory, an empty one, or, with overwrite=true, a
directory that holds an earlier export and nothing else. An earlier export is recognised by what the exporter
writes: only config.json and model.safetensors, and a config.json that carries the `prophet_medusa` key. So
overwrite=true never removes a checkpoint (meta.json), a directory with other content, the working directory,
the checkpoint being exported or a directory above any of them. The files get the modes the umask gives (0644
under the usual 022), as a save_pretrained directory does, so another user can serve them.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

MARK = "prophet_medusa"  # the config.json key every export carries (its checkpoint, fingerprints)
CONFIG, WEIGHTS = "config.json", "model.safetensors"
SIZES = {"hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size"}
SIZES |= {"num_hidden_layers", "num_heads", "draft_vocab_size", "target_hidden_size"}


class FormatError(ValueError):
    """What a serving format cannot hold, or a directory that is not one of them."""


# ------------------------------------------------------------------------------------------------- writing


def _blocker(path: Path) -> Path | None:
    """The first of `path` and its parents that exists and is not a directory (None: there is none)."""
    return next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)


def is_export(path: Path) -> bool:
    """True when `path` holds an earlier export of this project and nothing else."""
    try:
        names = {p.name for p in path.iterdir()}
        config = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return CONFIG in names and names <= {CONFIG, WEIGHTS} and isinstance(config, dict) and MARK in config


def check_out(out: Any, *, overwrite: bool, keep: Iterable[str | Path] = ()) -> Path:
    """`out` as a directory an export may be written to (see the module docstring), else a one-line FormatError.
    `keep`: directories that must survive whatever happens (the checkpoint exported, its base)."""
    if out is None or not str(out).strip():
        raise FormatError(f"out={out!r}: give the directory to write the export to (a new or empty directory)")
    path = Path(str(out)).expanduser().absolute()
    real = path.resolve()
    blocker = _blocker(real)
    if blocker is not None:
        where = "is a file" if blocker == real else f"lies under {blocker}, a file"
        raise FormatError(f"out={out} {where}, not a directory: give a directory to write the export to")
    if real.is_dir() and any(real.iterdir()):
        if not overwrite:
            raise FormatError(f"out={out} exists and is not empty: choose another directory or pass overwrite=true")
        for kept in (Path.cwd(), *map(Path, keep)):
            kept = kept.resolve()
            if real == kept or real in kept.parents:
                raise FormatError(
                    f"out={out} is {'' if real == kept else 'a parent of '}{kept}: overwrite=true never replaces "
                    "the working directory, the checkpoint or its base, nor a directory above them"
                )
        if not is_export(real):
            raise FormatError(
                f"out={out} holds files no export of this project wrote: overwrite=true replaces only an earlier "
                f"export ({CONFIG} with a {MARK!r} entry, and {WEIGHTS}); choose another directory"
            )
    existing = next(p for p in (real, *real.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise FormatError(f"out={out}: cannot write in {existing} (permission denied)")
    return path


def _umask_mode(mode: int) -> int:
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def write_directory(
    out: str | Path,
    config: dict,
    tensors: dict[str, Tensor],
    *,
    overwrite: bool = False,
    keep: Iterable[str | Path] = (),
    check: Callable[[Path], None] | None = None,
) -> Path:
    """config.json (stamped with MARK) and model.safetensors (float32, contiguous, on the CPU) into `out`,
    atomically: written under a temporary name, `check`ed there (it raises to refuse it), then renamed; a failure
    leaves `out` as it was."""
    out = check_out(out, overwrite=overwrite, keep=keep)
    config = {**config, MARK: {**config.get(MARK, {}), "exported": True}}
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        state = {
            k: (t.detach().float() if t.is_floating_point() else t.detach()).cpu().contiguous()
            for k, t in tensors.items()
        }
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=False) + "\n")
        for file in (tmp / WEIGHTS, tmp / CONFIG):
            os.chmod(file, _umask_mode(0o666))
        if check is not None:
            check(tmp)
        _replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _replace(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`; an earlier export there is moved aside first and removed only once `tmp` is in."""
    if not (out.is_dir() and any(out.iterdir())):
        os.replace(tmp, out)  # a missing or empty directory is replaced in one rename
        return
    old = out.with_name(f".{out.name}.{os.getpid()}.old")
    os.rename(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old)


# ------------------------------------------------------------------------------------------------- reading


def read_config(path: str | Path) -> dict[str, Any]:
    """The directory's config.json as a dict; missing, unreadable or not a JSON object: a FormatError."""
    file = Path(path) / CONFIG
    if not file.is_file():
        raise FormatError(f"{path} has no {CONFIG}: not a serving-format drafter directory")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FormatError(f"{file} is not valid JSON ({' '.join(str(e).split())})") from None
    if not isinstance(config, dict):
        raise FormatError(f"{file} holds a JSON {type(config).__name__}, not an object of settings")
    return config


def weight_files(path: str | Path) -> list[Path]:
    """The directory's *.safetensors files; none (a pickle-only directory, say): a FormatError."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in path.iterdir() if p.is_file() and p.name != CONFIG)
        found = f" (only {', '.join(others)})" if others else ""
        raise FormatError(
            f"{path} holds no *.safetensors weights{found}: pickled weights are never loaded here (a pickle can run "
            "code when read); convert them to safetensors"
        )
    return files


def _opened(file: Path, read) -> Any:
    try:
        return read(file)
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise FormatError(f"corrupted or truncated {file}: {' '.join(str(e).split())}") from None


def tensor_names(path: str | Path) -> set[str]:
    """The names of every tensor in the directory's weight files, from their headers alone (a file the header
    does not exactly cover, a truncated one, is refused)."""

    def header(file: Path) -> set[str]:
        with safe_open(str(file), framework="pt") as f:
            return set(f.keys())

    return set().union(*(_opened(file, header) for file in weight_files(path)))


def read_directory(path: str | Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """config.json and every tensor of the directory's *.safetensors files."""
    config = read_config(path)
    tensors: dict[str, Tensor] = {}
    for file in weight_files(path):
        tensors |= _opened(file, lambda f: load_file(str(f)))
    return config, tensors


def tensor(tensors: dict[str, Tensor], name: str, path: str | Path) -> Tensor:
    """tensors[name], or a FormatError naming the directory and the tensor it lacks."""
    if name not in tensors:
        raise FormatError(f"{path} lacks the tensor {name!r}")
    return tensors[name]


def setting(config: dict[str, Any], key: str, path: str | Path, *, within: str = "") -> Any:
    """config[key], a positive integer where the key is a size, or a FormatError naming the file and the key."""
    value = config.get(key)
    where = f"{Path(path) / CONFIG}{f' ({within})' if within else ''}"
    if value is None:
        raise FormatError(f"{where} has no {key!r}: a serving config names it")
    if key in SIZES and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise FormatError(f"{where}: {key}={value!r} must be a positive integer")
    return value
