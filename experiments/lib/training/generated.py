"""Regenerated training data (`features.source=generated`): windows of the frozen base's own conversations.

A drafter learns to guess what the base will write. A corpus is text the base did not write: its tokens and
style differ from the base's answers (an instruct model answers in markdown, with its own phrases), so a
drafter trained on it learns the wrong distribution at the positions that matter. Medusa-2 and EAGLE
therefore train on the base's answers to chat questions. Here the questions are the training question bank
(experiments/lib/data/question_bank.py: none is a benchmark prompt), the answers come from
experiments/lib/training/answers.py (continuous batching, half greedy and half at T = 1, second turns included),
and each answered turn becomes one window: [prompt + answer], cut to seq_len + 1 tokens and padded, with a mask
that is True only where the next token is the base's answer. A drafter drafts answers only: the question's
tokens are text the base did not write, so they neither train it nor count in its validation.

The bank's last VALIDATION_PER_CATEGORY questions of every category are answered too but never trained on:
validation and best-checkpoint selection run on those held-out answers, every category taking turns, so the first
12 hold one of each (the last questions of the bank alone came from its largest categories: no summarization or
rag, whose questions run out first).

`features.questions` chooses what is answered for training: the bank's other questions (`bank`), the base's own
questions (`self`: experiments/lib/data/self_questions.py, sampled once from its user-turn prefix and cached beside
the answers; a quarter of them get a second turn the base writes itself after its answer), or the two taking
turns (`mix`). Validation stays on the bank's held-out questions whatever the choice, and their answers are
shared: a run on self questions is measured on the same held-out answers as one on the bank.

Answers are found question by question (answers.py, answer_store.py): more windows answer only the questions not
answered yet, and more self questions sample only the new ones (self_questions.py), so a data set that grows
only adds to what was generated.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import Tensor, nn

from experiments.lib.data.chat import chat_template_for
from experiments.lib.data.prompts import Question
from experiments.lib.data.question_bank import BANK_CATEGORIES, bank_questions
from experiments.lib.data.self_questions import SelfQuestionSpec, self_questions
from experiments.lib.training.answer_store import Answers
from experiments.lib.training.answers import AnswerSpec, generate_answers
from experiments.lib.training.precision import cast_copy, native_bf16
from experiments.lib.training.shipped import seed_answers

__all__ = [
    "VALIDATION_PER_CATEGORY", "VALIDATION_QUESTIONS", "answer_spec", "conversation_windows", "generated_records",
    "generated_windows", "mix_questions", "split_questions",
]  # fmt: skip

log = logging.getLogger(__name__)
VALIDATION_PER_CATEGORY = 8  # the last questions of each bank category: answered for validation, never trained on
VALIDATION_QUESTIONS = VALIDATION_PER_CATEGORY * len(BANK_CATEGORIES)  # the bank's held-out questions: 96, as before


def split_questions(questions: list[Question]) -> tuple[list[Question], list[Question]]:
    """(training questions, held-out questions): the last VALIDATION_PER_CATEGORY of every category are held out
    (all of a category that has no more), the categories taking turns (in order of first appearance) so any first
    n of them spread over the categories; the training questions keep the list's order."""
    by_category: dict[str, list[int]] = {}
    for i, q in enumerate(questions):
        by_category.setdefault(q.category, []).append(i)
    tails = [ids[-VALIDATION_PER_CATEGORY:] for ids in by_category.values()]
    held = [tail[k] for k in range(VALIDATION_PER_CATEGORY) for tail in tails if k < len(tail)]
    out = set(held)
    return [q for i, q in enumerate(questions) if i not in out], [questions[i] for i in held]


def mix_questions(train: list[Question], own: list[Question]) -> list[Question]:
    """Bank and self questions taking turns (bank first) while both last, then the rest of the longer list: the
    first k windows of a run hold about k / 2 of each."""
    mixed = [q for pair in zip(train, own) for q in pair]
    return mixed + train[len(own) :] + own[len(train) :]


def answer_dtype(device: torch.device) -> str:
    """bf16 where the device computes it natively (batched bf16 decoding of SmolLM2 ran several times faster than
    fp32 here), else fp32: what the base answers (and asks its own questions) in."""
    return "bf16" if native_bf16(device)[0] else "fp32"


def answer_spec(spec, base_meta: dict, device: torch.device, *, max_new_tokens: int) -> AnswerSpec:
    """The answers `spec`'s windows come from, decoded in answer_dtype(device)."""
    dtype = answer_dtype(device)
    return AnswerSpec(
        base_fingerprint=spec.base_fingerprint, max_new_tokens=max_new_tokens, dtype=dtype, seed=spec.seed
    )


def conversation_windows(records: list[dict], *, seq_len: int, pad_id: int) -> tuple[Tensor, Tensor]:
    """Answered turns -> windows (N, seq_len + 1) long, [prompt + answer] cut and padded with pad_id, and mask
    (N, seq_len) bool: position t is True where token t + 1 is the answer's."""
    windows = torch.full((len(records), seq_len + 1), pad_id, dtype=torch.long)
    mask = torch.zeros(len(records), seq_len, dtype=torch.bool)
    for i, record in enumerate(records):
        ids = (record["prompt"] + record["answer"])[: seq_len + 1]
        windows[i, : len(ids)] = torch.tensor(ids)
        mask[i, len(record["prompt"]) - 1 : len(ids) - 1] = True
    return windows, mask


def answered_prefix(answers: Answers, wanted: int, *, prompt_len: int) -> list[dict] | None:
    """The first `wanted` answered turns with prompts <= prompt_len tokens, when the questions answered already
    (counted from the first, a shard of questions at a time) hold them; None when a question before them is not."""
    size, found = answers.spec.shard_questions, []
    for start in range(0, len(answers.questions), size):
        chunk = range(start, min(start + size, len(answers.questions)))
        got = answers.find(chunk)
        for j in chunk:
            if j not in got:
                return None
            found += [r for r in got[j] if len(r["prompt"]) <= prompt_len]
            if len(found) >= wanted:
                return found[:wanted]
    return None


def generated_windows(spec, base: nn.Module, tokenizer: Tokenizer, base_meta: dict, **kwargs) -> tuple[Tensor, Tensor]:
    """generated_records' turns as windows and masks (conversation_windows), padded with <|im_end|>."""
    records = generated_records(spec, base, tokenizer, base_meta, **kwargs)
    pad = tokenizer.token_to_id("<|im_end|>") if tokenizer.token_to_id("<|im_end|>") is not None else 0
    return conversation_windows(records, seq_len=spec.seq_len, pad_id=pad)


def generated_records(
    spec,
    base: nn.Module,
    tokenizer: Tokenizer,
    base_meta: dict,
    *,
    root: str | Path,
    max_new_tokens: int,
    batch: int,
    held_out: int = 0,
    questions: list[Question] | None = None,
    template=None,
    shipped: str | Path | None = None,
) -> list[dict]:
    """The answered turns of spec.windows training turns (spec.questions: the bank's questions, the base's own,
    or both) whose prompts fit in spec.prompt_len tokens; held_out=n: instead, every turn of the first n of the
    bank's held-out questions that fits. Answers missing under root are generated first, a shard of questions at a
    time, until there are enough (self questions, once, before them); answers shipped with the repository
    (shipped/, experiments/lib/training/shipped.py) are copied in before any is generated. `questions` and
    `template` replace the bank and the base's chat template (tests)."""
    template = template or chat_template_for(base_meta)
    bank = questions if questions is not None else bank_questions()
    train, val = split_questions(bank)
    if held_out and not 1 <= held_out <= len(val):
        raise ValueError(f"{held_out} held-out questions asked: there are {len(val)} (eval_blocks at most that)")
    dtype, decoder = answer_dtype(next(base.parameters()).device), None
    if not held_out and spec.questions != "bank":
        decoder = cast_copy(base, dtype)
        categories = BANK_CATEGORIES if spec.self_steering else ()
        n = spec.self_questions or (spec.windows if spec.questions == "self" else -(-spec.windows // 2))
        sspec = SelfQuestionSpec(base_fingerprint=spec.base_fingerprint, n=n, dtype=dtype, seed=spec.seed,
                                 categories=categories)  # fmt: skip
        own = self_questions(decoder, tokenizer, template, sspec, root=root, batch=batch, follow_ups=True)
        train = own if spec.questions == "self" else mix_questions(train, own)
    pool = val[:held_out] if held_out else train
    aspec = answer_spec(spec, base_meta, next(base.parameters()).device, max_new_tokens=max_new_tokens)
    if shipped is not None:
        seed_answers(shipped, root, aspec)
    answers = Answers(root, aspec, pool, template, tokenizer)
    size, wanted = aspec.shard_questions, len(pool) if held_out else spec.windows

    def answered(count: int) -> list[dict]:
        """Every fitting turn of pool[:count], the questions not answered yet answered first."""
        nonlocal decoder
        got = answers.find(range(count))
        missing = [j for j in range(count) if j not in got]
        if missing:
            decoder = decoder or cast_copy(base, aspec.dtype)
            generate_answers(answers.directory, decoder, tokenizer, template, pool, aspec, indices=missing,
                             batch=batch)  # fmt: skip
            got.update(answers.find(missing))
        return [r for j in range(count) for r in got[j] if len(r["prompt"]) <= spec.prompt_len]

    # the turns answered already may hold enough windows without their count in questions (one or two a question)
    records = None if held_out else answered_prefix(answers, wanted, prompt_len=spec.prompt_len)
    count = min(len(pool), wanted)
    while records is None:
        count = min(len(pool), -(-count // size) * size)  # whole shards of questions
        found = answered(count)
        if len(found) >= wanted or count == len(pool):
            records = found
            break
        # at the rate seen so far, would the questions left give enough? (else say so now, not after answering all)
        if not held_out and len(found) * len(pool) < wanted * count:
            records = found
            break
        count = max(count + size, -(-count * wanted * 11 // (10 * len(found))))  # the rate, +10%
    if not held_out and len(records) < spec.windows:
        raise ValueError(
            f"features.windows={spec.windows}: {count} of the {len(pool)} training questions gave only "
            f"{len(records)} answered turns whose prompts fit in features.prompt_len={spec.prompt_len} tokens, too "
            "few at that rate; ask for fewer windows or allow longer prompts"
            + (f" or set features.self_questions (now {spec.self_questions})" if spec.questions != "bank" else "")
        )
    adopted = f" ({answers.adopted} questions' answers from format-1 directories)" if answers.adopted else ""
    log.info("%d answered turns from %s%s", len(records), answers.directory, adopted)
    return records if held_out else records[:wanted]
