"""The data engine's answers (experiments/lib/training/answers.py) and their windows (generated.py): every answered
turn is plain decoding's answer to its prompt alone (greedy for even questions, T = 1 from the question's own seed
for odd ones), a second turn is asked after the first answer's text, shards resume to the same bytes whatever the
batch size, and each window's mask covers exactly the answer's tokens."""

import json

import pytest
import torch

from experiments.lib.data.prompts import Question
from experiments.lib.store.lm import build_lm
from experiments.lib.training.answers import (
    AnswerSpec,
    answer_records,
    generate_answers,
    question_sampling,
    shards_written,
)  # fmt: skip
from experiments.lib.training.generated import VALIDATION_QUESTIONS, conversation_windows, generated_windows
from verify.backends.target import Target
from verify.loop.plain import plain_generate

V = 61
END = 3  # the fake tokenizer's <|im_end|>
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class Tokens:
    """A stand-in tokenizer: a text is its token ids written as numbers."""

    def token_to_id(self, name: str) -> int | None:
        return END if name == "<|im_end|>" else None

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i == END))


class Template:
    """A stand-in chat template: each turn's words as ids (mod V, avoiding END), answers between them."""

    def encode(self, tokenizer, turns: list[str], answers: list[str] = ()) -> list[int]:
        ids = []
        for k, turn in enumerate(turns):
            ids += [1] + [4 + sum(map(ord, w)) % (V - 4) for w in turn.split()] + [2]
            if k < len(answers):
                ids += [int(w) for w in answers[k].split()] + [END]
        return ids


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    return build_lm(num_tokens=V, dim=32, depth=2, heads=2, max_seq_len=256).eval().requires_grad_(False)


def questions_of(n: int) -> list[Question]:
    follow = ("and then?",)
    return [
        Question(turns=(f"question number {i} about topic {i % 5}",) + (follow if i % 3 == 0 else ()), question_id=i)
        for i in range(n)
    ]


def spec_of(**over) -> AnswerSpec:
    return AnswerSpec(
        **{"base_fingerprint": "b", "questions": "test", "max_new_tokens": 9, "shard_questions": 4} | over
    )


def test_every_turn_is_plain_decodings_answer_alone(base, tmp_path):
    questions, spec = questions_of(7), spec_of()
    generate_answers(tmp_path, base, Tokens(), Template(), questions, spec, batch=3)
    asked = [json.loads(line) for line in (tmp_path / "questions.jsonl").read_text().splitlines()]
    assert [q["turns"] for q in asked] == [list(q.turns) for q in questions]  # what was asked, beside the answers
    records = list(answer_records(tmp_path))
    assert [(r["index"], r["turn"]) for r in records] == sorted(
        [(i, 1) for i in range(7)] + [(i, 2) for i in range(7) if i % 3 == 0]
    )
    by_turn = {(r["index"], r["turn"]): r for r in records}
    for (i, turn), r in by_turn.items():
        q = questions[i]
        if turn == 1:
            assert r["prompt"] == Template().encode(Tokens(), [q.turns[0]])
        else:  # asked after the first answer's text
            first = Tokens().decode(by_turn[(i, 1)]["answer"], skip_special_tokens=True).strip()
            assert r["prompt"] == Template().encode(Tokens(), list(q.turns), [first])
        sampling, seed = question_sampling(spec, i, turn)
        assert r["temperature"] == float(i % 2) and r["seed"] == seed
        alone = plain_generate(
            Target(base), [r["prompt"]], max_new_tokens=9, sampling=sampling, eos_id=END,
            generator=torch.Generator().manual_seed(seed),
        ).tokens[0]  # fmt: skip
        assert r["answer"] == alone, (i, turn)


def test_shards_resume_to_the_same_bytes_whatever_the_batch(base, tmp_path):
    questions, spec = questions_of(10), spec_of()
    generate_answers(tmp_path / "a", base, Tokens(), Template(), questions, spec, batch=2)
    generate_answers(tmp_path / "b", base, Tokens(), Template(), questions, spec, batch=5)
    (tmp_path / "b" / "answers-00001.jsonl").unlink()  # an interrupted run: shard 1 missing
    generate_answers(tmp_path / "b", base, Tokens(), Template(), questions, spec, batch=5)
    for i in range(3):
        name = f"answers-{i:05d}.jsonl"
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_a_directory_of_another_setting_is_refused(base, tmp_path):
    generate_answers(tmp_path, base, Tokens(), Template(), questions_of(2), spec_of())
    with pytest.raises(ValueError, match="was written for another setting \\(max_new_tokens: written 9, wanted 5"):
        generate_answers(tmp_path, base, Tokens(), Template(), questions_of(2), spec_of(max_new_tokens=5))


def test_a_bad_answer_setting_is_refused():
    with pytest.raises(ValueError, match="answers.max_new_tokens=0: must be an integer >= 1"):
        spec_of(max_new_tokens=0)
    with pytest.raises(ValueError, match="answers.dtype='fp16': must be bf16 or fp32"):
        spec_of(dtype="fp16")


def test_windows_mask_exactly_the_answer_tokens():
    records = [
        {"prompt": [1, 5, 6, 2], "answer": [7, 8, END]},
        {"prompt": [1, 9, 2], "answer": [10, 11, 12, 13, 14, 15]},  # cut at the window's end
    ]
    windows, mask = conversation_windows(records, seq_len=7, pad_id=0)
    assert windows.tolist() == [[1, 5, 6, 2, 7, 8, END, 0], [1, 9, 2, 10, 11, 12, 13, 14]]
    # position t predicts token t + 1: the answer's tokens are targets, the prompt's and the padding are not
    assert mask.tolist() == [[False, False, False, True, True, True, False], [False, False] + [True] * 5]


class Spec:  # the fields of a FeatureSpec that generated_windows reads
    base_fingerprint, seed, seq_len, prompt_len = "b", 0, 24, 12
    questions = "bank"  # the bank's questions (self questions: tests/test_self_questions.py)

    def __init__(self, windows: int):
        self.windows = windows


def test_generated_windows_take_training_questions_and_hold_out_the_last(base, tmp_path):
    questions = questions_of(VALIDATION_QUESTIONS + 30)
    kwargs = dict(root=tmp_path, max_new_tokens=6, batch=8, questions=questions, template=Template())
    windows, mask = generated_windows(Spec(12), base, Tokens(), {}, **kwargs)
    assert windows.shape == (12, 25) and mask.shape == (12, 24) and mask.any(dim=1).all()
    val, val_mask = generated_windows(Spec(12), base, Tokens(), {}, held_out=VALIDATION_QUESTIONS, **kwargs)
    assert val.shape[0] >= VALIDATION_QUESTIONS  # every held-out turn (but those whose prompt is too long)
    (train_dir,) = [d for d in tmp_path.iterdir() if "-val" not in d.name]
    asked = {r["question_id"] for r in answer_records(train_dir)}
    held = {
        r["question_id"] for r in answer_records(train_dir.with_name(f"{train_dir.name}-val{VALIDATION_QUESTIONS}"))
    }
    assert held == {q.question_id for q in questions[-VALIDATION_QUESTIONS:]} and not asked & held
    assert json.loads((train_dir / "meta.json").read_text())["spec"]["max_new_tokens"] == 6


def test_windows_come_from_the_fewest_shards_that_hold_them(base, tmp_path):
    class Longer(Spec):  # second turns fit too: 64 questions give more than 64 windows
        seq_len, prompt_len = 48, 30

    questions = questions_of(VALIDATION_QUESTIONS + 100)
    kwargs = dict(root=tmp_path, max_new_tokens=6, batch=16, questions=questions, template=Template())
    generated_windows(Longer(40), base, Tokens(), {}, **kwargs)  # two shards of 32 questions
    (directory,) = tmp_path.iterdir()
    fitting = [r for r in answer_records(directory) if len(r["prompt"]) <= Longer.prompt_len]
    assert shards_written(directory) == 2 and len(fitting) > 64  # the case: more windows than questions
    windows, mask = generated_windows(Longer(len(fitting)), base, Tokens(), {}, **kwargs)
    assert shards_written(directory) == 2  # no third shard answered for windows the two already hold
    expected = conversation_windows(fitting, seq_len=Longer.seq_len, pad_id=END)
    assert torch.equal(windows, expected[0]) and torch.equal(mask, expected[1])
    windows, _ = generated_windows(Longer(len(fitting) + 1), base, Tokens(), {}, **kwargs)
    assert shards_written(directory) == 3 and torch.equal(windows[:-1], expected[0])  # one more: a shard more


def test_too_many_windows_are_refused_in_one_line(base, tmp_path):
    questions = questions_of(VALIDATION_QUESTIONS + 3)
    with pytest.raises(
        ValueError, match="features.windows=50: 3 of the 3 training questions gave only 3 answered turns"
    ):
        generated_windows(
            Spec(50), base, Tokens(), {}, root=tmp_path, max_new_tokens=4, batch=4, questions=questions,
            template=Template(),
        )  # fmt: skip


def test_held_out_questions_are_counted_and_bounded(base, tmp_path):
    questions = questions_of(VALIDATION_QUESTIONS + 3)
    kwargs = dict(root=tmp_path, max_new_tokens=4, batch=4, questions=questions, template=Template())
    windows, _ = generated_windows(Spec(1), base, Tokens(), {}, held_out=5, **kwargs)
    assert 5 <= windows.shape[0] <= 7  # five questions, each of one or two turns
    with pytest.raises(ValueError, match=f"{VALIDATION_QUESTIONS + 1} held-out questions asked: there are"):
        generated_windows(Spec(1), base, Tokens(), {}, held_out=VALIDATION_QUESTIONS + 1, **kwargs)


def test_a_stream_killed_midway_keeps_its_whole_shards_and_resumes(base, tmp_path, monkeypatch):
    from experiments.lib.training import answers

    questions, spec = questions_of(12), spec_of()
    generate_answers(tmp_path / "a", base, Tokens(), Template(), questions, spec, batch=4)
    written, write = [], answers._write_lines

    def crash_after_one(path, records):
        if path.name.startswith("answers-"):  # the questions file is written first, always
            if written:
                raise RuntimeError("killed")
            written.append(path.name)
        write(path, records)

    monkeypatch.setattr(answers, "_write_lines", crash_after_one)
    with pytest.raises(RuntimeError, match="killed"):
        generate_answers(tmp_path / "b", base, Tokens(), Template(), questions, spec, batch=4)
    monkeypatch.undo()
    assert [p.name for p in (tmp_path / "b").glob("answers-*.jsonl")] == written  # one whole shard, nothing else
    generate_answers(tmp_path / "b", base, Tokens(), Template(), questions, spec, batch=4)
    for i in range(3):
        name = f"answers-{i:05d}.jsonl"
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
