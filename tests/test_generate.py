"""The generate console tool through Hydra's compose API, on a tiny base trained in seconds."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from rich.console import Console

from experiments import generate as gen
from experiments.lib.methods.registry import DRAFTER_KINDS, METHODS
from experiments.lib.store.checkpoint import load_lm
from experiments.lib.training.base_trainer import train

ROOT = Path(__file__).resolve().parents[1]
FAST_BASE = [
    "base.dim=32",
    "base.depth=1",
    "data.max_files=30",
    "data.vocab_size=512",
    "logger=none",
    "batch_size=8",
    "seq_len=64",
    "optim.warmup_steps=2",
    "eval_blocks=8",
    "max_steps=10",
]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two shared cores
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def base_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp, threads = tmp_path_factory.mktemp("generate"), torch.get_num_threads()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train_base", overrides=[*FAST_BASE, f"out_dir={tmp / 'base'}", f"data.cache_dir={tmp / 'data'}"])
    torch.set_num_threads(1)  # module fixtures start before the function-scoped one_thread
    try:
        return train(cfg)["checkpoint"]
    finally:
        torch.set_num_threads(threads)


def make_cfg(base_ckpt: str, *overrides: str) -> DictConfig:
    # artifacts.root in the test's tree: a missing checkpoint must never train into the repository
    fixed = [
        f"base_checkpoint={base_ckpt}",
        f"artifacts.root={Path(base_ckpt).parent}",
        "device=cpu",
        "max_new_tokens=24",
        "warmup_tokens=2",
    ]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("generate", overrides=[*fixed, *overrides])


def test_config_composes_with_the_benchmark_keys() -> None:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("generate")
    assert cfg.method == "prophet_tree" and cfg.method in METHODS and cfg.temperature == 0.0
    assert cfg.max_new_tokens == 64 and cfg.prompt == "def fib(n):" and cfg.interactive is False
    derived = gen.methods_config(cfg)
    assert list(derived.methods) == ["prophet_tree"] and derived.checkpoints.base is None
    assert set(derived) == {
        "methods",
        "checkpoints",
        "artifacts",
        "prompt_lookup",
        "hybrid",
        "shipped_drafters",
        *DRAFTER_KINDS,
        "vocab",
        "data",
    }


def test_prompt_lookup_one_shot(base_ckpt: str, capsys: pytest.CaptureFixture) -> None:
    result = gen.generate(make_cfg(base_ckpt, "method=prompt_lookup", 'prompt="def fib(n):"'))
    assert result["plain"] == result["speculative"] and result["plain_ids"] == result["speculative_ids"]
    assert len(result["accepted_mask"]) == len(result["speculative_ids"]) == 24
    st = result["stats"]
    assert st["exact"] is True and st["lossless"] and st["rule"] == "greedy"
    assert st["tau"] >= 1 and 0 <= st["alpha"] <= 1 and st["speedup"] > 0
    assert sum(not m for m in result["accepted_mask"]) == st["speculative_forwards"]  # one own token per forward
    out = capsys.readouterr().out
    for fragment in (
        "plain",
        "speculative: prompt_lookup",
        "tau",
        "alpha",
        "tokens/s",
        "speedup",
        "drafter / target / other",
        "acceptance by position",
        "identical",
        "def fib(n):",
    ):
        assert fragment in out, fragment


def test_draft_model_on_itself_accepts_every_draft(base_ckpt: str) -> None:
    console = Console(record=True, force_terminal=True, width=160)
    cfg = make_cfg(
        base_ckpt, "method=draft_model", f"checkpoints.draft={base_ckpt}", "stop_at_eos=false", "decode.gamma=4"
    )
    result = gen.generate(cfg, console=console)
    assert result["plain_ids"] == result["speculative_ids"] and result["stats"]["alpha"] == 1.0
    expected = [False]  # the prefill's token, then per step: gamma accepted drafts and the bonus token
    while len(expected) < 24:
        expected += [True] * min(4, 24 - len(expected) - 1) + [False]
    assert result["accepted_mask"] == expected
    view = console.export_text(styles=True, clear=False)
    assert "\x1b[32m" in view  # accepted drafts in green
    text = console.export_text()
    assert "speculative: draft_model" in text and "identical" in text and "tau" in text


def test_sampling_is_labelled_not_compared(base_ckpt: str) -> None:
    console = Console(record=True, width=200)
    result = gen.generate(make_cfg(base_ckpt, "method=prompt_lookup", "temperature=1"), console=console)
    assert result["stats"]["exact"] is None and result["stats"]["rule"] == "speculative"
    assert len(result["accepted_mask"]) == len(result["speculative_ids"])
    assert "may differ by chance" in console.export_text()


def test_interactive_reads_prompts_until_an_empty_line(base_ckpt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    too_long = "x = 1; " * 200
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"import os\n{too_long}\nclass A:\n\nnot read\n"))
    console = Console(record=True, width=120)
    out = gen.generate(make_cfg(base_ckpt, "method=prompt_lookup", "interactive=true"), console=console)
    assert [r["prompt"] for r in out["results"]] == ["import os", "class A:"]
    assert all(r["plain"] == r["speculative"] for r in out["results"])
    text = console.export_text()
    assert text.count("identical") == 2 and text.count("error: prompt 0 has") == 1


def test_interactive_stops_at_eof(base_ckpt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("def f(x):"))  # no newline, then EOF
    cfg = make_cfg(base_ckpt, "method=prompt_lookup", "interactive=true")
    out = gen.generate(cfg, console=Console(file=io.StringIO()))
    assert [r["prompt"] for r in out["results"]] == ["def f(x):"]


def fail_to_load(cfg, checked):
    raise AssertionError("the session was loaded")


@pytest.mark.parametrize("stdin", [io.StringIO(""), io.StringIO("\n"), None], ids=["eof", "empty_line", "closed"])
def test_interactive_with_nothing_on_stdin_ends_before_loading(
    stdin, base_ckpt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdin", stdin)
    monkeypatch.setattr(gen, "load_session", fail_to_load)  # nothing to generate: nothing loads or trains
    console = Console(record=True, width=120)
    out = gen.generate(make_cfg(base_ckpt, "method=prompt_lookup", "interactive=true"), console=console)
    assert out == {"results": []} and "no prompt on standard input" in console.export_text()


def test_interactive_line_that_is_not_utf8_is_one_error(base_ckpt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    stdin = io.TextIOWrapper(io.BytesIO(b"import os\n\xff\xfe\nclass A:\n"), encoding="utf-8")  # as sys.stdin on a pipe
    monkeypatch.setattr(sys, "stdin", stdin)
    console = Console(record=True, width=200)
    out = gen.generate(
        make_cfg(base_ckpt, "method=prompt_lookup", "interactive=true", "max_new_tokens=4"), console=console
    )
    assert [r["prompt"] for r in out["results"]] == ["import os", "class A:"]
    assert "error: stdin line 2 is not UTF-8 text (invalid start byte at byte 0): skipped" in console.export_text()


def test_ctrl_c_in_interactive_mode_is_not_swallowed(base_ckpt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """KeyboardInterrupt reaches the CLI's decorator (one line, exit 130) from reading and from decoding."""

    class Interrupted(io.StringIO):
        def readline(self, *args):
            raise KeyboardInterrupt

    def interrupted(*args):
        raise KeyboardInterrupt

    cfg = make_cfg(base_ckpt, "method=prompt_lookup", "interactive=true")
    monkeypatch.setattr(sys, "stdin", Interrupted())
    monkeypatch.setattr(gen, "load_session", fail_to_load)
    with pytest.raises(KeyboardInterrupt):
        gen.generate(cfg, console=Console(file=io.StringIO()))
    monkeypatch.setattr(sys, "stdin", io.StringIO("import os\nclass A:\n"))
    monkeypatch.setattr(gen, "load_session", lambda cfg, checked: None)
    monkeypatch.setattr(gen, "generate_one", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gen.generate(cfg, console=Console(file=io.StringIO()))


def test_tokens_and_pieces(base_ckpt: str) -> None:
    _, tokenizer, _ = load_lm(base_ckpt)
    ids = gen.encode(tokenizer, "a <|endoftext|> é€😀")
    assert 0 not in ids and tokenizer.decode(ids) == "a <|endoftext|> é€😀"  # text, not the EOS token
    pieces = gen.token_pieces(tokenizer, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == tokenizer.decode(ids)
    assert "\ufffd" not in "".join(pieces)


def test_accepted_mask_checks_the_record() -> None:
    steps = [(torch.tensor(2), torch.tensor([5, 6, 7])), (torch.tensor(0), torch.tensor([8, 0, 0]))]
    assert gen.accepted_mask([4, 5, 6, 7, 8], steps) == [False, True, True, False, False]
    assert gen.accepted_mask([4, 5], steps) == [False, True]  # cut by EOS or the budget
    with pytest.raises(RuntimeError, match="do not reproduce"):
        gen.accepted_mask([4, 5, 9], steps)


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("prompt=", "prompt='': give a non-empty text"),
        ('prompt="   "', "give a non-empty text"),
        ("method=magic", "method='magic': must be one of draft_model, prompt_lookup"),
        ("temperature=-1", "temperature=-1: must be a finite number >= 0"),
        ("max_new_tokens=0", "max_new_tokens=0: must be an integer >= 1"),
        ("interactive=maybe", "interactive='maybe': must be true or false"),
        ("decode.rule=greedy,temperature=1", "greedy acceptance needs temperature 0"),
    ],
)
def test_bad_input_fails_in_one_line_before_loading(
    override: str, fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_load(*args, **kwargs):
        raise AssertionError("a checkpoint was loaded before the config was checked")

    monkeypatch.setattr(gen, "load_lm", no_load)
    monkeypatch.setattr(gen, "checkpoint_for", no_load)
    with pytest.raises(ValueError) as excinfo:
        gen.generate(make_cfg("/nonexistent/checkpoint", *override.split(",")))
    assert "\n" not in str(excinfo.value) and fragment in str(excinfo.value), str(excinfo.value)


def test_entry_point(tmp_path: Path, base_ckpt: str) -> None:
    run = lambda *args: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "experiments.generate", f"hydra.run.dir={tmp_path}", "threads=1", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    bad = run("method=magic")
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: method='magic': must be one of")
    good = run(f"base_checkpoint={base_ckpt}", "method=prompt_lookup", "max_new_tokens=8", 'prompt="def f(x):"')
    assert good.returncode == 0, good.stderr
    assert "speculative: prompt_lookup" in good.stdout and "identical" in good.stdout


@pytest.mark.slow
def test_entry_point_with_stdin_closed(tmp_path: Path, base_ckpt: str) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.generate",
            f"hydra.run.dir={tmp_path}",
            f"base_checkpoint={base_ckpt}",
            "method=prompt_lookup",
            "interactive=true",
        ],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "no prompt on standard input" in proc.stdout, proc.stderr
