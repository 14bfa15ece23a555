"""Error handling shared by every entry point.

A single run:
- a user error (a bad config value, a missing file, a checkpoint that does not match) is reported as one line
  `error: <message>` on stderr with exit status 2, and no traceback: the traceback would only bury the message;
- a full disk or a path we may not write is a user error too: `error: disk full while writing <file>: ...`,
  `error: cannot write <file>: permission denied` (exit 2);
- Ctrl-C prints `interrupted` and exits 130 (the shell's status for SIGINT), no traceback;
- anything else is a bug and keeps its traceback.

A job of a multirun (`-m`) that fails, for any reason but Ctrl-C, must not take the other jobs down with it:
it writes failed.json into its own output directory (error type, one-line message, overrides, and the
traceback of a bug), prints `error: job N (overrides): message`, and raises `JobFailed` to Hydra. Hydra's
run_job records the job as failed and goes on with the next one; when the batch is done (the whole sweep,
with the basic sweeper) Hydra re-raises the first failure and exits 1, printing `str(JobFailed)`: one line
naming every failed job of the sweep, read from their failed.json. This works unchanged with the basic,
joblib and submitit launchers, since each reports the job's failure back through Hydra's own JobReturn.
Ctrl-C stops the whole sweep: `SystemExit` passes through Hydra's run_job, which only catches `Exception`.

Before main(cfg) runs, Hydra composes the config and creates the run directory; `hydra_preflight`
(experiments/lib/cli/preflight.py) checks both first, so a bad override or an unwritable run directory is one
line too, exit 2, before Hydra writes anything.

Put `exit_on_user_error` *inside* `@hydra.main`, so Hydra does not catch the exception first, and
`hydra_preflight` outside it, so it runs before Hydra starts:

    @hydra_preflight
    @hydra.main(version_base="1.3", config_path="../conf", config_name="train_base")
    @exit_on_user_error
    def main(cfg: DictConfig) -> None: ...
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import secrets
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf.errors import InterpolationResolutionError

__all__ = [
    "USER_ERRORS",
    "FAILED_FILE",
    "JobFailed",
    "exit_on_user_error",
    "one_line",
    "user_message",
    "read_failures",
    "write_atomic",
    "atomic_path",
    "fsync_directory",
    "fsync_tree",
    "remove_orphans",
]

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError)
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a process stopped by Ctrl-C
FAILED_FILE = "failed.json"

F = TypeVar("F", bound=Callable)
# The directories hydra_preflight made for this run, outermost first, the run directory last (empty: it existed).
FRESH_RUN_DIRS: list[Path] = []


def one_line(error: BaseException) -> str:
    """The exception's message with all whitespace (newlines included) collapsed to single spaces. A config
    resolver's own error (`${pretrained:...}` with its wheel missing) comes wrapped by OmegaConf as
    "<Type> raised while resolving interpolation: <message>" plus lines naming the key: the message alone."""
    if isinstance(error, InterpolationResolutionError):
        inner = str(error).split("\n")[0].split(" raised while resolving interpolation: ", 1)[-1]
        return " ".join(inner.split()) or type(error).__name__
    text = " ".join(str(error).split())
    return text or type(error).__name__


def runtime_fault(error: BaseException) -> str | None:
    """One line for an OSError the user fixes outside the code (a full disk, a path they may not touch)."""
    if not isinstance(error, OSError):
        return None
    name = error.filename if error.filename is not None else "a file"  # a write through an open file has no name
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"disk full while writing {name}: free some space or write elsewhere ({error.strerror})"
    if error.errno == errno.EROFS:
        return f"cannot write {name}: read-only file system"
    if isinstance(error, PermissionError):  # EACCES, EPERM
        # The same errno comes from reading: say so when the file is there and we may not read it.
        unreadable = error.filename is not None and os.path.exists(name) and not os.access(name, os.R_OK)
        return f"cannot {'read' if unreadable else 'write'} {name}: permission denied"
    return None


def user_message(error: BaseException) -> str | None:
    """The one-line message of an error the user can fix, or None for a bug (which keeps its traceback)."""
    fault = runtime_fault(error)
    if fault is not None:
        return fault
    return one_line(error) if isinstance(error, USER_ERRORS) else None


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` for a writer that needs a file name (safetensors' save_file, savefig,
    np.save): when the block ends, the file is fsync'd and renamed onto `path` and the directory fsync'd, so a
    reader sees the old file or the whole new one, never a part; if the block raises, the temporary file is
    removed and `path` is untouched. Same directory, so the rename stays on one file system and is atomic.

        with atomic_path(out / "shard.safetensors") as tmp:
            save_file(tensors, str(tmp))"""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


# atomic_path's temporary names (.<name>.<pid>.<hex>.tmp), and the older .<name>.<pid>.tmp of the writers before it
TEMP_NAME = re.compile(r"^\..+\.(\d+)(\.[0-9a-f]{8})?\.tmp$")
ORPHAN_AGE_S = 3600.0  # a writer renames its temporary file seconds after writing it: an hour-old one is orphaned


def remove_orphans(directory: str | Path) -> list[Path]:
    """Remove the temporary files of atomic writes into `directory` that no writer will rename any more: those of a
    process killed mid-write (SIGKILL, out of memory: nothing could clean up then), whose process is gone and which
    nobody touched for an hour. A feature shard's is gigabytes. Returns what it removed."""
    removed = []
    for path in Path(directory).glob(".*.tmp"):
        found = TEMP_NAME.match(path.name)
        if found is None or _alive(int(found.group(1))):
            continue
        try:
            if not path.is_file() or time.time() - path.stat().st_mtime < ORPHAN_AGE_S:
                continue
            path.unlink()
        except OSError:  # gone meanwhile, or not ours to remove: left as it is
            continue
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: someone else's process, alive
        return True
    return True


def fsync_directory(directory: str | Path) -> None:
    """Make a rename inside `directory` survive a power cut."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: str | Path) -> None:
    """fsync every file under `directory`, then the directories: its contents reach the disk before a rename
    publishes it (a rename alone can survive a power cut while the files' data does not). For writers that
    build a whole directory and rename it into place (the id cache, a pretrained conversion)."""
    directory = Path(directory)
    for path in sorted(directory.rglob("*"), key=lambda p: -len(p.parts)):  # deepest first, directories last
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        else:
            fsync_directory(path)
    fsync_directory(directory)


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write `data` to `path` so that a reader sees the old file or the whole new one, never a part (see
    atomic_path). The file gets the umask's mode, like open()."""
    raw = data.encode() if isinstance(data, str) else data
    with atomic_path(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)


# ---------------------------------------------------------------------------------------- multirun jobs


@dataclass(frozen=True)
class SweepJob:
    num: int
    overrides: list[str]
    output_dir: Path
    sweep_dir: Path

    @property
    def label(self) -> str:
        return f"job {self.num} ({' '.join(self.overrides)})"


def sweep_job() -> SweepJob | None:
    """This job of a multirun, or None in a single run (or outside Hydra, e.g. a test calling main)."""
    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    return SweepJob(
        num=int(hydra_cfg.job.num),
        overrides=[str(o) for o in hydra_cfg.overrides.task],
        output_dir=Path(hydra_cfg.runtime.output_dir),
        sweep_dir=Path(hydra_cfg.sweep.dir),
    )


def read_failures(sweep_dir: str | Path) -> dict[int, str]:
    """Job number -> label of every failed.json under a sweep directory (unreadable ones are skipped)."""
    labels = {}
    for path in Path(sweep_dir).rglob(FAILED_FILE):
        try:
            failure = json.loads(path.read_text())
            num, overrides = failure["job"], " ".join(map(str, failure["overrides"]))
        except (OSError, ValueError, KeyError, TypeError):  # half-written by a job killed meanwhile
            continue
        if isinstance(num, int):
            labels[num] = f"job {num} ({overrides})"
    return labels


class JobFailed(CompactHydraException):
    """Raised to Hydra by a failed job of a multirun, after its failed.json is written.

    Hydra prints str() of the first failed job's JobFailed once every job of the batch has run, so str()
    reads the sweep's failed.json files then, to name every failed job in one line, not only this one.
    Its args are plain strings and an int, so it pickles back from joblib and submitit workers."""

    def __init__(self, sweep_dir: str, job: int, label: str) -> None:
        super().__init__(sweep_dir, job, label)

    def __str__(self) -> str:
        sweep_dir, job, label = self.args
        labels = read_failures(sweep_dir)
        labels.setdefault(job, label)  # its failed.json may not have been written (a full disk)
        names = ", ".join(labels[n] for n in sorted(labels))
        jobs = "job" if len(labels) == 1 else "jobs"
        return (
            f"error: {len(labels)} {jobs} of the sweep failed: {names}; "
            f"each one's {FAILED_FILE} in {sweep_dir} says why"
        )


def record_failure(job: SweepJob, error: Exception) -> str:
    """Write the job's failed.json; return the one-line message to print."""
    message = user_message(error)
    is_bug = message is None
    path = job.output_dir / FAILED_FILE
    if is_bug:
        message = f"{type(error).__name__}: {one_line(error)} (traceback in {path})"
    failure = {
        "job": job.num,
        "overrides": job.overrides,
        "error_type": type(error).__name__,
        "message": message,
        "user_error": not is_bug,
        "traceback": "".join(traceback.format_exception(error)) if is_bug else None,
    }
    try:
        job.output_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(failure, indent=2) + "\n")
    except OSError as e:  # the disk that failed the job may fail this too: the line below still says why
        message += f" (could not write {path}: {user_message(e) or one_line(e)})"
    return message


def exit_interrupted() -> NoReturn:
    print("interrupted", file=sys.stderr)
    sys.exit(EXIT_INTERRUPTED)


def remove_refused_run_dir() -> None:
    """A run refused with a user error leaves nothing behind: the run directory hydra_preflight made for it (and
    the parents it made) is removed when it holds only what Hydra wrote there (.hydra/, the job's log)."""
    if not FRESH_RUN_DIRS or not HydraConfig.initialized():
        return
    run_dir = FRESH_RUN_DIRS[-1]
    hydras = run_dir.resolve() == Path(HydraConfig.get().runtime.output_dir).resolve()
    try:  # a run directory named by the time may be another one than Hydra's, a second later: removed if empty
        if not hydras or all(
            (p.name == ".hydra" and p.is_dir()) or (p.suffix == ".log" and p.is_file()) for p in run_dir.iterdir()
        ):
            shutil.rmtree(run_dir) if hydras else run_dir.rmdir()
            for parent in reversed(FRESH_RUN_DIRS[:-1]):
                parent.rmdir()  # refused when another run wrote into it meanwhile: then it stays
    except OSError:
        pass


def run_single(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except KeyboardInterrupt:
        exit_interrupted()
    except Exception as e:
        message = user_message(e)
        if message is None:
            raise
        remove_refused_run_dir()
        print(f"error: {message}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


def run_sweep_job(job: SweepJob, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    # A job run again into the same directory starts with a clean slate: an old failure is not this run's.
    try:
        (job.output_dir / FAILED_FILE).unlink(missing_ok=True)
    except OSError:  # an unusable directory: the job will say so itself
        pass
    try:
        return fn(*args, **kwargs)
    except KeyboardInterrupt:
        exit_interrupted()  # SystemExit is not an Exception: it ends the whole sweep, not just this job
    except Exception as e:
        message = record_failure(job, e)
        print(f"error: {job.label}: {message}", file=sys.stderr)
        raise JobFailed(str(job.sweep_dir), job.num, job.label) from None


def exit_on_user_error(fn: F) -> F:
    """Decorate an entry point's main(cfg), inside @hydra.main: see the module docstring."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        job = sweep_job()
        if job is None:
            return run_single(fn, *args, **kwargs)
        return run_sweep_job(job, fn, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
