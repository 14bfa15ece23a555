"""A serving-format drafter directory on disk (config.json + model.safetensors): written so that nothing is ever
lost, and read with every fault a one-line FormatError that names the file.

Where an export may go (`check_out`, before any work, and again under the lock): a new directory, an empty one,
or, with overwrite=true, a directory that holds an earlier export and nothing else. An earlier export is
recognised by what the exporter writes: only config.json and model.safetensors, and a config.json that carries
the `prophet_medusa` key. So overwrite=true never removes a checkpoint (meta.json), a directory with other
content, the working directory, the checkpoint being exported or a directory above any of them.

How it is written (`write_directory`), so that a race loses nothing:
- the export holds `out`'s lock (`claim`: flock on `.<name>.export.lock` beside it) from before its base loads
  to the end: a second export to the same `out` is refused in one line; the kernel drops the lock of a killed
  export, so a stale lock file never blocks;
- under the lock, what a killed export left beside `out` (`.<name>.<pid>.<hex>.tmp`, `.<name>.<pid>.<hex>.old`,
  its process gone) is removed, or restored when it is the only copy of an earlier export, or named;
- a missing `out` is claimed with mkdir (a directory made there meanwhile by anyone else is refused); the files
  go into a fresh temporary directory beside it, are read back (`check`), and the directory is renamed onto
  `out`: rename(2) replaces only an empty directory, so what appeared there meanwhile stays and is refused;
- overwrite=true moves the earlier export aside under a name only this export uses, checks again that what it
  moved is an earlier export (else puts it back and refuses), renames the new one in, then removes the old one.
A symbolic link as `out` is refused, dangling or not: the rename replaces the link itself, so an export "into"
a link would leave what it points to untouched (a stale export served on) and the link gone; resolving it
instead would replace a directory the user did not name. The link's parents may be links (they are resolved).
The files get the modes the umask gives (0644 under the usual 022), as a save_pretrained directory does.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import json
import logging
import os
import re
import secrets
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from experiments.lib.common.errors import atomic_path, fsync_directory, write_atomic

log = logging.getLogger(__name__)

MARK = "prophet_medusa"  # the config.json key every export carries (its checkpoint, fingerprints)
CONFIG, WEIGHTS = "config.json", "model.safetensors"
SIZES = {"hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size"}
SIZES |= {"num_hidden_layers", "num_heads", "draft_vocab_size", "target_hidden_size"}
# Upper bounds no real drafter reaches, checked before anything is allocated from a config (a num_heads of 1e9
# would allocate until memory runs out); each reader also holds the sizes to its tensors and to the base.
SIZE_LIMITS = {"num_heads": 256, "num_hidden_layers": 1024, "num_attention_heads": 4096, "num_key_value_heads": 4096}
SIZE_LIMIT = 1 << 24  # any other size: widths, vocabularies
LOCK = ".{}.export.lock"
ATOMIC_TEMP = re.compile(r"^\.|\.\d+\.[0-9a-f]{8}\.tmp$")  # atomic_path's .<name>.<pid>.<hex>.tmp, stripped to <name>
SIDE = r"^\.{}\.(?P<pid>\d+)(\.[0-9a-f]{{8}})?\.(?P<kind>tmp|old)$"  # .<out>.<pid>.<hex>.tmp; older: no hex


class FormatError(ValueError):
    """What a serving format cannot hold, or a directory that is not one of them."""


# ------------------------------------------------------------------------------------------------- where


def _blocker(path: Path) -> Path | None:
    """The first of `path` and its parents that exists and is not a directory (None: there is none)."""
    return next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)


def is_export(path: Path) -> bool:
    """True when `path` is a directory (not a link) holding an earlier export of this project and nothing else."""
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        names = {p.name for p in path.iterdir()}
        config = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return CONFIG in names and names <= {CONFIG, WEIGHTS} and isinstance(config, dict) and MARK in config


def _resolved(out: Any) -> Path:
    """`out` as an absolute path with its parents resolved; a symbolic link as out itself is refused."""
    if out is None or not str(out).strip():
        raise FormatError(f"out={out!r}: give the directory to write the export to (a new or empty directory)")
    path = Path(str(out)).expanduser().absolute()
    if path.is_symlink():
        target = os.readlink(path)
        dangling = "" if path.exists() else ", which does not exist"
        raise FormatError(
            f"out={out} is a symbolic link (to {target}{dangling}): an export is renamed into place, which would "
            "replace the link and not what it points to; give the directory itself or a new path"
        )
    return path.resolve()  # the last part is no link: this resolves the parents and '..' only


def check_out(out: Any, *, overwrite: bool, keep: Iterable[str | Path] = ()) -> Path:
    """`out` as a directory an export may be written to (see the module docstring), else a one-line FormatError.
    `keep`: directories that must survive whatever happens (the checkpoint exported, its base)."""
    real = _resolved(out)
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
    return real


# ------------------------------------------------------------------------------------------------- the lock


_HELD: dict[Path, int] = {}  # lock file -> the thread holding it: the export's own write_directory re-enters


def _lock_holder(lock: Path) -> str:
    try:
        return f"pid {int(lock.read_text().split()[0])}"
    except (OSError, ValueError, IndexError):
        return "another process"


@contextmanager
def claim(out: Any) -> Iterator[Path]:
    """Hold `out`'s export lock while the block runs (yields out resolved); an export holding it already (another
    process or thread) is refused in one line. flock: the kernel releases it when its holder dies, however."""
    real = _resolved(out)
    lock = real.with_name(LOCK.format(real.name))
    if _HELD.get(lock) == threading.get_ident():
        yield real
        return
    real.parent.mkdir(parents=True, exist_ok=True)
    fd = _take(lock, out)
    _HELD[lock] = threading.get_ident()
    try:
        yield real
    finally:
        del _HELD[lock]
        lock.unlink(missing_ok=True)  # while still holding it: whoever opened this inode meanwhile retries
        os.close(fd)


def _take(lock: Path, out: Any) -> int:
    """An open, flock'ed descriptor of `lock` holding this pid, else a FormatError naming the holder."""
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FormatError(
                f"out={out} is being written by another export ({_lock_holder(lock)}, lock {lock}): wait for it to "
                "finish, or choose another directory"
            ) from None
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:  # else its holder removed the file between our open and flock: take the new one
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def clear_stale(out: Path) -> None:
    """What an export killed while writing `out` left beside it (call with `out`'s lock held, so no live export
    of this project is writing them): a temporary directory is removed; an earlier export moved aside is put
    back when `out` is gone, else removed; anything else of that name is left and named."""
    ours = re.compile(SIDE.format(re.escape(out.name)))
    for side in sorted(out.parent.glob(f".{glob.escape(out.name)}.*")):
        found = ours.match(side.name)
        if found is None or _alive(int(found["pid"])):
            continue
        if found["kind"] == "old" and is_export(side) and not os.path.lexists(out):
            os.rename(side, out)  # killed between moving it aside and renaming the new one in: the only copy
            log.warning("restored %s from %s (an export killed while replacing it)", out, side)
        elif found["kind"] == "old" and is_export(side) and is_export(out):
            shutil.rmtree(side)  # killed after renaming the new one in: superseded
            log.warning("removed %s, an earlier export an export killed meanwhile had replaced", side)
        elif found["kind"] == "tmp" and _only_export_files(side):
            shutil.rmtree(side)
            log.warning("removed %s, left by an export that was killed", side)
        else:
            log.warning("left %s: named like an export's own directory, but not one this cleanup may remove", side)


def _only_export_files(path: Path) -> bool:
    """A directory (not a link) holding at most what an export writes (its files, or atomic_path's temporary
    files of them): a temporary directory of one."""
    try:
        names = {ATOMIC_TEMP.sub("", p.name) for p in path.iterdir()} if path.is_dir() else None
    except OSError:
        return False
    return names is not None and not path.is_symlink() and names <= {CONFIG, WEIGHTS}


# ------------------------------------------------------------------------------------------------- writing


def _umask_mode(mode: int) -> int:
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def _beside(out: Path, kind: str) -> Path:
    """A name beside `out` that only this process uses (`clear_stale` recognises it once the process is gone)."""
    return out.with_name(f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.{kind}")


def write_directory(
    out: str | Path,
    config: dict,
    tensors: dict[str, Tensor],
    *,
    overwrite: bool = False,
    keep: Iterable[str | Path] = (),
    check: Callable[[Path], None] | None = None,
) -> Path:
    """config.json (stamped with MARK) and model.safetensors (float32, contiguous, on the CPU) into `out` under
    its lock: written in a fresh temporary directory, `check`ed there (it raises to refuse it), then renamed into
    place (module docstring); a failure leaves `out` as it was."""
    check_out(out, overwrite=overwrite, keep=keep)
    config = {**config, MARK: {**config.get(MARK, {}), "exported": True}}
    with claim(out) as path:
        clear_stale(path)
        check_out(out, overwrite=overwrite, keep=keep)  # again: under the lock, after the cleanup
        claimed = _claim_missing(path)
        tmp = _beside(path, "tmp")
        try:
            tmp.mkdir()
            _write_files(tmp, config, tensors)
            if check is not None:
                check(tmp)
            _swap_in(tmp, path, out, overwrite=overwrite)
            fsync_directory(path.parent)  # the rename itself survives a power cut
        except BaseException:
            if claimed:
                _remove_if_empty(path)
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # its unique name: nobody else's
    return path


def _claim_missing(path: Path) -> bool:
    """mkdir `path` when it is missing (True: made here), so nobody else starts filling it meanwhile."""
    try:
        path.mkdir()
    except FileExistsError:
        return False
    return True


def _remove_if_empty(path: Path) -> None:
    try:
        path.rmdir()  # only ever an empty directory: what another process put there meanwhile stays
    except OSError:
        pass


def _write_files(tmp: Path, config: dict, tensors: dict[str, Tensor]) -> None:
    state = {
        k: (t.detach().float() if t.is_floating_point() else t.detach()).cpu().contiguous() for k, t in tensors.items()
    }
    with atomic_path(tmp / WEIGHTS) as path:  # fsync'd: the directory renamed into place holds files on disk
        save_file(state, str(path), metadata={"format": "pt"})
    write_atomic(tmp / CONFIG, json.dumps(config, indent=2, sort_keys=False) + "\n")
    for file in (tmp / WEIGHTS, tmp / CONFIG):
        os.chmod(file, _umask_mode(0o666))
    fsync_directory(tmp)


CHANGED = "changed while the export ran"


def _swap_in(tmp: Path, path: Path, out: Any, *, overwrite: bool) -> None:
    """Rename `tmp` onto `path`: the kernel refuses a non-empty directory there, which only an earlier export may
    be (overwrite=true), moved aside first, checked again, and removed only once `tmp` is in."""
    try:
        os.rename(tmp, path)  # onto nothing, or an empty directory
        return
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise FormatError(f"out={out}: cannot rename the export into place ({e.strerror})") from None
        if not overwrite:
            raise FormatError(
                f"out={out} {CHANGED}: something else was written there, left as it is; nothing exported "
                "(choose another directory)"
            ) from None
    old = _beside(path, "old")
    os.rename(path, old)  # what is there now, under a name only this export uses
    if not is_export(old):
        _put_back(old, path, out)
        raise FormatError(f"out={out} {CHANGED} and no longer holds only an earlier export: left as it is")
    try:
        os.rename(tmp, path)
    except OSError:
        _put_back(old, path, out)
        raise FormatError(f"out={out} {CHANGED}: a directory appeared there again, left as it is") from None
    shutil.rmtree(old)


def _put_back(old: Path, path: Path, out: Any) -> None:
    try:
        os.rename(old, path)
    except OSError:
        raise FormatError(f"out={out} {CHANGED}: what it held is now {old} (out= was taken meanwhile)") from None


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
    """config.json and every tensor of the directory's *.safetensors files; a tensor holding NaN or inf is
    refused (a drafter with them drafts nothing useful, and would do so silently: acceptance 0)."""
    config = read_config(path)
    tensors: dict[str, Tensor] = {}
    for file in weight_files(path):
        tensors |= _opened(file, lambda f: load_file(str(f)))
    for name, value in tensors.items():
        if value.is_floating_point() and not bool(value.isfinite().all()):
            bad = int((~value.isfinite()).sum())
            raise FormatError(f"{path}: the tensor {name!r} holds {bad} NaN or infinite values of {value.numel()}")
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
    if key in SIZES:
        limit = SIZE_LIMITS.get(key, SIZE_LIMIT)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
            raise FormatError(f"{where}: {key}={value!r} must be a positive integer of at most {limit}")
    return value
