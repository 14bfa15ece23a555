"""The one training loop: exact resume of every drafter after a crash or kill -9, the run-directory lock,
recipe checks on resume, gradient accumulation, and torchrun with two ranks on CPU (identical replicas)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from experiments.lib.store.checkpoint import CheckpointError, load_checkpoint
from experiments.lib.store.rundir import RunDirectoryInUse, RunLock
from experiments.lib.training import base_trainer, drafter_trainer
from experiments.lib.training import loop as training
from experiments.lib.training.loop import MetricsFile
from tests.test_experiments import BASE, FAMILIES, drafter_cfg, make_cfg

ROOT = Path(__file__).resolve().parents[1]
FP32 = ["precision=fp32", "threads=1", "max_minutes=null"]  # bit-exact: no autocast, one thread, no wall-clock schedule
TORCHRUN = Path(sys.executable).with_name("torchrun")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def base_cfg(out_dir: Path, cache_dir: str, *overrides: str):
    return make_cfg("train_base", *BASE, *FP32, f"data.cache_dir={cache_dir}", f"out_dir={out_dir}", *overrides)


def fingerprint_of(result: dict) -> str:
    return load_checkpoint(Path(result["checkpoint"])).meta["fingerprint"]


def crash_at(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    real_step = training.TrainLoop.step

    def crashing_step(self, elapsed):
        if self.state.step == step:
            raise RuntimeError("killed")
        return real_step(self, elapsed)

    monkeypatch.setattr(training.TrainLoop, "step", crashing_step)


# ------------------------------------------------------------------------------- drafters: crash, resume


@pytest.mark.parametrize("family", FAMILIES)
def test_drafter_crash_and_resume_equals_uninterrupted(
    family: str, tiny_base: Path, cache_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    common = ["max_steps=6", "checkpoint_every=2", "eval_every=2", *FP32]
    clean = drafter_trainer.train(drafter_cfg(family, tiny_base, cache_dir, tmp_path / "clean", *common))
    crash_at(monkeypatch, 5)
    with pytest.raises(RuntimeError, match="killed"):
        drafter_trainer.train(drafter_cfg(family, tiny_base, cache_dir, tmp_path / "crashed", *common))
    monkeypatch.undo()
    meta = load_checkpoint(tmp_path / "crashed" / "last").meta  # the periodic checkpoint of the latest weights
    assert meta["step"] == 4 and meta["finished"] is False and meta["has_optimizer"]
    resumed = drafter_trainer.train(drafter_cfg(family, tiny_base, cache_dir, tmp_path / "crashed", *common))
    assert resumed["start_step"] == 4 and resumed["step"] == 6
    # the batch and the RNG of step s are functions of (seed, s): the resumed run retraces the clean one
    assert fingerprint_of(resumed) == fingerprint_of(clean)
    assert resumed["positions"] == clean["positions"]
    metric = {
        "medusa": "head1_agree",
        "prophet": "step1_agree",
        "prophet_block": "head1_agree",
        "draft": "agree",
        "sequential": "head1_agree",
        "early_exit": "agree",
    }[family]
    assert resumed[metric] == clean[metric]
    steps = [r["step"] for r in MetricsFile.read(tmp_path / "crashed" / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == list(range(1, 7))  # no repeats, no gaps
    assert load_checkpoint(tmp_path / "crashed" / "checkpoint").meta["finished"] is True
    assert load_checkpoint(tmp_path / "crashed" / "last").meta["finished"] is True
    assert meta_of(tmp_path / "crashed" / "last")["fingerprint"] == meta_of(tmp_path / "clean" / "last")["fingerprint"]


def _wait_for_checkpoint(out_dir: Path, proc: subprocess.Popen, *, step: int, timeout: float) -> int:
    meta = out_dir / "last" / "meta.json"  # the periodic checkpoint
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if meta.is_file():
            found = json.loads(meta.read_text())["step"]
            if found >= step:
                return found
        time.sleep(0.02)
    raise AssertionError(f"no checkpoint at step >= {step} before the process ended: {proc.poll()}")


@pytest.mark.slow
def test_drafter_survives_kill_9(tiny_base: Path, cache_dir: str, tmp_path: Path) -> None:
    """A real SIGKILL mid-run: the periodic checkpoint is intact and resuming ends on the clean run's weights."""
    args = ["max_steps=150", "checkpoint_every=1", "eval_every=1000", "log_every=1000", *FP32]
    cfg = drafter_cfg("medusa", tiny_base, cache_dir, tmp_path / "killed", *args)
    overrides = [f"{k}={v}" for k, v in [("drafter", "medusa"), ("base_checkpoint", tiny_base)]]
    command = [
        sys.executable,
        "-m",
        "experiments.train_drafter",
        *overrides,
        *_cli_overrides(cfg, args),
        f"hydra.run.dir={tmp_path / 'killed'}",
    ]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_for_checkpoint(tmp_path / "killed", proc, step=3, timeout=240)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    meta = load_checkpoint(tmp_path / "killed" / "last").meta  # complete and verified (fingerprint)
    assert 3 <= meta["step"] < 150 and meta["finished"] is False
    resumed = drafter_trainer.train(cfg)
    clean = drafter_trainer.train(drafter_cfg("medusa", tiny_base, cache_dir, tmp_path / "clean", *args))
    assert resumed["start_step"] == meta["step"] and resumed["step"] == 150
    assert fingerprint_of(resumed) == fingerprint_of(clean)


def _cli_overrides(cfg, extra: list[str]) -> list[str]:
    """The drafter_cfg overrides as command-line arguments (the same run, launched as a process)."""
    from tests.test_experiments import DATA, DRAFTER, SMALL

    return [
        *DRAFTER,
        *SMALL["medusa"],
        *DATA,
        f"data.cache_dir={cfg.data.cache_dir}",
        f"features.root={cfg.features.root}",
        *extra,
    ]


def test_an_unfinished_artifact_is_resumed_not_reused(
    tiny_base: Path, cache_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from experiments.lib.training import artifacts
    from tests.test_experiments import DRAFTER

    recipe = [
        f"base_checkpoint={tiny_base}",
        "drafter=medusa",
        *DRAFTER,
        f"data.cache_dir={cache_dir}",
        f"features.root={cache_dir}/features",
        "max_steps=6",
        "checkpoint_every=2",
        *FP32,
    ]
    crash_at(monkeypatch, 5)
    with pytest.raises(RuntimeError, match="killed"):  # a benchmark killed while it trained its medusa
        artifacts.ensure("medusa", recipe, root=tmp_path)
    monkeypatch.undo()
    ckpt = artifacts.ensure("medusa", recipe, root=tmp_path)  # the next benchmark
    meta = load_checkpoint(ckpt).meta  # the best validation's (chain_tau), at step 2, 4 or 6
    assert meta["finished"] is True and load_checkpoint(ckpt.parent / "last").meta["step"] == 6  # ran to the end
    assert json.loads((ckpt.parent / "result.json").read_text())["start_step"] == 4  # resumed, not started over


# --------------------------------------------------------------------------------- the run directory


def test_second_training_in_the_same_directory_fails_at_once(
    tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_work(**kwargs):
        raise AssertionError("prepare_data ran although the run directory is in use")

    monkeypatch.setattr(base_trainer, "prepare_data", no_work)
    with RunLock(tmp_path):  # held as another training would hold it
        with pytest.raises(
            RunDirectoryInUse, match=rf"run directory {tmp_path} is in use by another training \(pid {os.getpid()}\)"
        ):
            base_trainer.train(base_cfg(tmp_path, cache_dir, "max_steps=2"))


def test_lock_is_released_when_the_holder_dies(tmp_path: Path) -> None:
    code = (
        f"from experiments.lib.store.rundir import RunLock; l = RunLock({str(tmp_path)!r}).__enter__(); "
        "import os; os.kill(os.getpid(), 9)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT)
    assert proc.returncode == -signal.SIGKILL and (tmp_path / ".lock").exists()
    with RunLock(tmp_path):  # the kernel dropped the dead process's lock: no stale lock to clean up
        pass


@pytest.mark.slow
def test_second_process_in_the_same_directory_gets_one_line(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from experiments.lib.store.rundir import RunLock; "
            f"l = RunLock({str(tmp_path)!r}).__enter__(); print('locked', flush=True); time.sleep(60)",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        proc = subprocess.run(
            [sys.executable, "-m", "experiments.train_base", *BASE, f"hydra.run.dir={tmp_path}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"error: run directory {tmp_path} is in use by another training (pid {holder.pid}); "
        "wait for it to finish or choose another out_dir / hydra.run.dir"
    )


def test_checkpoint_without_meta_is_refused_before_training(
    tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "model.safetensors").write_bytes(b"weights copied without their meta.json")
    monkeypatch.setattr(base_trainer, "prepare_data", lambda **kw: pytest.fail("trained before refusing"))
    with pytest.raises(ValueError, match="holds files but no meta.json: it is not a complete checkpoint"):
        base_trainer.train(base_cfg(tmp_path, cache_dir, "max_steps=2"))
    assert (tmp_path / "checkpoint" / "model.safetensors").read_bytes().startswith(b"weights")  # nothing lost


def test_out_dir_that_cannot_be_written_is_one_line(tmp_path: Path, cache_dir: str) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"out_dir='.*file/run' is not a writable directory \(.*file is a file\)"):
        base_trainer.train(base_cfg(tmp_path / "file" / "run", cache_dir, "max_steps=2"))


# ------------------------------------------------------------------------------------ recipe on resume


@pytest.mark.parametrize(
    "override, diff",
    [
        ("seed=1", "seed: checkpoint 0 vs now 1"),
        ("optim.lr=0.01", "'lr': 0.003"),
        ("batch_size=2", "batch_size: checkpoint 4 vs now 2"),
    ],
)
def test_base_resume_refuses_another_recipe(override: str, diff: str, tmp_path: Path, cache_dir: str) -> None:
    base_trainer.train(base_cfg(tmp_path, cache_dir, "max_steps=2"))
    with pytest.raises(CheckpointError, match="was trained with another recipe") as excinfo:
        base_trainer.train(base_cfg(tmp_path, cache_dir, "max_steps=4", override))
    assert diff in str(excinfo.value) and "\n" not in str(excinfo.value)
    assert base_trainer.train(base_cfg(tmp_path, cache_dir, "max_steps=4", override, "resume=false"))["start_step"] == 0


@pytest.mark.parametrize(
    "override, diff",
    [
        ("seed=1", "seed: checkpoint 0 vs now 1"),
        ("drafter.loss.target=argmax", "'target': 'kl'"),
        ("features.batch=8", "'batch': 8"),
    ],
)
def test_drafter_resume_refuses_another_recipe(
    override: str, diff: str, tiny_base: Path, cache_dir: str, tmp_path: Path
) -> None:
    drafter_trainer.train(drafter_cfg("medusa", tiny_base, cache_dir, tmp_path, "max_steps=2"))
    with pytest.raises(CheckpointError, match="was trained with another recipe") as excinfo:
        drafter_trainer.train(drafter_cfg("medusa", tiny_base, cache_dir, tmp_path, "max_steps=4", override))
    assert diff in str(excinfo.value)


def test_a_drafter_recipe_of_the_default_caching_batch_is_the_one_recorded_before_it(
    tiny_base: Path, cache_dir: str, tmp_path: Path
) -> None:
    # runs from before features.batch existed recorded no batch (they cached 16 windows at once): they resume
    out = drafter_trainer.train(drafter_cfg("medusa", tiny_base, cache_dir, tmp_path, "max_steps=2"))
    assert "batch" not in load_checkpoint(Path(out["checkpoint"])).meta["recipe"]["features"]


def test_drafter_resume_refuses_a_base_checkpoint_in_its_directory(
    tiny_base: Path, cache_dir: str, tmp_path: Path
) -> None:
    base_trainer.train(base_cfg(tmp_path, cache_dir, "max_steps=2"))  # a base's run directory, given as a drafter's
    with pytest.raises(ValueError, match=r"/last is not a drafter checkpoint \(kind='base_lm'\)"):
        drafter_trainer.train(drafter_cfg("medusa", tiny_base, cache_dir, tmp_path, "max_steps=2"))


# ------------------------------------------------------------------------------- gradient accumulation


def test_gradient_accumulation_matches_the_whole_batch(tmp_path: Path, cache_dir: str) -> None:
    whole = base_trainer.train(base_cfg(tmp_path / "whole", cache_dir, "max_steps=3"))
    accumulated = base_trainer.train(base_cfg(tmp_path / "accum", cache_dir, "max_steps=3", "grad_accum=2"))
    a = load_checkpoint(Path(whole["checkpoint"])).state_dict
    b = load_checkpoint(Path(accumulated["checkpoint"])).state_dict
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    assert accumulated["train_tokens"] == whole["train_tokens"]


def test_grad_accum_larger_than_the_batch_is_one_line(tmp_path: Path, cache_dir: str) -> None:
    with pytest.raises(ValueError, match="grad_accum=8 must not exceed the rows per step and process \\(4\\)"):
        base_trainer.train(base_cfg(tmp_path, cache_dir, "max_steps=2", "grad_accum=8"))


# ------------------------------------------------------------------------------------------ torchrun


def _torchrun(module: str, *overrides: str, timeout: int = 600) -> dict:
    proc = subprocess.run(
        [str(TORCHRUN), "--standalone", "--nproc_per_node", "2", "-m", module, *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout  # only rank 0 prints its result
    return json.loads(lines[0])


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    # the same global batch in two halves: equal up to float summation order
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=2e-4, rtol=1e-3) for k in a)


# 10-20 s (two ranks, each a fresh interpreter importing torch): the slow tier's; the fast tier keeps one process's
# training, its crash and resume, and gradient accumulation equal to the whole batch (above)
@pytest.mark.slow
def test_torchrun_two_ranks_train_identical_replicas(tmp_path: Path, cache_dir: str) -> None:
    common = [*BASE, *FP32, f"data.cache_dir={cache_dir}", "max_steps=4", "eval_every=2", "checkpoint_every=2"]
    result = _torchrun("experiments.train_base", *common, f"hydra.run.dir={tmp_path / 'ddp'}")
    assert result["world_size"] == 2 and result["step"] == 4
    meta = load_checkpoint(Path(result["last_checkpoint"])).meta  # the final weights
    assert result["replica_fingerprints"] == [meta["fingerprint"]] * 2  # both ranks end on the saved weights
    assert meta["world_size"] == 2 and result["train_tokens"] == 4 * 4 * 64  # the global batch, counted once
    single = base_trainer.train(
        base_cfg(tmp_path / "single", cache_dir, "max_steps=4", "eval_every=2", "checkpoint_every=2")
    )
    # data sharded by rank and gradients averaged: the same training as one process on the whole batch
    assert _close(
        load_checkpoint(Path(result["last_checkpoint"])).state_dict,
        load_checkpoint(Path(single["last_checkpoint"])).state_dict,
    )


@pytest.mark.slow
@pytest.mark.parametrize("family", ["medusa", "prophet"])
def test_torchrun_two_ranks_train_a_drafter(family: str, tiny_base: Path, cache_dir: str, tmp_path: Path) -> None:
    from tests.test_experiments import DATA, DRAFTER, SMALL

    common = [
        f"drafter={family}",
        f"base_checkpoint={tiny_base}",
        *DRAFTER,
        *SMALL[family],
        *DATA,
        *FP32,
        f"data.cache_dir={cache_dir}",
        f"features.root={cache_dir}/features",
    ]
    result = _torchrun("experiments.train_drafter", *common, f"hydra.run.dir={tmp_path / 'ddp'}")
    meta = load_checkpoint(Path(result["last_checkpoint"])).meta  # the final weights
    assert result["world_size"] == 2 and result["replica_fingerprints"] == [meta["fingerprint"]] * 2
    single = drafter_trainer.train(drafter_cfg(family, tiny_base, cache_dir, tmp_path / "single", *FP32))
    assert _close(
        load_checkpoint(Path(result["last_checkpoint"])).state_dict,
        load_checkpoint(Path(single["last_checkpoint"])).state_dict,
    )


# ------------------------------------------------------------------------- settings checked before work


@pytest.mark.parametrize(
    "family, override, message",
    [
        ("medusa", "drafter.loss.target=bogus", "target='bogus': must be one of kl, argmax, true, tv, kl_tv"),
        ("medusa", "+drafter.loss.foo=1", "drafter.loss.foo: not a setting of medusa.train.loss"),
        ("medusa", "+drafter.module.foo=1", "drafter.module.foo: not a setting of medusa.train.build"),
        ("prophet", "drafter.loss.unroll=0", "unroll=0: must be an integer >= 1"),
        ("medusa", "drafter.module.num_heads=0", "drafter.module.num_heads=0: must be an integer >= 1"),
    ],
)
def test_drafter_settings_fail_before_the_feature_cache(
    family: str,
    override: str,
    message: str,
    tiny_base: Path,
    cache_dir: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(drafter_trainer, "open_features", lambda *a, **k: pytest.fail("the feature cache ran first"))
    with pytest.raises(ValueError) as excinfo:
        drafter_trainer.train(drafter_cfg(family, tiny_base, cache_dir, tmp_path, override))
    assert message in str(excinfo.value) and "\n" not in str(excinfo.value)


def test_metrics_file_drops_a_line_cut_short_by_a_kill(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1}\n{"kind": "train", "step": 2}\n{"kind": "tr')
    assert [r["step"] for r in MetricsFile(path, resume_step=2).read(path)] == [1, 2]
    path.write_text('{"kind": "train", "step": 1}\nnot json\n{"kind": "train", "step": 2}\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        MetricsFile.read(path)


def test_a_nan_loss_stops_training_and_keeps_the_last_checkpoint(
    tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    base_trainer.train(base_cfg(tmp_path, cache_dir, "max_steps=2"))
    before = load_checkpoint(tmp_path / "checkpoint").meta["fingerprint"]
    real_loss = base_trainer.lm_loss
    monkeypatch.setattr(base_trainer, "lm_loss", lambda model, batch: real_loss(model, batch) * float("nan"))
    with pytest.raises(training.NonFiniteLoss, match="training loss is nan at step 2: lower optim.lr"):
        base_trainer.train(base_cfg(tmp_path, cache_dir, "max_steps=4"))
    assert load_checkpoint(tmp_path / "checkpoint").meta["fingerprint"] == before


@pytest.fixture
def small_disk(tmp_path: Path):
    """A directory on a tmpfs of the size asked for (root only: mount); skipped where it cannot be mounted."""
    mounted: list[Path] = []

    def mount(size_bytes: int) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        ok = (
            os.geteuid() == 0
            and subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(where)], capture_output=True
            ).returncode
            == 0
        )
        if not ok:
            pytest.skip("mounting a small tmpfs needs root")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], capture_output=True)


def test_a_full_disk_keeps_the_last_checkpoint(small_disk, tmp_path: Path, cache_dir: str) -> None:
    """A real full disk: the save that does not fit fails as ENOSPC, leaves no partial file, and the checkpoint
    before it stays whole (the atomic swap needs room for both, so the disk holds one and a half)."""
    probe = base_trainer.train(base_cfg(tmp_path / "probe", cache_dir, "max_steps=2"))
    size = sum(f.stat().st_size for f in Path(probe["checkpoint"]).iterdir())
    disk = small_disk(int(size * 1.5) + 64 * 1024)
    with pytest.raises(OSError) as excinfo:
        base_trainer.train(base_cfg(disk / "run", cache_dir, "max_steps=4", "checkpoint_every=2", "eval_every=2"))
    assert excinfo.value.errno == 28  # ENOSPC, which the command line prints as one line
    meta = load_checkpoint(disk / "run" / "checkpoint").meta  # whole and verified
    assert meta["step"] == 2
    assert sorted(p.name for p in (disk / "run").iterdir() if p.name.startswith(".checkpoint")) == []


def test_a_job_needing_an_artifact_another_job_is_training_waits_and_reuses_it(
    tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parallel sweep jobs share artifacts: the second waits for the first's lock instead of failing."""
    import threading

    from experiments.lib.training import artifacts

    real_train = base_trainer.train
    recipe = [*BASE, f"data.cache_dir={cache_dir}", "max_steps=2", "optim.warmup_steps=1", *FP32]
    out_dir = tmp_path / f"base-{artifacts.recipe_key(artifacts._compose('train_base', recipe))}"
    out_dir.mkdir()
    holder = RunLock(out_dir).__enter__()  # the first job, still training
    done: list[Path] = []
    waiter = threading.Thread(target=lambda: done.append(artifacts.ensure("base", recipe, root=tmp_path)))
    waiter.start()
    time.sleep(1.0)
    assert not done and waiter.is_alive()  # blocked on the lock, not failed
    monkeypatch.setattr(base_trainer, "train", lambda cfg: pytest.fail("trained the artifact a second time"))
    # the first job's finished checkpoint appears (trained elsewhere here: our holder stands for its lock)
    trained = real_train(base_cfg(tmp_path / "first", cache_dir, "max_steps=2", "optim.warmup_steps=1"))
    shutil.copytree(trained["checkpoint"], out_dir / "checkpoint")
    holder.__exit__(None, None, None)  # the first job ends
    waiter.join(timeout=120)
    assert done == [out_dir / "checkpoint"]


def test_another_recipe_is_refused_before_the_corpus_is_read(
    tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    base_trainer.train(base_cfg(tmp_path, cache_dir, "max_steps=2"))
    monkeypatch.setattr(base_trainer, "prepare_data", lambda **kw: pytest.fail("read the corpus before refusing"))
    with pytest.raises(CheckpointError, match="seed: checkpoint 0 vs now 1"):
        base_trainer.train(base_cfg(tmp_path, cache_dir, "max_steps=4", "seed=1"))


def test_drafter_recipe_is_refused_before_the_feature_cache(
    tiny_base: Path, cache_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    drafter_trainer.train(drafter_cfg("medusa", tiny_base, cache_dir, tmp_path, "max_steps=2"))
    monkeypatch.setattr(drafter_trainer, "prepare_data", lambda **kw: pytest.fail("read the corpus before refusing"))
    with pytest.raises(CheckpointError, match="seed: checkpoint 0 vs now 1"):
        drafter_trainer.train(drafter_cfg("medusa", tiny_base, cache_dir, tmp_path, "max_steps=4", "seed=1"))


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_a_step_samples_as_many_positions_in_micro_batches(
    grad_accum: int, tiny_base: Path, cache_dir: str, tmp_path: Path
) -> None:
    """Medusa samples `positions` per loss call: split into micro-batches (or ranks), each samples its share."""
    result = drafter_trainer.train(
        drafter_cfg("medusa", tiny_base, cache_dir, tmp_path, "drafter.loss.positions=16", f"grad_accum={grad_accum}")
    )
    assert result["positions"] == 4 * 16  # 4 steps of 16 positions, however the batch was split


def test_seed_out_of_range_is_one_line(tmp_path: Path, cache_dir: str) -> None:
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*32\), got 1099511627776"):
        base_trainer.train(base_cfg(tmp_path, cache_dir, f"seed={2**40}"))


def test_metrics_file_with_a_row_that_is_not_a_metrics_row_is_one_error(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match="line 2 is not a metrics row"):
        MetricsFile.read(path)


# ------------------------------------------------------------------- best checkpoint and early stopping


def scripted_val_losses(monkeypatch: pytest.MonkeyPatch, losses: list[float]) -> list[int]:
    """Make the base's validation return `losses` in order (the model still trains for real); returns the list
    the number of each call is appended to, so a test can see how many validations ran."""
    calls: list[int] = []

    def evaluate(model, blocks, *, batch_size, device):
        calls.append(len(calls))
        return losses[len(calls) - 1]

    monkeypatch.setattr(base_trainer, "evaluate", evaluate)
    return calls


def meta_of(directory: Path) -> dict:
    return load_checkpoint(directory).meta


def test_the_best_checkpoint_is_kept_when_validation_gets_worse(
    tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    scripted_val_losses(monkeypatch, [3.0, 2.0, 2.5, 2.0])  # steps 2, 4, 6, 8: a tie keeps the earlier
    result = base_trainer.train(base_cfg(tmp_path, cache_dir, "max_steps=8", "eval_every=2", "checkpoint_every=2"))
    best, last = meta_of(tmp_path / "checkpoint"), meta_of(tmp_path / "last")
    assert result["checkpoint"] == str(tmp_path / "checkpoint") and result["best_step"] == 4
    assert (best["step"], best["selected"], best["best_step"], best["best_value"]) == (4, "best", 4, 2.0)
    assert best["metrics"]["val_loss"] == 2.0 and best["metrics"]["step"] == 4  # the figure of these weights
    assert best["finished"] is True and best["last_step"] == 8 and best["stopped_by"] == "max_steps"
    assert (last["step"], last["selected"], last["best_step"], last["last_step"]) == (8, "last", 4, 8)
    assert last["finished"] is True and last["has_optimizer"] and best["fingerprint"] != last["fingerprint"]
    assert result["val_loss"] == 2.0 and result["step"] == 8  # the final validation is still reported


def test_last_holds_the_latest_while_training(tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    scripted_val_losses(monkeypatch, [2.0, 3.0, 3.0])  # steps 2, 4, 6: the best is the first
    crash_at(monkeypatch, 5)
    with pytest.raises(RuntimeError, match="killed"):
        base_trainer.train(base_cfg(tmp_path, cache_dir, "max_steps=6", "eval_every=2", "checkpoint_every=2"))
    best, last = meta_of(tmp_path / "checkpoint"), meta_of(tmp_path / "last")
    assert (best["step"], best["finished"]) == (2, False)
    assert (last["step"], last["selected"], last["best_step"], last["finished"]) == (4, "last", 2, False)


def test_resume_restores_the_best_figure(tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The resumed run's best (2.2) is worse than the first session's (2.0): checkpoint/ keeps the first's."""
    scripted_val_losses(monkeypatch, [3.0, 2.0])  # steps 2, 4
    base_trainer.train(base_cfg(tmp_path, cache_dir, "max_steps=4", "eval_every=2", "checkpoint_every=2"))
    before = meta_of(tmp_path / "checkpoint")
    calls = scripted_val_losses(monkeypatch, [2.5, 2.2])  # steps 6, 8
    result = base_trainer.train(base_cfg(tmp_path, cache_dir, "max_steps=8", "eval_every=2", "checkpoint_every=2"))
    assert result["start_step"] == 4 and len(calls) == 2 and result["best_step"] == 4
    best = meta_of(tmp_path / "checkpoint")
    assert best["fingerprint"] == before["fingerprint"] and best["best_value"] == 2.0
    assert best["finished"] is True and best["last_step"] == 8 and meta_of(tmp_path / "last")["step"] == 8


def test_resume_beats_the_best_on_disk_not_the_older_record(
    tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A best written after last/ (validated every 2 steps, last/ every 4): the resumed run retraces from last/
    and must not replace that best with a worse figure that only beats last/'s older record."""
    scripted_val_losses(monkeypatch, [3.0, 2.5, 1.0])  # steps 2, 4, 6
    crash_at(monkeypatch, 7)
    with pytest.raises(RuntimeError, match="killed"):
        base_trainer.train(base_cfg(tmp_path, cache_dir, "max_steps=8", "eval_every=2", "checkpoint_every=4"))
    monkeypatch.undo()
    assert meta_of(tmp_path / "last")["best_value"] == 2.5 and meta_of(tmp_path / "checkpoint")["step"] == 6
    scripted_val_losses(monkeypatch, [1.5, 1.8])  # steps 6, 8 again: better than 2.5, worse than 1.0
    result = base_trainer.train(base_cfg(tmp_path, cache_dir, "max_steps=8", "eval_every=2", "checkpoint_every=4"))
    assert result["start_step"] == 4
    best = meta_of(tmp_path / "checkpoint")
    assert (best["step"], best["best_value"], best["metrics"]["val_loss"], best["finished"]) == (6, 1.0, 1.0, True)
    assert meta_of(tmp_path / "last")["best_value"] == 1.0


@pytest.mark.parametrize(
    "losses, extra, stop_step, best_step",
    [
        ([3.0, 2.0, 2.1, 2.05, 1.0, 1.0], [], 4, 2),  # two validations without improvement after step 2
        ([3.0, 2.99, 2.98, 2.97, 2.96, 2.95], ["min_delta=0.05"], 3, 3),  # improving, but by less than 0.05
    ],
)
def test_early_stopping_after_patience_validations_without_improvement(
    losses: list[float],
    extra: list[str],
    stop_step: int,
    best_step: int,
    tmp_path: Path,
    cache_dir: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls = scripted_val_losses(monkeypatch, losses)
    cfg = base_cfg(tmp_path, cache_dir, "max_steps=6", "eval_every=1", "checkpoint_every=1", "patience=2", *extra)
    with caplog.at_level("INFO", logger="experiments.lib.training.loop"):
        result = base_trainer.train(cfg)
    assert result["stopped_by"] == "patience" and result["step"] == stop_step and len(calls) == stop_step
    assert [r.message for r in caplog.records if "early stop" in r.message] == [
        f"early stop at step {stop_step}: val_loss did not improve by min_delta={0.05 if extra else 0:g} in 2 "
        f"validations (patience 2); best {losses[best_step - 1]:.4f} at step {best_step}"
    ]
    best, last = meta_of(tmp_path / "checkpoint"), meta_of(tmp_path / "last")
    assert best["step"] == best_step and best["stopped_by"] == last["stopped_by"] == "patience"
    assert last["step"] == stop_step and last["early_stopping"]["stale"] == 2 and last["finished"] is True
    stops = [r for r in MetricsFile.read(tmp_path / "metrics.jsonl") if r["kind"] == "stop"]
    assert [(r["step"], r["stopped_by"], r["best_step"]) for r in stops] == [(stop_step, "patience", best_step)]
    again = base_trainer.train(cfg)  # started again: the patience is still spent, nothing trains or is added
    assert again["stopped_by"] == "patience" and again["step"] == stop_step and len(calls) == stop_step
    assert len([r for r in MetricsFile.read(tmp_path / "metrics.jsonl") if r["kind"] == "stop"]) == 1


def test_without_patience_training_runs_to_its_budget(
    tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    scripted_val_losses(monkeypatch, [3.0, 2.0, 2.1, 2.2, 2.3, 2.4])
    result = base_trainer.train(base_cfg(tmp_path, cache_dir, "max_steps=6", "eval_every=1", "checkpoint_every=3"))
    assert result["stopped_by"] == "max_steps" and result["step"] == 6 and result["best_step"] == 2


@pytest.mark.parametrize(
    "override, message",
    [
        ("patience=-1", "patience must be a positive integer or null, got -1"),
        ("patience=0", "patience must be a positive integer or null, got 0"),
        ("patience=1.5", "patience must be a positive integer or null, got 1.5"),
        ("patience=soon", "patience must be a positive integer or null, got 'soon'"),
        ("min_delta=-0.1", "min_delta must be a number >= 0, got -0.1"),
        ("min_delta=nan", "min_delta must be a number >= 0, got nan"),
    ],
)
def test_bad_early_stopping_settings_are_refused_before_work(
    override: str, message: str, tmp_path: Path, cache_dir: str, tiny_base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(base_trainer, "prepare_data", lambda **kw: pytest.fail("worked before refusing"))
    with pytest.raises(ValueError) as excinfo:
        base_trainer.train(base_cfg(tmp_path / "base", cache_dir, override))
    assert str(excinfo.value) == message
    monkeypatch.setattr(drafter_trainer, "load_lm", lambda *a, **k: pytest.fail("worked before refusing"))
    with pytest.raises(ValueError) as excinfo:
        drafter_trainer.train(drafter_cfg("medusa", tiny_base, cache_dir, tmp_path / "drafter", override))
    assert str(excinfo.value) == message
    assert not (tmp_path / "base").exists() and not (tmp_path / "drafter").exists()


def test_a_run_directory_without_last_still_resumes(
    tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run directory written before last/ existed: checkpoint/ holds the latest weights and no selection."""
    base_trainer.train(base_cfg(tmp_path, cache_dir, "max_steps=4", "eval_every=2", "checkpoint_every=2"))
    shutil.rmtree(tmp_path / "last")
    meta_file = tmp_path / "checkpoint" / "meta.json"
    old = json.loads(meta_file.read_text())
    for key in ("selected", "best_metric", "best_step", "best_value", "last_step", "early_stopping", "stopped_by"):
        del old[key]
    meta_file.write_text(json.dumps(old))
    before = meta_of(tmp_path / "checkpoint")["fingerprint"]
    again = base_trainer.train(base_cfg(tmp_path, cache_dir, "max_steps=4", "eval_every=2", "checkpoint_every=2"))
    assert again["start_step"] == again["step"] == 4  # finished: nothing to do, nothing rewritten
    assert not (tmp_path / "last").exists() and "selected" not in json.loads(meta_file.read_text())
    scripted_val_losses(monkeypatch, [9.0, 9.5])  # steps 6, 8: worse than any real loss, the best of this session
    result = base_trainer.train(base_cfg(tmp_path, cache_dir, "max_steps=8", "eval_every=2", "checkpoint_every=2"))
    assert result["start_step"] == 4 and result["step"] == 8
    best, last = meta_of(tmp_path / "checkpoint"), meta_of(tmp_path / "last")
    assert best["fingerprint"] != before and (best["step"], best["selected"], best["best_value"]) == (6, "best", 9.0)
    assert (last["step"], last["selected"], last["finished"]) == (8, "last", True)
