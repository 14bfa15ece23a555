"""The prompts a decoding entry point runs, with their categories: held-out windows of the base's corpus, a
user's prompts file (plain, or Spec-Bench's question.jsonl), or the embedded chat set (prompts.set=chat_mix);
raw text, or rendered with the base's chat template (prompts.chat=true), first turns, and with
prompts.turns=2 also second turns after the model's own first answer (as Spec-Bench and MT-bench ask).
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from experiments.lib.data.chat import ChatTemplate, chat_template_for, second_turns
from experiments.lib.data.chat_mix import chat_mix_questions
from experiments.lib.data.pipeline import base_data_config, prepare_data
from experiments.lib.data.prompts import Question, heldout_prompts, read_questions, select_questions
from experiments.lib.store.checkpoint import tokenizer_mismatch

__all__ = [
    "HELDOUT",
    "PROMPT_SETS",
    "PromptSet",
    "add_second_turns",
    "check_pilot_room",
    "get_prompt_set",
    "get_prompts",
]

HELDOUT = "heldout"  # the category of held-out corpus windows
PROMPT_SETS = ("chat_mix",)  # embedded sets, by prompts.set


@dataclass
class PromptSet:
    ids: list[list[int]]  # token ids of every prompt, in order
    categories: list[str]  # the category of each
    questions: list[Question] | None  # the questions the first turns came from; None for held-out windows
    template: ChatTemplate | None  # the chat template that rendered them, with prompts.chat=true
    turns: list[int]  # which turn each prompt is (1, or 2 with prompts.turns=2)


def _questions(cfg: DictConfig) -> list[Question] | None:
    if cfg.prompts.get("set") == "chat_mix":
        return chat_mix_questions()
    if cfg.prompts.file:
        return read_questions(cfg.prompts.file)
    return None


def _heldout(cfg: DictConfig, tokenizer, base_meta: dict) -> list[list[int]]:
    data = prepare_data(**base_data_config(base_meta, OmegaConf.to_container(cfg.data, resolve=True)))
    if data.tokenizer.to_str() != tokenizer.to_str():
        raise ValueError(
            tokenizer_mismatch("the data config", data.tokenizer, tokenizer, "pass the base's data config")
        )
    return heldout_prompts(data, num_prompts=cfg.prompts.num_prompts, prompt_len=cfg.prompts.prompt_len, seed=cfg.seed)


def get_prompt_set(cfg: DictConfig, tokenizer, base_meta: dict) -> PromptSet:
    """First turns: prompts.num_prompts questions of the file or set (round-robin over its categories), or
    held-out windows of the base's own corpus (prompt_len tokens each, drawn with cfg.seed)."""
    questions = _questions(cfg)
    chat = bool(cfg.prompts.get("chat", False))
    if questions is None:
        if chat:
            raise ValueError(
                "prompts.chat=true: held-out corpus windows are not questions; "
                "give prompts.file=... or prompts=chat_mix"
            )
        ids = _heldout(cfg, tokenizer, base_meta)
        return PromptSet(ids, [HELDOUT] * len(ids), None, None, [1] * len(ids))
    questions = select_questions(questions, cfg.prompts.num_prompts)
    if chat:
        template = chat_template_for(base_meta, system=cfg.prompts.get("system"))
        ids = [template.encode(tokenizer, [q.turns[0]]) for q in questions]
    else:
        template = None
        ids = [enc.ids for enc in tokenizer.encode_batch([q.turns[0] for q in questions], add_special_tokens=False)]
    return PromptSet(ids, [q.category for q in questions], questions, template, [1] * len(ids))


def check_pilot_room(cfg: DictConfig) -> None:
    """budget=auto's pilots decode questions of the same file or set that no benchmark prompt is (the benchmark
    takes prompts.num_prompts of them, the pilots the next ones): refuse, before any work, a file or set that
    prompts.num_prompts leaves nothing of. Not the training question bank instead: the drafters learned from
    its answers, so a pilot there would overstate their acceptance and pick budgets too large. Held-out
    corpus windows (no file, no set) are drawn afresh and never run out."""
    questions = _questions(cfg)
    if questions is None or len(questions) > cfg.prompts.num_prompts:
        return
    source = f"prompts.file={cfg.prompts.file!r}" if cfg.prompts.get("file") else f"prompts.set={cfg.prompts.set!r}"
    raise ValueError(
        f"budget=auto: {source} holds {len(questions)} questions and prompts.num_prompts={cfg.prompts.num_prompts} "
        f"benchmarks every one, leaving none for its pilot runs; give prompts.num_prompts={len(questions) - 1} or "
        "fewer, or budget=fixed"
    )


def get_prompts(cfg: DictConfig, tokenizer, base_meta: dict) -> list[list[int]]:
    """The token ids of get_prompt_set's first turns."""
    return get_prompt_set(cfg, tokenizer, base_meta).ids


def add_second_turns(prompts: PromptSet, tokenizer, *, target, max_new_tokens: int, eos_id) -> PromptSet:
    """prompts.turns=2: the set with every question's second turn appended (after the model's own greedy
    answer to the first, decoded with plain decoding on `target`), each in its question's category."""
    asked, ids = second_turns(
        prompts.questions,
        prompts.ids,
        prompts.template,
        tokenizer,
        target=target,
        max_new_tokens=max_new_tokens,
        eos_id=eos_id,
    )
    return PromptSet(
        prompts.ids + ids,
        prompts.categories + [q.category for q in asked],
        prompts.questions,
        prompts.template,
        prompts.turns + [2] * len(ids),
    )
