"""The data writers go through one atomic writer (experiments/lib/common/errors.py): a failure mid-write (a full
disk at fsync, a failed rename) leaves the previous file whole and no temporary file behind, for the question
files (prompts.write_questions, the bank), the self questions, the shipped answers and the answer shards; the two
directory writers (the token-id cache, the converted pretrained base) fsync their files before the rename and
remove their temporary directory when it fails."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from experiments.lib.data import question_bank
from experiments.lib.data import self_questions as sq
from experiments.lib.data.pipeline import prepare_data
from experiments.lib.data.prompts import Question, write_questions
from experiments.lib.store import pretrained
from experiments.lib.training.answers import AnswerSpec, generate_answers
from experiments.lib.training.shipped import seed_directory, ship_answers
from tests.test_answers import Template, Tokens, questions_of, tiny_llama

FAILS = ["fsync", "replace"]  # a full disk when the data is flushed, or a rename that fails


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def failing(monkeypatch: pytest.MonkeyPatch, call: str) -> None:
    monkeypatch.setattr(os, call, full_disk)


def files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("fails", FAILS)
def test_questions_files_keep_the_previous_file(fails, tmp_path, monkeypatch):
    path = tmp_path / "questions.jsonl"
    write_questions([Question(("old",), "qa", 1)], path)
    before = files(tmp_path)
    failing(monkeypatch, fails)
    with pytest.raises(OSError, match="No space left"):
        write_questions([Question(("new",), "qa", 1)] * 1000, path)
    monkeypatch.undo()
    assert files(tmp_path) == before


@pytest.mark.parametrize("fails", FAILS)
def test_the_bank_file_keeps_the_previous_file(fails, tmp_path, monkeypatch):
    bank = [Question(("a question",), "qa", "bank-qa-1"), Question(("another",), "math", "bank-math-1")]
    monkeypatch.setattr(question_bank, "bank_questions", lambda n=None, **kwargs: bank[:n])
    path = tmp_path / "bank.jsonl"
    assert question_bank.write_bank(path, 1) == {"qa": 1}
    before = files(tmp_path)
    with monkeypatch.context() as m, pytest.raises(OSError, match="No space left"):
        m.setattr(os, fails, full_disk)
        question_bank.write_bank(path, 2)
    assert files(tmp_path) == before


@pytest.mark.parametrize("fails", FAILS)
def test_self_questions_leave_no_partial_file(fails, tmp_path, monkeypatch):
    spec = sq.SelfQuestionSpec(base_fingerprint="b", n=2)
    records = [{"question_id": f"self-self-{i}", "category": "self", "turns": [f"question {i}?"], "index": i,
                "seed": i} for i in range(2)]  # fmt: skip
    stats = {"counts": {"kept": 2}, "candidates": 2, "tokens": 10, "seconds": 1.0, "tokens_per_s": 10.0}
    monkeypatch.setattr(sq, "generate_self_questions", lambda *a, **k: (records, stats))
    with monkeypatch.context() as m, pytest.raises(OSError, match="No space left"):
        m.setattr(os, fails, full_disk)
        sq.self_questions(None, None, None, spec, root=tmp_path)
    assert files(tmp_path) == {}  # no question file (it would be read as a whole one) and no temporary file


def answer_directory(root: Path) -> Path:
    directory = root / "answers"
    directory.mkdir(parents=True)
    (directory / "meta.json").write_text(json.dumps({"spec": {"seed": 0}, "format": 1, "shards": 1}))
    (directory / "answers-00000.jsonl").write_text('{"index":0,"turn":1,"answer":[1,2,3]}\n')
    return directory


@pytest.mark.parametrize("fails", FAILS)
def test_shipping_and_seeding_answers_leave_no_partial_file(fails, tmp_path, monkeypatch):
    directory = answer_directory(tmp_path)
    failing(monkeypatch, fails)
    with pytest.raises(OSError, match="No space left"):
        ship_answers(directory, tmp_path / "shipped")
    monkeypatch.undo()
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "shipped").rglob("*"))
    ship_answers(directory, tmp_path / "shipped")
    failing(monkeypatch, fails)
    with pytest.raises(OSError, match="No space left"):
        seed_directory(tmp_path / "shipped" / "answers", tmp_path / "new" / "answers")
    monkeypatch.undo()
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "new").rglob("*"))


@pytest.mark.parametrize("fails", FAILS)
def test_answer_shards_leave_no_partial_file(fails, tmp_path, monkeypatch):
    spec = AnswerSpec(base_fingerprint="b", max_new_tokens=4, shard_questions=2)
    with monkeypatch.context() as m, pytest.raises(OSError, match="No space left"):
        m.setattr(os, fails, full_disk)
        generate_answers(tmp_path, tiny_llama(61), Tokens(), Template(), questions_of(4), spec, batch=2)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".") or p.name.startswith("answers-")]


def test_the_token_id_cache_is_synced_and_leaves_no_temporary_directory(tmp_path, monkeypatch):
    corpus, cache = tmp_path / "corpus", tmp_path / "cache"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"m{i}.py").write_text("".join(f"def f{i}_{j}(x):\n    return x + {j}\n" for j in range(30)))
    failing(monkeypatch, "fsync")  # the entry's files are flushed before the rename publishes them
    with pytest.raises(OSError, match="No space left"):
        prepare_data(source="files", paths=[str(corpus)], vocab_size=300, cache_dir=str(cache))
    monkeypatch.undo()
    assert list(cache.iterdir()) == []  # neither an entry nor a temporary directory


def test_the_pretrained_conversion_is_synced_and_leaves_no_temporary_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(pretrained, "_checked_file", lambda name: tmp_path / "model.gguf")

    def convert(gguf: Path, out: Path) -> None:
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(pretrained, "_convert", convert)
    with monkeypatch.context() as m, pytest.raises(OSError, match="No space left"):
        m.setattr(os, "fsync", full_disk)
        pretrained.ensure_pretrained("smollm2", tmp_path / "artifacts")
    left = [p.name for p in (tmp_path / "artifacts" / "pretrained").iterdir()]
    assert left == [".smollm2-b179c9523d0e.lock"]  # the lock file only: no half-converted directory
    final = pretrained.ensure_pretrained("smollm2", tmp_path / "artifacts")
    assert sorted(p.name for p in final.iterdir()) == ["model.safetensors", "provenance.json"]


def test_two_conversions_at_once_convert_once(tmp_path, monkeypatch):
    """make test's workers (or two runs) asking for the base at once: one converts, the other waits and takes it."""
    import threading
    import time

    monkeypatch.setattr(pretrained, "_checked_file", lambda name: tmp_path / "model.gguf")
    calls = []

    def convert(gguf: Path, out: Path) -> None:
        calls.append(out)
        time.sleep(0.3)  # long enough for the other thread to arrive while this one converts
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(pretrained, "_convert", convert)
    found = []
    threads = [
        threading.Thread(target=lambda: found.append(pretrained.ensure_pretrained("smollm2", tmp_path / "a")))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(found) == 2 and found[0] == found[1]
