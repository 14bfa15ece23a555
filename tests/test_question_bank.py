"""The training question bank (experiments/lib/data/question_bank.py): its size and categories, no benchmark prompt
or quoted benchmark passage in it, determinism (across processes too), balanced prefixes, exclusion of a prompts
file, the one-line refusals of a bad n, the written question.jsonl, well-formed generated text, and the same
questions since its word lists became a data file shipped with the package."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.lib.data.chat_mix import chat_mix_questions
from experiments.lib.data.prompts import Question, read_questions, write_questions
from experiments.lib.data.question_bank import (
    BANK_CATEGORIES,
    SHARED_RUN,
    TOPICS_FILE,
    bank_questions,
    category_counts,
    excluded_texts,
    topics,
    write_bank,
)

ROOT = Path(__file__).resolve().parent.parent
SPEC_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
SPEC_BENCH += ("translation", "summarization", "qa", "rag")
GENERATED = ("writing", "roleplay", "reasoning", "math", "stem", "humanities")  # no stdlib text in them


def norm(text: str) -> str:
    return " ".join(text.lower().split())


@pytest.fixture(scope="module")
def bank() -> list[Question]:
    return bank_questions()


def test_size_categories_and_ids(bank):
    assert len(bank) >= 20_000
    assert len({norm(q.turns[0]) for q in bank}) == len(bank)
    assert set(SPEC_BENCH) <= set(BANK_CATEGORIES) and len(BANK_CATEGORIES) >= 10
    counts = category_counts(bank)
    assert list(counts) == list(BANK_CATEGORIES) and min(counts.values()) >= 500, counts
    assert sum(counts.values()) == len(bank)
    ids = [q.question_id for q in bank]
    assert len(set(ids)) == len(ids) and all(i.startswith(f"bank-{q.category}-") for i, q in zip(ids, bank))
    two = [q for q in bank if len(q.turns) == 2]
    assert len(two) >= 0.2 * len(bank) and {q.category for q in two} == set(BANK_CATEGORIES)
    assert all(len(q.turns) in (1, 2) and all(t.strip() for t in q.turns) for q in bank)
    assert max(len(q.turns[0].split()) for q in bank) <= 300  # passages stay short prompts


def test_no_benchmark_prompt_or_passage_in_the_bank(bank):
    mix = chat_mix_questions()
    prompts = {norm(t) for q in mix for t in q.turns}
    assert prompts <= excluded_texts()
    assert not [t for q in bank for t in q.turns if norm(t) in prompts]
    texts = "\0".join(norm("\n".join(q.turns)) for q in bank)
    checked = 0
    for q in mix:  # 80-character slices (start, middle, end) of its longest line, and of its whole first turn
        line, whole = norm(max(q.turns[0].splitlines(), key=len)), norm(q.turns[0])
        if len(whole) < SHARED_RUN:
            continue  # a one-line question (qa): the equality above covers it
        checked += 1
        for key in [whole, line] if len(line) >= SHARED_RUN else [whole]:
            for start in (0, (len(key) - SHARED_RUN) // 2, len(key) - SHARED_RUN):
                assert key[start : start + SHARED_RUN] not in texts, (q.category, key[start : start + SHARED_RUN])
    assert checked >= 0.8 * len(mix)  # the check is not vacuous


def digest(questions: list[Question]) -> str:
    return hashlib.sha256(
        json.dumps([[q.question_id, q.category, list(q.turns)] for q in questions]).encode()
    ).hexdigest()


# The bank's questions when its word lists were the Python module question_topics.py (2026-11-29): the categories
# made of templates alone on any Python, the whole bank on the Python that measured it (its stdlib is text too).
TEMPLATE_DIGEST = "a7b30ac669f6ff6f67750db231636bfe45006c56c2b464f74482e6308b404cf2"
WHOLE_DIGEST = ("3.11.7", "ed6c24249b9ed737c3964d972762beeefa7beae9fa5407efe0d6eddc87c56264")


def test_the_word_lists_moved_to_a_data_file_without_changing_a_question(bank):
    assert digest([q for q in bank if q.category in GENERATED]) == TEMPLATE_DIGEST
    if platform.python_version() == WHOLE_DIGEST[0]:
        assert digest(bank) == WHOLE_DIGEST[1]
    assert isinstance(topics().NAME, tuple) and isinstance(topics().FOLLOW_UPS[0], tuple)


def test_the_word_lists_ship_with_the_package():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    folder = ROOT / "experiments" / "lib" / "data"
    assert any((folder / TOPICS_FILE) in folder.glob(pattern) for pattern in data["experiments.lib.data"])


def test_deterministic_and_seeded(bank):
    assert bank_questions(600) == bank[:600]
    other = bank_questions(600, seed=1)
    assert [q.category for q in other] == [q.category for q in bank[:600]]
    assert len({q.turns[0] for q in other} - {q.turns[0] for q in bank[:600]}) > 300


# 12 s (the bank built again in a fresh interpreter); the fast tier pins the bank's hash on this Python instead
@pytest.mark.slow
def test_same_bank_in_another_process(bank):
    """Another interpreter with another hash seed builds the same questions (no set order, no global random)."""
    code = (
        "import hashlib, json; from experiments.lib.data.question_bank import bank_questions; "
        "print(hashlib.sha256(json.dumps([q.as_json() for q in bank_questions()]).encode()).hexdigest())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == hashlib.sha256(json.dumps([q.as_json() for q in bank]).encode()).hexdigest()


def test_first_n_balanced(bank):
    assert set(category_counts(bank[: 50 * len(BANK_CATEGORIES)]).values()) == {50}
    counts = category_counts(bank_questions(100))
    assert len(counts) == len(BANK_CATEGORIES) and max(counts.values()) - min(counts.values()) <= 1


def test_prompts_file_excluded(bank, tmp_path):
    """A prompts file's prompt drops the bank question equal to it, and those sharing a run of SHARED_RUN characters
    with one of its prompts (a passage quoted inside another prompt, a templated near-copy); nothing else."""
    same = next(q for q in bank if q.category == "math")
    quoted = next(q for q in bank if q.category == "summarization" and len(q.turns[0]) > 400)
    passage = quoted.turns[0].split("\n\n", 1)[1][: SHARED_RUN + 20]
    path = tmp_path / "question.jsonl"
    write_questions([Question((same.turns[0],), "math", 1), Question((f"Paraphrase: {passage}",), "x", 2)], path)
    assert norm(same.turns[0]) in excluded_texts([str(path)])
    kept = bank_questions(seed=0, exclude_files=[str(path)])
    texts = {q.turns[0] for q in kept}
    assert same.turns[0] not in texts and quoted.turns[0] not in texts
    prompts = [norm(same.turns[0]), norm(f"Paraphrase: {passage}")]
    windows = [p[i : i + SHARED_RUN] for p in prompts for i in range(len(p) - SHARED_RUN + 1)]
    quoting = {q.turns[0] for q in bank if any(w in norm(q.turns[0]) for w in windows)}
    assert {q.turns[0] for q in bank} - texts == quoting | {same.turns[0]}  # those, and nothing else
    assert bank_questions() == bank  # the exclusion does not stick


@pytest.mark.parametrize("n", [0, -3, 2.5, True, "10"])
def test_bad_n_refused(n):
    with pytest.raises(ValueError, match=r"^n=.*integer >= 1") as e:
        bank_questions(n)
    assert "\n" not in str(e.value)


def test_too_many_refused(bank):
    with pytest.raises(ValueError, match=rf"^n={len(bank) + 1}: .*only {len(bank)} questions") as e:
        bank_questions(len(bank) + 1)
    assert "\n" not in str(e.value)


def test_write_bank(bank, tmp_path):
    path = tmp_path / "question.jsonl"
    counts = write_bank(path, 240)
    back = read_questions(str(path))
    assert counts == category_counts(back) == category_counts(bank[:240])
    assert [(q.turns, q.category, q.question_id) for q in back] == [
        (q.turns, q.category, q.question_id) for q in bank[:240]
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["question.jsonl"]  # no temporary file left behind
    with pytest.raises(ValueError, match="jsonl"):
        write_bank(tmp_path / "question.txt", 10)


def test_generated_text_is_well_formed(bank):
    """No template field left unfilled, no None, in the generated questions; math and puzzles have answers."""
    extraction_heads = {t.split("\n")[0] for t in topics().EXTRACTION_TEMPLATES}
    generated = [
        q.turns[0]
        for q in bank
        if q.category in GENERATED
        or (q.category == "rag" and q.turns[0].startswith(topics().RAG_INTROS))
        or (q.category == "extraction" and q.turns[0].split("\n")[0] in extraction_heads)
        or (q.category == "qa" and not q.turns[0].startswith("What does the Python function"))
    ]
    assert len(generated) > 10_000
    assert not [t for t in generated if re.search(r"[{}]|\bNone\b", t)]
    for text in (t for t in generated if t.startswith("Solve for x:")):
        a, b, c = map(int, re.match(r"Solve for x: (\d+)x \+ (\d+) = (-?\d+)\.", text).groups())
        assert (c - b) % a == 0, text  # an integer root
    puzzles = [t for t in generated if re.match(r"(Four|Five|Six) people", t)]
    assert len(puzzles) > 100
    for text in puzzles:  # one clue per neighbouring pair: the clues chain every person into one order
        people = re.match(r"\w+ people [^:]+: ([^.]+)\.", text)[1].replace(" and ", ", ").split(", ")
        pairs = re.findall(r"(\w+) (?:[a-z ]+) (\w+)\.", text.split(": ", 1)[1].split(". ", 1)[1])
        firsts, seconds = {a for a, _ in pairs}, {b for _, b in pairs}
        assert len(pairs) == len(people) - 1 and len(set(people) - seconds) == 1 and len(set(people) - firsts) == 1
