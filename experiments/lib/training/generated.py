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

The bank's last VALIDATION_QUESTIONS questions are answered too but never trained on: validation and
best-checkpoint selection run on those held-out answers.

`features.questions` chooses what is answered for training: the bank's other questions (`bank`), the base's own
questions (`self`: experiments/lib/data/self_questions.py, sampled once from its user-turn prefix and cached beside
the answers; a quarter of them get a second turn the base writes itself after its answer), or the two taking
turns (`mix`). Validation stays on the bank's held-out questions whatever the choice, and their answers are
shared: a run on self questions is measured on the same held-out answers as one on the bank.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import Tensor, nn

from experiments.lib.data.chat import chat_template_for
from experiments.lib.data.prompts import Question
from experiments.lib.data.question_bank import BANK_CATEGORIES, bank_questions
from experiments.lib.data.self_questions import SelfQuestionSpec, self_questions
from experiments.lib.training.answers import AnswerSpec, answer_records, generate_answers, shards_written
from experiments.lib.training.precision import cast_copy, native_bf16
from experiments.lib.training.shipped import seed_answers

__all__ = [
    "VALIDATION_QUESTIONS", "answer_spec", "conversation_windows", "generated_windows", "mix_questions",
    "shards_enough", "split_questions",
]  # fmt: skip

log = logging.getLogger(__name__)
VALIDATION_QUESTIONS = 96  # the bank's last questions: answered for validation, never trained on


def split_questions(questions: list[Question]) -> tuple[list[Question], list[Question]]:
    """(training questions, held-out questions): the last VALIDATION_QUESTIONS are held out."""
    if len(questions) <= VALIDATION_QUESTIONS:
        raise ValueError(f"{len(questions)} questions: need more than the {VALIDATION_QUESTIONS} held out")
    return questions[:-VALIDATION_QUESTIONS], questions[-VALIDATION_QUESTIONS:]


def questions_key(questions: list[Question]) -> str:
    """Names a question list by its content: answers to another bank are other answers."""
    text = "\n\n".join("\n".join(q.turns) for q in questions)
    return f"{len(questions)}-" + hashlib.sha256(text.encode()).hexdigest()[:12]


def mix_questions(train: list[Question], own: list[Question]) -> list[Question]:
    """Bank and self questions taking turns (bank first) while both last, then the rest of the longer list: the
    first k windows of a run hold about k / 2 of each."""
    mixed = [q for pair in zip(train, own) for q in pair]
    return mixed + train[len(own) :] + own[len(train) :]


def answer_dtype(device: torch.device) -> str:
    """bf16 where the device computes it natively (batched bf16 decoding of SmolLM2 ran several times faster than
    fp32 here), else fp32: what the base answers (and asks its own questions) in."""
    return "bf16" if native_bf16(device)[0] else "fp32"


def answer_spec(spec, base_meta: dict, device: torch.device, *, max_new_tokens: int, questions: str) -> AnswerSpec:
    """The answers `spec`'s windows come from, decoded in answer_dtype(device)."""
    dtype = answer_dtype(device)
    return AnswerSpec(
        base_fingerprint=spec.base_fingerprint, questions=questions, max_new_tokens=max_new_tokens, dtype=dtype,
        seed=spec.seed,
    )  # fmt: skip


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


def shards_enough(directory: Path, wanted: int, *, prompt_len: int, size: int) -> int:
    """The fewest written shards (counted from the first) whose answered turns with prompts <= prompt_len tokens
    number `wanted`; 0 when the written ones hold fewer. The windows are those turns' first `wanted` in question
    order whatever shards follow, so reading only these shards changes no window."""
    if not (directory / "meta.json").exists():
        return 0
    found = 0
    for record in answer_records(directory, shards=shards_written(directory)):
        found += len(record["prompt"]) <= prompt_len
        if found == wanted:
            return record["index"] // size + 1
    return 0


def generated_windows(
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
) -> tuple[Tensor, Tensor]:
    """The windows and masks of spec.windows answered turns of training questions (spec.questions: the bank's,
    the base's own, or both) whose prompts fit in spec.prompt_len tokens; held_out=n: instead, those of the first
    n of the bank's held-out questions (each turn). Answers missing from root/<answer spec key> are generated
    first, a shard of questions at a time, until there are enough (self questions, once, before them).
    Answers shipped with the repository (shipped/<answer key>, experiments/lib/training/shipped.py) are copied in
    before any is generated. `questions` and `template` replace the bank and the base's chat template (tests)."""
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
    # the answer directory is named by every question listed, held-out ones included: validation answers are the
    # bank's whatever spec.questions is, so every source shares them
    listed = bank if held_out else train + val
    pool = val[:held_out] if held_out else train
    aspec = answer_spec(spec, base_meta, next(base.parameters()).device, max_new_tokens=max_new_tokens,
                        questions=questions_key(listed))  # fmt: skip
    directory = Path(root) / (aspec.key() + (f"-val{held_out}" if held_out else ""))
    if shipped is not None:
        seed_answers(shipped, directory)
    wanted = len(pool) if held_out else spec.windows
    # a question gives one or two windows: shards already written may hold enough without their count in questions
    enough = 0 if held_out else shards_enough(directory, wanted, prompt_len=spec.prompt_len, size=aspec.shard_questions)
    count = enough * aspec.shard_questions or min(len(pool), wanted)
    while True:
        shards = -(-count // aspec.shard_questions)
        if not (directory / "meta.json").exists() or shards_written(directory) < shards:
            decoder = decoder or cast_copy(base, aspec.dtype)
            generate_answers(directory, decoder, tokenizer, template, pool[: shards * aspec.shard_questions], aspec,
                             batch=batch)  # fmt: skip
        records = [r for r in answer_records(directory, shards=shards) if len(r["prompt"]) <= spec.prompt_len]
        asked = min(len(pool), shards * aspec.shard_questions)
        if len(records) >= wanted or asked == len(pool):
            break
        # at the rate seen so far, would the questions left give enough? (else say so now, not after answering all)
        if not held_out and len(records) * len(pool) < wanted * asked:
            break
        count = max(asked + aspec.shard_questions, -(-asked * wanted * 11 // (10 * len(records))))  # the rate, +10%
    if not held_out and len(records) < spec.windows:
        raise ValueError(
            f"features.windows={spec.windows}: {asked} of the {len(pool)} training questions gave only "
            f"{len(records)} answered turns whose prompts fit in features.prompt_len={spec.prompt_len} tokens, too "
            "few at that rate; ask for fewer windows or allow longer prompts"
            + (f" or set features.self_questions (now {spec.self_questions})" if spec.questions != "bank" else "")
        )
    log.info("%d answered turns from %s", len(records), directory)
    pad = tokenizer.token_to_id("<|im_end|>") if tokenizer.token_to_id("<|im_end|>") is not None else 0
    return conversation_windows(records if held_out else records[:wanted], seq_len=spec.seq_len, pad_id=pad)
