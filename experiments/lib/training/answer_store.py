"""Finding a question list's answers under an answers root, question by question, wherever they were written.

The answers of one setting (AnswerSpec.setting: the base, the length, the dtype, the seed) live in the directory
named by AnswerSpec.key, each question's records under question_key (its turns and its position). Directories of
format 1 hold the answers of one whole question list, shards by position (the answers shipped on 2026-11-28, and
caches written before per-question keys): their records carry no key, so a record is taken for a question only
when it is that question's own: the same position and id, the sampling that position gets, and prompts equal to
the question's turns encoded now (a question whose text or encoding changed is answered again). A run that found
answers there before finds the same ones now, without answering again.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from tokenizers import Tokenizer

from experiments.lib.data.chat import ChatTemplate
from experiments.lib.data.prompts import Question
from experiments.lib.data.self_questions import FOLLOW_UP
from experiments.lib.training.answers import AnswerSpec, question_key, question_sampling, read_shard, stored_answers

__all__ = ["Answers", "LEGACY_FORMAT", "legacy_directories"]

LEGACY_FORMAT = 1
log = logging.getLogger(__name__)


def legacy_directories(root: Path, spec: AnswerSpec) -> list[Path]:
    """The format-1 answer directories under `root` written with spec's setting, by name."""
    found = []
    for meta in sorted(root.glob("*/meta.json")) if root.is_dir() else ():
        try:
            written = json.loads(meta.read_text())
            version, setting = written["format"], written["spec"]
        except (ValueError, KeyError, TypeError):
            continue  # not an answer directory
        if version == LEGACY_FORMAT and {k: setting.get(k) for k in spec.setting()} == spec.setting():
            found.append(meta.parent)
    return found


class Answers:
    """The answers of `questions` (their position in the list answered included) at `spec`'s setting under
    `root`: those of its own directory, then those of format-1 directories that are provably the same."""

    def __init__(self, root: str | Path, spec: AnswerSpec, questions: list[Question], template: ChatTemplate,
                 tokenizer: Tokenizer):  # fmt: skip
        self.root, self.spec, self.questions = Path(root), spec, questions
        self.template, self.tokenizer = template, tokenizer
        self.directory = self.root / spec.key()
        # format-1 directories -> their shard size (questions per shard, by position)
        self.legacy = {d: json.loads((d / "meta.json").read_text())["spec"]["shard_questions"]
                       for d in legacy_directories(self.root, spec)}  # fmt: skip
        self._read: dict[str, list[dict]] = {}  # shard name -> records (a written shard never changes)
        self._legacy: dict[tuple[Path, int], dict[int, list[dict]]] = {}  # (directory, shard) -> index -> records
        self._found: dict[int, list[dict]] = {}  # position -> its records, once found (answers never change)
        self.adopted = 0  # questions whose answers came from a format-1 directory

    def find(self, indices: list[int] | range) -> dict[int, list[dict]]:
        """position -> the records of questions[position] (turn 1 first), for those of `indices` answered."""
        stored = None
        for j in (j for j in indices if j not in self._found):
            stored = stored_answers(self.directory, cache=self._read) if stored is None else stored
            q = self.questions[j]
            records = stored.get(question_key(q, j)) or self._from_legacy(j)
            if records:
                self._found[j] = [{**r, "question_id": q.question_id, "category": q.category} for r in records]
        return {j: self._found[j] for j in indices if j in self._found}

    def _from_legacy(self, j: int) -> list[dict] | None:
        for directory in self.legacy:
            records = self._legacy_shard(directory, j).get(j)
            if records and self._own(j, records):
                self.adopted += 1
                return [{**r, "key": question_key(self.questions[j], j)} for r in records]
        return None

    def _legacy_shard(self, directory: Path, j: int) -> dict[int, list[dict]]:
        size = self.legacy[directory]
        where = (directory, j // size)
        if where not in self._legacy:
            path = directory / f"answers-{j // size:05d}.jsonl"
            by_index: dict[int, list[dict]] = {}
            for record in read_shard(path) if path.exists() else ():
                by_index.setdefault(record["index"], []).append(record)
            self._legacy[where] = {i: sorted(rs, key=lambda r: r["turn"]) for i, rs in by_index.items()}
        return self._legacy[where]

    def _own(self, j: int, records: list[dict]) -> bool:
        """Whether format-1 records at position j are questions[j]'s answers at this setting."""
        q, encode = self.questions[j], self.template.encode
        first, second = records[0], records[1:]
        if first["turn"] != 1 or first["question_id"] != q.question_id or not self._sampled(j, first):
            return False
        if first["prompt"] != encode(self.tokenizer, [q.turns[0]]):
            return False
        if len(q.turns) == 1 or not second:  # a FOLLOW_UP the base did not ask (or one rejected) ends at turn 1
            return not second and (len(q.turns) == 1 or q.turns[1] == FOLLOW_UP)
        said = self.tokenizer.decode(first["answer"], skip_special_tokens=True).strip()
        turn = second[0].get("asked") if q.turns[1] == FOLLOW_UP else q.turns[1]
        if len(second) != 1 or second[0]["turn"] != 2 or turn is None or not self._sampled(j, second[0]):
            return False
        return second[0]["prompt"] == encode(self.tokenizer, [q.turns[0], turn], [said])

    def _sampled(self, j: int, record: dict) -> bool:
        sampling, seed = question_sampling(self.spec, j, record["turn"])
        return record["temperature"] == sampling.temperature and record["seed"] == seed
