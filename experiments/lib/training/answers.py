"""The base's own answers to training questions, generated once with continuous batching and kept in resumable shards.

A drafter learns to guess what its base writes, so its training text is the base's own answers (Medusa-2, EAGLE
and PARD regenerate their data the same way). Each question is answered in the base's chat template; a question
with a second turn is asked it after the base's first answer (rendered from the answer's text, as a user's client
would send it back), so multi-turn text is the base's too. A second turn FOLLOW_UP (given to the base's own
questions, experiments/lib/data/self_questions.py) is written by the base itself: after its first answer it is
given the user turn's opening, and what it writes is answered if it passes the self questions' filter. Half of the
questions (odd indices) are answered at T = 1, each from its own seeded generator, and half greedily: drafting must
serve both, and an answer depends only on its question, its index and the seed, never on the batch size
(verify/loop/continuous.py).

Layout of an answer directory:
    meta.json                the AnswerSpec, shards written, and what each holds
    questions.jsonl          the questions (Spec-Bench's question.jsonl form), their category counts logged
    answers-00000.jsonl      one record per answered turn: question_id, category, turn, temperature, seed,
    ...                      prompt (token ids the base was given), answer (its tokens, <|im_end|> included),
                             and asked (the follow-up's text) on the second turn of a FOLLOW_UP question
A shard covers `shard_questions` consecutive questions and is written to a temporary name then renamed, so a
shard that exists is whole and an interrupted run resumes at the first missing one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from tokenizers import Tokenizer
from torch import nn

from experiments.lib.common.errors import write_atomic
from experiments.lib.common.progress import generation_bar
from experiments.lib.data.chat import ChatTemplate
from experiments.lib.data.prompts import Question
from experiments.lib.data.self_questions import FOLLOW_UP, FollowUpFilter, read_candidate
from verify.backends.choose import make_target
from verify.loop.continuous import Request, serve
from verify.loop.sampling import SamplingConfig

__all__ = ["AnswerSpec", "answer_records", "generate_answers", "question_sampling", "shards_written"]

FORMAT_VERSION = 1
ASK = 3  # the turn number of a follow-up question the base is asked to write (a request, never a record)
LOG_EVERY = 30.0  # seconds between progress lines when the console is not a terminal (a run under nohup)
BAR = "questions · {task.fields[tokens]:,} tokens · {task.fields[rate]:.0f} tok/s"  # the progress bar's live fields
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AnswerSpec:
    """Everything that decides an answer directory's contents (the batch size does not)."""

    base_fingerprint: str
    questions: str  # the question list's key (its source, size and seed)
    max_new_tokens: int = 512  # per answered turn
    dtype: str = "bf16"  # what the base decodes in: bf16 answers are bf16 decoding's, not fp32's
    seed: int = 0
    shard_questions: int = 32  # a shard is written once its questions are answered: small shards lose little

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "shard_questions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"answers.{name}={value!r}: must be an integer >= 1")
        if self.dtype not in ("bf16", "fp32"):
            raise ValueError(f"answers.dtype={self.dtype!r}: must be bf16 or fp32")

    def key(self) -> str:
        record = {**asdict(self), "format": FORMAT_VERSION}
        return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def question_sampling(spec: AnswerSpec, index: int, turn: int) -> tuple[SamplingConfig, int]:
    """Question `index` (0-based in the list) is answered greedily when even, at T = 1 when odd; its seed is a
    function of the spec's seed, the index and the turn only."""
    temperature = float(index % 2)
    return SamplingConfig(temperature=temperature), spec.seed * 1_000_003 + 4099 * index + turn


def _shard_path(directory: Path, i: int) -> Path:
    return directory / f"answers-{i:05d}.jsonl"


def shards_written(directory: str | Path) -> int:
    """How many shards of an answer directory exist, counted from the first (a later one alone does not count)."""
    i = 0
    while _shard_path(Path(directory), i).exists():
        i += 1
    return i


def _check_meta(directory: Path, spec: AnswerSpec) -> None:
    path = directory / "meta.json"
    if not path.exists():
        return
    try:
        found = json.loads(path.read_text())["spec"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not an answer directory's meta.json ({type(e).__name__}): delete it") from None
    wanted = asdict(spec)
    diff = ", ".join(f"{k}: written {found.get(k)!r}, wanted {v!r}" for k, v in wanted.items() if found.get(k) != v)
    if diff:
        raise ValueError(f"answer directory {directory} was written for another setting ({diff}): choose another one")


def generate_answers(
    directory: str | Path,
    base: nn.Module,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    questions: list[Question],
    spec: AnswerSpec,
    *,
    batch: int = 64,
    console: Console | None = None,
) -> Path:
    """Answer `questions` (those of every shard that is missing) with `base` (already in spec.dtype), in one
    continuous stream: a shard is written as soon as its last answer arrives. Returns the directory."""
    directory = Path(directory)
    _check_meta(directory, spec)
    directory.mkdir(parents=True, exist_ok=True)
    size = spec.shard_questions
    shards = -(-len(questions) // size)
    _write_json(directory / "meta.json", {"spec": asdict(spec), "format": FORMAT_VERSION, "shards": shards})
    # the questions as Spec-Bench's question.jsonl beside their answers: what was asked, readable without the code
    _write_lines(directory / "questions.jsonl", [q.as_json() for q in questions])
    counts = Counter(q.category for q in questions)
    log.info("%d questions by category: %s", len(questions), ", ".join(f"{c} {n}" for c, n in counts.items()))
    missing = [i for i in range(shards) if not _shard_path(directory, i).exists()]
    if not missing:
        return directory
    pending = {i: [] for i in missing}  # shard -> its records so far
    closed = Counter()  # shard -> its questions answered to their last turn (a follow-up may end a question early)
    indices = [j for i in missing for j in range(i * size, min((i + 1) * size, len(questions)))]
    console = console or Console(stderr=True)
    with generation_bar(console, "answers", BAR) as progress:
        task = progress.add_task("answers", total=len(questions), completed=len(questions) - len(indices), tokens=0,
                                 rate=0)  # fmt: skip
        started, tokens, logged, answered = time.perf_counter(), 0, time.perf_counter(), 0
        eos = tokenizer.token_to_id("<|im_end|>")
        for record in _answer_stream(make_target(base), tokenizer, template, questions, spec, indices=indices,
                                     batch=batch, eos_id=eos):  # fmt: skip
            k = record["index"] // size
            pending[k].append(record)
            closed[k] += record["last"]
            if closed[k] == len(questions[k * size : (k + 1) * size]):  # its last answer: the shard is whole
                _write_lines(_shard_path(directory, k), sorted(pending[k], key=_order))
            tokens += len(record["answer"])
            now = time.perf_counter()
            rate, answered = tokens / (now - started), answered + int(record["last"])
            progress.update(task, advance=int(record["last"]), tokens=tokens, rate=rate)
            if not console.is_terminal and now - logged > LOG_EVERY:
                left = (len(indices) - answered) * (now - started) / max(answered, 1)
                log.info("answers: %d/%d questions, %d tokens, %.0f tok/s, about %.0f min left",
                         len(questions) - len(indices) + answered, len(questions), tokens, rate, left / 60)  # fmt: skip
                logged = now
    return directory


def _order(record: dict) -> tuple[int, int]:
    return record["index"], record["turn"]


def _answer_stream(
    target, tokenizer: Tokenizer, template: ChatTemplate, questions: list[Question], spec: AnswerSpec, *,
    indices: list[int], batch: int, eos_id: int,
) -> Iterator[dict]:  # fmt: skip
    """Records of questions[j] for j in `indices`, as they finish. A second turn is queued first in line when its
    first answer arrives, so a question's turns finish close together and shards are written as the stream runs.
    A FOLLOW_UP second turn is the base's own: asked (the conversation so far, then the user turn's opening,
    sampled at T = 1 from the question's seed) and judged by FollowUpFilter before it is answered; the first
    answer's record waits for that verdict, and is the question's last when the follow-up is rejected."""
    queue: deque[tuple[Request, int, int]] = deque()  # (request, question index, turn)
    for j in indices:
        sampling, seed = question_sampling(spec, j, 1)
        prompt = template.encode(tokenizer, [questions[j].turns[0]])
        queue.append((Request(prompt, spec.max_new_tokens, sampling, seed), j, 1))
    taken: list[tuple[Request, int, int]] = []

    def pull() -> Request | None:
        if not queue:
            return None
        taken.append(queue.popleft())
        return taken[-1][0]

    # A second turn's prompt holds the first answer (re-encoded from its text: a few tokens either way) and turn 2;
    # a follow-up the base writes is up to follow.spec.max_tokens long.
    asked = [questions[j].turns[:2] for j in indices]
    longest = max(len(template.encode(tokenizer, list(turns), [""] * (len(turns) - 1))) for turns in asked)
    follow = FollowUpFilter() if any(turns[1:] == (FOLLOW_UP,) for turns in asked) else None
    capacity = longest + 2 * spec.max_new_tokens + 64 + (follow.spec.max_tokens if follow else 0)
    first: dict[int, tuple[str, dict]] = {}  # question -> its first answer's text and record, awaiting a follow-up
    follow_ups: dict[int, str] = {}  # question -> the follow-up the base asked, being answered
    for answer in serve(target, pull, batch=min(batch, len(indices)), capacity=capacity, eos_id=eos_id):
        request, j, turn = taken[answer.index]
        q = questions[j]
        if turn == ASK:  # the base's follow-up question: answered next if it is one, else the question ends
            text, length, finished, special = read_candidate(tokenizer, answer.tokens, eos_id)
            said, record = first.pop(j)
            if follow(text, tokens=length, finished=finished, special=special) is None:
                sampling, seed = question_sampling(spec, j, 2)
                prompt = template.encode(tokenizer, [q.turns[0], text], [said])
                queue.appendleft((Request(prompt, spec.max_new_tokens, sampling, seed), j, 2))
                follow_ups[j] = text
            yield {**record, "last": j not in follow_ups}
            continue
        last = turn == len(q.turns) or turn == 2
        record = {
            "index": j,
            "question_id": q.question_id,
            "category": q.category,
            "turn": turn,
            "temperature": request.sampling.temperature,
            "seed": request.seed,
            "prompt": request.prompt,
            "answer": answer.tokens,
            "last": last,
        }
        if turn == 2 and j in follow_ups:
            record["asked"] = follow_ups.pop(j)  # what the base asked itself: not in questions.jsonl
        if not last:  # the second turn, after the base's first answer as its text
            text = tokenizer.decode(answer.tokens, skip_special_tokens=True).strip()
            if q.turns[1] == FOLLOW_UP:
                seed = question_sampling(spec, j, ASK)[1]
                prompt = template.user_prefix(tokenizer, [q.turns[0]], [text])
                queue.appendleft((Request(prompt, follow.spec.max_tokens, SamplingConfig(temperature=1.0), seed), j,
                                  ASK))  # fmt: skip
                first[j] = (text, record)
                continue
            sampling, seed = question_sampling(spec, j, 2)
            prompt = template.encode(tokenizer, list(q.turns[:2]), [text])
            queue.appendleft((Request(prompt, spec.max_new_tokens, sampling, seed), j, 2))
        yield record


def answer_records(directory: str | Path, *, shards: int | None = None) -> Iterator[dict]:
    """The records of an answer directory's first `shards` shards (None: all it lists), in question order (turn 1
    before turn 2)."""
    directory = Path(directory)
    shards = json.loads((directory / "meta.json").read_text())["shards"] if shards is None else shards
    for i in range(shards):
        path = _shard_path(directory, i)
        if not path.exists():
            raise ValueError(f"answer directory {directory} lacks {path.name}: generate the answers first")
        with path.open() as f:
            for line in f:
                yield json.loads(line)


def _write_json(path: Path, value: dict) -> None:
    write_atomic(path, json.dumps(value, indent=1))


def _write_lines(path: Path, records: list[dict]) -> None:
    """Atomic (write_atomic: fsync'd, renamed, nothing left behind on failure): a shard that exists is whole."""
    write_atomic(path, "".join(json.dumps(record, separators=(",", ":")) + "\n" for record in records))
