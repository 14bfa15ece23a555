"""The training question bank: about 24,000 distinct chat questions in 12 categories, for the base to answer.

Drafters train on the base's own answers to chat questions (as Medusa-2 and EAGLE do), and Spec-Bench measures them
per category (MT-bench's eight, translation, summarization, qa, rag): acceptance differs by task, so the questions
span those kinds of request, worded the way users ask a chat assistant. Sources per category:

- coding, qa: chat_train's questions over stdlib training-file functions, and generated requests (a task in a
  programming language, a concept; everyday how-to, advice and fact questions) from question_topics.yaml;
- summarization, rag, extraction: chat_train's module-docstring passages, and prose of training-file class and
  function docstrings and comment blocks, under an instruction or a question; rag and extraction also get
  fictional contexts and records (a library's rules, an order email...) with questions or fields to pull out;
- translation: a sentence or two of training-file docstrings or everyday English into a named language, and
  hand-written German, French and Spanish sentences into English (Spec-Bench translates German to English);
- writing, roleplay, reasoning, math, stem, humanities: templates x topic lists x seeded numbers and names; math
  problems and puzzles have answers by construction (an equation's root is drawn first, a puzzle's clues come
  from a drawn order).

Disjoint from the benchmark: chat_mix quotes the stdlib's validation files, packages' METADATA and pydoc_data,
never read here, and a question equal to a benchmark prompt (lowercase, whitespace collapsed) or sharing a run of
SHARED_RUN characters with one (a quoted passage) is dropped, for chat_mix and any prompts file in exclude_files.
Categories take turns (the first n are balanced); a quarter of the questions have a generic second turn.
Deterministic for (n, seed) with the same Python: string-seeded `random.Random`s over stdlib files and topic lists.
"""

from __future__ import annotations

import functools
import random
import re
import string
import sysconfig
from collections import Counter
from collections.abc import Callable, Iterable, Set
from importlib import resources
from pathlib import Path
from types import SimpleNamespace

from experiments.lib.data.chat_mix import STDLIB_VAL_FRACTION, chat_mix_questions, rank
from experiments.lib.data.chat_train import chat_train_questions
from experiments.lib.data.prompts import Question, read_questions, write_questions
from experiments.lib.data.sources import is_validation, stdlib_files

__all__ = ["BANK_CATEGORIES", "bank_questions", "benchmark_check", "category_counts", "excluded_texts", "write_bank"]

BANK_CATEGORIES = (
    "writing", "roleplay", "reasoning", "math", "coding", "extraction",
    "stem", "humanities", "translation", "summarization", "qa", "rag",
)  # fmt: skip
PER_CATEGORY = 2200  # ~24k questions in all: above what a training run asks, below where templates repeat themselves
FOLLOW_UP_SHARE = 0.25
SHARED_RUN = 80  # characters: a common run this long is quoted text, shorter ones are common phrases
PASSAGE_CHARS = (250, 1400)  # summarization and rag passages: ~40 to ~220 words
EXTRACT_CHARS = 150  # extraction needs less text: a list of names or numbers
SENTENCE_CHARS = (40, 220)  # translation: a sentence or two
DOC_SHARE = {"extraction": 0.6, "translation": 0.45}  # the rest: generated records, everyday / foreign sentences
RAG_GENERATED = 700  # the fictional contexts are few: more would repeat them
TRAIN_AS = {"explanation": "coding", "documentation": "coding"}  # chat_train's code categories are Spec-Bench's coding
GENERATED = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities", "translation")
GENERATED += ("qa",)  # categories filled up with their question_topics.yaml <CATEGORY>_TEMPLATES
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth")
COUNT_WORDS = {4: "Four", 5: "Five", 6: "Six"}
TOPICS_FILE = "question_topics.yaml"  # word lists and templates: data, beside this module
# A `def` or `class` line, then a triple-quoted docstring: groups (keyword, name, quotes, text).
DOCSTRING = re.compile(r"(?ms)^\s*(?:async\s+)?(def|class)\s+(\w+)[^\n]*:[ \t]*\n\s*[rRuU]?(\"\"\"|\'\'\')(.*?)\3")


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


@functools.cache
def topics() -> SimpleNamespace:
    """The bank's word lists and templates (question_topics.yaml, shipped inside the package: package-data in
    pyproject.toml), each list a tuple, by name: `topics().NAME`."""
    import yaml  # PyYAML comes with omegaconf

    text = resources.files(__package__).joinpath(TOPICS_FILE).read_text(encoding="utf-8")
    data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # the C SafeLoader: 3x faster
    return SimpleNamespace(**{name: _tuples(value) for name, value in data.items()})


def _normalize(text: str) -> str:
    return " ".join(text.lower().split())


# ---------------------------------------------------------------- stdlib training-file text


def _prose(text: str) -> str:
    """The prose paragraphs of a docstring or comment block (sentences, not argument lists, tables, code or
    doctests), each on one line, joined by blank lines, up to PASSAGE_CHARS[1] characters."""
    out: list[str] = []
    for block in re.split(r"\n\s*\n", text.strip()):
        para = " ".join(block.split())
        letters = sum(ch.isalpha() or ch.isspace() for ch in para)
        short_lines = len(para) < 30 * len(block.strip().splitlines())  # a column of short lines: a list, a table
        markup = para.startswith((">>>", "|", "-", "*", ":", "..", "#", "="))
        if len(para.split()) < 8 or not para.endswith(".") or letters < 0.85 * len(para) or short_lines or markup:
            continue
        if len("\n\n".join([*out, para])) > PASSAGE_CHARS[1]:
            break
        out.append(para)
    return "\n\n".join(out)


def _file_texts(text: str) -> list[tuple[str | None, str]]:
    """(name, raw text) of each class and function docstring (name: `f()` or `C`) and comment block (no name)
    of a module's source; module docstrings are chat_train's. A pattern rather than `ast`: ten times faster, and
    the few docstrings it misses (signatures over several lines) are not needed."""
    found: list[tuple[str | None, str]] = []
    for match in DOCSTRING.finditer(text):
        found.append((match[2] if match[1] == "class" else f"{match[2]}()", match[4]))
    for block in re.finditer(r"(?:^[ \t]*#[^\n]*\n){2,}", text, re.M):
        lines = [line.strip().lstrip("#").strip() for line in block.group(0).splitlines()]
        comment = "\n".join(lines)
        if "copyright" not in comment.lower() and "license" not in comment.lower():
            found.append((None, comment))
    return found


def _sentences(para: str) -> list[str]:
    """Whole sentences of a prose paragraph, a short one paired with the next, of SENTENCE_CHARS characters."""
    parts = re.split(r"(?<=[.!?])\s+(?=[A-Z])", para)
    out, i = [], 0
    while i < len(parts):
        unit = parts[i]
        if len(unit) < 90 and i + 1 < len(parts) and len(unit) + len(parts[i + 1]) < SENTENCE_CHARS[1]:
            unit, i = f"{unit} {parts[i + 1]}", i + 1
        i += 1
        whole = unit.endswith(".") and not unit.endswith(("e.g.", "i.e.", "etc.")) and unit[0].isupper()
        if whole and SENTENCE_CHARS[0] <= len(unit) <= SENTENCE_CHARS[1] and unit.count("(") == unit.count(")"):
            out.append(unit)
    return out


@functools.lru_cache(maxsize=1)
def _training_prose() -> tuple[tuple[tuple[str, str | None, str], ...], tuple[str, ...]]:
    """(source, name, passage) of the prose docstrings and comment blocks of the stdlib corpus's training files,
    and their sentences; each text once, in the order of its hash (machine-independent)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    passages: dict[str, tuple[str, str | None, str]] = {}
    sentences: set[str] = set()
    for path in stdlib_files():
        rel = path.relative_to(root).as_posix()
        if is_validation(rel, STDLIB_VAL_FRACTION):
            continue
        module = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        for name, raw in _file_texts(path.read_bytes().decode("utf-8", errors="replace")):
            text = _prose(raw)
            kind = "the documentation" if name else "a code comment"
            if len(text) >= EXTRACT_CHARS:
                passages.setdefault(text, (f"{kind} of Python's {module} module", name, text))
            sentences.update(s for para in text.split("\n\n") for s in _sentences(para))
    return tuple(passages[k] for k in sorted(passages, key=rank)), tuple(sorted(sentences, key=rank))


_train_questions = functools.lru_cache(maxsize=1)(chat_train_questions)  # [(category, text)], built once


# ---------------------------------------------------------------- generated text


def _term(k: int, var: str) -> str:
    """` + 3x`, ` - y`, ` + 4`: one signed term of a polynomial after its first."""
    return "" if k == 0 else f"{' - ' if k < 0 else ' + '}{'' if abs(k) == 1 and var else abs(k)}{var}"


def _numbers(rng: random.Random) -> dict[str, object]:
    """Fresh numbers for one problem, puzzle or record. Derived ones keep a problem consistent: an equation's right
    side comes from a drawn root, a change of money from the price, a snail's well is deeper than one day's climb."""
    r = rng.randint
    a, b, c, d, x = r(2, 19), r(2, 19), r(2, 9), r(2, 9), rng.choice([v for v in range(-12, 16) if v])
    price = r(2, 60) + rng.choice((0, 0.25, 0.5, 0.75, 0.99))
    s, t, t2, hourly, cheap, g = r(30, 120), r(2, 9), r(1, 6), r(12, 45), r(5, 95), r(2, 9)
    p1, p2, sx, sy, year = r(-9, 9), r(-9, 9), r(-6, 9), r(-6, 9), r(1950, 2005)
    a1, a2 = r(1, 5), r(1, 5)
    b1, b2 = rng.choice((-3, -2, -1, 1, 2, 4, 5)), rng.choice((-4, -1, 2, 3, 5))
    if a1 * b2 == a2 * b1:  # parallel lines: no single solution
        b2 = -b2
    first = lambda k: "x" if k == 1 else f"{k}x"  # noqa: E731
    start, step, g0, ratio, scale = r(1, 20), r(2, 9), r(1, 5), r(2, 4), r(1, 4)
    leg = rng.choice(((3, 4), (5, 12), (8, 15), (7, 24), (20, 21)))
    v: dict[str, object] = dict(a=a, b=b, c=c, d=d, x=x, k=r(4, 12), m=r(5, 90), r=r(1, 20), w=r(3, 40), h=r(3, 40))
    v.update(axb=a * x + b, acx=a * (x - c), b_small=r(1, a - 1), c_small=r(1, min(3, c - 1)), well=a + r(5, 30))
    v.update(big=r(100, 999), big2=r(100, 999), big_small=r(20, 99), b_big=r(20, 99), huge=r(20000, 99999))
    v.update(pct=rng.randrange(5, 65, 5), pct2=rng.randrange(5, 65, 5), dice=r(2, 12), temp=r(5, 35), stars=r(1, 5))
    v.update(quad=f"x^2{_term(-(p1 + p2), 'x')}{_term(p1 * p2, '')} = 0", rate=r(2, 9), square=r(4, 30) ** 2)
    v["system"] = (
        f"{first(a1)}{_term(b1, 'y')} = {a1 * sx + b1 * sy} and {first(a2)}{_term(b2, 'y')} = {a2 * sx + b2 * sy}"
    )
    v.update(frac=f"{r(1, 5)}/{r(6, 12)}", frac2=f"{r(1, 3)}/{r(4, 9)}", num=g * r(1, 9), den=g * r(10, 19))
    v.update(
        seq=", ".join(str(start + i * step) for i in range(5)), geo=", ".join(str(g0 * ratio**i) for i in range(5))
    )
    v.update(
        decimal=f"{r(1, 99) + r(1, 999) / 1000:.3f}", price=f"{price:.2f}", gap=g, total=f"{2 * cheap / 100 + g:.2f}"
    )
    v.update(bill=next(b for b in (20, 50, 100, 200, 500, 1000, 2000, 5000) if b >= a * price))
    v.update(bill_total=f"{r(40, 400) + r(0, 99) / 100:.2f}", fee=f"{rng.choice((0.1, 0.2, 0.25, 0.5)):.2f}")
    v.update(hourly=hourly, hours=r(20, 45), goal=hourly * r(5, 30), grams=r(2, 12) * 50, seat=rng.choice("ABCDEF"))
    v.update(s=s, s2=r(30, 120), t=t, t2=t2, dist=s * t, dist2=s * t2, leg=leg[0] * scale, leg2=leg[1] * scale)
    v.update(data=", ".join(str(r(1, 30)) for _ in range(7)), clock=f"{r(1, 12)}:{rng.randrange(0, 60, 5):02d}")
    v.update(year=year, year2=year + r(3, 15), order=r(10000, 99999))
    v["date"] = f"{rng.choice(topics().MONTH)} {r(1, 28)}, {r(2024, 2027)}"
    return v


@functools.cache
def _fields(template: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the template's fields, those that no question_topics.yaml list fills: numbers or given values)."""
    fields = tuple(dict.fromkeys(field for _, field, _, _ in string.Formatter().parse(template) if field))
    return fields, tuple(f for f in fields if not hasattr(topics(), f.rstrip("0123456789").upper()))


def _render(template: str, rng: random.Random, values: dict[str, object] | None = None) -> str:
    """The template with each field from `values`, else from the question_topics.yaml list of its name (`{name2}`:
    NAME again), different fields of one list taking different values (two people, two cities)."""
    values = dict(values or {})
    fields, other = _fields(template)
    if any(f not in values for f in other):
        values = {**_numbers(rng), **values}
    for field in (f for f in fields if f not in values):
        pool = field.rstrip("0123456789")
        used = {values[f] for f in fields if f in values and f.rstrip("0123456789") == pool}
        values[field] = rng.choice([v for v in getattr(topics(), pool.upper()) if v not in used])
    return template.format(**values)


def _ordering_puzzle(rng: random.Random) -> str:
    """Who came k-th among 4-6 people, from one clue per neighbouring pair of a drawn order: always one answer."""
    setting, relation, ask = rng.choice(topics().ORDER_SETTING)
    people = rng.sample(topics().NAME, rng.randint(4, 6))
    clues = [f"{first} {relation} {second}." for first, second in zip(people, people[1:])]
    rng.shuffle(clues)
    listed = rng.sample(people, len(people))
    question = rng.choice((f"{ask} {rng.choice(ORDINALS[: len(people)])}?", "What was the full order, first to last?"))
    intro = f"{COUNT_WORDS[len(people)]} people {setting}: {', '.join(listed[:-1])} and {listed[-1]}."
    return " ".join([intro, *clues, question])


def _rag_context(rng: random.Random) -> str:
    context, *questions = rng.choice(topics().RAG_CONTEXTS)
    text = f"{rng.choice(topics().RAG_INTROS)}\n\nContext:\n{context}\n\nQuestion: {rng.choice(questions)}"
    return _render(text, rng)


def _draw(rng: random.Random, count: int, make: Callable[[random.Random], str], seen: set[str]) -> list[str]:
    """Up to `count` texts of make(rng) not in `seen` (added to it); stops early when a small template space keeps
    repeating itself."""
    out: list[str] = []
    for _ in range(20 * count + 100):
        if len(out) >= count:
            break
        text = make(rng)
        if _normalize(text) not in seen:
            seen.add(_normalize(text))
            out.append(text)
    return out


# ---------------------------------------------------------------- categories


def _over_passages(rng: random.Random, templates: tuple[str, ...], passages: Iterable[tuple]) -> list[str]:
    """One question per (source, name, passage), its template drawn among those it can fill (a comment has no
    name to ask about)."""
    out = []
    for source, name, text in passages:
        usable = [t for t in templates if name or "{name}" not in t]
        out.append(rng.choice(usable).format(passage=text, source=source, name=name))
    return out


def _extraction_templates(text: str) -> tuple[str, ...]:
    """Instructions the passage can answer: names only where it has code names, numbers where it has digits."""
    names = topics().EXTRACT_NAME_TEMPLATES if re.search(r"\w\(\)|\b[a-z]+_[a-z_]+\b|\b[a-z]+[A-Z]\w+", text) else ()
    return (
        topics().EXTRACT_ANY_TEMPLATES + names + (topics().EXTRACT_NUMBER_TEMPLATES if re.search(r"\d", text) else ())
    )


def _category_texts(category: str, rng: random.Random) -> list[str]:
    """A category's questions before the bank-wide dedup and benchmark filter, in a seeded order: stdlib-based
    ones first (as many as the category takes), then generated ones up to PER_CATEGORY."""
    passages, sentences = _training_prose()
    long = [p for p in passages if len(p[2]) >= PASSAGE_CHARS[0]]
    fixed = [text for c, text in _train_questions() if TRAIN_AS.get(c, c) == category]
    if category == "summarization":
        fixed += _over_passages(rng, topics().SUMMARIZATION_TEMPLATES, long[0::2])
    elif category == "rag":
        fixed += _over_passages(rng, topics().RAG_DOC_TEMPLATES, long[1::2])
    elif category == "extraction":
        chosen = rng.sample(passages, min(len(passages), int(DOC_SHARE[category] * PER_CATEGORY)))
        fixed += [rng.choice(_extraction_templates(p[2])).format(passage=p[2]) for p in chosen]
    elif category == "translation":
        chosen = rng.sample(sentences, min(len(sentences), int(DOC_SHARE[category] * PER_CATEGORY)))
        fixed += [_render(rng.choice(topics().DOC_TRANSLATION_TEMPLATES), rng, {"text": s}) for s in chosen]
    rng.shuffle(fixed)
    seen = {_normalize(text) for text in fixed}
    fixed = list(dict.fromkeys(fixed))[:PER_CATEGORY]
    if category == "rag":
        make, count = _rag_context, min(RAG_GENERATED, PER_CATEGORY - len(fixed))
    elif category in GENERATED:
        templates = getattr(topics(), f"{category.upper()}_TEMPLATES")
        make, count = lambda r: _render(r.choice(templates), r), PER_CATEGORY - len(fixed)
        if category == "reasoning":
            make = lambda r: _ordering_puzzle(r) if r.random() < 0.25 else _render(r.choice(templates), r)  # noqa: E731
    else:
        return fixed
    out = fixed + _draw(rng, count, make, seen)
    rng.shuffle(out)
    return out


@functools.lru_cache(maxsize=4)
def _candidates(seed: int) -> dict[str, tuple[tuple[str, ...], ...]]:
    """category -> the turns of its questions, distinct across the whole bank, before the benchmark filter."""
    seen: set[str] = set()
    out = {}
    for category in BANK_CATEGORIES:
        rng = random.Random(f"question-bank:{seed}:{category}")  # a string seed hashes the same everywhere
        turns = []
        for text in _category_texts(category, rng):
            key = _normalize(text)
            if key not in seen:
                seen.add(key)
                second = rng.random() < FOLLOW_UP_SHARE
                follow_up = rng.choice([t for c, t in topics().FOLLOW_UPS if c == category])
                turns.append((text, follow_up) if second else (text,))
        out[category] = tuple(turns)
    return out


# ---------------------------------------------------------------- benchmark exclusion and API


def _runs(texts: Iterable[str], width: int) -> set[str]:
    """Every `width`-character window of the texts."""
    return {t[i : i + width] for t in texts for i in range(len(t) - width + 1)}


@functools.lru_cache(maxsize=1)
def _chat_mix() -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    """chat_mix's normalized prompt turns, their SHARED_RUN // 2 and their SHARED_RUN character windows."""
    texts = frozenset(_normalize(turn) for q in chat_mix_questions() for turn in q.turns)
    return texts, frozenset(_runs(texts, SHARED_RUN // 2)), frozenset(_runs(texts, SHARED_RUN))


def _quotes(key: str, halves: Set[str], runs: Set[str]) -> bool:
    """Whether normalized text `key` shares a run of SHARED_RUN characters with a benchmark text (`halves`, `runs`:
    its windows of half and full length). Such a run covers a window of `key` starting at a multiple of the half
    length, so only those are looked up (a quick test), and the full windows around a hit decide."""
    half = SHARED_RUN // 2
    for j in range(0, len(key) - half + 1, half):
        if key[j : j + half] in halves:
            if any(key[o : o + SHARED_RUN] in runs for o in range(max(0, j - half), min(j, len(key) - SHARED_RUN) + 1)):
                return True
    return False


def excluded_texts(extra_files: list[str] = ()) -> set[str]:
    """Normalized texts (lowercase, whitespace collapsed) of every benchmark prompt turn: chat_mix's, and those
    of each prompts file given (anything read_questions reads, e.g. Spec-Bench's question.jsonl)."""
    texts = set(_chat_mix()[0])
    for path in extra_files:
        texts.update(_normalize(turn) for q in read_questions(str(path)) for turn in q.turns)
    return texts


def benchmark_check(exclude_files: Iterable[str] = ()) -> Callable[[str], bool]:
    """A test of whether a text is a benchmark prompt of chat_mix or of `exclude_files` (lowercase, whitespace
    collapsed) or quotes SHARED_RUN characters of one: what every training question must not be."""
    excluded = excluded_texts(list(exclude_files))
    known, halves, runs = _chat_mix()
    extra = excluded - known  # a prompts file's texts: their windows join chat_mix's
    if extra:
        halves, runs = halves | _runs(extra, SHARED_RUN // 2), runs | _runs(extra, SHARED_RUN)

    def benchmark(text: str) -> bool:
        key = _normalize(text)
        return key in excluded or _quotes(key, halves, runs)

    return benchmark


def bank_questions(n: int | None = None, *, seed: int = 0, exclude_files: Iterable[str] = ()) -> list[Question]:
    """The first n questions of the bank (None: all), categories taking turns while each has questions left;
    ids `bank-<category>-<k>`. A question whose first turn is a benchmark prompt of chat_mix or of `exclude_files`,
    or quotes SHARED_RUN characters of one, is left out."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"n={n!r}: the number of bank questions must be an integer >= 1 (or None for all)")
    benchmark = benchmark_check(exclude_files)
    kept = {c: [turns for turns in qs if not benchmark(turns[0])] for c, qs in _candidates(seed).items()}
    questions = []
    for i in range(max(len(qs) for qs in kept.values())):
        questions += [Question(kept[c][i], c, f"bank-{c}-{i + 1}") for c in BANK_CATEGORIES if i < len(kept[c])]
    if n is not None and n > len(questions):
        raise ValueError(f"n={n}: the question bank holds only {len(questions)} questions (seed={seed})")
    return questions if n is None else questions[:n]


def category_counts(questions: list[Question]) -> dict[str, int]:
    """category -> number of questions, categories in order of first appearance."""
    return dict(Counter(q.category for q in questions))


def write_bank(
    path: str | Path, n: int | None = None, *, seed: int = 0, exclude_files: Iterable[str] = ()
) -> dict[str, int]:
    """Write the bank's first n questions as Spec-Bench's question.jsonl, atomically (a reader never sees half a
    file, a failed write leaves the previous one), and return their category counts."""
    path = Path(path)
    if path.suffix != ".jsonl":
        raise ValueError(f"path={str(path)!r}: the bank is written as Spec-Bench's question.jsonl, give a .jsonl path")
    questions = bank_questions(n, seed=seed, exclude_files=exclude_files)
    write_questions(questions, path)  # atomic: fsync'd, renamed, no temporary file left on failure
    return category_counts(questions)
