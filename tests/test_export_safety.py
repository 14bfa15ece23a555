"""The export and the import of serving-format directories against hostile input: nothing lost, one line each.

experiments.export writes a drafter in a serving format (experiments/lib/store/served_dir.py says where it may
write); benchmark and generate read such a directory back with `checkpoints.<family>=<dir>`
(experiments/lib/formats/registry.py). A tiny Hugging Face Llama base (a checkpoint of this project, arch=llama)
and an EAGLE-3 prophet on it are real; every bad input must end in one FormatError line before the base loads,
with every file where it was.
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
from hydra import compose, initialize_config_dir

from experiments import export as export_mod
from experiments.lib.families.registry import family
from experiments.lib.formats import medusa
from experiments.lib.formats.registry import check_served, read
from experiments.lib.store import served_dir
from experiments.lib.store.checkpoint import load_lm, save_checkpoint
from experiments.lib.store.lm import build_lm
from experiments.lib.store.served_dir import MARK, FormatError, write_directory
from tests.test_bad_inputs import tokenizer_json

ROOT = Path(__file__).resolve().parents[1]
LM = dict(arch="llama", num_tokens=64, dim=32, depth=4, heads=4, kv_heads=2, max_seq_len=128)


def save_base(directory: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    extra = {"kind": "base_lm", "data": {"config": None, "eos_id": 0}}
    model = build_lm(**LM)
    return save_checkpoint(
        directory, model=model, model_config=LM, tokenizer_json=tokenizer_json(64), step=1, extra=extra
    )


def save_prophet(directory: Path, base_dir: Path) -> Path:
    base, _, meta = load_lm(base_dir)
    module = {"arch": "eagle3", "fuse_layers": [1, 2, 3]}
    drafter = {"package": "prophet", "module": module, "loss": {"unroll": 1, "target": "kl"}}
    extra = {"kind": "drafter", "base_fingerprint": meta["fingerprint"], "base_checkpoint": str(base_dir)}
    model = family("prophet").build(base, **module)
    config = {"package": "prophet", "module": module}
    return save_checkpoint(
        directory, model=model, model_config=config, tokenizer_json=None, step=1, extra=extra | {"drafter": drafter}
    )


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Pristine checkpoints and one good export, copied by `work` for each test."""
    tmp = tmp_path_factory.mktemp("export_safety")
    base = save_base(tmp / "base", 0)
    save_prophet(tmp / "drafter", base)
    save_base(tmp / "other_base", 1)
    export_mod.export(cfg(checkpoint=tmp / "drafter", out=tmp / "e3"))
    return {"root": tmp}


@pytest.fixture
def work(made: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the checkpoints and the export in a fresh directory, which is also the working directory.
    The drafter's meta names its base by absolute path: the copy's meta names the copy's base."""
    shutil.copytree(made["root"], tmp_path / "w")
    work = tmp_path / "w"
    meta = json.loads((work / "drafter" / "meta.json").read_text())
    meta["base_checkpoint"] = str(work / "base")
    (work / "drafter" / "meta.json").write_text(json.dumps(meta))
    monkeypatch.chdir(work)
    return work


def cfg(**settings):
    overrides = [f"{k}={v}" for k, v in settings.items()]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("export", overrides=overrides)


def listing(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# ------------------------------------------------------------------------------------------ where it writes


@pytest.mark.parametrize(
    "out, fragment",
    [
        ("{w}/drafter", "is {w}/drafter: overwrite=true never replaces"),  # the checkpoint: meta.json, weights
        ("{w}", "is {w}: overwrite=true never replaces"),  # the working directory and the checkpoint's parent
        (".", "out=. is {w}: overwrite=true never replaces"),
        ("..", "out=.. is a parent of {w}"),
        ("{w}/base", "is {w}/base: overwrite=true never replaces"),  # the base the drafter was trained on
        ("{w}/notes", "holds files no export of this project wrote"),
        ("{w}/other_base", "holds files no export of this project wrote"),  # a checkpoint of another run
    ],
)
def test_overwrite_never_removes_what_is_not_an_earlier_export(work: Path, out: str, fragment: str) -> None:
    (work / "notes").mkdir()
    (work / "notes" / "notes.txt").write_text("mine\n")
    before = listing(work.parent)
    with pytest.raises(FormatError) as excinfo:
        export_mod.export(cfg(checkpoint=work / "drafter", out=out.format(w=work), overwrite="true"))
    assert fragment.format(w=work) in str(excinfo.value) and "\n" not in str(excinfo.value)
    assert listing(work.parent) == before


def test_overwrite_replaces_an_earlier_export_with_files_others_can_read(work: Path) -> None:
    old = (work / "e3" / "model.safetensors").read_bytes()
    umask = os.umask(0o022)
    try:
        export_mod.export(cfg(checkpoint=work / "drafter", out=work / "e3", overwrite="true"))
    finally:
        os.umask(umask)
    assert (work / "e3" / "model.safetensors").read_bytes() == old  # the same drafter: the same bytes
    assert sorted(p.name for p in (work / "e3").iterdir()) == ["config.json", "model.safetensors"]
    assert {oct((work / "e3" / f).stat().st_mode & 0o777) for f in ("config.json", "model.safetensors")} == {"0o644"}
    assert json.loads((work / "e3" / "config.json").read_text())[MARK]["base_fingerprint"]
    assert not [p for p in work.iterdir() if p.name.startswith(".")]  # no temporary directory left


def test_a_failing_check_leaves_the_earlier_export(work: Path) -> None:
    before = {p.name: p.read_bytes() for p in (work / "e3").iterdir()}

    def refuse(tmp: Path) -> None:
        raise FormatError("read back with other logits")

    with pytest.raises(FormatError, match="other logits"):
        write_directory(work / "e3", {"model_type": "llama"}, {"w": torch.ones(2)}, overwrite=True, check=refuse)
    assert {p.name: p.read_bytes() for p in (work / "e3").iterdir()} == before
    assert not [p for p in work.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize(
    "settings, fragment",
    [
        ({"out": "{w}/a_file"}, "out={w}/a_file is a file, not a directory"),
        ({"out": "{w}/a_file/x"}, "out={w}/a_file/x lies under {w}/a_file, a file, not a directory"),
        ({"out": "''"}, "out='': give the directory to write the export to"),
        ({"out": "{w}/e3"}, "out={w}/e3 exists and is not empty: choose another directory or pass overwrite=true"),
        ({"checkpoint": "''"}, "checkpoint='': give a drafter checkpoint directory"),
        ({"checkpoint": None}, "checkpoint is required: give checkpoint=<a drafter checkpoint directory"),
    ],
)
def test_bad_paths_are_one_line_before_the_base_loads(
    work: Path, settings: dict, fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (work / "a_file").write_text("x")
    monkeypatch.setattr(export_mod, "load_lm", lambda *a, **k: pytest.fail("the base loaded before the check"))
    given = {"checkpoint": str(work / "drafter"), "out": str(work / "new")} | settings
    overrides = {k: v.format(w=work) for k, v in given.items() if v is not None}
    with pytest.raises(FormatError) as excinfo:
        export_mod.export(cfg(**overrides))
    assert fragment.format(w=work) in str(excinfo.value) and "\n" not in str(excinfo.value)


def test_the_command_line_refuses_in_one_line_and_leaves_no_run_directory(work: Path) -> None:
    """A refused export exits 2 with one line; the run directory Hydra made for it (named by the time) is gone."""
    before = listing(work)
    run = subprocess.run(
        [sys.executable, "-m", "experiments.export", f"checkpoint={work / 'drafter'}", "out=.", "overwrite=true"],
        cwd=work,
        capture_output=True,
        text=True,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )
    assert run.returncode == 2 and run.stderr.strip().count("\n") == 0, run.stderr
    assert run.stderr.startswith("error: out=. is ") and "never replaces" in run.stderr
    assert listing(work) == before  # no outputs/export/<time>/ either


@pytest.mark.parametrize("hook", ["load_lm", "save_file"])
def test_a_directory_made_at_out_while_exporting_is_refused_and_kept(
    work: Path, hook: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """out= is made and written by someone else while the base loads, or while the export is being written."""
    out = work / "new"
    module = export_mod if hook == "load_lm" else served_dir
    real = getattr(module, hook)

    def meanwhile(*args, **kwargs):
        out.mkdir(exist_ok=True)
        (out / "notes.txt").write_text("mine\n")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, hook, meanwhile)
    with pytest.raises(FormatError) as excinfo:
        export_mod.export(cfg(checkpoint=work / "drafter", out=out))
    assert str(excinfo.value).startswith(f"out={out} ") and "\n" not in str(excinfo.value)
    assert listing(out) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine\n"
    assert not [p for p in work.iterdir() if p.name.startswith(".")]


def test_two_exports_to_one_out_one_is_refused_and_nothing_is_deleted(
    work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second export to the same out= starts while the first writes its files (in another thread, as another
    process would): it is refused by out='s lock in one line, and the first's export is whole."""
    second, real = {}, served_dir.save_file
    second_cfg = cfg(checkpoint=work / "drafter", out=work / "new")

    def run_second() -> None:
        try:
            second["result"] = f"exported {export_mod.export(second_cfg)}"
        except FormatError as e:
            second["result"] = str(e)

    def write_while_another_starts(*args, **kwargs):
        monkeypatch.setattr(served_dir, "save_file", real)  # the second export writes its files plainly
        thread = threading.Thread(target=run_second)
        thread.start()
        thread.join()
        return real(*args, **kwargs)

    monkeypatch.setattr(served_dir, "save_file", write_while_another_starts)
    export_mod.export(cfg(checkpoint=work / "drafter", out=work / "new"))
    assert second["result"].startswith(f"out={work / 'new'} is being written by another export (pid {os.getpid()}")
    assert "\n" not in second["result"]
    assert (work / "new" / "model.safetensors").read_bytes() == (work / "e3" / "model.safetensors").read_bytes()
    assert not [p for p in work.iterdir() if p.name.startswith(".")]


# ------------------------------------------------------------------------------------------ what it reads


def variant(work: Path, name: str, *, edit=None, files=None) -> Path:
    """A copy of the good export, its config edited (a function of the dict) or its files changed."""
    path = work / name
    shutil.copytree(work / "e3", path)
    if edit is not None:
        config = json.loads((path / "config.json").read_text())
        edit(config)
        (path / "config.json").write_text(json.dumps(config))
    if files is not None:
        files(path)
    return path


def third_party(config: dict, verifier: dict) -> None:
    """As a drafter trained elsewhere has it: no fingerprint of this project, its own verifier."""
    config.pop(MARK)
    config["speculators_config"]["verifier"] = verifier


def truncate(path: Path) -> None:
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4000])


def pickle_only(path: Path) -> None:
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")


LLAMA_8B = {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct"}
BROKEN = [
    (
        "no_heads",
        dict(edit=lambda c: c["transformer_layer_config"].pop("num_attention_heads")),
        "has no 'num_attention_heads'",
    ),
    ("no_vocab", dict(edit=lambda c: c["transformer_layer_config"].pop("vocab_size")), "has no 'vocab_size'"),
    ("zero_width", dict(edit=lambda c: c["transformer_layer_config"].update(hidden_size=0)), "hidden_size=0 must be"),
    ("truncated", dict(files=truncate), "corrupted or truncated"),
    (
        "pickle_only",
        dict(files=pickle_only),
        "holds no *.safetensors weights (only pytorch_model.bin): pickled weights are never loaded",
    ),
    ("bad_json", dict(files=lambda p: (p / "config.json").write_text('{"a": ')), "config.json is not valid JSON"),
    ("no_fc", dict(edit=lambda c: None, files=lambda p: None), None),  # the good export: passes
    ("other_model", dict(edit=lambda c: third_party(c, LLAMA_8B)), "drafts for the verifier 'meta-llama/Llama-3.1"),
    ("other_arch", dict(edit=lambda c: third_party(c, {"architectures": ["Qwen3ForCausalLM"]})), "Qwen3ForCausalLM"),
    ("named_for_it", dict(edit=lambda c: third_party(c, {"name_or_path": "someone/base"})), None),  # its name
]


@pytest.mark.parametrize("name, how, fragment", BROKEN, ids=[b[0] for b in BROKEN])
def test_a_broken_served_directory_is_one_line_before_the_base_loads(
    work: Path, name: str, how: dict, fragment: str | None
) -> None:
    path = variant(work, name, **how)
    if fragment is None:
        assert check_served(path, "prophet", work / "base") == "eagle3"
        return
    with pytest.raises(FormatError) as excinfo:
        check_served(path, "prophet", work / "base")
    assert fragment in str(excinfo.value) and str(path) in str(excinfo.value) and "\n" not in str(excinfo.value)


def test_an_export_is_refused_on_another_base_of_the_same_shape(work: Path) -> None:
    other, _, other_meta = load_lm(work / "other_base")
    base, _, base_meta = load_lm(work / "base")
    read(work / "e3", base, base_meta)  # its own base: read
    with pytest.raises(FormatError, match="was exported from a drafter of base .* not of this base"):
        read(work / "e3", other, other_meta)


def test_a_medusa_directory_without_its_sizes_or_tensors_is_one_line(work: Path) -> None:
    base, _, _ = load_lm(work / "base")
    config = {"model_type": "medusa", "hidden_size": 32, "vocab_size": 64, "num_heads": 2, "num_hidden_layers": 1}
    tensors = {f"blocks.{k}.layers.0.weight": torch.zeros(32, 32) for k in range(2)}
    tensors |= {f"blocks.{k}.layers.0.bias": torch.zeros(32) for k in range(2)}
    tensors |= {"lm_heads.0.weight": torch.zeros(64, 32)}  # head 1's output layer is missing
    path = write_directory(work / "m", config, tensors)
    with pytest.raises(FormatError, match=r"lacks the tensors \['lm_heads.1.weight'\] of a medusa"):
        check_served(path, "medusa")
    with pytest.raises(FormatError, match=r"lacks the tensors \['lm_heads.1.weight'\] of a medusa"):
        medusa.read(path, base)
    for key in ("num_heads", "num_hidden_layers"):
        (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != key}))
        with pytest.raises(FormatError, match=f"has no '{key}'"):
            check_served(path, "medusa")
        with pytest.raises(FormatError, match=f"has no '{key}'"):
            medusa.read(path, base)
