"""chat_mix: an embedded chat benchmark set in Spec-Bench's question format, built from text on every machine.

Spec-Bench (Xia et al. 2024) measures drafters per task category (MT-bench's conversations, translation,
summarization, QA, math, RAG) because acceptance differs by task. Its question file cannot be downloaded
here, so `prompts=chat_mix` builds a set of the same form from text that ships with Python and the venv,
with fixed templates around real text nobody here wrote (no prompt is written by hand to suit a drafter):

- coding: "Write a Python function with this signature that ..." from a held-out stdlib function's
  signature and the first paragraph of its docstring;
- explanation: "Explain what this function does" over a held-out stdlib function's code;
- documentation: "Write a docstring for this function" over held-out stdlib code with its docstring removed;
- summarization: "Summarize this project description" over the long description in an installed
  package's `*.dist-info/METADATA`;
- qa: "What is <topic> in Python?" for a topic of the stdlib's own language reference (`pydoc_data.topics`);
- rag: a question answered from a passage of that reference, given in the prompt (as Spec-Bench's RAG).

Held out: the stdlib functions come only from files of the stdlib corpus's validation split (the same
file-level hash rule as `data=stdlib`), the venv's packages corpus holds `.py` files only (no METADATA, no
stdlib), and the METADATA and reference topics are kept out of every training corpus of this project.
Each category takes QUESTIONS_PER_CATEGORY candidates in the order of a hash of their name, so the set is
the same on every machine with the same Python and venv, and a second turn (a generic follow-up per
category) makes `prompts.turns=2` possible.
"""

from __future__ import annotations

import functools
import hashlib
import re
import sysconfig
from email.parser import Parser
from importlib import metadata
from pathlib import Path

from experiments.lib.data.prompts import Question
from experiments.lib.data.seq2seq import function_docstrings
from experiments.lib.data.sources import is_validation, stdlib_files

__all__ = [
    "CATEGORIES",
    "QUESTIONS_PER_CATEGORY",
    "chat_mix_questions",
    "code_question",
    "passage",
    "rank",
    "stdlib_functions",
]

QUESTIONS_PER_CATEGORY = 16
STDLIB_VAL_FRACTION = 0.05  # conf/data/stdlib.yaml's val_fraction: the held-out files (tests/test_data.py ties them)
MAX_CODE_LINES = 30  # functions a reader takes in at a glance; longer ones are skipped
MIN_CODE_LINES = 4
PASSAGE_CHARS = (400, 1500)  # summarization and RAG passages: long enough to say something, short as a prompt
FOLLOW_UP = {
    "coding": "Now write three short test cases for your function.",
    "explanation": "Can you suggest one way to make this function clearer?",
    "documentation": "Now give a one-line summary of what the function returns.",
    "summarization": "Who would find this project useful?",
    "qa": "Give one common mistake people make with it.",
    "rag": "Summarize that passage in one sentence.",
}
CATEGORIES = tuple(FOLLOW_UP)


def rank(key: str) -> str:
    return hashlib.sha1(key.encode("utf-8")).hexdigest()


def _first(candidates: dict[str, str], n: int) -> list[str]:
    """n values of `candidates` (key -> text) in the order of their keys' hashes: deterministic, unbiased."""
    return [candidates[k] for k in sorted(candidates, key=rank)[:n]]


@functools.cache  # parsing half the stdlib takes 4-5 s; the question sets of a process read it several times
def stdlib_functions(*, validation: bool) -> dict[str, tuple[str, str, str]]:
    """key -> (name, code without docstring, docstring summary) of every short public function with a docstring
    in the stdlib corpus's validation files (validation=True: the benchmark's) or its training files. Cached per
    process: read it, never change it."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = {}
    for path in stdlib_files():
        name = path.relative_to(root).as_posix()
        if is_validation(name, STDLIB_VAL_FRACTION) != validation:
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        for fn, code, summary in function_docstrings(text):
            lines = code.strip("\n").count("\n") + 1
            if MIN_CODE_LINES <= lines <= MAX_CODE_LINES and not fn.startswith("_"):
                found[f"{name}:{fn}"] = (fn, code.strip("\n"), " ".join(summary.split()))
    return found


def _signature(code: str) -> str:
    """The `def` line(s) of a function's code, up to the colon that opens its body."""
    head = []
    for line in code.splitlines():
        head.append(line)
        if line.rstrip().endswith(":"):
            break
    return "\n".join(head)


def code_question(category: str, function: tuple[str, str, str]) -> str:
    """The coding / explanation / documentation prompt about one (name, code, summary) function."""
    fence = "```python\n{}\n```"
    _, code, summary = function
    if category == "coding":
        signature = fence.format(_signature(code))
        return f"Write a Python function with this signature:\n\n{signature}\n\nIt should do the following: {summary}"
    if category == "explanation":
        return f"Explain what this Python function does:\n\n{fence.format(code)}"
    return f"Write a docstring for this Python function:\n\n{fence.format(code)}"


def _code_questions(functions: dict[str, tuple[str, str, str]]) -> dict[str, list[str]]:
    """Three disjoint slices of the held-out functions, one per code category."""
    keys = sorted(functions, key=rank)
    n = QUESTIONS_PER_CATEGORY
    slices = {"coding": keys[:n], "explanation": keys[n : 2 * n], "documentation": keys[2 * n : 3 * n]}
    return {category: [code_question(category, functions[k]) for k in ks] for category, ks in slices.items()}


def _prose(paragraph: str) -> bool:
    """A paragraph of sentences: not markup, a badge row, a table, a code block, a list of links or a heading."""
    lines = paragraph.splitlines()
    letters = sum(c.isalpha() or c.isspace() for c in paragraph)
    return (
        len(paragraph.split()) >= 8
        and "." in paragraph
        and letters >= 0.8 * len(paragraph)
        and len(paragraph) >= 30 * len(lines)  # lines of a sentence, not a column of words
        and not paragraph.startswith(("|", "```", "<", "!", ">", "#", "-", "*", "=", ".."))
    )


def passage(text: str, *, prose_only: bool = False) -> str | None:
    """The first paragraphs of `text` (only prose ones with prose_only; HTML tags and markdown images and
    links reduced to their text) up to PASSAGE_CHARS[1] characters, or None when shorter than [0]."""
    text = re.sub(r"\n{3,}", "\n\n", text.strip())
    out = ""
    for paragraph in text.split("\n\n"):
        if prose_only:
            paragraph = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", re.sub(r"<[^>]+>", "", paragraph)).strip()
            if not _prose(paragraph):
                continue
        if len(out) + len(paragraph) > PASSAGE_CHARS[1]:
            break
        out += paragraph + "\n\n"
    out = out.strip()
    return out if len(out) >= PASSAGE_CHARS[0] else None


def _descriptions() -> dict[str, str]:
    """Distribution name -> a passage of its long description, for each installed distribution with one."""
    found = {}
    for dist in metadata.distributions():
        raw = dist.read_text("METADATA")
        if not raw:
            continue
        message = Parser().parsestr(raw)
        body = message.get_payload() if not message.is_multipart() else ""
        found_passage = passage(str(body or message.get("Description") or ""), prose_only=True)
        name = message.get("Name")
        if found_passage and name:
            found[name.lower()] = found_passage
    return found


def _topics() -> dict[str, tuple[str, str]]:
    """Reference topic -> (its title, a passage of its text), from the stdlib's pydoc_data."""
    from pydoc_data.topics import topics

    found = {}
    for key, text in topics.items():
        lines = text.strip().splitlines()
        found_passage = passage("\n".join(lines[2:]))  # a title, then its underline
        if lines and found_passage:
            found[key] = (lines[0].strip(), found_passage)
    return found


def chat_mix_questions() -> list[Question]:
    """The set, sorted by category (CATEGORIES' order); ids 1..N. A category short of candidates (a venv
    with few documented packages) gives what it has."""
    texts = _code_questions(stdlib_functions(validation=True))
    texts["summarization"] = [
        f"Summarize the following project description in a few sentences:\n\n{p}"
        for p in _first(_descriptions(), QUESTIONS_PER_CATEGORY)
    ]
    topics = _topics()
    keys = sorted(topics, key=rank)
    n = QUESTIONS_PER_CATEGORY
    texts["qa"] = [f"What is this in Python: {topics[k][0]}? Explain it briefly, with an example." for k in keys[:n]]
    texts["rag"] = [
        f"Answer using only the documentation below.\n\nDocumentation:\n{topics[k][1]}\n\n"
        f"Question: what does this documentation say about {topics[k][0]}?"
        for k in keys[n : 2 * n]
    ]
    questions = []
    for category in CATEGORIES:
        for text in texts[category]:
            questions.append(Question((text, FOLLOW_UP[category]), category, len(questions) + 1))
    return questions
