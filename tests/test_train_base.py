"""Base training through Hydra's compose API: the loss drops, resume continues, bad configs fail fast,
precision=auto follows the (faked) CPU flags and the checkpoint records what ran."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from experiments.lib.store.checkpoint import load_checkpoint, load_lm
from experiments.lib.training import base_trainer, precision
from experiments.lib.training import loop as training
from experiments.lib.training.base_trainer import train
from experiments.lib.training.loop import MetricsFile, lr_at

ROOT = Path(__file__).resolve().parents[1]
# A model and corpus small enough for a few seconds per run; 30 stdlib files, a 512-token BPE.
FAST = [
    "base.dim=32",
    "base.depth=1",
    "data.max_files=30",
    "data.vocab_size=512",
    "logger=none",
    "batch_size=8",
    "seq_len=64",
    "optim.warmup_steps=2",
    "eval_blocks=8",
    "log_every=1",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("data_cache"))  # the tokenizer is trained once per module


def make_cfg(out_dir: Path, cache_dir: str, *overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train_base", overrides=[*FAST, f"out_dir={out_dir}", f"data.cache_dir={cache_dir}", *overrides])


def train_rows(out_dir: Path) -> list[dict]:
    return [r for r in MetricsFile.read(out_dir / "metrics.jsonl") if r["kind"] == "train"]


def test_loss_drops_and_outputs(tmp_path: Path, cache_dir: str) -> None:
    result = train(make_cfg(tmp_path, cache_dir, "max_steps=30", "eval_every=10", "checkpoint_every=10"))
    losses = [r["train_loss"] for r in train_rows(tmp_path)]
    assert len(losses) == 30
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert first > math.log(512) - 0.3  # starts near uniform over the vocabulary
    assert first - last > 0.5, (first, last)
    assert result["step"] == 30 and result["start_step"] == 0 and result["stopped_by"] == "max_steps"
    assert result["train_tokens"] == 30 * 8 * 64 and result["val_tokens"] == 8 * 64
    assert result["val_loss"] < first and 0 < result["val_bpb"] < 10 and result["tokens_per_s"] > 0
    val_rows = [r for r in MetricsFile.read(tmp_path / "metrics.jsonl") if r["kind"] == "val"]
    assert [r["step"] for r in val_rows] == [10, 20, 30]
    model, tokenizer, meta = load_lm(result["checkpoint"])
    assert meta["step"] == 30 and meta["tokens_seen"] == result["train_tokens"]
    assert meta["model_config"]["dim"] == 32 and meta["metrics"]["val_loss"] == result["val_loss"]
    assert tokenizer.get_vocab_size() == 512


def test_resume_continues_from_checkpoint(tmp_path: Path, cache_dir: str) -> None:
    first = train(make_cfg(tmp_path, cache_dir, "max_steps=10"))
    assert first["step"] == 10
    second = train(make_cfg(tmp_path, cache_dir, "max_steps=20"))
    assert second["start_step"] == 10 and second["step"] == 20
    assert second["train_tokens"] == 20 * 8 * 64
    assert [r["step"] for r in train_rows(tmp_path)] == list(range(1, 21))  # no repeats, no gaps
    again = train(make_cfg(tmp_path, cache_dir, "max_steps=20"))  # nothing left to do
    assert again["start_step"] == again["step"] == 20


def test_resume_false_starts_over(tmp_path: Path, cache_dir: str) -> None:
    train(make_cfg(tmp_path, cache_dir, "max_steps=6"))
    result = train(make_cfg(tmp_path, cache_dir, "max_steps=4", "resume=false"))
    assert result["start_step"] == 0 and load_checkpoint(tmp_path / "checkpoint").meta["step"] == 4


def test_crash_and_resume_equals_uninterrupted(tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    common = ["max_steps=16", "checkpoint_every=8", "eval_every=8"]
    clean = train(make_cfg(tmp_path / "clean", cache_dir, *common))
    real_step = training.TrainLoop.step

    def crashing_step(self, elapsed):
        if self.state.step == 12:
            raise RuntimeError("killed")
        return real_step(self, elapsed)

    monkeypatch.setattr(training.TrainLoop, "step", crashing_step)
    with pytest.raises(RuntimeError, match="killed"):
        train(make_cfg(tmp_path / "crashed", cache_dir, *common))
    monkeypatch.undo()
    resumed = train(make_cfg(tmp_path / "crashed", cache_dir, *common))
    assert resumed["start_step"] == 8
    # batches are a function of (seed, step): the resumed run retraces the uninterrupted one exactly
    fingerprints = [load_checkpoint(Path(r["checkpoint"])).meta["fingerprint"] for r in (clean, resumed)]
    assert fingerprints[0] == fingerprints[1]
    assert resumed["val_loss"] == clean["val_loss"]


def test_time_budget_stops_early(tmp_path: Path, cache_dir: str) -> None:
    result = train(make_cfg(tmp_path, cache_dir, "max_steps=100000", "max_minutes=0.02"))
    assert result["stopped_by"] == "max_minutes" and 0 < result["step"] < 100000
    assert load_checkpoint(tmp_path / "checkpoint").meta["step"] == result["step"]


def test_wandb_logger_offline(tmp_path: Path, cache_dir: str) -> None:
    train(make_cfg(tmp_path, cache_dir, "max_steps=3", "logger=wandb"))
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_precision_follows_the_machine_and_is_recorded(
    tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def run(name: str, requested: str, flags: set[str]) -> tuple[str, list[float]]:
        monkeypatch.setattr(precision, "cpu_flags", lambda: flags)
        result = train(make_cfg(tmp_path / name, cache_dir, "max_steps=3", f"precision={requested}", "device=cpu"))
        assert load_checkpoint(tmp_path / name / "checkpoint").meta["precision"] == result["precision"]
        assert result["precision"]["requested"] == requested
        return result["precision"]["used"], [r["train_loss"] for r in train_rows(tmp_path / name)]

    fp32 = run("fp32", "fp32", {"avx2", "avx512_bf16"})
    bf16 = run("bf16", "bf16", {"avx2"})
    assert fp32[0] == "fp32" and bf16[0] == "bf16"
    assert fp32[1][0] != bf16[1][0]  # bf16 autocast really ran: it changes the very first loss
    # auto trains exactly as the explicit choice the flags call for (same losses, bit for bit)
    assert run("auto_without", "auto", {"avx2", "avx512f"}) == fp32
    assert run("auto_with", "auto", {"avx2", "amx_bf16"}) == bf16


def test_lr_schedule() -> None:
    sched = dict(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert lr_at(0, **sched) == pytest.approx(0.1)
    assert lr_at(9, **sched) == pytest.approx(1.0)
    assert lr_at(10, **sched) == pytest.approx(1.0)
    assert lr_at(60, **sched) == pytest.approx(0.55)  # cosine midpoint
    assert lr_at(110, **sched) == pytest.approx(0.1)
    assert lr_at(20, **sched, time_fraction=1.0) == pytest.approx(0.1)  # time budget spent: fully annealed
    assert lr_at(4, **sched, time_fraction=1.0) == pytest.approx(0.05)  # ... even during warm-up
    assert lr_at(5, **{**sched, "warmup_steps": 0}) < 1.0


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("max_steps=0", "max_steps must be a positive integer, got 0"),
        ("batch_size=-1", "batch_size must be a positive integer, got -1"),
        ("eval_blocks=0", "eval_blocks must be a positive integer"),
        ("max_minutes=0", "max_minutes must be positive or null"),
        ("optim.lr=0", "optim.lr must be positive"),
        ("optim.lr=fast", "optim.lr must be a number, got 'fast'"),
        ("max_minutes=soon", "max_minutes must be positive or null, got 'soon'"),
        ("resume=maybe", "resume must be true or false"),
        ("threads=0", "threads must be a positive integer or null, got 0"),
        ("optim.min_lr=1.0", "optim.min_lr must lie in"),
        ("optim.warmup_steps=1001", "optim.warmup_steps (1001) must not exceed max_steps (1000)"),
        ("optim.grad_clip=-1", "optim.grad_clip must be non-negative"),
        ("optim.betas=[0.9,1.5]", "optim.betas must be two numbers in [0, 1)"),
        ("seq_len=512", "seq_len (512) must not exceed base.max_seq_len (256)"),
        ("seq_len=0", "seq_len must be a positive integer, got 0"),
        ("base.dim=0", "dim must be a positive integer, got 0"),
        ("base.heads=3", "must be divisible by heads (3)"),
        ("device=tpu", "device must be auto, cpu or cuda"),
        ("data=files", "data.paths"),
        ("precision=fp16", "precision='fp16': must be one of auto, fp32, bf16"),
        ("precision=null", "precision=None: must be one of auto, fp32, bf16"),
    ],
)
def test_bad_config_fails_before_work(
    tmp_path: Path, override: str, fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_work(**kwargs):
        raise AssertionError("prepare_data ran before the config was validated")

    monkeypatch.setattr(base_trainer, "prepare_data", no_work)
    cfg = make_cfg(tmp_path / "out", "unused", "max_steps=1000", override)
    with pytest.raises(ValueError) as excinfo:
        train(cfg)
    assert "\n" not in str(excinfo.value) and fragment in str(excinfo.value), str(excinfo.value)
    assert not (tmp_path / "out").exists()


def test_entry_point_user_error_is_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.train_base", "max_steps=0", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "error: max_steps must be a positive integer, got 0"


def test_entry_point_runs_and_prints_json(tmp_path: Path, cache_dir: str) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.train_base",
            *FAST,
            "max_steps=2",
            f"hydra.run.dir={tmp_path}",
            f"data.cache_dir={cache_dir}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["step"] == 2 and Path(result["out_dir"]) == tmp_path
    assert (tmp_path / "checkpoint" / "model.safetensors").is_file()
    assert (tmp_path / ".hydra" / "config.yaml").is_file()
