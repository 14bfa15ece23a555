"""Writing a serving-format directory loses nothing, whatever happens at out= meanwhile (served_dir.write_directory).

Each race is staged deterministically: the `check` hook runs after the files are written and before they are
renamed into place, the window in which another process may create, fill or replace out=; a second writer
runs in a thread inside that window; a killed export is a real `kill -9` of a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from experiments.lib.store.served_dir import MARK, FormatError, check_out, is_export, write_directory

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"model_type": "llama"}


def write(out: Path, value: float = 1.0, **kwargs) -> Path:
    return write_directory(out, CONFIG, {"w": torch.full((2,), value)}, **kwargs)


def hidden(directory: Path) -> list[str]:
    """What a writer left beside its output: temporary directories, lock files."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------------------------------ what appears meanwhile


def test_a_directory_made_at_out_while_the_export_runs_is_refused_and_kept(tmp_path: Path) -> None:
    out = tmp_path / "new"

    def someone_else(tmp: Path) -> None:  # another process makes out= and writes in it before the rename
        out.mkdir(exist_ok=True)
        (out / "notes.txt").write_text("mine\n")

    with pytest.raises(FormatError) as error:
        write(out, check=someone_else)
    assert f"out={out} changed while the export ran" in one_line(error)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine\n"
    assert hidden(tmp_path) == []


def test_overwrite_refuses_an_earlier_export_replaced_meanwhile_and_puts_it_back(tmp_path: Path) -> None:
    out = write(tmp_path / "e")

    def replace_it(tmp: Path) -> None:  # out= is no longer the export check_out saw
        shutil.rmtree(out)
        out.mkdir()
        (out / "notes.txt").write_text("mine\n")

    with pytest.raises(FormatError) as error:
        write(out, 2.0, overwrite=True, check=replace_it)
    assert "no longer holds only an earlier export: left as it is" in one_line(error)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert hidden(tmp_path) == []


def test_a_second_writer_while_the_first_writes_is_refused_in_one_line(tmp_path: Path) -> None:
    out, second = tmp_path / "new", {}

    def race(tmp: Path) -> None:
        def run() -> None:
            try:
                write(out, 2.0)
                second["result"] = "written"
            except FormatError as e:
                second["result"] = str(e)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()

    write(out, 1.0, check=race)
    assert second["result"].startswith(f"out={out} is being written by another export (pid {os.getpid()}")
    assert "\n" not in second["result"]
    assert is_export(out) and hidden(tmp_path) == []


# ------------------------------------------------------------------------------------------ symbolic links


@pytest.mark.parametrize("dangling", [False, True])
def test_a_symbolic_link_as_out_is_refused_and_left_as_it_is(tmp_path: Path, dangling: bool) -> None:
    target = tmp_path / "gone" if dangling else write(tmp_path / "v1")
    link = tmp_path / "latest"
    link.symlink_to(target)
    before = None if dangling else {p.name: p.read_bytes() for p in target.iterdir()}
    with pytest.raises(FormatError) as error:
        write(link, 2.0, overwrite=True)
    message = one_line(error)
    assert message.startswith(f"out={link} is a symbolic link (to {target}") and "give the directory itself" in message
    assert ("which does not exist" in message) == dangling
    assert link.is_symlink() and os.readlink(link) == str(target)
    if not dangling:
        assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert hidden(tmp_path) == []


def test_links_above_out_are_resolved(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    assert check_out(tmp_path / "alias" / "new", overwrite=False) == tmp_path / "real" / "new"
    assert write(tmp_path / "alias" / "new") == tmp_path / "real" / "new" and is_export(tmp_path / "real" / "new")


# ------------------------------------------------------------------------------------------ a killed export

HANG = """
import sys, time, torch
from experiments.lib.store.served_dir import write_directory
def hang(tmp):
    print("written", flush=True)
    time.sleep(120)
write_directory(sys.argv[1], {"model_type": "llama"}, {"w": torch.ones(2)}, check=hang)
"""


def test_what_a_killed_export_left_is_removed_by_the_next(tmp_path: Path) -> None:
    out = tmp_path / "new"
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-c", HANG, str(out)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdout.readline().strip() == "written"
    finally:
        process.kill()  # SIGKILL: nothing of its own cleans up
        process.wait()
    left = hidden(tmp_path)
    assert any(name.startswith(f".new.{process.pid}.") and name.endswith(".tmp") for name in left), left
    write(out, 2.0)  # its lock does not block (the kernel dropped it); its temporary directory is removed
    assert is_export(out) and hidden(tmp_path) == []


def test_stale_directories_are_removed_restored_or_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dead, alive = dead_pid(), os.getppid()
    earlier = write(tmp_path / "src")
    (tmp_path / f".new.{dead}.tmp").mkdir()  # the older writers' name, a partial file in it
    (tmp_path / f".new.{dead}.tmp" / "model.safetensors").write_bytes(b"\x00" * 8)
    (tmp_path / f".new.{alive}.0123abcd.tmp").mkdir()  # a live process's: not ours to remove
    (tmp_path / f".new.{dead}.89abcdef.tmp").mkdir()
    (tmp_path / f".new.{dead}.89abcdef.tmp" / "notes.txt").write_text("mine\n")  # not what an export writes
    os.rename(earlier, tmp_path / f".new.{dead}.0123abcd.old")  # killed between moving it aside and the rename
    with pytest.raises(FormatError, match="exists and is not empty"):
        write(tmp_path / "new")
    assert is_export(tmp_path / "new")  # the earlier export is back where it was
    assert json.loads((tmp_path / "new" / "config.json").read_text())[MARK] == {"exported": True}
    assert hidden(tmp_path) == sorted([f".new.{alive}.0123abcd.tmp", f".new.{dead}.89abcdef.tmp"])  # by name, not pid
    assert f".new.{dead}.89abcdef.tmp: named like an export's own directory" in caplog.text
