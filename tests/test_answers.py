"""The data engine's answers (experiments/lib/training/answers.py) and their windows (generated.py): every answered
turn is plain decoding's answer to its prompt alone (greedy for even questions, T = 1 from the question's own seed
for odd ones), a second turn is asked after the first answer's text, shards resume to the same bytes whatever the
batch size, each window's mask covers exactly the answer's tokens, answers are kept per question (a grown question
list answers only its new questions), a second turn that outgrows the rows is skipped once with its reason, and a
run holds only its open shards' records."""

import json

import pytest
import torch

from experiments.lib.data.prompts import Question
from experiments.lib.training import answers, generated
from experiments.lib.training.answers import (
    AnswerSpec,
    answer_records,
    generate_answers,
    question_key,
    question_sampling,
    shard_files,
    shards_written,
)  # fmt: skip
from experiments.lib.training.generated import (
    VALIDATION_PER_CATEGORY,
    conversation_windows,
    generated_records,
    generated_windows,
    split_questions,
)
from verify.backends.choose import make_target
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


def tiny_llama(vocab: int, *, seed: int = 0) -> torch.nn.Module:
    """A small random transformers Llama on the lean engine: continuous batching runs there only (its rows' bits
    are tested to be independent of the batch, verify/loop/continuous.py)."""
    transformers = pytest.importorskip("transformers")
    from verify.backends.hf import HFBase

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1, bos_token_id=None,
        eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    return HFBase(transformers.LlamaForCausalLM(config)).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def base():
    return tiny_llama(V)


CATEGORIES = 3  # questions_of's categories, taking turns
HELD = CATEGORIES * VALIDATION_PER_CATEGORY  # held out of questions_of's lists


def questions_of(n: int) -> list[Question]:
    follow = ("and then?",)
    return [
        Question(turns=(f"question number {i} about topic {i % 5}",) + (follow if i % 3 == 0 else ()),
                 category=f"c{i % CATEGORIES}", question_id=i)
        for i in range(n)
    ]  # fmt: skip


def spec_of(**over) -> AnswerSpec:
    return AnswerSpec(**{"base_fingerprint": "b", "max_new_tokens": 9, "shard_questions": 4} | over)


def ordered(records) -> list[dict]:
    return sorted(records, key=lambda r: (r["index"], r["turn"]))


def test_every_turn_is_plain_decodings_answer_alone(base, tmp_path):
    questions, spec = questions_of(7), spec_of()
    generate_answers(tmp_path, base, Tokens(), Template(), questions, spec, batch=3)
    records = ordered(answer_records(tmp_path))
    assert [(r["index"], r["turn"]) for r in records] == sorted(
        [(i, 1) for i in range(7)] + [(i, 2) for i in range(7) if i % 3 == 0]
    )
    by_turn = {(r["index"], r["turn"]): r for r in records}
    for (i, turn), r in by_turn.items():
        q = questions[i]
        assert r["key"] == question_key(q, i) and r["category"] == q.category
        if turn == 1:
            assert r["prompt"] == Template().encode(Tokens(), [q.turns[0]])
            assert r["turns"] == list(q.turns)  # what was asked, beside the answer
        else:  # asked after the first answer's text
            first = Tokens().decode(by_turn[(i, 1)]["answer"], skip_special_tokens=True).strip()
            assert r["prompt"] == Template().encode(Tokens(), list(q.turns), [first])
        sampling, seed = question_sampling(spec, i, turn)
        assert r["temperature"] == float(i % 2) and r["seed"] == seed
        alone = plain_generate(
            make_target(base), [r["prompt"]], max_new_tokens=9, sampling=sampling, eos_id=END,
            generator=torch.Generator().manual_seed(seed),
        ).tokens[0]  # fmt: skip
        assert r["answer"] == alone, (i, turn)


def shards(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in shard_files(directory)}


def test_shards_resume_to_the_same_bytes_whatever_the_batch(base, tmp_path):
    questions, spec = questions_of(10), spec_of()
    generate_answers(tmp_path / "a", base, Tokens(), Template(), questions, spec, batch=2)
    generate_answers(tmp_path / "b", base, Tokens(), Template(), questions, spec, batch=5)
    assert len(shards(tmp_path / "a")) == 3 and shards(tmp_path / "a") == shards(tmp_path / "b")
    shard_files(tmp_path / "b")[1].unlink()  # an interrupted run: one shard missing
    generate_answers(tmp_path / "b", base, Tokens(), Template(), questions, spec, batch=5)
    assert shards(tmp_path / "a") == shards(tmp_path / "b")


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


def directories(root) -> list:
    return [d for d in root.iterdir() if d.is_dir()]


def test_held_out_questions_are_the_last_of_every_category_taking_turns():
    questions = [Question((f"q{i}",), c, f"{c}-{i}") for c, n in (("big", 30), ("small", 10), ("mid", 20))
                 for i in range(n)]  # fmt: skip
    train, val = split_questions(questions)
    assert len(val) == 3 * VALIDATION_PER_CATEGORY and not {q.question_id for q in train} & {q.question_id for q in val}
    assert [q.category for q in val[:3]] == ["big", "small", "mid"]  # the categories take turns
    assert [q.question_id for q in val if q.category == "small"] == [f"small-{i}" for i in range(2, 10)]
    assert train == [q for q in questions if q not in val]  # in the list's order
    train, val = split_questions(questions[:30] + questions[32:40])  # a category of 8: all held out
    assert len(val) == 8 * 2 and not [q for q in train if q.category == "small"]


def test_generated_windows_take_training_questions_and_hold_out_the_last(base, tmp_path):
    questions = questions_of(HELD + 30)
    kwargs = dict(root=tmp_path, max_new_tokens=6, batch=8, questions=questions, template=Template())
    windows, mask = generated_windows(Spec(12), base, Tokens(), {}, **kwargs)
    assert windows.shape == (12, 25) and mask.any(dim=1).all()
    asked = {r["question_id"] for r in answer_records(directories(tmp_path)[0])}
    val = generated_records(Spec(12), base, Tokens(), {}, held_out=HELD, **kwargs)
    assert len(val) >= HELD  # every held-out turn (but those whose prompt is too long)
    (directory,) = directories(tmp_path)  # one directory: the setting's, held-out answers beside the others
    held = {r["question_id"] for r in val}
    assert held == {q.question_id for q in split_questions(questions)[1]} and not asked & held
    assert [r["category"] for r in val if r["turn"] == 1][:3] == ["c0", "c1", "c2"]
    assert json.loads((directory / "meta.json").read_text())["spec"]["max_new_tokens"] == 6


def test_answered_turns_serve_more_windows_without_answering_again(base, tmp_path):
    class Longer(Spec):  # second turns fit too: 64 questions give more than 64 windows
        seq_len, prompt_len = 48, 30

    questions = questions_of(HELD + 100)
    kwargs = dict(root=tmp_path, max_new_tokens=6, batch=16, questions=questions, template=Template())
    generated_windows(Longer(40), base, Tokens(), {}, **kwargs)  # two shards of 32 questions
    (directory,) = directories(tmp_path)
    fitting = [r for r in ordered(answer_records(directory)) if len(r["prompt"]) <= Longer.prompt_len]
    assert shards_written(directory) == 2 and len(fitting) > 64  # the case: more windows than questions
    windows, mask = generated_windows(Longer(len(fitting)), base, Tokens(), {}, **kwargs)
    assert shards_written(directory) == 2  # no question answered for windows the two shards already hold
    expected = conversation_windows(fitting, seq_len=Longer.seq_len, pad_id=END)
    assert torch.equal(windows, expected[0]) and torch.equal(mask, expected[1])
    windows, _ = generated_windows(Longer(len(fitting) + 1), base, Tokens(), {}, **kwargs)
    assert shards_written(directory) == 3 and torch.equal(windows[:-1], expected[0])  # one more: a shard more


def test_a_grown_question_list_answers_only_its_new_questions(base, tmp_path, monkeypatch):
    """Answers are kept per question: twice the windows answer the new questions alone, and give the windows of a
    run that asked for them all at once."""
    questions, asked = questions_of(HELD + 200), []
    real = generated.generate_answers

    def counting(directory, base, tokenizer, template, pool, spec, *, indices, batch):
        asked.append(list(indices))
        return real(directory, base, tokenizer, template, pool, spec, indices=indices, batch=batch)

    monkeypatch.setattr(generated, "generate_answers", counting)
    kwargs = dict(max_new_tokens=6, batch=16, questions=questions, template=Template())
    small = generated_windows(Spec(40), base, Tokens(), {}, root=tmp_path / "grown", **kwargs)
    grown = generated_windows(Spec(80), base, Tokens(), {}, root=tmp_path / "grown", **kwargs)
    first, second = asked
    assert first == list(range(len(first))) and second == list(range(len(first), len(first) + len(second)))
    once = generated_windows(Spec(80), base, Tokens(), {}, root=tmp_path / "once", **kwargs)
    assert torch.equal(grown[0], once[0]) and torch.equal(grown[0][:40], small[0])
    (directory,) = directories(tmp_path / "grown")
    assert shards(directory) == shards(directories(tmp_path / "once")[0])  # the same shards, named by their questions


def test_too_many_windows_are_refused_in_one_line(base, tmp_path):
    questions = questions_of(HELD + 3)
    with pytest.raises(
        ValueError, match="features.windows=50: 3 of the 3 training questions gave only 3 answered turns"
    ):
        generated_windows(
            Spec(50), base, Tokens(), {}, root=tmp_path, max_new_tokens=4, batch=4, questions=questions,
            template=Template(),
        )  # fmt: skip


def test_held_out_questions_are_counted_and_bounded(base, tmp_path):
    questions = questions_of(HELD + 3)
    kwargs = dict(root=tmp_path, max_new_tokens=4, batch=4, questions=questions, template=Template())
    windows, _ = generated_windows(Spec(1), base, Tokens(), {}, held_out=5, **kwargs)
    assert 5 <= windows.shape[0] <= 7  # five questions, each of one or two turns
    with pytest.raises(ValueError, match=f"{HELD + 1} held-out questions asked: there are {HELD}"):
        generated_windows(Spec(1), base, Tokens(), {}, held_out=HELD + 1, **kwargs)


def test_a_stream_killed_midway_keeps_its_whole_shards_and_resumes(base, tmp_path, monkeypatch):
    questions, spec = questions_of(12), spec_of()
    generate_answers(tmp_path / "a", base, Tokens(), Template(), questions, spec, batch=4)
    written, write = [], answers.write_atomic

    def crash_after_one(path, data):
        if path.name.startswith("answers-"):
            if written:
                raise RuntimeError("killed")
            written.append(path.name)
        write(path, data)

    monkeypatch.setattr(answers, "write_atomic", crash_after_one)
    with pytest.raises(RuntimeError, match="killed"):
        generate_answers(tmp_path / "b", base, Tokens(), Template(), questions, spec, batch=4)
    monkeypatch.undo()
    assert [p.name for p in shard_files(tmp_path / "b")] == written  # one whole shard, nothing else
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == sorted([*written, "meta.json"])  # no .tmp
    generate_answers(tmp_path / "b", base, Tokens(), Template(), questions, spec, batch=4)
    assert shards(tmp_path / "a") == shards(tmp_path / "b")


def test_a_run_holds_only_its_open_shards(base, tmp_path, monkeypatch):
    """Records are written with their shard and let go: a long run's memory does not grow with its answers."""
    held, add = [], answers._Shards.add

    def add_and_count(self, record):
        add(self, record)
        held.append(self.held())

    monkeypatch.setattr(answers._Shards, "add", add_and_count)
    questions = questions_of(40)
    generate_answers(tmp_path, base, Tokens(), Template(), questions, spec_of(shard_questions=2), batch=2)
    records = list(answer_records(tmp_path))
    assert len(held) == len(records) and held[-1] == 0 and max(held) <= 8  # a few shards of 2 questions, not 40


class Wordy(Template):
    """A template whose answers encode to 20 tokens a word: a second turn's prompt outgrows its first answer."""

    def encode(self, tokenizer, turns, answers=()):
        return super().encode(tokenizer, turns, [" ".join([a] * 20) for a in answers])


def test_a_second_turn_that_outgrows_the_rows_is_skipped_once_with_its_reason(base, tmp_path, monkeypatch):
    questions, spec = questions_of(6), spec_of(max_new_tokens=9)
    generate_answers(tmp_path, base, Tokens(), Wordy(), questions, spec, batch=3)
    records = ordered(answer_records(tmp_path))
    skipped = [r for r in records if "skipped" in r]
    assert [r["index"] for r in skipped] == [0, 3] and all(r["turn"] == 1 and r["last"] for r in skipped)
    assert "second turn's prompt of" in skipped[0]["skipped"] and "more than the rows'" in skipped[0]["skipped"]
    assert not [r for r in records if r["turn"] == 2]
    monkeypatch.setattr(answers, "serve", lambda *a, **k: pytest.fail("a resumed run asked again"))
    generate_answers(tmp_path, base, Tokens(), Wordy(), questions, spec, batch=3)  # whole: nothing to answer
