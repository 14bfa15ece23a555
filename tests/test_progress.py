"""Progress of long work outside a terminal (a job's log, nohup, CI): a log line every LOG_EVERY seconds with what
is done of the total, the rate and the time left, so a long loop is never silent for minutes; a terminal gets the
bar instead. The feature cache (cache_features) reports each teacher batch through it."""

from __future__ import annotations

import io
import logging
import re

import pytest
import torch
from rich.console import Console

from experiments.lib.common import progress
from experiments.lib.common.progress import ProgressLog, track

LOGGER = "test.progress"


class FakeClock:
    """Seconds that move only when the test says: `step` per reading."""

    def __init__(self, step: float = 0.0) -> None:
        self.now, self.step = 1000.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_a_long_loop_logs_a_line_every_interval_with_count_rate_and_time_left(caplog) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = FakeClock()
    out = ProgressLog("features", 100, unit="windows", every=30.0, clock=clock, logger=logging.getLogger(LOGGER))
    for _ in range(100):
        clock.now += 2.0  # a window every 2 s: 200 s in all
        out.advance(1)
    found = lines(caplog)
    assert len(found) == 6  # at 30, 60, ... 180 s: one per interval, not one per window
    assert found[0] == "features: 15/100 windows, 0.5 windows/s, about 2.8 min left"
    assert found[-1] == "features: 90/100 windows, 0.5 windows/s, about 20 s left"
    out.finish()
    assert lines(caplog)[-1] == "features: 100/100 windows in 3.3 min"


def test_work_found_done_moves_the_count_not_the_rate(caplog) -> None:
    """A resumed cache skips its written shards at once: the time left comes from the work done in this run."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = FakeClock()
    out = ProgressLog("features", 1000, unit="windows", every=10.0, clock=clock, logger=logging.getLogger(LOGGER))
    out.skip(900)
    clock.now += 20.0
    out.advance(10)  # 10 windows in 20 s
    assert lines(caplog) == ["features: 910/1000 windows, 0.5 windows/s, about 3.0 min left"]


def test_track_logs_outside_a_terminal_and_draws_the_bar_on_one(caplog) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    for terminal in (False, True):
        caplog.clear()
        console = Console(file=io.StringIO(), force_terminal=terminal)
        clock = FakeClock(step=10.0)
        with track("work", 50, unit="items", console=console, logger=logging.getLogger(LOGGER), clock=clock) as bar:
            for _ in range(50):
                bar.advance(1)
        if terminal:
            assert lines(caplog) == []
        else:
            assert len(lines(caplog)) >= 10 and lines(caplog)[-1].startswith("work: 50/50 items in ")
            assert console.file.getvalue() == ""  # no bar drawn into a log


def test_bad_progress_settings_are_one_line_errors() -> None:
    with pytest.raises(ValueError, match="total=-1: must be an integer >= 0"):
        ProgressLog("x", -1)
    with pytest.raises(ValueError, match="every=0: must be a positive number of seconds"):
        ProgressLog("x", 1, every=0)


def test_the_feature_cache_logs_progress_within_a_shard(tmp_path, caplog, monkeypatch) -> None:
    """cache_features wrote nothing for minutes per shard outside a terminal: now each teacher batch counts, and a
    line comes every LOG_EVERY seconds, between shard boundaries too."""
    from experiments.lib.store.lm import build_lm
    from experiments.lib.training.features import FeatureSpec, write_features

    torch.manual_seed(0)
    base = build_lm(num_tokens=97, dim=32, depth=2, heads=2, max_seq_len=64).eval().requires_grad_(False)
    ids = torch.randint(1, 97, (2000,), generator=torch.Generator().manual_seed(0))
    spec = FeatureSpec(base_fingerprint="b", data_key="d", seq_len=16, windows=20, top_k=8, dtype="float32", batch=2)
    monkeypatch.setattr(progress, "CLOCK", FakeClock(step=progress.LOG_EVERY))  # every reading a whole interval
    monkeypatch.setattr(progress, "Console", lambda **kw: Console(file=io.StringIO()))  # a job's log, even under -s
    caplog.set_level(logging.INFO, logger="experiments.lib.training.features")
    write_features(tmp_path / "f", base, ids, spec, shard_windows=10)
    counts = [
        int(m.group(1))
        for r in caplog.records
        if r.name == "experiments.lib.training.features" and (m := re.match(r"features: (\d+)/20 windows, ", r.message))
    ]
    assert counts == list(range(2, 21, 2))  # a line per teacher batch of 2, inside each shard of 10
