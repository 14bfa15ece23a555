"""Answers shipped with the repository (experiments/lib/training/shipped.py, experiments/ship_answers.py): a shipped
directory unpacks to its shards' exact bytes, a run starts from it without answering those questions again and
answers only the rest, and a damaged or foreign copy is refused before anything is written."""

import gzip
import json

import pytest
import torch

from experiments import ship_answers as cli
from experiments.lib.training import generated
from experiments.lib.training.answers import shards_written
from experiments.lib.training.generated import VALIDATION_QUESTIONS, generated_windows
from experiments.lib.training.shipped import seed_answers, ship_answers
from tests.test_answers import Spec, Template, Tokens, questions_of
from tests.test_answers import base as base  # noqa: F401  (the module's tiny LM fixture)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
QUESTIONS = questions_of(VALIDATION_QUESTIONS + 100)


def windows(root, base, wanted: int, **over):
    kwargs = dict(root=root, max_new_tokens=6, batch=16, questions=QUESTIONS, template=Template()) | over
    return generated_windows(Spec(wanted), base, Tokens(), {}, **kwargs)


@pytest.fixture(scope="module")
def answered(base, tmp_path_factory):
    """An answer directory of 3 shards (96 questions), generated once."""
    root = tmp_path_factory.mktemp("answers")
    windows(root, base, 90)
    (directory,) = root.iterdir()
    assert shards_written(directory) == 3
    return directory


def no_answering(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("answers were generated although shipped ones hold them")

    monkeypatch.setattr(generated, "generate_answers", refuse)


def test_shipped_answers_unpack_to_the_same_bytes_and_are_not_answered_again(base, answered, tmp_path, monkeypatch):
    out = ship_answers(answered, tmp_path / "shipped")
    assert out == tmp_path / "shipped" / answered.name
    assert sorted(p.name for p in out.iterdir()) == ["answers-00000.jsonl.gz", "answers-00001.jsonl.gz",
                                                     "answers-00002.jsonl.gz", "meta.json"]  # fmt: skip
    packed = {p.name: p.read_bytes() for p in out.iterdir()}
    ship_answers(answered, tmp_path / "shipped")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == packed  # the same shards pack to the same bytes
    no_answering(monkeypatch)
    got = windows(tmp_path / "new", base, 90, shipped=tmp_path / "shipped")
    for i in range(3):
        name = f"answers-{i:05d}.jsonl"
        assert (tmp_path / "new" / answered.name / name).read_bytes() == (answered / name).read_bytes()
    expected = windows(answered.parent, base, 90)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert seed_answers(tmp_path / "shipped", tmp_path / "new" / answered.name) == 0  # all there: nothing copied


def test_a_run_answers_only_what_was_not_shipped(base, answered, tmp_path):
    partial = tmp_path / "partial" / answered.name  # an answer directory of its first shard only
    partial.mkdir(parents=True)
    (partial / "meta.json").write_bytes((answered / "meta.json").read_bytes())
    (partial / "answers-00000.jsonl").write_bytes((answered / "answers-00000.jsonl").read_bytes())
    ship_answers(partial, tmp_path / "shipped")
    got = windows(tmp_path / "new", base, 90, shipped=tmp_path / "shipped")  # shard 0 shipped, 1 and 2 answered
    assert shards_written(tmp_path / "new" / answered.name) == 3
    for i in range(3):  # an answer depends on its question, index and seed only: the same as answered in one run
        name = f"answers-{i:05d}.jsonl"
        assert (tmp_path / "new" / answered.name / name).read_bytes() == (answered / name).read_bytes()
    assert torch.equal(got[0], windows(answered.parent, base, 90)[0])


def test_a_damaged_shipped_shard_is_refused_before_anything_is_written(answered, tmp_path):
    out = ship_answers(answered, tmp_path / "shipped")
    shard = out / "answers-00001.jsonl.gz"
    raw = gzip.decompress(shard.read_bytes()).replace(b'"turn":1', b'"turn":2', 1)
    shard.write_bytes(gzip.compress(raw))
    target = tmp_path / "new" / answered.name
    with pytest.raises(ValueError, match="answers-00001.jsonl.gz does not match its sha256 in meta.json"):
        seed_answers(tmp_path / "shipped", target)
    assert not target.exists()  # not even shard 0, which was whole
    shard.write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="answers-00001.jsonl.gz is damaged"):
        seed_answers(tmp_path / "shipped", target)


def test_shipped_answers_of_another_setting_are_refused(answered, tmp_path):
    ship_answers(answered, tmp_path / "shipped")
    target = tmp_path / "new" / answered.name
    target.mkdir(parents=True)
    meta = json.loads((answered / "meta.json").read_text())
    meta["spec"]["max_new_tokens"] += 1
    (target / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="were written for another setting than"):
        seed_answers(tmp_path / "shipped", target)
    assert sorted(p.name for p in target.iterdir()) == ["meta.json"]
    assert seed_answers(tmp_path / "elsewhere", target) == 0  # nothing shipped under that name: nothing to do


def test_the_command_ships_and_reports(answered, tmp_path, capsys):
    assert cli.main([str(answered), "--out", str(tmp_path / "shipped")]) == 0
    line = capsys.readouterr().out
    assert f"{tmp_path / 'shipped' / answered.name}: 3 shards, 96 questions" in line and "answer tokens" in line
    assert cli.main([str(tmp_path / "nothing"), "--out", str(tmp_path / "shipped")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nothing'}: not an answer directory (no meta.json)"
