"""Chat prompts for instruct models: a conversation rendered with the model's own chat template.

An instruct model (SmolLM2-135M-Instruct) is trained on conversations in a fixed format
(`<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n`); given raw text it continues it as a base
model would, which is not how it is used. `prompts.chat=true` renders each prompt as the user's turn of a
conversation (with an optional system prompt; without one, whatever the template adds by itself) and
ends it where the assistant's answer begins. The template is the Jinja one that ships with the model
directory (`chat_template.jinja` or tokenizer_config.json's `chat_template`), rendered by transformers'
`apply_chat_template`, so the prompt is exactly what `generate` users feed the model. The rendered text is
then tokenized with the template's own special tokens recognised (its `<|im_start|>` must be one token, not its
characters) while the messages' text stays text: a user who types "<|im_start|>" (or an answer that writes it)
gets those characters, never a turn marker, as corpus text does.

A second turn (Spec-Bench and MT-bench ask two) needs the model's own first answer: `second_turns`
decodes it greedily with plain decoding, then renders [user 1, assistant's answer, user 2].
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from experiments.lib.data.prompts import Question
from verify.common.numerics import EosId
from verify.loop.plain import plain_generate
from verify.loop.sampling import SamplingConfig

__all__ = ["ChatTemplate", "chat_template_for", "encode_conversation", "encode_special", "second_turns"]

USER_MARK = "USER-TURN-7f3c"  # text no template writes by itself: where the next user turn's content starts
CONTENT_MARK = "MESSAGE-7f3c-{}-END"  # the same, standing for message i's text while the template renders


def encode_special(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of `text` with the tokenizer's special tokens parsed as such (the project's tokenizers
    encode them as text by default, see experiments/lib/data/tokenizer.py configure_tokenizer)."""
    before = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = False
    try:
        return tokenizer.encode(text, add_special_tokens=False).ids
    finally:
        tokenizer.encode_special_tokens = before


def _plain(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of `text` with every special-token string in it encoded as its characters."""
    before = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = True
    try:
        return tokenizer.encode(text, add_special_tokens=False).ids if text else []
    finally:
        tokenizer.encode_special_tokens = before


def encode_conversation(tokenizer: Tokenizer, segments: list[tuple[str, bool]]) -> list[int]:
    """Token ids of the concatenated segments (text, is_message): special-token strings are special tokens in the
    template's segments and plain text in the messages'. The text between two of the template's special tokens is
    encoded as one piece, as encode_special encodes it (so a conversation whose messages hold no special-token
    string gets encode_special's very ids), whatever message boundaries lie inside it."""
    specials = sorted((t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special), key=len)
    found = re.compile("|".join(re.escape(t) for t in reversed(specials))) if specials else None
    ids: list[int] = []
    piece: list[str] = []
    for text, is_message in segments:
        at = 0
        for match in () if is_message or found is None else found.finditer(text):
            piece.append(text[at : match.start()])
            ids += _plain(tokenizer, "".join(piece)) + [tokenizer.token_to_id(match.group())]
            piece, at = [], match.end()
        piece.append(text[at:])
    return ids + _plain(tokenizer, "".join(piece))


class ChatTemplate:
    """The chat template of a Hugging Face model directory."""

    def __init__(self, directory: str | Path, *, system: str | None = None):
        from transformers import AutoTokenizer  # the hf extra: only a Hugging Face model has a template

        self.directory, self.system = str(directory), system
        self.hf = AutoTokenizer.from_pretrained(self.directory, local_files_only=True)
        if not getattr(self.hf, "chat_template", None):
            raise ValueError(
                f"prompts.chat=true: the base {self.directory} has no chat template (not an instruct model); "
                "use prompts.chat=false"
            )
        if system is not None and (not isinstance(system, str) or not system.strip()):
            raise ValueError(f"prompts.system={system!r}: give a non-empty text, or null for the template's own")

    def messages(self, turns: list[str], answers: list[str], *, system: str | None = None) -> list[dict[str, str]]:
        """[system?, user 1, assistant 1, ..., user n]: len(answers) == len(turns) - 1; `system` replaces the
        template's system prompt (None: self.system)."""
        system = self.system if system is None else system
        out = [{"role": "system", "content": system}] if system is not None else []
        for i, turn in enumerate(turns):
            out.append({"role": "user", "content": turn})
            if i < len(answers):
                out.append({"role": "assistant", "content": answers[i]})
        return out

    def render(self, turns: list[str], answers: list[str] = ()) -> str:
        """The conversation as text, ending where the assistant's next answer begins."""
        messages = self.messages(list(turns), list(answers))
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, tokenizer: Tokenizer, turns: list[str], answers: list[str] = ()) -> list[int]:
        """Token ids of render(turns, answers), the messages' text encoded as text (see encode_conversation)."""
        return self._encode(tokenizer, self.messages(list(turns), list(answers)), generation=True)

    def _encode(
        self, tokenizer: Tokenizer, messages: list[dict[str, str]], *, generation: bool, cut: str = ""
    ) -> list[int]:
        """The messages rendered, cut where `cut` starts (if given), then encoded with their text as text: each
        message's text is rendered as a marker first, so the template's own text is told from the messages'."""
        marked = [{**m, "content": CONTENT_MARK.format(i)} for i, m in enumerate(messages)]
        text = self.hf.apply_chat_template(marked, tokenize=False, add_generation_prompt=generation)
        text = text[: text.index(cut)] if cut else text
        parts = re.split(CONTENT_MARK.format("([0-9]+)"), text)  # template, index, template, index, ..., template
        segments = [
            (part, False) if k % 2 == 0 else (messages[int(part)]["content"], True) for k, part in enumerate(parts)
        ]
        real = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
        if not real.startswith("".join(t for t, _ in segments)):  # a template that rewrites the messages' text
            raise ValueError(f"the chat template of {self.directory} changes the messages' text: not supported")
        return encode_conversation(tokenizer, segments)

    def user_prefix(
        self, tokenizer: Tokenizer, turns: list[str] = (), answers: list[str] = (), *, system: str | None = None
    ) -> list[int]:
        """Token ids of the conversation so far (len(answers) == len(turns)) and the opening of the user's next
        turn (`<|im_start|>user\\n`), exactly as the template renders it: what an instruct model continues with a
        question of its own (Magpie). `system` replaces the prompt's system text (None: the template's own)."""
        if len(answers) != len(turns):
            raise ValueError(f"{len(turns)} turns and {len(answers)} answers: the next user turn follows an answer")
        if system is not None and (not isinstance(system, str) or not system.strip()):
            raise ValueError(f"system={system!r}: give a non-empty text, or None for the template's own")
        # rendered with a marker as the next user turn, then cut where the marker starts
        messages = self.messages([*turns, USER_MARK], list(answers), system=system)
        return self._encode(tokenizer, messages, generation=False, cut=CONTENT_MARK.format(len(messages) - 1))


def chat_template_for(base_meta: dict[str, Any], *, system: str | None = None) -> ChatTemplate:
    """The chat template of the base a checkpoint's meta describes; a one-line ValueError for a base that has
    none (the project's own bases are trained on raw text)."""
    config = base_meta.get("model_config") or {}
    if config.get("arch") != "hf":
        raise ValueError(
            "prompts.chat=true: this base is one of the project's own (trained on raw text, no chat template); "
            "use prompts.chat=false, or a Hugging Face instruct model such as base=smollm2"
        )
    return ChatTemplate(config["path"], system=system)


def second_turns(
    questions: list[Question],
    first: list[list[int]],
    template: ChatTemplate,
    tokenizer: Tokenizer,
    *,
    target,
    max_new_tokens: int,
    eos_id: EosId,
) -> tuple[list[Question], list[list[int]]]:
    """(the questions that have a second turn, the token ids of their second-turn prompts): the model's
    greedy answer to the first turn (`first[i]` the ids of question i's first-turn prompt), then turn 2."""
    asked = [(q, ids) for q, ids in zip(questions, first) if len(q.turns) > 1]
    prompts = []
    for q, ids in asked:
        out = plain_generate(target, [ids], max_new_tokens=max_new_tokens, sampling=SamplingConfig(), eos_id=eos_id)
        answer = tokenizer.decode(out.tokens[0], skip_special_tokens=True).strip()
        prompts.append(template.encode(tokenizer, list(q.turns[:2]), [answer]))
    return [q for q, _ in asked], prompts
