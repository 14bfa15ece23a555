"""The source hashes that name cached artifacts and cost tables: they move with the code that decides them. An
artifact's key holds the hash of the code that trains it (its family's network, loss and validation, the loop, the
data), so an artifact trained by older code is retrained, not reused silently, unless artifacts.reuse_stale=true
asks for it, with a one-line warning naming the files that changed."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from experiments.lib.common.sources import ROOT, code_manifest, code_version, module_files, source_version
from experiments.lib.methods import registry
from experiments.lib.methods.calibrate import engine_version
from experiments.lib.store.checkpoint import save_checkpoint
from experiments.lib.store.lm import build_lm
from experiments.lib.training import artifacts, drafter_trainer

MEDUSA = ["base_checkpoint=/nonexistent", "logger=none"]


def _tree(root: Path, files: dict[str, str | bytes]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(text.encode() if isinstance(text, str) else text)
    return root


def _version(root: Path) -> str:
    source_version.cache_clear()  # the real function caches per (directories, root); these roots change in place
    return source_version(("pkg",), root)


def test_hash_moves_with_every_python_byte_and_name(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"pkg/a.py": "x = 1\n", "pkg/sub/b.py": "y = 2\n", "pkg/notes.txt": "n"})
    first = _version(root)
    assert _version(root) == first  # deterministic
    (root / "pkg/notes.txt").write_text("other")  # not source: same hash
    assert _version(root) == first
    (root / "pkg/sub/b.py").write_text("y = 3\n")  # a nested file's bytes
    changed = _version(root)
    assert changed != first
    (root / "pkg/sub/b.py").rename(root / "pkg/sub/c.py")  # same bytes, another name
    assert _version(root) not in (first, changed)
    (root / "pkg/sub/c.py").write_text("y = 2\n")
    (root / "pkg/sub/c.py").rename(root / "pkg/sub/b.py")  # back as it was
    assert _version(root) == first
    (root / "pkg/new.py").write_text("")  # an added (even empty) module
    assert _version(root) != first


def test_the_code_of_a_module_is_what_it_imports(tmp_path: Path) -> None:
    """Every way of importing is followed (from-imports of modules, relative, inside functions), and a data file a
    module names beside it is code too; the engine and the reporting helpers are not followed; the family registry
    is hashed but not entered (it imports every family)."""
    root = _tree(
        tmp_path,
        {
            "medusa/__init__.py": "",
            "medusa/train.py": "import torch\nfrom medusa import heads\nfrom .trees import grow\n"
            "def f():\n    import verify.training.distill\n",
            "medusa/heads.py": "from verify.backends import engine\nfrom experiments.lib.common.errors import x\n",
            "medusa/trees.py": 'TOPICS = "topics.yaml"  # data beside it, named\ndef grow(): ...\n',
            "medusa/topics.yaml": "words: [a, b]\n",
            "medusa/other.yaml": "not named by any module\n",
            "medusa/unused.py": "",
            "verify/__init__.py": "",
            "verify/training/__init__.py": "",
            "verify/training/distill.py": "from experiments.lib.families import registry\n",
            "verify/backends/__init__.py": "",
            "verify/backends/engine.py": "",
            "experiments/__init__.py": "",
            "experiments/lib/__init__.py": "",
            "experiments/lib/common/errors.py": "",
            "experiments/lib/families/__init__.py": "",
            "experiments/lib/families/registry.py": "import medusa.unused\n",
        },
    )
    assert module_files(("medusa.train",), root) == (
        "experiments/__init__.py",
        "experiments/lib/__init__.py",
        "experiments/lib/families/__init__.py",
        "experiments/lib/families/registry.py",
        "medusa/__init__.py",
        "medusa/heads.py",
        "medusa/topics.yaml",
        "medusa/train.py",
        "medusa/trees.py",
        "verify/__init__.py",
        "verify/training/__init__.py",
        "verify/training/distill.py",
    )


def test_the_code_hash_is_the_bytes_not_the_line_endings_or_the_clock(tmp_path: Path) -> None:
    """A fresh clone gets the same key: file bytes (CRLF read as LF), never modification times."""
    unix = _tree(tmp_path / "unix", {"medusa/__init__.py": "", "medusa/train.py": "x = 1\ny = 2\n"})
    windows = _tree(tmp_path / "windows", {"medusa/__init__.py": "", "medusa/train.py": b"x = 1\r\ny = 2\r\n"})
    first = code_manifest(("medusa.train",), unix)
    assert code_manifest(("medusa.train",), windows) == first
    (unix / "medusa/train.py").touch()
    assert code_version(code_manifest(("medusa.train",), unix)) == code_version(first)
    (unix / "medusa/train.py").write_text("x = 1\ny = 3\n")
    assert code_version(code_manifest(("medusa.train",), unix)) != code_version(first)


def test_each_family_is_keyed_by_its_own_code_and_the_shared_loop() -> None:
    """The files that shape each artifact's weights are in its code; another family's, the engine's and the
    reporting helpers' are not (a change to the prophet's loss does not retrain Medusa's heads)."""
    code = {kind: set(artifacts.training_code(kind)) for kind in artifacts.ENTRY}
    shared = {
        "experiments/lib/training/loop.py",
        "experiments/lib/store/checkpoint.py",
        "experiments/lib/data/pipeline.py",
    }
    drafters = {
        "experiments/lib/training/drafter_trainer.py",
        "experiments/lib/training/features.py",
        "experiments/lib/training/answers.py",
        "verify/training/distill.py",
        "prophet/model.py",  # the base's features, cached for every family
        "experiments/lib/data/question_topics.yaml",  # the question bank's words: what the base answers
    }
    own = {
        "base": {"experiments/lib/training/base_trainer.py", "experiments/lib/store/lm.py"},
        "draft": {"experiments/lib/families/draft.py", "experiments/lib/store/lm.py"},
        "medusa": {"medusa/train.py", "medusa/heads.py"},
        "prophet": {"prophet/train.py", "prophet/eagle.py"},
        "prophet_block": {"prophet/block_train.py", "prophet/block.py"},
        "sequential": {"medusa/sequential_train.py", "medusa/sequential.py", "experiments/lib/families/sequential.py"},
        "early_exit": {"experiments/lib/families/early_exit.py"},
    }
    for kind, files in code.items():
        assert shared | own[kind] | (drafters if kind != "base" else set()) <= files, kind
        assert not any(f.startswith(("verify/backends/", "experiments/lib/common/")) for f in files), kind
    assert "prophet/train.py" not in code["medusa"] and "medusa/train.py" not in code["prophet"]
    assert "experiments/lib/training/drafter_trainer.py" not in code["base"]


def test_engine_version_hashes_the_backends() -> None:
    assert engine_version() == source_version(("verify/backends",))


# ------------------------------------------------------------------------------------- the artifact cache


@pytest.fixture
def medusa_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the code that trains Medusa's heads, which the artifact cache hashes instead of the real one, and
    a trainer that saves a tiny checkpoint: the test edits the copy's bytes."""
    root = tmp_path / "code"
    for rel in artifacts.training_code("medusa"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / rel, root / rel)
    monkeypatch.setattr(
        artifacts, "training_code", lambda kind: code_manifest(artifacts.training_modules(kind), root=root)
    )
    return root


@pytest.fixture
def trained(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The artifact directories trained (by a fake trainer that saves a tiny checkpoint)."""
    out: list[Path] = []

    def train(cfg) -> dict:
        out.append(Path(cfg.out_dir))
        torch.manual_seed(0)
        model = build_lm(num_tokens=16, dim=8, depth=1, heads=1, max_seq_len=8)
        save_checkpoint(Path(cfg.out_dir) / "checkpoint", model=model, model_config={}, tokenizer_json=None, step=1)
        return {"step": 1}

    monkeypatch.setattr(drafter_trainer, "train", train)
    return out


def test_changed_training_code_retrains_and_reuse_stale_reuses_with_a_warning(
    tmp_path: Path, medusa_code: Path, trained: list[Path], caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "artifacts"
    first = artifacts.ensure("medusa", MEDUSA, root=root)
    assert trained == [first.parent] and artifacts.ensure("medusa", MEDUSA, root=root) == first  # same code: reused
    with (medusa_code / "medusa/train.py").open("a") as f:
        f.write("# a changed loss\n")
    second = artifacts.ensure("medusa", MEDUSA, root=root)
    assert second != first and trained == [first.parent, second.parent]  # retrained, beside the old one
    assert first.exists() and second.parent.name.split("-")[1] == first.parent.name.split("-")[1]  # same recipe
    with (medusa_code / "experiments/lib/training/loop.py").open("a") as f:
        f.write("# a changed loop\n")
    caplog.set_level(logging.WARNING, logger=artifacts.__name__)
    assert artifacts.ensure("medusa", MEDUSA, root=root, reuse_stale=True) == second  # the newest of the recipe
    assert len(trained) == 2
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning == (
        f"artifacts.reuse_stale=true: reusing medusa artifact {second.parent}, trained by other code than this "
        "checkout's: experiments/lib/training/loop.py changed"
    )
    artifacts.ensure("medusa", MEDUSA, root=root)  # without it: trained by this code
    assert len(trained) == 3 and len({*trained}) == 3


def test_reuse_stale_trains_when_no_artifact_of_the_recipe_exists(
    tmp_path: Path, medusa_code: Path, trained: list[Path]
) -> None:
    artifacts.ensure("medusa", MEDUSA, root=tmp_path, reuse_stale=True)
    artifacts.ensure("medusa", [*MEDUSA, "seed=1"], root=tmp_path, reuse_stale=True)  # another recipe: not stale
    assert len(trained) == 2
    with pytest.raises(ValueError, match="artifacts.reuse_stale='yes': must be true or false"):
        artifacts.ensure("medusa", MEDUSA, root=tmp_path, reuse_stale="yes")


def test_the_decoding_entry_points_pass_reuse_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    """conf/models: artifacts.reuse_stale, false by default, reaches the artifact cache."""
    from hydra import compose, initialize_config_dir

    seen = []
    monkeypatch.setattr(registry, "ensure", lambda kind, overrides, **kw: seen.append(kw) or Path("/x"))
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        for value in (False, True):
            cfg = compose(config_name="benchmark", overrides=[f"artifacts.reuse_stale={str(value).lower()}"])
            registry.checkpoint_for(cfg, "medusa", "/base", None)
            assert seen[-1]["reuse_stale"] is value
        assert compose(config_name="benchmark").artifacts.reuse_stale is False
