"""Prompt sets with categories: Spec-Bench's question.jsonl format, the embedded chat_mix set, round-robin
selection over categories, per-category benchmark figures, and the one-line refusals of bad prompt settings.
(The chat template itself runs on the real instruct model in tests/test_smollm2.py.)"""

from __future__ import annotations

import json
import sysconfig
from collections import Counter
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from experiments.lib.data import chat_mix
from experiments.lib.data.prompts import Question, read_questions, select_questions, write_questions
from experiments.lib.data.sources import is_validation
from experiments.lib.methods.decode_checks import check_prompts
from experiments.lib.report.by_category import category_batches, category_figures, category_table, per_category
from experiments.lib.report.results import mode


def test_spec_bench_questions_round_trip(tmp_path):
    path = tmp_path / "question.jsonl"
    lines = [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Make it shorter."]},
        {"question_id": 7, "category": "math_reasoning", "turns": ["What is 2 + 2?"], "reference": ["4"]},
        "a bare string prompt",
        {"prompt": "an object prompt"},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    questions = read_questions(str(path))
    assert questions[0] == Question(("Write a poem.", "Make it shorter."), "writing", 81)
    assert questions[1] == Question(("What is 2 + 2?",), "math_reasoning", 7)
    assert [q.category for q in questions[2:]] == ["all", "all"] and questions[3].turns == ("an object prompt",)
    out = tmp_path / "out.jsonl"
    write_questions(questions, out)
    assert read_questions(str(out)) == questions


@pytest.mark.parametrize(
    "line, message",
    [
        ({"turns": []}, "'turns' must be a non-empty list"),
        ({"turns": "hi"}, "'turns' must be a non-empty list"),
        ({"turns": ["ok", "  "]}, "turn 2"),
        ({"turns": ["ok"], "category": ""}, "'category' must be a non-empty string"),
        ({"text": "x"}, r"q\.jsonl:1 must be a JSON string"),
    ],
)
def test_bad_questions_are_one_line_errors(tmp_path, line, message):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=message) as e:
        read_questions(str(path))
    assert "\n" not in str(e.value)


def test_selection_keeps_every_category_in_set_order():
    qs = [Question((f"{c}{i}",), c) for c in "abc" for i in range(4)]  # sorted by category, as Spec-Bench's file
    picked = select_questions(qs, 5)
    assert [q.turns[0] for q in picked] == ["a0", "a1", "b0", "b1", "c0"]
    assert select_questions(qs, 100) == qs
    plain = [Question((str(i),)) for i in range(6)]
    assert select_questions(plain, 3) == plain[:3]


@pytest.fixture(scope="module")
def mix():
    return chat_mix.chat_mix_questions()


def test_chat_mix_has_the_promised_shape(mix):
    counts = Counter(q.category for q in mix)
    assert list(counts) == list(chat_mix.CATEGORIES) and len(counts) >= 5
    assert all(n == chat_mix.QUESTIONS_PER_CATEGORY for n in counts.values()) and len(mix) >= 80
    assert [q.question_id for q in mix] == list(range(1, len(mix) + 1))
    assert all(len(q.turns) == 2 and q.turns[1] == chat_mix.FOLLOW_UP[q.category] for q in mix)
    assert len({q.turns[0] for q in mix}) == len(mix)  # no question twice
    assert chat_mix.chat_mix_questions() == mix  # deterministic


def test_chat_mix_code_comes_from_held_out_stdlib_files(mix):
    """Every function quoted in a code question is defined in a validation file of the stdlib corpus."""
    root = Path(sysconfig.get_paths()["stdlib"])
    functions = chat_mix.stdlib_functions(validation=True)
    assert functions and all(is_validation(key.split(":")[0], 0.05) for key in functions)
    quoted = [q for q in mix if q.category in ("explanation", "documentation")]
    codes = {code for _, code, _ in functions.values()}
    for q in quoted:
        code = q.turns[0].split("```python\n", 1)[1].rsplit("\n```", 1)[0]
        assert code in codes
    assert all((root / key.split(":")[0]).is_file() for key in functions)


def test_category_batches_never_mix_categories():
    ids = [[1], [2], [3], [4], [5]]
    batches, labels = category_batches(ids, ["x", "y", "x", "x", "y"], batch_size=2)
    assert batches == [[[1], [3]], [[4]], [[2], [5]]] and labels == ["x", "x", "y"]


def test_category_figures_against_the_fastest_plain_per_round():
    summarize = lambda stats: {"tokens_per_s": sum(stats) / len(stats), "tau": 2.0}  # noqa: E731
    labels = ["x", "y"]
    assert per_category([10.0], ["x"], summarize) == {}  # one category: nothing per category
    plain_fast = {"category_rounds": [per_category([10.0, 20.0], labels, summarize)] * 3}
    plain_slow = {"category_rounds": [per_category([5.0, 5.0], labels, summarize)] * 3}
    method = {"category_rounds": [per_category([15.0, 10.0], labels, summarize)] * 3}
    figures = category_figures(method, [plain_fast, plain_slow])
    assert figures == {
        "x": {"speedup": 1.5, "tau": 2.0, "tokens_per_s": 15.0},
        "y": {"speedup": 0.5, "tau": 2.0, "tokens_per_s": 10.0},
    }
    row = {"name": "m", "temperature": 0.0, "threads": 2, "compiled": False, "speedup": 1.1, "tau": 2.0}
    table = category_table({"methods": [{**row, "categories": figures}]}, mode)
    assert "| m | eager 2t | 0 | 1.50x (2.00) | 0.50x (2.00) | 1.00x | 1.10x (2.00) |" in table
    assert category_table({"methods": [{**row, "categories": {}}]}, mode) == ""


def prompts_node(**changes):
    node = {"set": None, "file": None, "num_prompts": 4, "prompt_len": 16, "chat": False, "system": None, "turns": 1}
    return OmegaConf.create({**node, **changes})


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"set": "mt_bench"}, "prompts.set='mt_bench': must be null"),
        ({"chat": "yes"}, "prompts.chat='yes': must be true or false"),
        ({"chat": True, "system": " "}, "prompts.system=' ': give a non-empty text"),
        ({"turns": 3}, "prompts.turns=3: must be 1 or 2"),
        ({"turns": 2}, "prompts.turns=2: .* set prompts.chat=true"),
        ({"set": "chat_mix", "file": "q.jsonl"}, "give one of them"),
    ],
)
def test_bad_prompt_settings_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        check_prompts(prompts_node(**changes))


def test_good_prompt_settings_pass(tmp_path):
    check_prompts(prompts_node(set="chat_mix", chat=True, turns=2, system="Be brief."))
    path = tmp_path / "question.jsonl"
    path.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["Why?"]}) + "\n")
    check_prompts(prompts_node(file=str(path), chat=True, num_prompts=1))  # more than the file holds: refused


def test_summarize_reports_per_category(tmp_path):
    from experiments.summarize import summarize

    row = {"name": "medusa_chain", "temperature": 0.0, "threads": 2, "compiled": False, "gamma": 4, "tau": 2.0}
    for job, gamma in (("0", 2), ("1", 4)):
        (tmp_path / job / ".hydra").mkdir(parents=True)
        (tmp_path / job / ".hydra" / "overrides.yaml").write_text(f"- decode.gamma={gamma}\n- prompts=chat_mix\n")
        cats = {"coding": {"speedup": 1.2 * gamma, "tau": 2.5, "tokens_per_s": 9.0}}
        if gamma == 4:
            cats["qa"] = {"speedup": 0.9, "tau": 1.5, "tokens_per_s": 7.0}
        methods = [{**row, "gamma": gamma, "speedup": 1.1, "categories": cats}]
        (tmp_path / job / "results.json").write_text(json.dumps({"methods": methods}))
    summarize(tmp_path)
    text = (tmp_path / "summary.md").read_text()
    assert "| method | mode | T | coding | qa | mean | overall |" in text
    assert "| medusa_chain | decode.gamma=2 eager 2t | 0 | 2.40x (2.50) | - | 2.40x | 1.10x (2.00) |" in text
    assert "| medusa_chain | decode.gamma=4 eager 2t | 0 | 4.80x (2.50) | 0.90x (1.50) | 2.85x | 1.10x (2.00) |" in text
