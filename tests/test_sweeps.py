"""Sweeps that never lose work: a failing job of a multirun is recorded (failed.json, one line) and the others
run; the multirun then exits non-zero naming the failed jobs; Ctrl-C stops a run or a whole sweep in one line;
a full disk or a path we may not write is one line; summarize lists failed and killed jobs; the Slurm and
joblib launcher configs compose for the entry points and run.

The multiruns run a tiny Hydra app decorated exactly like the entry points (written to a temporary dir):
importing torch would cost seconds per process, and the app fails, sleeps or succeeds on demand."""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig

from experiments import summarize as summ_mod
from experiments.lib.common import errors as cli

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
ENTRY_POINTS = (
    "train_base",
    "train_drafter",
    "benchmark",
    "generate",
    "baseline",
    "cache_features",
    "grow_tree",
    "peer",
    "train_seq2seq",
)

APP = '''
"""A Hydra app decorated like the entry points: value=N writes results.json, other values fail or sleep."""
import errno, json, time
from pathlib import Path

import hydra
from omegaconf import DictConfig

from experiments.lib.common.errors import exit_on_user_error


@hydra.main(version_base="1.3", config_path=".", config_name="app")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    value = str(cfg.value)
    if value == "bad":
        raise ValueError(f"value must be an integer, got {value!r}")
    if value == "bug":
        print(1 / 0)
    if value == "full":
        raise OSError(errno.ENOSPC, "No space left on device", str(Path(cfg.out_dir) / "checkpoint.pt"))
    if value == "sleep":
        print("ready", flush=True)
        time.sleep(60)
    gamma = int(value)
    row = {"name": "m", "temperature": 0.0, "gamma": gamma, "tau": 1.0 + gamma, "alpha": 0.5, "speedup": 1.0,
           "efficiency": 1.0, "draft_share": 0.1, "lossless": True, "exact": True, "threads": 1, "compiled": False}
    (Path(cfg.out_dir) / "results.json").write_text(json.dumps({"methods": [row]}))


if __name__ == "__main__":
    main()
'''

APP_CONFIG = f"""
value: 1
out_dir: ${{hydra:runtime.output_dir}}
hydra:
  job:
    chdir: false
  searchpath: [file://{CONF}]   # the project's hydra/launcher configs
"""


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("app")
    (directory / "app.py").write_text(APP)
    (directory / "app.yaml").write_text(APP_CONFIG)
    return directory / "app.py"


def env() -> dict:
    # PYTHONPATH: this checkout's experiments package, whatever the venv has installed
    environ = {key: value for key, value in os.environ.items() if key != "HYDRA_FULL_ERROR"}  # Hydra's own traceback
    return {**environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def run(*args: str, cwd: Path, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout)


def run_app(app: Path, *overrides: str) -> subprocess.CompletedProcess:
    return run(str(app), *overrides, cwd=app.parent)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def interrupt_app(app: Path, *overrides: str) -> tuple[int, str]:
    """Run the app until it prints `ready`, press Ctrl-C (SIGINT), return its exit status and stderr."""
    proc = subprocess.Popen(
        [sys.executable, str(app), *overrides],
        cwd=app.parent,
        env=env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # a shell's background job ignores SIGINT, and children inherit that: undo it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    for line in proc.stdout:
        if line.strip() == "ready":
            break
    else:
        proc.wait(timeout=30)
        pytest.fail(f"the app never got ready: {proc.stderr.read()}")
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    return proc.returncode, stderr


# ------------------------------------------------------------------------- 1. a multirun with failing jobs


@pytest.fixture(scope="module")
def sweep(app: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """Four jobs with the basic launcher: 1 is a user error, 2 a bug; 0 and 3 succeed."""
    sweep_dir = tmp_path_factory.mktemp("sweep") / "multirun"
    proc = run_app(app, "-m", "value=1,bad,bug,2", f"hydra.sweep.dir={sweep_dir}")
    return sweep_dir, proc


def test_jobs_before_and_after_a_failure_run(sweep) -> None:
    sweep_dir, proc = sweep
    for job in (0, 3):
        assert (sweep_dir / str(job) / "results.json").is_file(), proc.stderr
        assert not (sweep_dir / str(job) / "failed.json").exists()
    for job in (1, 2):
        assert (sweep_dir / str(job) / "failed.json").is_file(), proc.stderr
        assert not (sweep_dir / str(job) / "results.json").exists()


def test_failed_json_of_a_user_error_and_of_a_bug(sweep) -> None:
    sweep_dir, _ = sweep
    user = json.loads((sweep_dir / "1" / "failed.json").read_text())
    assert user == {
        "job": 1,
        "overrides": ["value=bad"],
        "error_type": "ValueError",
        "message": "value must be an integer, got 'bad'",
        "user_error": True,
        "traceback": None,
    }
    bug = json.loads((sweep_dir / "2" / "failed.json").read_text())
    assert bug["job"] == 2 and bug["overrides"] == ["value=bug"] and bug["error_type"] == "ZeroDivisionError"
    assert bug["user_error"] is False and bug["message"].startswith("ZeroDivisionError: division by zero")
    assert "Traceback (most recent call last)" in bug["traceback"] and "print(1 / 0)" in bug["traceback"]


def test_multirun_with_failures_exits_non_zero_naming_them_in_one_line_each(sweep) -> None:
    sweep_dir, proc = sweep
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr  # a bug's traceback is in its failed.json, not on the terminal
    lines = error_lines(proc.stderr)
    assert lines[0] == "error: job 1 (value=bad): value must be an integer, got 'bad'"
    assert lines[1] == (
        f"error: job 2 (value=bug): ZeroDivisionError: division by zero "
        f"(traceback in {sweep_dir / '2' / 'failed.json'})"
    )
    assert lines[2] == (
        f"error: 2 jobs of the sweep failed: job 1 (value=bad), job 2 (value=bug); "
        f"each one's failed.json in {sweep_dir} says why"
    )
    assert len(lines) == 3


def test_a_sweep_without_failures_exits_0_and_drops_old_failures(app: Path, tmp_path: Path) -> None:
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "failed.json").write_text('{"job": 0, "message": "from an earlier sweep into this dir"}')
    proc = run_app(app, "-m", "value=1,2", f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    assert error_lines(proc.stderr) == [] and not list(tmp_path.rglob("failed.json"))
    assert (tmp_path / "0" / "results.json").is_file() and (tmp_path / "1" / "results.json").is_file()


def test_joblib_launcher_runs_every_job_and_records_the_failure(app: Path, tmp_path: Path) -> None:
    proc = run_app(app, "-m", "hydra/launcher=parallel", "value=1,bad,2", f"hydra.sweep.dir={tmp_path}")
    assert "Joblib.Parallel(n_jobs=2" in proc.stdout  # our config, not the basic launcher
    assert proc.returncode == 1, proc.stderr
    assert (tmp_path / "0" / "results.json").is_file() and (tmp_path / "2" / "results.json").is_file()
    assert json.loads((tmp_path / "1" / "failed.json").read_text())["error_type"] == "ValueError"
    assert error_lines(proc.stderr) == [
        "error: job 1 (value=bad): value must be an integer, got 'bad'",
        f"error: 1 job of the sweep failed: job 1 (value=bad); each one's failed.json in {tmp_path} says why",
    ]


def test_every_entry_point_keeps_the_decorator_inside_hydra_main() -> None:
    """The decorator must see the exception before Hydra does: `@hydra.main(...)` then `@exit_on_user_error`."""
    pattern = re.compile(r"@hydra\.main\([^)]*\)\n@exit_on_user_error\ndef main\(cfg: DictConfig\)")
    for name in ENTRY_POINTS:
        source = (ROOT / "experiments" / f"{name}.py").read_text()
        assert len(pattern.findall(source)) == 1, name


@pytest.mark.slow  # importing torch and the project: ~5 s on a quiet machine
def test_a_real_entry_point_multirun_runs_every_job(tmp_path: Path) -> None:
    """train_base refuses max_steps <= 0 before loading any data: two jobs, two failures, both recorded."""
    proc = run(
        "-m",
        "experiments.train_base",
        "-m",
        "max_steps=0,-1",
        "logger=none",
        f"hydra.sweep.dir={tmp_path}",
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert error_lines(proc.stderr) == [
        "error: job 0 (max_steps=0 logger=none): max_steps must be a positive integer, got 0",
        "error: job 1 (max_steps=-1 logger=none): max_steps must be a positive integer, got -1",
        "error: 2 jobs of the sweep failed: job 0 (max_steps=0 logger=none), job 1 (max_steps=-1 logger=none); "
        f"each one's failed.json in {tmp_path} says why",
    ]
    assert [json.loads((tmp_path / job / "failed.json").read_text())["job"] for job in "01"] == [0, 1]


@pytest.mark.slow
def test_a_real_entry_point_multirun_with_joblib(tmp_path: Path) -> None:
    proc = run(
        "-m",
        "experiments.train_base",
        "-m",
        "hydra/launcher=parallel",
        "max_steps=0,-1",
        "logger=none",
        f"hydra.sweep.dir={tmp_path}",
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert sorted(p.parent.name for p in tmp_path.glob("*/failed.json")) == ["0", "1"]
    assert error_lines(proc.stderr)[-1].startswith("error: 2 jobs of the sweep failed: job 0 (max_steps=0")


# ------------------------------------------------------------------------------------ 2. runtime faults


def test_ctrl_c_in_a_single_run_is_one_line_exit_130(app: Path, tmp_path: Path) -> None:
    code, stderr = interrupt_app(app, "value=sleep", f"hydra.run.dir={tmp_path}")
    assert code == 130 and stderr == "interrupted\n"


@pytest.fixture(scope="module")
def interrupted_sweep(app: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str]:
    """Ctrl-C during job 0 of two."""
    sweep_dir = tmp_path_factory.mktemp("interrupted")
    code, stderr = interrupt_app(app, "-m", "value=sleep,1", f"hydra.sweep.dir={sweep_dir}")
    return sweep_dir, code, stderr


def test_ctrl_c_stops_the_whole_sweep(interrupted_sweep) -> None:
    sweep_dir, code, stderr = interrupted_sweep
    assert code == 130 and stderr == "interrupted\n"
    assert (sweep_dir / "0").is_dir() and not (sweep_dir / "1").exists()  # the job after it never started
    assert not list(sweep_dir.rglob("failed.json"))  # an interruption is not a job failure


def test_full_disk_in_a_single_run_is_one_line_exit_2(app: Path, tmp_path: Path) -> None:
    proc = run_app(app, "value=full", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2
    assert proc.stderr == (
        f"error: disk full while writing {tmp_path / 'checkpoint.pt'}: free some space or write "
        "elsewhere (No space left on device)\n"
    )


def test_a_user_error_in_a_single_run_is_unchanged(app: Path, tmp_path: Path) -> None:
    proc = run_app(app, "value=bad", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2 and proc.stderr == "error: value must be an integer, got 'bad'\n"
    assert not (tmp_path / "failed.json").exists()  # failed.json is for the jobs of a multirun


def raising(error: BaseException):
    @cli.exit_on_user_error
    def main() -> None:
        raise error

    return main


@pytest.mark.parametrize(
    "error, line",
    [
        (
            OSError(errno.ENOSPC, "No space left on device", "/data/run/checkpoint.pt"),
            "error: disk full while writing /data/run/checkpoint.pt: free some space or write elsewhere "
            "(No space left on device)",
        ),
        (
            OSError(errno.ENOSPC, "No space left on device"),  # a write through an open file: the OS names no file
            "error: disk full while writing a file: free some space or write elsewhere (No space left on device)",
        ),
        (
            PermissionError(errno.EACCES, "Permission denied", "/data/run/results.json"),
            "error: cannot write /data/run/results.json: permission denied",
        ),
        (
            OSError(errno.EACCES, "Permission denied", "/data/run/results.json"),
            "error: cannot write /data/run/results.json: permission denied",
        ),
        (
            OSError(errno.EROFS, "Read-only file system", "/mnt/ro/metrics.jsonl"),
            "error: cannot write /mnt/ro/metrics.jsonl: read-only file system",
        ),
        (FileNotFoundError("checkpoint /x does not exist"), "error: checkpoint /x does not exist"),
    ],
)
def test_runtime_faults_are_one_line_exit_2(error: BaseException, line: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as excinfo:
        raising(error)()
    assert excinfo.value.code == 2
    assert capsys.readouterr().err == line + "\n"


def test_permission_denied_on_a_file_we_may_not_read_says_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    path = tmp_path / "checkpoint.pt"
    path.write_text("x")
    monkeypatch.setattr(os, "access", lambda p, mode: False)  # root may read anything: pretend we may not
    with pytest.raises(SystemExit):
        raising(PermissionError(errno.EACCES, "Permission denied", str(path)))()
    assert capsys.readouterr().err == f"error: cannot read {path}: permission denied\n"


def test_ctrl_c_in_process_is_exit_130(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as excinfo:
        raising(KeyboardInterrupt())()
    assert excinfo.value.code == 130 and capsys.readouterr().err == "interrupted\n"


@pytest.mark.parametrize("error", [KeyError("bug"), OSError(errno.EIO, "Input/output error", "/x")])
def test_bugs_and_other_os_errors_keep_their_traceback(error: BaseException) -> None:
    with pytest.raises(type(error)):
        raising(error)()


def job_in(tmp_path: Path, num: int = 3, output_dir: Path | None = None) -> cli.SweepJob:
    return cli.SweepJob(
        num=num,
        overrides=["decode.gamma=0", "repeats=1"],
        output_dir=output_dir or tmp_path / str(num),
        sweep_dir=tmp_path,
    )


def test_a_failed_job_that_cannot_write_failed_json_still_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "3").write_text("a file where the job directory should be")
    job = job_in(tmp_path, output_dir=tmp_path / "3" / "sub")

    def main() -> None:
        raise ValueError("decode.gamma must be >= 1, got 0")

    with pytest.raises(cli.JobFailed) as excinfo:
        cli.run_sweep_job(job, main)
    err = capsys.readouterr().err
    assert err.startswith("error: job 3 (decode.gamma=0 repeats=1): decode.gamma must be >= 1, got 0 (could not write ")
    assert err.count("\n") == 1
    assert str(excinfo.value) == (
        f"error: 1 job of the sweep failed: job 3 (decode.gamma=0 repeats=1); "
        f"each one's failed.json in {tmp_path} says why"
    )


def test_job_failed_pickles_and_names_every_failed_job(tmp_path: Path) -> None:
    """joblib and submitit send the exception back to the launching process pickled."""
    for num in (3, 5):
        with pytest.raises(cli.JobFailed):
            cli.run_sweep_job(job_in(tmp_path, num), lambda: 1 / 0)
    error = pickle.loads(pickle.dumps(cli.JobFailed(str(tmp_path), 3, "job 3 (decode.gamma=0 repeats=1)")))
    assert str(error).startswith(
        "error: 2 jobs of the sweep failed: job 3 (decode.gamma=0 repeats=1), job 5 (decode.gamma=0 repeats=1); "
    )


def test_a_sweep_job_that_succeeds_returns_its_value(tmp_path: Path) -> None:
    assert cli.run_sweep_job(job_in(tmp_path), lambda: 7) == 7
    assert not (tmp_path / "3" / "failed.json").exists()


# ------------------------------------------------------------------------------------------ 3. summarize


def test_summarize_lists_failed_and_killed_jobs(sweep, tmp_path: Path) -> None:
    sweep_dir = tmp_path / "multirun"
    shutil.copytree(sweep[0], sweep_dir)
    shutil.copytree(sweep_dir / "3", sweep_dir / "4")  # job 4: killed before writing anything
    (sweep_dir / "4" / "results.json").unlink()
    (sweep_dir / "4" / ".hydra" / "overrides.yaml").write_text("- value=4\n")
    rows = summ_mod.summarize(sweep_dir)
    assert [(r["job"], r["status"]) for r in rows] == [
        ("0", "ok"),
        ("1", "failed"),
        ("2", "failed"),
        ("3", "ok"),
        ("4", "no result"),
    ]
    assert rows[1]["error"] == "value must be an integer, got 'bad'" and rows[1]["error_type"] == "ValueError"
    assert rows[4]["error"] == "no result (killed or still running)" and rows[4]["overrides"] == "value=4"
    assert json.loads((sweep_dir / "summary.json").read_text()) == rows
    md = (sweep_dir / "summary.md").read_text()
    assert "\n## Failed jobs\n" in md
    assert "| 1 | value=bad | value must be an integer, got 'bad' |" in md
    # the message recorded when the job failed (in the sweep this one is a copy of)
    assert (
        f"| 2 | value=bug | ZeroDivisionError: division by zero (traceback in {sweep[0] / '2' / 'failed.json'}) |" in md
    )
    assert "| 4 | value=4 | no result (killed or still running) |" in md
    assert md.count("| m | eager 1t |") == 2  # the two jobs that ran keep their rows
    # drawn against the setting the jobs that ran sweep (value=1, 2: numbers), not against their fixed gamma
    assert (sweep_dir / "speedup_vs_value.png").stat().st_size > 0 and not (sweep_dir / "speedup_vs_gamma.png").exists()
    assert not list(sweep_dir.glob(".*.tmp"))  # atomic writes leave no temp files


def test_summarize_of_an_interrupted_sweep(interrupted_sweep, tmp_path: Path) -> None:
    shutil.copytree(interrupted_sweep[0], tmp_path / "multirun")
    rows = summ_mod.summarize(tmp_path / "multirun")
    assert rows == [
        {
            "job": "0",
            "overrides": "value=sleep",
            "status": "no result",
            "error_type": "",
            "error": "no result (killed or still running)",
        }
    ]
    assert not list((tmp_path / "multirun").glob("speedup_vs_*.png"))  # nothing to plot


@pytest.mark.parametrize(
    "content, fragment",
    [
        ('{"methods": [{"name": "m"', "results.json is not valid JSON (cut short?): "),
        ('{"rows": []}', 'results.json has no list of method rows under "methods"'),
        ("", "results.json is not valid JSON (cut short?): "),
    ],
)
def test_summarize_a_corrupt_results_json_is_one_line(
    sweep, content: str, fragment: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    sweep_dir = tmp_path / "multirun"
    shutil.copytree(sweep[0], sweep_dir)
    (sweep_dir / "3" / "results.json").write_text(content)
    assert summ_mod.main([str(sweep_dir)]) == 0
    out = capsys.readouterr().out
    [line] = [line for line in out.splitlines() if line.startswith("| 3 |")]
    assert line.startswith(f"| 3 | value=2 | {fragment}") and "Traceback" not in out
    assert out.count("| m | eager 1t |") == 1  # job 0 is still summarized


def test_summarize_bad_directories_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "multirun.yaml").write_text("hydra: {}\n")  # a sweep that launched no job
    for directory, fragment in [(tmp_path / "missing", "does not exist"), (tmp_path, "holds no */results.json")]:
        assert summ_mod.main([str(directory)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and fragment in err and err.count("\n") == 1


def test_summarize_an_unwritable_directory_is_one_line(
    sweep, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    def denied(path, data) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(summ_mod, "write_atomic", denied)
    assert summ_mod.main([str(sweep[0])]) == 2
    assert capsys.readouterr().err == f"error: cannot write {sweep[0] / 'summary.md'}: permission denied\n"


def test_summarize_a_job_rerun_after_its_failure_counts_its_results(sweep, tmp_path: Path) -> None:
    sweep_dir = tmp_path / "multirun"
    shutil.copytree(sweep[0], sweep_dir)
    shutil.copy(sweep_dir / "0" / "results.json", sweep_dir / "1" / "results.json")
    os.utime(sweep_dir / "1" / "failed.json", (time.time() - 60, time.time() - 60))  # the failure came first
    rows = summ_mod.summarize(sweep_dir)
    assert [r["status"] for r in rows if r["job"] == "1"] == ["ok"]


def test_write_atomic_keeps_the_old_file_when_the_write_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "summary.md"
    cli.write_atomic(path, "old\n")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        cli.write_atomic(path, "new\n")
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["summary.md"]


# ------------------------------------------------------------------------------------- 4. the launchers


def compose_with(name: str, *overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        extra = [] if name == "train_base" else ["base_checkpoint=/b"]
        return compose(config_name=name, overrides=[*overrides, *extra], return_hydra_config=True)


@pytest.mark.parametrize("name", ["benchmark", "train_base", "train_drafter"])
def test_slurm_launcher_composes(name: str) -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")  # the optional `sweep` extra
    launcher = compose_with(name, "hydra/launcher=slurm").hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (
        launcher.partition,
        launcher.timeout_min,
        launcher.cpus_per_task,
        launcher.gpus_per_node,
        launcher.mem_gb,
        launcher.array_parallelism,
    ) == (None, 240, 8, None, 16, 16)
    launcher = compose_with(
        name,
        "hydra/launcher=slurm",
        "hydra.launcher.partition=gpu",
        "hydra.launcher.timeout_min=30",
        "hydra.launcher.gpus_per_node=1",
    ).hydra.launcher
    assert (launcher.partition, launcher.timeout_min, launcher.gpus_per_node) == ("gpu", 30, 1)


@pytest.mark.parametrize("name", ["benchmark", "train_base", "train_drafter"])
def test_joblib_launcher_composes(name: str) -> None:
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    launcher = compose_with(name, "hydra/launcher=parallel").hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
    assert launcher.n_jobs == 2 and launcher.prefer == "processes"
    assert compose_with(name, "hydra/launcher=parallel", "hydra.launcher.n_jobs=4").hydra.launcher.n_jobs == 4


def test_slurm_launcher_writes_a_valid_sbatch_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin's own launch() turns our config into submitit's sbatch parameters (which it validates);
    only the submission is stubbed out: there is no cluster here."""
    submitit = pytest.importorskip("submitit")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text("#!/bin/sh\n")  # submitit checks that it is on a Slurm machine
    (tmp_path / "bin" / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    submitted = []
    monkeypatch.setattr(
        submitit.AutoExecutor, "map_array", lambda executor, fn, *args: submitted.append(executor) or []
    )
    cfg = compose_with(
        "benchmark", "hydra/launcher=slurm", "hydra.launcher.partition=cpu", f"hydra.sweep.dir={tmp_path / 'sweep'}"
    )
    launcher = instantiate(cfg.hydra.launcher)
    launcher.config = cfg
    assert launcher.launch([["decode.gamma=1"], ["decode.gamma=2"]], initial_job_idx=0) == []
    script = submitted[0]._executor._make_submission_file_text("python -m experiments.benchmark", "0")
    for line in ("--partition=cpu", "--time=240", "--cpus-per-task=8", "--mem=16GB", "--ntasks-per-node=1"):
        assert f"#SBATCH {line}\n" in script, line
    assert "gpus" not in script
    assert submitted[0]._executor.parameters["array_parallelism"] == 16


def test_write_atomic_files_get_the_umask_mode_and_leave_no_temporary(tmp_path: Path) -> None:
    from experiments.lib.common.errors import write_atomic

    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "results.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "results.json").stat().st_mode & 0o777 == 0o644  # like open(): readable by the group
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]
