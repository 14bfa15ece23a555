"""The base's own questions: an instruct model given only the opening of a user turn writes the user's question.

An instruct model is trained on conversations, so given its chat template's prefix up to `<|im_start|>user\\n`
and nothing more it writes what a user of its training data would ask (Magpie, Xu et al. 2024). Those questions
are the base's own distribution of requests, cost no outside data, and come in any number: the training
question bank's templates (question_bank.py) cover what Spec-Bench measures, these cover what the base expects.

How a question is made: the prefix (the template's system turn, or in its place one line of system text that
steers towards a bank category, then the user turn's opening) is sampled at T = 1 from a generator seeded by (seed,
index) alone, until `<|im_end|>` or max_tokens, through continuous batching (verify/loop/continuous.py): a
candidate depends on its index and the seed, never on the batch. Candidates are judged in index order by
`QuestionFilter` (unfinished at the limit, template tokens inside, empty, no letters, mostly non-printable, too
short or too long, a benchmark prompt or a quote of one, a near-duplicate of an earlier one) and the first n
kept are the questions: the same for any batch size, and a smaller n's questions are a larger n's first ones.

They are kept in <root>/self-questions-<key>-n<n>.jsonl (the key: the base's fingerprint and dtype, the seed,
the steering, the filter's settings and the excluded benchmark texts), one record a line in Spec-Bench's
question.jsonl form plus the candidate's index and seed; the .json beside it holds the spec and the counts of
kept and rejected candidates by reason. A file of the same key with at least n questions is read (its first n),
not regenerated.

Second turns: with follow_ups, every FOLLOW_UP_EVERY-th question gets the marker turn FOLLOW_UP, and answers.py
has the base write that turn itself after its first answer (the conversation, then the user turn's opening),
judged by FollowUpFilter before it is answered.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from tokenizers import Tokenizer
from torch import nn

from experiments.lib.common.errors import write_atomic
from experiments.lib.common.progress import generation_bar
from experiments.lib.data.prompts import Question
from experiments.lib.data.question_bank import benchmark_check, excluded_texts
from verify.backends.choose import make_target
from verify.loop.continuous import Request, serve
from verify.loop.sampling import SamplingConfig

__all__ = [
    "FOLLOW_UP", "SELF", "STEERING", "FollowUpFilter", "QuestionFilter", "SelfQuestionSpec", "question_seed",
    "read_candidate", "reject_reason", "self_questions",
]  # fmt: skip

FORMAT_VERSION = 1
SELF = "self"  # the category of an unsteered question
# The system turn of a steered question, in place of the template's own: a 135M base follows a description of the
# request (what the user gives, what they ask for) more than a bare category name ("The user asks about math."
# changed next to nothing in a trial of 48 questions on SmolLM2; these lines did; docs/training.md).
STEERING = {
    "writing": "The user asks you to write something: a story, a poem, an email, an essay or a speech.",
    "roleplay": "The user asks you to play a character or a role and answer in it.",
    "reasoning": "The user asks you to solve a logic puzzle or a riddle, step by step.",
    "math": "The user asks you to solve a math problem: arithmetic, algebra, geometry or probability.",
    "coding": "The user asks you to write, explain or fix code in a programming language.",
    "extraction": "The user gives you a text and asks you to extract names, dates, numbers or facts from it.",
    "stem": "The user asks you a question about science, technology, engineering or medicine.",
    "humanities": "The user asks you a question about history, philosophy, literature, art or society.",
    "translation": "The user asks you to translate a sentence into another language.",
    "summarization": "The user gives you a passage and asks you to summarize it.",
    "qa": "The user asks you a factual question or for everyday advice.",
    "rag": "The user gives you a passage and asks a question that it answers.",
}
FOLLOW_UP = "<the base's own follow-up question>"  # a second turn the base asks itself after its answer (answers.py)
FOLLOW_UP_EVERY = 4  # every 4th self question gets one, as a quarter of the bank's questions have a second turn
MAX_CANDIDATES = 8  # candidates sampled per question asked at most: a filter that keeps fewer says so
PRINTABLE_SHARE = 0.9  # a question is text: at most a tenth of its characters may be control or broken bytes
TEMPLATE_TEXT = re.compile(r"(?m)<\|[\w-]+\|>|^(?:user|assistant|system)[ \t]*$")  # a turn marker written as text
LOG_EVERY = 30.0  # seconds between progress lines when the console is not a terminal
BAR = "kept · {task.fields[candidates]:,} candidates · {task.fields[rate]:.0f} tok/s"  # the progress bar's live fields
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SelfQuestionSpec:
    """Everything that decides the questions (the batch does not); its hash names the file."""

    base_fingerprint: str
    n: int  # questions kept
    dtype: str = "bf16"  # what the base samples in: bf16 questions are bf16 decoding's
    seed: int = 0
    categories: tuple[str, ...] = ()  # steering categories, taking turns by index; (): unsteered, category "self"
    max_tokens: int = 96  # a candidate still writing at this length is dropped (unfinished)
    min_tokens: int = 4
    chars: tuple[int, int] = (16, 600)  # a kept question's length in characters, stripped
    exclude_files: tuple[str, ...] = ()  # prompts files whose questions are excluded, beside chat_mix's

    def __post_init__(self) -> None:
        for name in ("n", "max_tokens", "min_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"self_questions.{name}={value!r}: must be an integer >= 1")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"self_questions.seed={self.seed!r}: must be an integer >= 0")
        if self.dtype not in ("bf16", "fp32"):
            raise ValueError(f"self_questions.dtype={self.dtype!r}: must be bf16 or fp32")
        object.__setattr__(self, "categories", tuple(self.categories))
        unknown = [c for c in self.categories if c not in STEERING]
        if unknown or len(set(self.categories)) != len(self.categories):
            raise ValueError(
                f"self_questions.categories={list(self.categories)!r}: distinct names among {', '.join(STEERING)}"
            )
        lo, hi = self.chars
        if not 1 <= lo <= hi:
            raise ValueError(f"self_questions.chars={self.chars!r}: must be (min, max) with 1 <= min <= max")
        object.__setattr__(self, "exclude_files", tuple(str(f) for f in self.exclude_files))

    def key(self) -> str:
        """Every setting but n: a smaller n's questions are a larger n's first ones, read from its file."""
        record = {**asdict(self), "format": FORMAT_VERSION, "steering": [self.system(c) for c in self.categories]}
        del record["n"]
        # the excluded texts themselves, not the files' names: another benchmark file keeps other questions
        record["exclude_files"] = sorted(excluded_texts(list(self.exclude_files)))
        return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]

    def category(self, index: int) -> str:
        return self.categories[index % len(self.categories)] if self.categories else SELF

    @staticmethod
    def system(category: str) -> str | None:
        """The system text a candidate of `category` is sampled under (None: the template's own)."""
        return None if category == SELF else STEERING[category]


def question_seed(seed: int, index: int) -> int:
    """Candidate `index`'s generator seed: a function of the seed and the index only (never of the batch)."""
    return seed * 1_000_003 + 7919 * index + 17


def _normalize(text: str) -> str:
    """Lowercase words and numbers: two questions that differ only in case, spacing or punctuation are one."""
    return " ".join(re.findall(r"\w+", text.lower()))


def reject_reason(text: str, *, tokens: int, finished: bool, special: bool, spec: SelfQuestionSpec) -> str | None:
    """Why a candidate (`text` stripped, of `tokens` tokens without its end-of-turn, `finished` when it wrote one,
    `special` when a template token is among its tokens) is not a question on its own; None: it is one."""
    if not finished:  # cut at max_tokens: a question cut off, or text that never ends (a document, a list)
        return "unfinished"
    if special or TEMPLATE_TEXT.search(text):  # a turn inside the turn: the base wrote a conversation
        return "template"
    if not text:
        return "empty"
    if not any(ch.isalpha() for ch in text):
        return "no letters"
    broken = sum(not (ch.isprintable() or ch in "\n\t") or ch == "\ufffd" for ch in text)
    if broken > (1 - PRINTABLE_SHARE) * len(text):
        return "non-printable"
    if tokens < spec.min_tokens or len(text) < spec.chars[0]:
        return "too short"
    if len(text) > spec.chars[1]:
        return "too long"
    return None


class QuestionFilter:
    """Judges candidates in index order: reject_reason's checks, then the benchmark (a prompt of chat_mix or of
    spec.exclude_files, or 80 characters quoted from one: question_bank.benchmark_check) and near-duplicates of
    an earlier kept question. `counts` holds "kept" and each rejection reason."""

    def __init__(self, spec: SelfQuestionSpec):
        self.spec, self.seen, self.counts = spec, set(), Counter()
        self.benchmark = benchmark_check(spec.exclude_files)

    def __call__(self, text: str, *, tokens: int, finished: bool, special: bool) -> str | None:
        reason = reject_reason(text, tokens=tokens, finished=finished, special=special, spec=self.spec)
        if reason is None and self.benchmark(text):
            reason = "benchmark"
        if reason is None and _normalize(text) in self.seen:
            reason = "duplicate"
        if reason is None:
            self.seen.add(_normalize(text))
        self.counts[reason or "kept"] += 1
        return reason


class FollowUpFilter:
    """Judges the base's follow-up questions (answers.py): reject_reason's checks at the default settings, then the
    benchmark. No duplicate check: follow-ups are judged as they arrive, in an order the batch decides, and one
    follow-up ("Can you give an example?") may fit many answers."""

    def __init__(self):
        self.spec, self.benchmark = SelfQuestionSpec(base_fingerprint="", n=1), benchmark_check()

    def __call__(self, text: str, *, tokens: int, finished: bool, special: bool) -> str | None:
        reason = reject_reason(text, tokens=tokens, finished=finished, special=special, spec=self.spec)
        return reason or ("benchmark" if self.benchmark(text) else None)


def read_candidate(tokenizer: Tokenizer, ids: list[int], eos_id: int) -> tuple[str, int, bool, bool]:
    """(text stripped, tokens before the end-of-turn, whether it wrote one, whether a template token is among
    them) of a sampled user turn: what the filters judge."""
    finished = bool(ids) and ids[-1] == eos_id
    body = ids[:-1] if finished else ids
    text = tokenizer.decode(body, skip_special_tokens=True).strip()
    return text, len(body), finished, text != tokenizer.decode(body, skip_special_tokens=False).strip()


def _summary(counts: Counter, spec: SelfQuestionSpec) -> str:
    judged = sum(counts.values())
    rejected = ", ".join(f"{reason} {k}" for reason, k in counts.most_common() if reason != "kept") or "none"
    return f"self questions: kept {counts['kept']} of {judged} candidates ({spec.n} asked); rejected: {rejected}"


def generate_self_questions(
    base: nn.Module,
    tokenizer: Tokenizer,
    template,
    spec: SelfQuestionSpec,
    *,
    batch: int = 64,
    console: Console | None = None,
    start: tuple[list[dict], dict] | None = None,
) -> tuple[list[dict], dict]:
    """(the first spec.n kept questions as records, what the run counted) sampled from `base` (already in
    spec.dtype); `template` is the base's ChatTemplate (its user_prefix). start: (the questions a run of fewer
    kept, what it counted): sampling goes on from the first candidate that run did not judge, with its filter's
    state, so the result is the one a single run of spec.n gives, for the new questions' cost alone."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r}: must be an integer >= 1 (rows sampled at once)")
    eos = tokenizer.token_to_id("<|im_end|>")
    if eos is None:
        raise ValueError("the tokenizer has no <|im_end|>: self questions need a ChatML instruct base (SmolLM2)")
    names = spec.categories or (SELF,)
    prefixes = {c: template.user_prefix(tokenizer, system=spec.system(c)) for c in names}
    check, limit = QuestionFilter(spec), MAX_CANDIDATES * spec.n
    kept: list[dict] = []
    judged_in = Counter()  # category -> candidates judged (how well each steering line keeps)
    done: dict[int, tuple] = {}  # finished candidates read but not judged yet (they finish out of order)
    finished = judged = tokens = 0
    passing = waiting = 0  # finished candidates that pass reject_reason: all of them, and those not judged yet
    before = {"tokens": 0, "seconds": 0.0}  # the earlier run's share of the counts
    if start is not None:
        kept, counted = list(start[0][: spec.n]), start[1]
        judged, before = counted["candidates"], {k: counted.get(k, 0) for k in before}
        check.seen.update(_normalize(r["turns"][0]) for r in kept)
        check.counts.update(counted["counts"])
        judged_in.update({c: pair[1] for c, pair in counted.get("kept_of_judged_by_category", {}).items()})
    first = issued = judged  # this run's first candidate; candidates handed out so far

    def pull() -> Request | None:
        nonlocal issued
        # Sample while the questions to expect (kept, finished and likely kept, in flight at the rate seen) fall
        # short of n. The judged ones alone would lag: judging waits for the lowest index still sampling, and a
        # row left idle meanwhile is shed for good (serve).
        rate = passing / finished if finished else 1.0
        flying = issued - first - finished
        if len(kept) + waiting + flying * max(rate, 0.05) >= spec.n or issued >= limit:
            return None
        issued += 1
        sampling = SamplingConfig(temperature=1.0)
        prefix = prefixes[spec.category(issued - 1)]
        # remember: every question of a category starts from the same prefix, prefilled once (measured: 96
        # steered questions in 44 s instead of 52, the same questions)
        return Request(prefix, spec.max_tokens, sampling, question_seed(spec.seed, issued - 1), remember=True)

    console = console or Console(stderr=True)
    capacity = max(len(p) for p in prefixes.values()) + spec.max_tokens
    started = logged = time.perf_counter()
    with generation_bar(console, "self questions", BAR) as progress:
        task = progress.add_task("self", total=spec.n, candidates=0, rate=0)
        rows = min(batch, max(spec.n - len(kept), 1))
        for answer in serve(make_target(base), pull, batch=rows, capacity=capacity, eos_id=eos):
            text, length, ended, special = read_candidate(tokenizer, answer.tokens, eos)
            passes = reject_reason(text, tokens=length, finished=ended, special=special, spec=spec) is None
            done[first + answer.index] = (text, length, ended, special, passes)  # serve counts from 0
            finished, passing, waiting = finished + 1, passing + passes, waiting + passes
            tokens += len(answer.tokens)
            while judged in done and len(kept) < spec.n:  # judge in index order: the batch never changes a verdict
                i, (text, length, ended, special, passes) = judged, done.pop(judged)
                judged, waiting = judged + 1, waiting - passes
                category = spec.category(i)
                judged_in[category] += 1
                if check(text, tokens=length, finished=ended, special=special) is None:
                    kept.append({"question_id": f"self-{category}-{i}", "category": category, "turns": [text],
                                 "index": i, "seed": question_seed(spec.seed, i)})  # fmt: skip
            now = time.perf_counter()
            rate = tokens / max(now - started, 1e-9)
            progress.update(task, completed=len(kept), candidates=judged, rate=rate)
            if not console.is_terminal and now - logged > LOG_EVERY:
                log.info("self questions: %d/%d kept of %d candidates, %d tokens, %.0f tok/s",
                         len(kept), spec.n, judged, tokens, rate)  # fmt: skip
                logged = now
            if len(kept) >= spec.n:  # the rows still sampling hold later candidates: not needed
                break
    if len(kept) < spec.n:
        raise ValueError(
            f"self_questions={spec.n}: only {len(kept)} of {judged} candidates passed the filter "
            f"({_summary(check.counts, spec).split('; ', 1)[1]}): ask for fewer questions"
        )
    seconds = time.perf_counter() - started
    by_category = {c: [sum(r["category"] == c for r in kept), judged_in[c]] for c in judged_in}
    tokens, seconds = tokens + before["tokens"], seconds + before["seconds"]  # both runs' (one when not resumed)
    stats = {"counts": dict(check.counts), "candidates": judged, "sampled": issued, "tokens": tokens,
             "seconds": round(seconds, 1), "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
             "kept_of_judged_by_category": by_category, "first_candidate_sampled": first}  # fmt: skip
    return kept, stats


def self_questions(
    base: nn.Module,
    tokenizer: Tokenizer,
    template,
    spec: SelfQuestionSpec,
    *,
    root: str | Path,
    batch: int = 64,
    follow_ups: bool = False,
    console: Console | None = None,
) -> list[Question]:
    """The base's own spec.n questions, the first of root/self-questions-<spec key>-n<n'>.jsonl with n' >= n, or
    sampled and written there first (`base` already in spec.dtype); ids `self-<category>-<index>`. Kept and
    rejected counts by reason are logged (and printed on a terminal). follow_ups: every FOLLOW_UP_EVERY-th
    candidate's question gets the second turn FOLLOW_UP, which answers.py asks the base to write after its answer."""
    path = _cached(Path(root), spec)
    if path is None:
        start = _fewer(Path(root), spec)  # a file of fewer: its questions are the first ones, sampling goes on
        records, stats = generate_self_questions(base, tokenizer, template, spec, batch=batch, console=console,
                                                 start=start)  # fmt: skip
        path = Path(root) / f"self-questions-{spec.key()}-n{spec.n}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"spec": asdict(spec), "format": FORMAT_VERSION, **stats}
        write_atomic(path.with_suffix(".json"), json.dumps(meta, indent=1) + "\n")
        write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))  # last: it marks done
        summary = _summary(Counter(stats["counts"]), spec)
        log.info("%s; %d tokens in %.0f s (%.0f tok/s); %s", summary, stats["tokens"], stats["seconds"],
                 stats["tokens_per_s"], path)  # fmt: skip
        console = console or Console(stderr=True)
        if console.is_terminal:
            console.print(summary)
    else:
        log.info("self questions: the first %d of %s", spec.n, path)
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()[: spec.n]]
    counts = Counter(r["category"] for r in records)
    log.info("%d self questions by category: %s", len(records), ", ".join(f"{c} {k}" for c, k in counts.items()))
    if not follow_ups:
        return [Question(tuple(r["turns"]), r["category"], r["question_id"]) for r in records]
    return [
        Question((*r["turns"], *((FOLLOW_UP,) if r["index"] % FOLLOW_UP_EVERY == 0 else ())), r["category"],
                 r["question_id"])
        for r in records
    ]  # fmt: skip


def _files(root: Path, spec: SelfQuestionSpec) -> dict[int, Path]:
    """n -> the file of spec's key that holds n questions."""
    return {int(p.stem.rsplit("-n", 1)[1]): p for p in root.glob(f"self-questions-{spec.key()}-n*.jsonl")}


def _cached(root: Path, spec: SelfQuestionSpec) -> Path | None:
    """The file of spec's key that holds the most questions, when that is at least spec.n; else None."""
    sizes = _files(root, spec)
    return sizes[max(sizes)] if sizes and max(sizes) >= spec.n else None


def _fewer(root: Path, spec: SelfQuestionSpec) -> tuple[list[dict], dict] | None:
    """(the questions, the counts) of the largest file of spec's key, which holds fewer than spec.n (else there
    would be a cached one); None when there is none or its counts are unreadable (then all are sampled anew)."""
    sizes = _files(root, spec)
    if not sizes:
        return None
    path = sizes[max(sizes)]
    try:
        counted = json.loads(path.with_suffix(".json").read_text())
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    except (OSError, ValueError):
        return None
    if not isinstance(counted, dict) or not {"candidates", "counts"} <= set(counted):
        return None
    log.info("self questions: %d in %s, sampling on from candidate %d", len(records), path, counted["candidates"])
    return records, counted
