"""The base LM builder and checkpoint I/O: sizes, round trips, atomic saves, and one-line errors."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from tokenizers import Tokenizer, models

from experiments.lib.common.errors import exit_on_user_error
from experiments.lib.store import checkpoint as ckpt_mod
from experiments.lib.store.checkpoint import (
    CheckpointError,
    checkpoint_exists,
    fingerprint,
    load_checkpoint,
    load_lm,
    save_checkpoint,
)
from experiments.lib.store.lm import build_lm, count_parameters

CONF = Path(__file__).resolve().parents[1] / "conf"
SMALL = dict(num_tokens=64, dim=32, depth=1, heads=4, max_seq_len=32)


def preset(name: str, vocab: int = 8192) -> dict:
    cfg = OmegaConf.load(CONF / "base" / f"{name}.yaml")
    cfg.num_tokens = vocab  # the preset interpolates data.vocab_size, which lives elsewhere
    kwargs = OmegaConf.to_container(cfg)
    kwargs.pop("_target_")
    return kwargs


def tokenizer_json() -> str:
    return Tokenizer(models.BPE()).to_str()


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_lm(**SMALL)


def save(directory: Path, model: torch.nn.Module, **kwargs) -> Path:
    defaults = dict(model_config=SMALL, tokenizer_json=tokenizer_json(), step=7, extra={"tokens_seen": 123})
    return save_checkpoint(directory, model=model, **{**defaults, **kwargs})


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.parent.iterdir() if p.name.startswith(f".{directory.name}."))


def assert_one_line_error(excinfo: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(excinfo.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


# ------------------------------------------------------------------------------------------------ lm


@pytest.mark.parametrize(
    "name, low, high", [("tiny", 2.7e6, 3.1e6), ("small", 10.0e6, 11.0e6), ("draft", 1.5e6, 2.6e6)]
)
def test_preset_sizes(name: str, low: float, high: float) -> None:
    n = count_parameters(build_lm(**preset(name)))
    assert low <= n <= high, f"{name}: {n} parameters"


def test_draft_is_cheaper_than_tiny() -> None:
    assert preset("draft")["depth"] < preset("tiny")["depth"]
    assert count_parameters(build_lm(**preset("draft"))) < count_parameters(build_lm(**preset("tiny")))


def test_forward_shape_and_rotary_only() -> None:
    model = make_model()
    logits = model(torch.randint(0, 64, (2, 10)))  # (B, N, V)
    assert logits.shape == (2, 10, 64)
    assert not any("pos_emb.emb" in name for name in model.state_dict())  # no absolute position table


@pytest.mark.parametrize(
    "override, fragment",
    [
        ({"dim": 0}, "dim must be a positive integer, got 0"),
        ({"depth": -1}, "depth must be a positive integer, got -1"),
        ({"heads": 2.5}, "heads must be a positive integer, got 2.5"),
        ({"num_tokens": True}, "num_tokens must be a positive integer, got True"),
        ({"max_seq_len": "256"}, "max_seq_len must be a positive integer, got '256'"),
        ({"heads": 3}, "dim (32) must be divisible by heads (3)"),
        ({"attn_dim_head": 0}, "attn_dim_head must be a positive integer, got 0"),
    ],
)
def test_bad_sizes_rejected(override: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        build_lm(**{**SMALL, **override})
    assert_one_line_error(excinfo, fragment)


def test_explicit_head_dim() -> None:
    model = build_lm(**{**SMALL, "heads": 3, "attn_dim_head": 16})
    assert model(torch.randint(0, 64, (1, 5))).shape == (1, 5, 64)


# ----------------------------------------------------------------------------------------- checkpoint


def test_round_trip(tmp_path: Path) -> None:
    model = make_model()
    directory = save(tmp_path / "ckpt", model)
    assert sorted(p.name for p in directory.iterdir()) == ["meta.json", "model.safetensors", "tokenizer.json"]
    loaded = load_checkpoint(directory, expected_config=SMALL)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict[name], tensor), name
    meta = loaded.meta
    assert meta["model_config"] == SMALL and meta["step"] == 7 and meta["tokens_seen"] == 123
    assert meta["fingerprint"] == fingerprint(model.state_dict())
    assert meta["provenance"]["torch"] == torch.__version__ and meta["provenance"]["x_transformers"]
    assert (directory / "tokenizer.json").read_text() == meta["tokenizer"]
    assert loaded.optimizer_state is None
    assert leftovers(directory) == []


def test_fingerprint_stable_and_sensitive(tmp_path: Path) -> None:
    model = make_model()
    first = fingerprint(model.state_dict())
    assert fingerprint(make_model().state_dict()) == first  # same seed, same weights
    save(tmp_path / "a", model)
    assert load_checkpoint(tmp_path / "a").meta["fingerprint"] == first
    assert len(first) == 16 and int(first, 16) >= 0
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1e-6
    assert fingerprint(model.state_dict()) != first
    bf16 = {k: v.to(torch.bfloat16) for k, v in make_model().state_dict().items()}
    assert fingerprint(bf16) != first  # dtype is part of the hash (and bf16 hashes at all)


def test_optimizer_round_trip(tmp_path: Path) -> None:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 64, (2, 8))).sum().backward()
    optimizer.step()
    save(tmp_path / "ckpt", model, optimizer=optimizer)
    state = load_checkpoint(tmp_path / "ckpt").optimizer_state
    fresh = torch.optim.AdamW(make_model(1).parameters(), lr=5.0)
    fresh.load_state_dict(state)
    expected = optimizer.state_dict()
    assert fresh.state_dict()["param_groups"][0]["lr"] == 1e-3
    for pid, param_state in expected["state"].items():
        for key, value in param_state.items():
            assert torch.equal(fresh.state_dict()["state"][pid][key], value), (pid, key)


def test_load_lm(tmp_path: Path) -> None:
    model = make_model().eval()
    save(tmp_path / "ckpt", model)
    loaded, tokenizer, meta = load_lm(tmp_path / "ckpt")
    tokens = torch.randint(0, 64, (2, 12))
    assert not loaded.training
    assert torch.equal(loaded(tokens), model(tokens))
    assert isinstance(tokenizer, Tokenizer) and meta["step"] == 7


def test_resave_replaces(tmp_path: Path) -> None:
    save(tmp_path / "ckpt", make_model(0), step=1)
    save(tmp_path / "ckpt", make_model(1), step=2)
    assert load_checkpoint(tmp_path / "ckpt").meta["fingerprint"] == fingerprint(make_model(1).state_dict())
    assert leftovers(tmp_path / "ckpt") == []


# --------------------------------------------------------------------------------------------- atomic


def test_failure_while_writing_keeps_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = save(tmp_path / "ckpt", make_model(0), step=1)

    def crash(*args, **kwargs):  # meta.json is written after the weights: a crash mid-save
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_mod, "_write_json", crash)
    with pytest.raises(OSError, match="disk full"):
        save(directory, make_model(1), step=2)
    loaded = load_checkpoint(directory)
    assert loaded.meta["step"] == 1 and loaded.meta["fingerprint"] == fingerprint(make_model(0).state_dict())
    assert leftovers(directory) == []


def test_failure_between_renames_keeps_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = save(tmp_path / "ckpt", make_model(0), step=1)
    tmp, _ = ckpt_mod._siblings(directory)
    real_replace = os.replace

    def replace(src, dst):  # the old checkpoint has been moved aside; moving the new one in fails
        if Path(src) == tmp:
            raise OSError("power cut")
        real_replace(src, dst)

    monkeypatch.setattr(ckpt_mod.os, "replace", replace)
    with pytest.raises(OSError, match="power cut"):
        save(directory, make_model(1), step=2)
    assert load_checkpoint(directory).meta["step"] == 1
    assert leftovers(directory) == []


def test_every_file_and_the_new_directory_reach_the_disk_before_the_swap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A power cut right after the swap must not leave a checkpoint of empty files: each file is written with the
    atomic writer (fsync'd), and the new directory's own entries are fsync'd, before it is renamed into place."""
    directory = save(tmp_path / "ckpt", make_model(0), step=1)
    tmp, _ = ckpt_mod._siblings(directory)
    events: list[tuple[str, Path, Path | None]] = []  # (fsync, path, None) or (replace, source, destination)
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}")), None))
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(("replace", Path(src).resolve(), Path(dst).resolve()))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    save(directory, make_model(1), step=2)
    swap = next(i for i, (kind, src, _) in enumerate(events) if kind == "replace" and src == tmp.resolve())
    synced = {path for kind, path, _ in events[:swap] if kind == "fsync"}
    assert tmp.resolve() in synced  # the directory's entries: the files' names
    renamed = {src: dst for kind, src, dst in events[:swap] if kind == "replace"}  # temporary file -> its name
    files = {tmp.resolve() / name for name in ("model.safetensors", "tokenizer.json", "meta.json")}
    assert files <= set(renamed.values())
    assert {src for src, dst in renamed.items() if dst in files} <= synced  # each fsync'd before its rename
    assert leftovers(directory) == []


def test_crash_between_renames_is_readable_and_recovered(tmp_path: Path) -> None:
    directory = save(tmp_path / "ckpt", make_model(0), step=1)
    tmp, backup = ckpt_mod._siblings(directory)
    os.replace(directory, backup)  # the state a killed process leaves between the two renames
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"half")
    assert checkpoint_exists(directory)
    assert load_checkpoint(directory).meta["step"] == 1  # read from the backup, nothing changed on disk
    assert backup.exists() and tmp.exists()
    save(directory, make_model(1), step=2)
    assert load_checkpoint(directory).meta["step"] == 2
    assert leftovers(directory) == []


# --------------------------------------------------------------------------------------------- errors


def test_missing_directory_and_files(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(tmp_path / "nope")
    assert_one_line_error(excinfo, "not found", "nope")
    directory = save(tmp_path / "ckpt", make_model())
    (directory / "model.safetensors").unlink()
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(directory)
    assert_one_line_error(excinfo, "model.safetensors is missing")


def test_truncated_weights(tmp_path: Path) -> None:
    directory = save(tmp_path / "ckpt", make_model())
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(directory)
    assert_one_line_error(excinfo, str(path))


def test_flipped_byte_fails_fingerprint(tmp_path: Path) -> None:
    directory = save(tmp_path / "ckpt", make_model())
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # inside the last tensor's data: the file still parses
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(directory)
    assert_one_line_error(excinfo, "fingerprint")


@pytest.mark.parametrize("content", ['{"format": "prophet-medusa/checkpoint-v1", "step": ', "\xff\xfe", "[]", "{}"])
def test_corrupted_meta(tmp_path: Path, content: str) -> None:
    directory = save(tmp_path / "ckpt", make_model())
    (directory / "meta.json").write_text(content, encoding="latin-1")
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(directory)
    assert_one_line_error(excinfo, "meta.json")


def test_corrupted_optimizer(tmp_path: Path) -> None:
    model = make_model()
    directory = save(tmp_path / "ckpt", model, optimizer=torch.optim.AdamW(model.parameters()))
    (directory / "optim.safetensors").write_bytes(b"\x00" * 4)
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(directory)
    assert_one_line_error(excinfo, "optim.safetensors")


def test_expected_config_mismatch(tmp_path: Path) -> None:
    save(tmp_path / "ckpt", make_model())
    with pytest.raises(CheckpointError) as excinfo:
        load_checkpoint(tmp_path / "ckpt", expected_config={**SMALL, "dim": 64, "extra_key": 1})
    assert_one_line_error(excinfo, "dim: checkpoint 32 vs expected 64", "extra_key: checkpoint '<absent>'")
    assert "depth" not in str(excinfo.value)  # only differing keys are named


def test_never_replaces_a_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "precious.txt").write_text("keep me")
    with pytest.raises(CheckpointError) as excinfo:
        save(tmp_path / "run", make_model())
    assert_one_line_error(excinfo, "is not a checkpoint")
    assert (tmp_path / "run" / "precious.txt").read_text() == "keep me"


def test_extra_cannot_override_reserved_keys(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="reserved"):
        save(tmp_path / "ckpt", make_model(), extra={"step": 3})


def test_loading_never_unpickles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model()
    save(tmp_path / "ckpt", model, optimizer=torch.optim.AdamW(model.parameters()))

    def forbidden(*args, **kwargs):
        raise AssertionError("unpickling is forbidden")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    load_lm(tmp_path / "ckpt")
    assert load_checkpoint(tmp_path / "ckpt").optimizer_state is not None


def test_meta_is_plain_json(tmp_path: Path) -> None:
    directory = save(tmp_path / "ckpt", make_model())
    meta = json.loads((directory / "meta.json").read_text())
    assert meta["format"] == "prophet-medusa/checkpoint-v1" and meta["has_optimizer"] is False


# ------------------------------------------------------------------------------------------------ cli


def test_cli_user_error_exits_2_with_one_line(capsys: pytest.CaptureFixture) -> None:
    @exit_on_user_error
    def entry() -> None:
        raise CheckpointError("checkpoint x is broken:\n  details")

    with pytest.raises(SystemExit) as excinfo:
        entry()
    assert excinfo.value.code == 2
    assert capsys.readouterr().err == "error: checkpoint x is broken: details\n"


def test_cli_bug_keeps_traceback() -> None:
    @exit_on_user_error
    def entry() -> None:
        raise KeyError("bug")

    with pytest.raises(KeyError):
        entry()


def test_the_project_imports_and_refuses_llama_without_transformers():
    """transformers is the optional `hf` extra: without it every module imports, and arch=llama says what to install."""
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import prophet.model, medusa.drafter, verify.backends.hf, verify.drafters.early_exit\n"
        "import verify.loop.speculative\n"
        "import experiments.benchmark, experiments.generate, experiments.train_drafter, experiments.peer\n"
        "from experiments.lib.store.lm import build_lm\n"
        "try:\n    build_lm(arch='llama', num_tokens=10, dim=8, depth=1, heads=2, max_seq_len=8)\n"
        "except ValueError as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1]
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "arch=llama needs transformers: pip install -e '.[hf]'"


# -------------------------------------------------------------------------- what load_lm refuses, in one line


def word_tokenizer(size: int) -> str:
    return Tokenizer(models.WordLevel({f"t{i}": i for i in range(size)}, unk_token="t0")).to_str()


def no_weights_read(monkeypatch: pytest.MonkeyPatch) -> None:
    def read(*args, **kwargs):
        raise AssertionError("the weights were read before the meta was checked")

    monkeypatch.setattr(ckpt_mod, "_read_safetensors", read)


def test_load_lm_refuses_a_drafter_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = save(
        tmp_path / "medusa",
        make_model(),
        tokenizer_json=None,
        model_config={"package": "medusa", "module": {}},
        extra={"kind": "drafter", "base_fingerprint": "0" * 16},
    )
    no_weights_read(monkeypatch)
    with pytest.raises(CheckpointError) as excinfo:
        load_lm(directory)
    assert_one_line_error(
        excinfo,
        f"{directory} is a drafter checkpoint (kind=drafter); base_checkpoint takes a base LM "
        "checkpoint (experiments.train_base)",
    )
    with pytest.raises(CheckpointError) as excinfo:
        load_lm(directory, role="checkpoints.assistant")
    assert_one_line_error(excinfo, "checkpoints.assistant takes a base LM checkpoint")


@pytest.mark.parametrize(
    "tokens, eos_id, fragment",
    [
        (100, 0, "its tokenizer has 100 tokens, more than the model's 64 (num_tokens)"),
        (10, 10, "its EOS id 10 is not a token of its 10-token tokenizer"),
        (10, -1, "its EOS id -1"),
        (10, "0", "its EOS id '0'"),
    ],
)
def test_load_lm_refuses_a_tokenizer_that_does_not_fit_the_weights(
    tokens: int, eos_id, fragment: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = save(
        tmp_path / "ckpt", make_model(), tokenizer_json=word_tokenizer(tokens), extra={"data": {"eos_id": eos_id}}
    )
    no_weights_read(monkeypatch)
    with pytest.raises(CheckpointError) as excinfo:
        load_lm(directory)
    assert_one_line_error(excinfo, str(directory), fragment)


def test_load_lm_accepts_a_tokenizer_that_fits(tmp_path: Path) -> None:
    directory = save(tmp_path / "ckpt", make_model(), tokenizer_json=word_tokenizer(64), extra={"data": {"eos_id": 63}})
    model, tokenizer, meta = load_lm(directory)
    assert tokenizer.get_vocab_size() == model.num_tokens == 64 and meta["data"]["eos_id"] == 63


@pytest.mark.parametrize(
    "tokenizer, model_config, fragment",
    [
        ('{"not a tokenizer"', SMALL, "its tokenizer does not load"),
        (None, SMALL, "has no tokenizer: base_checkpoint takes a base LM checkpoint"),
        (tokenizer_json(), {"package": "medusa", "module": {}}, "holds no model this loader builds"),
    ],
)
def test_load_lm_refuses_what_is_not_a_base_lm(tokenizer, model_config: dict, fragment: str, tmp_path: Path) -> None:
    directory = save(tmp_path / "ckpt", make_model(), tokenizer_json=tokenizer, model_config=model_config)
    with pytest.raises(CheckpointError) as excinfo:
        load_lm(directory)
    assert_one_line_error(excinfo, fragment)


def test_read_meta_reads_no_weights_and_says_what_a_directory_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = save(tmp_path / "run" / "checkpoint", make_model())
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "not_hf").mkdir()
    (tmp_path / "not_hf" / "config.json").write_text("{}")  # a config.json alone is no Hugging Face model
    (tmp_path / "empty").mkdir()
    truncated = save(tmp_path / "truncated", make_model()) / "model.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:-8])
    no_weights_read(monkeypatch)
    assert ckpt_mod.read_meta(directory)["step"] == 7
    for path, fragment in (
        (tmp_path / "run", f"is a run directory, not a checkpoint: give {directory}"),
        (tmp_path / "hf", "is a Hugging Face model directory, not a checkpoint of this project"),
        (tmp_path / "not_hf", "nor a Hugging Face model directory: its config.json names no 'model_type'"),
        (tmp_path / "empty", "is not a checkpoint directory (no meta.json, no model.safetensors)"),
        (truncated.parent, f"corrupted or truncated {truncated}"),
    ):
        with pytest.raises(CheckpointError) as excinfo:
            ckpt_mod.read_meta(path)
        assert_one_line_error(excinfo, fragment)


def hf_directory(directory: Path, *, config_eos=None, generation_eos=None) -> Path:
    """A Hugging Face model directory (save_pretrained of a tiny Llama, a 64-token tokenizer whose t5 is its
    end-of-text token) with the given eos_token_id in config.json and generation_config.json (None: absent)."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    build_lm(arch="llama", **SMALL).hf.save_pretrained(directory)
    (directory / "tokenizer.json").write_text(word_tokenizer(64))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t5"}))
    for name, eos in (("config.json", config_eos), ("generation_config.json", generation_eos)):
        file = directory / name
        data = json.loads(file.read_text()) if file.is_file() else {}
        data.pop("eos_token_id", None)
        if eos is not None:
            data["eos_token_id"] = eos
        file.write_text(json.dumps(data))
    return directory


@pytest.mark.parametrize(
    "config_eos, generation_eos, expected",
    [
        (None, None, 5),  # the tokenizer's end-of-text token
        (7, None, 7),  # config.json before the tokenizer
        (7, [9, 11], [9, 11]),  # generation_config.json first, a list as transformers takes it
        ([12, 13], None, [12, 13]),
    ],
)
def test_a_hugging_face_directory_records_the_eos_its_generate_uses(
    config_eos, generation_eos, expected, tmp_path: Path
) -> None:
    directory = hf_directory(tmp_path / "hf", config_eos=config_eos, generation_eos=generation_eos)
    _, _, meta = load_lm(directory)
    assert meta["data"]["eos_id"] == expected


@pytest.mark.parametrize(
    "eos, fragment",
    [
        ([9, 64], "its EOS ids [9, 64] must be a non-empty list of tokens of its 64-token tokenizer"),
        ([], "its EOS ids [] must be a non-empty list"),
        ([True], "its EOS ids [True]"),
        (64, "its EOS id 64 is not a token of its 64-token tokenizer"),
    ],
)
def test_a_hugging_face_directory_with_a_bad_eos_is_a_one_line_error(eos, fragment: str, tmp_path: Path) -> None:
    directory = hf_directory(tmp_path / "hf", generation_eos=eos)
    with pytest.raises(CheckpointError) as excinfo:
        load_lm(directory)
    assert_one_line_error(excinfo, f"Hugging Face model {directory}: {fragment}")


def test_a_checkpoint_may_record_several_eos_ids(tmp_path: Path) -> None:
    directory = save(
        tmp_path / "ckpt", make_model(), tokenizer_json=word_tokenizer(64), extra={"data": {"eos_id": [3, 63]}}
    )
    assert load_lm(directory)[2]["data"]["eos_id"] == [3, 63]
    bad = save(tmp_path / "bad", make_model(), tokenizer_json=word_tokenizer(64), extra={"data": {"eos_id": [3, 64]}})
    with pytest.raises(CheckpointError) as excinfo:
        load_lm(bad)
    assert_one_line_error(excinfo, "its EOS ids [3, 64] must be a non-empty list of tokens of its 64-token tokenizer")
