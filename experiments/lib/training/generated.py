"""Regenerated training data (`features.source=generated`): the frozen base's own answers to chat prompts.

A drafter learns to guess what the base will write. A corpus is text the base did not write: its tokens and
style differ from the base's answers (an instruct model answers in markdown, with its own phrases), so a
drafter trained on it learns the wrong distribution at the positions that matter. Medusa-2 and EAGLE
therefore train on the base's answers to chat prompts. Here the prompts are experiments/lib/data/chat_train.py's
questions (stdlib training files only, disjoint from every benchmark prompt), rendered with the base's own chat
template; the base answers half of the windows greedily and half at temperature 1 (alternate batches), since
drafting must serve both. The feature cache stores each window [prompt + answer] like any other, with the
teacher's outputs at every position, so shards stay resumable: a batch's answers depend only on its prompts
and its seed.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from experiments.lib.data.chat import chat_template_for
from experiments.lib.data.chat_train import chat_train_questions
from verify.backends.choose import make_target
from verify.loop.plain import plain_generate
from verify.loop.sampling import SamplingConfig

__all__ = ["answer_windows", "generation_prompts", "window_temperature"]


def generation_prompts(spec, tokenizer, base_meta: dict) -> list[list[int]] | None:
    """The chat prompts (token ids) the base answers for `spec`'s windows, or None when spec.source is not
    `generated`. A question whose prompt is longer than spec.prompt_len tokens is skipped, so every window keeps
    at least seq_len + 1 - prompt_len tokens of answer."""
    if spec.source != "generated":
        return None
    template = chat_template_for(base_meta)
    prompts: list[list[int]] = []
    for _, question in chat_train_questions():
        ids = template.encode(tokenizer, [question])
        if len(ids) <= spec.prompt_len:
            prompts.append(ids)
        if len(prompts) == spec.windows:
            break
    if len(prompts) < spec.windows:
        raise ValueError(
            f"features.windows={spec.windows}: only {len(prompts)} training questions fit in features.prompt_len="
            f"{spec.prompt_len} tokens; ask for fewer windows or allow longer prompts"
        )
    # Batches of similar lengths waste fewer generated tokens (a batch generates for its shortest prompt).
    return sorted(prompts[: spec.windows], key=len)


def window_temperature(batch_index: int) -> float:
    """Even batches are answered greedily, odd ones at temperature 1."""
    return 0.0 if batch_index % 2 == 0 else 1.0


@torch.no_grad()
def answer_windows(base: nn.Module, prompts: list[list[int]], *, seq_len: int, temperature: float, seed: int) -> Tensor:
    """(B, seq_len + 1) windows: each prompt followed by the base's answer, cut to seq_len + 1 tokens. The base
    is not stopped at its end-of-turn token: what it writes after it is its own text too."""
    longest = seq_len + 1 - min(len(p) for p in prompts)
    device = next(base.parameters()).device
    out = plain_generate(
        make_target(base),
        prompts,
        max_new_tokens=longest,
        sampling=SamplingConfig(temperature=temperature),
        generator=torch.Generator(device=device).manual_seed(seed),
    ).tokens
    rows = [(p + answer)[: seq_len + 1] for p, answer in zip(prompts, out)]
    return torch.tensor(rows, dtype=torch.long, device=device)
