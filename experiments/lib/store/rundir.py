"""The run directory of a training: one writer at a time, checked before any work.

Two trainings started in the same directory would corrupt each other (the second resumes the first's
checkpoint, their metrics interleave, one deletes the other's checkpoint while swapping in its own), so a
training holds an exclusive lock on `<out_dir>/.lock` for its whole life. The lock is an flock: the kernel
drops it when the process ends in any way (kill -9 included), so a crashed run never leaves a stale lock.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from types import TracebackType

from experiments.lib.store.checkpoint import checkpoint_exists

__all__ = ["RunLock", "check_writable", "check_checkpoint_dir"]

LOCK_FILE = ".lock"


class RunDirectoryInUse(ValueError):
    """Another process holds the run directory's lock."""


def check_writable(directory: str | Path, name: str) -> Path:
    """Check that files can be written in `directory` (or, when it does not exist yet, created in its
    nearest existing parent) by writing and removing a probe file: an output directory that cannot be
    written is a one-line ValueError before the run, not a lost result after it. Creates nothing."""
    if not isinstance(directory, (str, Path)):
        raise ValueError(f"{name}={directory!r}: must be a directory path")
    directory = Path(directory)
    existing = next(p for p in (directory, *directory.absolute().parents) if p.exists())
    try:
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is a file")
        probe = existing / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(
            f"{name}={str(directory)!r} is not a writable directory ({e.strerror or e}): give one this user can write"
        ) from None
    return directory


def check_checkpoint_dir(directory: Path) -> None:
    """A `checkpoint/` that holds files but no meta.json (copied in part, or foreign) would be trained over
    and then refused at the first save, losing the run: refuse it before training instead."""
    if directory.is_dir() and any(directory.iterdir()) and not checkpoint_exists(directory):
        raise ValueError(
            f"{directory} holds files but no meta.json: it is not a complete checkpoint; "
            "move it away (or point out_dir elsewhere) before training"
        )


class RunLock:
    """`with RunLock(out_dir):` exclusive use of a run directory; a second holder fails at once."""

    def __init__(self, directory: Path) -> None:
        self.path = Path(directory) / LOCK_FILE
        self.fd: int | None = None

    def __enter__(self) -> RunLock:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(self.fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            self.fd = None
            raise RunDirectoryInUse(
                f"run directory {self.path.parent} is in use by another training (pid {holder}); "
                "wait for it to finish or choose another out_dir / hydra.run.dir"
            ) from None
        try:  # the pid only names the holder in the error above; a failure here must not keep the lock
            os.ftruncate(self.fd, 0)
            os.write(self.fd, f"{os.getpid()}\n".encode())
        except OSError:
            self.__exit__(None, None, None)
            raise
        return self

    @staticmethod
    def wait_free(directory: Path) -> None:
        """Block until no process holds `directory`'s lock (return at once when none does)."""
        path = Path(directory) / LOCK_FILE
        if not path.exists():
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # granted once the exclusive holder is gone
        finally:
            os.close(fd)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock; the file stays (removing it would race a new holder)
            self.fd = None
