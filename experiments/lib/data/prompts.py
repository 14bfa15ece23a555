"""Prompts for generation and benchmarks: held out from the validation split, or a user's file.

Held-out prompts matter because a base model continues text it was trained on too well: drafters then
look better than they are. Prompts come only from validation documents, never
cross a document boundary (EOS), and are spread over as many different files as possible.

A prompts file is read as `Question`s: the user's turns and a category. A `.jsonl` line is a string, an
object with a "prompt", or a question in Spec-Bench's `question.jsonl` form (`question_id`, `category`,
`turns`: the user's messages of a conversation); a text file holds one-turn prompts without a category.
Benchmarks report per category (Spec-Bench's protocol), so a subset keeps every category
(`select_questions`: round-robin over the categories, in the file's order).
"""

from __future__ import annotations

import json
import os
import stat
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tokenizers import Tokenizer

if TYPE_CHECKING:  # annotations only: prompts need no data pipeline at run time
    from experiments.lib.data.id_cache import PreparedData

SEPARATOR = "---"  # a line holding only this separates prompts in a plain-text prompts file
NO_CATEGORY = "all"  # the category of a prompt that names none


@dataclass(frozen=True)
class Question:
    """One benchmark prompt: the user's turns (a plain prompt has one), its category and its id."""

    turns: tuple[str, ...]
    category: str = NO_CATEGORY
    question_id: Any = None

    def as_json(self) -> dict[str, Any]:
        """The Spec-Bench question.jsonl form."""
        return {"question_id": self.question_id, "category": self.category, "turns": list(self.turns)}


# ---------------------------------------------------------------- held-out prompts


def document_regions(ids: torch.Tensor, eos_id: int) -> list[tuple[int, int]]:
    """[(start, end)) of every non-empty run of tokens between EOS tokens in a (N,) stream.

    Scanned in chunks: the stream may be a memory map larger than memory, and `ids == eos_id` over all of
    it at once would allocate a mask of N bytes."""
    chunk = 1 << 24
    eos = [
        i
        for start in range(0, ids.numel(), chunk)
        for i in ((ids[start : start + chunk] == eos_id).nonzero().flatten() + start).tolist()
    ]
    bounds = [-1] + eos + [ids.numel()]
    return [(a + 1, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a + 1]


def _round_robin(order: list[int], capacity: list[int], num_prompts: int) -> list[tuple[int, int]]:
    """(region, k) picks: one window per region per round, regions in `order`, until num_prompts.

    The first len(order) prompts thus come from different files; a region gives at most capacity windows."""
    picks: list[tuple[int, int]] = []
    taken = [0] * len(capacity)
    while len(picks) < num_prompts:
        for r in order:
            if taken[r] < capacity[r] and len(picks) < num_prompts:
                picks.append((r, taken[r]))
                taken[r] += 1
    return picks


def heldout_prompts(data: PreparedData, *, num_prompts: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """num_prompts windows of prompt_len validation tokens, none containing EOS; deterministic in seed.

    Files are visited in a seeded random order, one window per file per round. A file giving c windows
    is cut into c equal slots and each window starts at a seeded random offset inside its slot, so the
    windows of one file never overlap."""
    if num_prompts < 1 or prompt_len < 1:
        raise ValueError(f"num_prompts={num_prompts} and prompt_len={prompt_len} must both be at least 1")
    regions = document_regions(data.val_ids, data.eos_id)
    capacity = [(end - start) // prompt_len for start, end in regions]
    if sum(capacity) < num_prompts:
        raise ValueError(
            f"num_prompts={num_prompts} with prompt_len={prompt_len} is too many: the validation split "
            f"({data.val_ids.numel()} tokens, {len(regions)} files) holds only {sum(capacity)} such windows"
        )
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(regions), generator=g).tolist()
    picks = _round_robin(order, capacity, num_prompts)
    counts = Counter(r for r, _ in picks)
    prompts = []
    for r, k in picks:
        start, end = regions[r]
        slot = (end - start) // counts[r]  # >= prompt_len since counts[r] <= capacity[r]
        offset = int(torch.randint(0, slot - prompt_len + 1, (1,), generator=g))
        first = start + k * slot + offset
        prompts.append(data.val_ids[first : first + prompt_len].tolist())
    return prompts


# ---------------------------------------------------------------- a user's prompts file


def check_prompt_text(text: Any, name: str, example: str = "") -> str:
    """`text` as a prompt: a string holding more than whitespace. A blank prompt gives the model nothing to
    continue, and a benchmark would time it as if it were a prompt. `name` says where it came from."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{name}={text!r}: give a non-empty text, not only whitespace{example}")
    return text


def _question(item: Any, path: str, line: int, n: int) -> Question:
    """A .jsonl line's value as the n-th Question: a string, {"prompt": ...}, or Spec-Bench's {"turns": [...]}."""
    where = f"prompts file {path!r} line {line}"
    if isinstance(item, dict) and "turns" in item:
        turns = item["turns"]
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"{where}: 'turns' must be a non-empty list of strings, got {turns!r}")
        odd = [(i, t) for i, t in enumerate(turns) if not isinstance(t, str)]
        if odd:  # a number is no empty text: say what it is
            i, t = odd[0]
            raise ValueError(f"{where}: turn {i + 1} is {t!r}, a {type(t).__name__}: 'turns' must be strings")
        category = item.get("category", NO_CATEGORY)
        if not isinstance(category, str) or not category.strip():
            raise ValueError(f"{where}: 'category' must be a non-empty string, got {category!r}")
        texts = tuple(check_prompt_text(t, f"{where}: turn {i + 1}") for i, t in enumerate(turns))
        return Question(texts, category, item.get("question_id"))
    if isinstance(item, dict) and isinstance(item.get("prompt"), str):
        text = item["prompt"]
    elif isinstance(item, str):
        text = item
    else:
        raise ValueError(
            f"{path}:{line} must be a JSON string, an object with a string field 'prompt', or a Spec-Bench "
            "question with a list 'turns'"
        )
    # Refused, not dropped: a line that names a prompt is one the user meant to run.
    return Question((check_prompt_text(text, f"{where}: prompt {n}"),))


def _jsonl_questions(lines: list[str], path: str) -> list[Question]:
    questions = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n} is not valid JSON ({e.msg})") from None
        questions.append(_question(item, path, n, len(questions) + 1))
    return questions


def _plain_prompts(lines: list[str]) -> list[str]:
    """Blocks separated by `---` lines (blank lines at a block's ends trimmed, indentation kept);
    without any `---`, one prompt per non-empty line."""
    if not any(line.strip() == SEPARATOR for line in lines):
        return [line for line in lines if line.strip()]
    blocks: list[list[str]] = [[]]
    for line in lines:
        if line.strip() == SEPARATOR:
            blocks.append([])
        else:
            blocks[-1].append(line)
    texts = ["\n".join(block).strip("\n") for block in blocks]
    return [t for t in texts if t.strip()]


def file_kind(path: str | Path) -> str:
    """What a path that exists is, in words: "a directory", "a FIFO", "a character device" ..."""
    mode = os.stat(path).st_mode
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"))
    kinds += ((stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a file")


def read_questions(path: str) -> list[Question]:
    """The questions of a `.jsonl` file (strings, {"prompt"} objects or Spec-Bench questions) or of a
    plain-text file (one-turn prompts, see _plain_prompts), in the file's order."""
    path = str(path)
    if not Path(path).exists():
        raise FileNotFoundError(f"prompts file {path!r} does not exist")
    if not Path(path).is_file():  # a FIFO would block the read, a device (/dev/null) reads as nothing
        raise ValueError(f"prompts file {path!r} is not a regular file ({file_kind(path)}): give a .jsonl or text file")
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    if path.endswith(".jsonl"):
        questions = _jsonl_questions(lines, path)
    else:
        questions = [Question((text,)) for text in _plain_prompts(lines)]
    if not questions:
        raise ValueError(f"prompts file {path!r} holds no prompts")
    return questions


def write_questions(questions: list[Question], path: str | Path) -> None:
    """Spec-Bench's question.jsonl form, one question a line, written atomically (write_atomic: a reader sees the
    old file or the whole new one, and a failed write leaves no temporary file)."""
    from experiments.lib.common.errors import write_atomic  # imported when writing: reading prompts needs no Hydra

    write_atomic(path, "".join(json.dumps(q.as_json(), ensure_ascii=False) + "\n" for q in questions))


def select_questions(questions: list[Question], num_prompts: int) -> list[Question]:
    """The first num_prompts questions taken round-robin over the categories (each category's in file order,
    categories in order of first appearance), so a subset of a set sorted by category keeps every category;
    returned in the set's order. Without categories: the first num_prompts."""
    by_category: dict[str, list[int]] = {}
    for i, q in enumerate(questions):
        by_category.setdefault(q.category, []).append(i)
    queues, picked = list(by_category.values()), []
    while len(picked) < min(num_prompts, len(questions)):
        for queue in queues:
            if queue and len(picked) < num_prompts:
                picked.append(queue.pop(0))
    return [questions[i] for i in sorted(picked)]


def load_prompts(path: str, tokenizer: Tokenizer) -> list[list[int]]:
    """Token ids of the prompts (first turns, as raw text) in a `.jsonl` file or a plain-text file."""
    texts = [q.turns[0] for q in read_questions(path)]
    return [enc.ids for enc in tokenizer.encode_batch(texts, add_special_tokens=False)]
