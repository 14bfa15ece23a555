"""The base's own answers to training questions, generated once with continuous batching and kept in resumable shards.

A drafter learns to guess what its base writes, so its training text is the base's own answers (Medusa-2, EAGLE
and PARD regenerate their data the same way). Each question is answered in the base's chat template; a question
with a second turn is asked it after the base's first answer (rendered from the answer's text, as a user's client
would send it back), so multi-turn text is the base's too. A second turn FOLLOW_UP (given to the base's own
questions, experiments/lib/data/self_questions.py) is written by the base itself: after its first answer it is
given the user turn's opening, and what it writes is answered if it passes the self questions' filter. Half of the
questions (odd positions in the list answered) are answered at T = 1, each from its own seeded generator, and half
greedily: drafting must serve both, and an answer depends only on its question, its position and the seed, never on
the batch size (verify/loop/continuous.py).

Answers are kept per question: an answer directory is named by the setting alone (the base, the length, the dtype,
the seed: AnswerSpec.key), and each question's records by question_key (its turns and its position). A longer
question list whose first questions are a shorter one's (more windows, more self questions) finds their answers
and answers only the new ones; a list that changes answers only the questions that changed.

Layout of an answer directory (format 2):
    meta.json                  the setting (AnswerSpec.setting) and the format
    answers-<hash>.jsonl       up to `shard_questions` questions' records, one per answered turn: index (the
    ...                        position answered), key (question_key), question_id, category, turn, temperature,
                               seed, prompt (token ids the base was given), answer (its tokens, <|im_end|> included),
                               turns (the question, on turn 1), asked (a FOLLOW_UP's text, on turn 2) and skipped
                               (on turn 1, when the second turn could not be asked: why)
A shard is named by its questions' keys and written atomically once its last answer arrives, so a shard that exists
is whole and an interrupted run answers only the questions of the shards it did not write. Directories of format 1
(one question list, shards by position: the shipped answers of 2026-11) are read by answer_store.py.
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

__all__ = [
    "AnswerSpec", "answer_records", "generate_answers", "question_key", "question_sampling", "shard_files",
    "shards_written", "stored_answers",
]  # fmt: skip

FORMAT_VERSION = 2  # 1: a directory per question list, shards by position (answer_store.py reads those)
ASK = 3  # the turn number of a follow-up question the base is asked to write (a request, never a record)
MARGIN = 64  # tokens a second turn's prompt may gain when the first answer's text is encoded again
LOG_EVERY = 30.0  # seconds between progress lines when the console is not a terminal (a run under nohup)
BAR = "questions · {task.fields[tokens]:,} tokens · {task.fields[rate]:.0f} tok/s"  # the progress bar's live fields
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AnswerSpec:
    """Everything that decides an answer (the question and its position aside; the batch size does not)."""

    base_fingerprint: str
    max_new_tokens: int = 512  # per answered turn
    dtype: str = "bf16"  # what the base decodes in: bf16 answers are bf16 decoding's, not fp32's
    seed: int = 0
    shard_questions: int = 32  # questions per shard: how much an interruption loses, not what is answered

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "shard_questions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"answers.{name}={value!r}: must be an integer >= 1")
        if self.dtype not in ("bf16", "fp32"):
            raise ValueError(f"answers.dtype={self.dtype!r}: must be bf16 or fp32")

    def setting(self) -> dict:
        """The fields that decide an answer: what a directory of answers is named by."""
        return {k: v for k, v in asdict(self).items() if k != "shard_questions"}

    def key(self) -> str:
        record = {**self.setting(), "format": FORMAT_VERSION}
        return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def question_key(question: Question, index: int) -> str:
    """Names one question's answers in a directory: its turns and its position in the list answered (the position
    decides its temperature and seed: question_sampling)."""
    return hashlib.sha256(json.dumps([list(question.turns), index]).encode()).hexdigest()[:16]


def question_sampling(spec: AnswerSpec, index: int, turn: int) -> tuple[SamplingConfig, int]:
    """Question `index` (0-based in the list) is answered greedily when even, at T = 1 when odd; its seed is a
    function of the spec's seed, the index and the turn only."""
    temperature = float(index % 2)
    return SamplingConfig(temperature=temperature), spec.seed * 1_000_003 + 4099 * index + turn


def shard_files(directory: str | Path) -> list[Path]:
    """The shards of an answer directory, by name."""
    return sorted(Path(directory).glob("answers-*.jsonl"))


def shards_written(directory: str | Path) -> int:
    return len(shard_files(directory))


def read_shard(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def answer_records(directory: str | Path) -> Iterator[dict]:
    """Every record of an answer directory, shard by shard (by name), each shard in question order."""
    for path in shard_files(directory):
        yield from read_shard(path)


def stored_answers(directory: str | Path, *, cache: dict[str, list[dict]] | None = None) -> dict[str, list[dict]]:
    """question_key -> that question's records (turn 1 first) in a directory of format 2. `cache` (shard name ->
    records) spares reading a shard twice in one run: a written shard never changes."""
    cache = {} if cache is None else cache
    found: dict[str, list[dict]] = {}
    for path in shard_files(directory):
        if path.name not in cache:
            cache[path.name] = read_shard(path)
        for record in cache[path.name]:
            found.setdefault(record["key"], []).append(record)
    return found


def _check_meta(directory: Path, spec: AnswerSpec) -> None:
    path = directory / "meta.json"
    if not path.exists():
        return
    try:
        meta = json.loads(path.read_text())
        found, version = meta["spec"], meta["format"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not an answer directory's meta.json ({type(e).__name__}): delete it") from None
    if version != FORMAT_VERSION:
        raise ValueError(f"answer directory {directory} has format {version!r}, not {FORMAT_VERSION}: choose another")
    wanted = spec.setting()
    diff = ", ".join(f"{k}: written {found.get(k)!r}, wanted {v!r}" for k, v in wanted.items() if found.get(k) != v)
    if diff:
        raise ValueError(f"answer directory {directory} was written for another setting ({diff}): choose another one")


class _Shards:
    """The shards being answered: each holds its questions' records until its last question closes, then writes
    them and lets them go, so a run holds only its open shards' records."""

    def __init__(self, directory: Path, questions: list[Question], missing: list[int], size: int):
        self.directory, self.size = directory, size
        self.chunk = {j: k // size for k, j in enumerate(missing)}  # question -> its shard among this run's
        self.open = {k: [] for k in range(-(-len(missing) // size))}  # shard -> its records so far
        self.left = Counter(self.chunk.values())  # shard -> its questions not closed yet
        self.keys = {k: [] for k in self.open}
        for j in missing:
            self.keys[self.chunk[j]].append(question_key(questions[j], j))

    def add(self, record: dict) -> None:
        k = self.chunk[record["index"]]
        self.open[k].append(record)
        self.left[k] -= record["last"]
        if self.left[k] == 0:  # its last answer: the shard is whole
            name = hashlib.sha256("\n".join(self.keys[k]).encode()).hexdigest()[:16]
            records = sorted(self.open.pop(k), key=lambda r: (r["index"], r["turn"]))
            write_atomic(self.directory / f"answers-{name}.jsonl", "".join(_line(r) for r in records))

    def held(self) -> int:
        return sum(len(records) for records in self.open.values())


def _line(record: dict) -> str:
    return json.dumps(record, separators=(",", ":")) + "\n"


def generate_answers(
    directory: str | Path,
    base: nn.Module,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    questions: list[Question],
    spec: AnswerSpec,
    *,
    indices: list[int] | None = None,
    batch: int = 64,
    console: Console | None = None,
) -> Path:
    """Answer questions[j] for j in `indices` (None: all) that the directory lacks, with `base` (already in
    spec.dtype), in one continuous stream: a shard of spec.shard_questions of them is written as soon as its last
    answer arrives. Returns the directory."""
    directory = Path(directory)
    _check_meta(directory, spec)
    directory.mkdir(parents=True, exist_ok=True)
    write_atomic(directory / "meta.json", json.dumps({"spec": spec.setting(), "format": FORMAT_VERSION}, indent=1))
    indices = list(range(len(questions))) if indices is None else list(indices)
    stored = stored_answers(directory)
    missing = [j for j in indices if question_key(questions[j], j) not in stored]
    if not missing:
        return directory
    counts = Counter(questions[j].category for j in missing)
    log.info("answering %d questions by category: %s", len(missing), ", ".join(f"{c} {n}" for c, n in counts.items()))
    shards = _Shards(directory, questions, missing, spec.shard_questions)
    console = console or Console(stderr=True)
    with generation_bar(console, "answers", BAR) as progress:
        task = progress.add_task("answers", total=len(missing), completed=0, tokens=0, rate=0)
        started, tokens, logged, answered = time.perf_counter(), 0, time.perf_counter(), 0
        eos = tokenizer.token_to_id("<|im_end|>")
        for record in _answer_stream(make_target(base), tokenizer, template, questions, spec, indices=missing,
                                     batch=batch, eos_id=eos):  # fmt: skip
            shards.add(record)
            tokens += len(record["answer"])
            now = time.perf_counter()
            rate, answered = tokens / (now - started), answered + int(record["last"])
            progress.update(task, advance=int(record["last"]), tokens=tokens, rate=rate)
            if not console.is_terminal and now - logged > LOG_EVERY:
                left = (len(missing) - answered) * (now - started) / max(answered, 1)
                log.info("answers: %d/%d questions, %d tokens, %.0f tok/s, about %.0f min left",
                         answered, len(missing), tokens, rate, left / 60)  # fmt: skip
                logged = now
    return directory


def _answer_stream(
    target, tokenizer: Tokenizer, template: ChatTemplate, questions: list[Question], spec: AnswerSpec, *,
    indices: list[int], batch: int, eos_id: int,
) -> Iterator[dict]:  # fmt: skip
    """Records of questions[j] for j in `indices`, as they finish. A second turn is queued first in line when its
    first answer arrives, so a question's turns finish close together and shards are written as the stream runs.
    A FOLLOW_UP second turn is the base's own: asked (the conversation so far, then the user turn's opening,
    sampled at T = 1 from the question's seed) and judged by FollowUpFilter before it is answered; the first
    answer's record waits for that verdict, and is the question's last when the follow-up is rejected. A second
    turn whose prompt outgrew the rows (the first answer's text encodes to more tokens than it had) is skipped,
    recorded on the first turn's record with its reason: the question is whole, never asked again on a resume."""
    queue: deque[tuple[Request, int, int]] = deque()  # (request, question index, turn)
    for j in indices:
        sampling, seed = question_sampling(spec, j, 1)
        prompt = template.encode(tokenizer, [questions[j].turns[0]])
        queue.append((Request(prompt, spec.max_new_tokens, sampling, seed), j, 1))
    taken: dict[int, tuple[Request, int, int]] = {}  # serve's request index -> the request, until it is answered
    pulled = 0

    def pull() -> Request | None:
        nonlocal pulled
        if not queue:
            return None
        taken[pulled], pulled = queue.popleft(), pulled + 1
        return taken[pulled - 1][0]

    # A second turn's prompt holds the first answer (re-encoded from its text: a few tokens either way) and turn 2;
    # a follow-up the base writes is up to follow.spec.max_tokens long.
    asked = [questions[j].turns[:2] for j in indices]
    longest = max(len(template.encode(tokenizer, list(turns), [""] * (len(turns) - 1))) for turns in asked)
    follow = FollowUpFilter() if any(turns[1:] == (FOLLOW_UP,) for turns in asked) else None
    capacity = longest + 2 * spec.max_new_tokens + MARGIN + (follow.spec.max_tokens if follow else 0)

    def fits(prompt: list[int], new: int) -> str | None:
        if len(prompt) + new <= capacity:
            return None
        return f"second turn's prompt of {len(prompt)} tokens + {new} new is more than the rows' {capacity}"

    first: dict[int, tuple[str, dict]] = {}  # question -> its first answer's text and record, awaiting a follow-up
    follow_ups: dict[int, str] = {}  # question -> the follow-up the base asked, being answered
    for answer in serve(target, pull, batch=min(batch, len(indices)), capacity=capacity, eos_id=eos_id):
        request, j, turn = taken.pop(answer.index)
        q = questions[j]
        if turn == ASK:  # the base's follow-up question: answered next if it is one, else the question ends
            text, length, finished, special = read_candidate(tokenizer, answer.tokens, eos_id)
            said, record = first.pop(j)
            if follow(text, tokens=length, finished=finished, special=special) is None:
                sampling, seed = question_sampling(spec, j, 2)
                prompt = template.encode(tokenizer, [q.turns[0], text], [said])
                record["skipped"] = fits(prompt, spec.max_new_tokens)
                if record["skipped"] is None:
                    queue.appendleft((Request(prompt, spec.max_new_tokens, sampling, seed), j, 2))
                    follow_ups[j] = text
            yield _finish({**record, "last": j not in follow_ups})
            continue
        last = turn == len(q.turns) or turn == 2
        record = {
            "index": j, "key": question_key(q, j), "question_id": q.question_id, "category": q.category,
            "turn": turn, "temperature": request.sampling.temperature, "seed": request.seed,
            "prompt": request.prompt, "answer": answer.tokens, "last": last,
        }  # fmt: skip
        if turn == 1:
            record["turns"] = list(q.turns)  # what was asked, readable beside its answer
        if turn == 2 and j in follow_ups:
            record["asked"] = follow_ups.pop(j)  # what the base asked itself
        if not last:  # the second turn, after the base's first answer as its text
            text = tokenizer.decode(answer.tokens, skip_special_tokens=True).strip()
            if q.turns[1] == FOLLOW_UP:
                seed = question_sampling(spec, j, ASK)[1]
                prompt = template.user_prefix(tokenizer, [q.turns[0]], [text])
                record["skipped"] = fits(prompt, follow.spec.max_tokens)
                if record["skipped"] is None:
                    queue.appendleft((Request(prompt, follow.spec.max_tokens, SamplingConfig(temperature=1.0), seed),
                                      j, ASK))  # fmt: skip
                    first[j] = (text, record)
                    continue
            else:
                sampling, seed = question_sampling(spec, j, 2)
                prompt = template.encode(tokenizer, list(q.turns[:2]), [text])
                record["skipped"] = fits(prompt, spec.max_new_tokens)
                if record["skipped"] is None:
                    queue.appendleft((Request(prompt, spec.max_new_tokens, sampling, seed), j, 2))
            record["last"] = record["skipped"] is not None
        yield _finish(record)


def _finish(record: dict) -> dict:
    """The record as written: a second turn that was asked leaves no `skipped` behind; one that was not says why."""
    if record.get("skipped", "") is None:
        del record["skipped"]
    elif "skipped" in record:
        log.warning("question %s: %s; its first turn is kept, the second skipped", record["question_id"],
                    record["skipped"])  # fmt: skip
    return record
