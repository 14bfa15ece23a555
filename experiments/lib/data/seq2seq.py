"""A sequence-to-sequence task from the embedded corpus: a stdlib function (its code, docstring removed)
-> the first paragraph of its docstring.

Pairs come from `ast` over the same files `experiments.lib.data.pipeline.prepare_data` reads, and a pair is held out
iff its file is one of that data's validation files: the same file-level split as the base LM, and the
tokenizer (trained on the training split only) never saw a held-out pair. The first paragraph rather
than the whole docstring: it is the summary (a few dozen tokens), where the rest is often a long
argument list that a few minutes of CPU training cannot learn.
"""

from __future__ import annotations

import ast
import sysconfig
import textwrap
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from experiments.lib.data.id_cache import PreparedData
from experiments.lib.data.sources import stdlib_files


@dataclass
class Pairs:
    sources: list[list[int]]  # function code token ids, at most max_source_tokens each
    targets: list[list[int]]  # docstring summary token ids, EOS last, at most max_target_tokens each
    names: list[str]  # "file.py:function" per pair, for reports


def function_docstrings(text: str) -> list[tuple[str, str, str]]:
    """(function name, code without its docstring, first paragraph of the docstring) for every function
    in a module's text that has a docstring and a body after it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in old files: not our business
            tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        first = node.body[0]
        # The docstring must sit on its own lines, and something must follow it, or there is no task.
        if not doc or len(node.body) < 2 or first.lineno == node.lineno:
            continue
        code = lines[node.lineno - 1 : first.lineno - 1] + lines[first.end_lineno : node.end_lineno]
        summary = doc.strip().split("\n\n")[0].strip()
        if summary:
            found.append((node.name, textwrap.dedent("".join(code)), summary))
    return found


def seq2seq_pairs(
    data: PreparedData, *, max_source_tokens: int, max_target_tokens: int, max_files: int | None = None
) -> tuple[Pairs, Pairs]:
    """(train, validation) pairs from the stdlib, tokenized with `data.tokenizer`, split by `data.val_files`.
    `max_files` must be the data's own (the first files in the corpus's order, as prepare_data takes them).

    Sources longer than max_source_tokens are cut (the signature and the start of the body survive);
    pairs whose summary + EOS exceeds max_target_tokens are dropped (a cut summary teaches nothing)."""
    if max_source_tokens < 1 or max_target_tokens < 2:
        raise ValueError(
            f"max_source_tokens={max_source_tokens}, max_target_tokens={max_target_tokens}: need >= 1 and >= 2"
        )
    root = Path(sysconfig.get_paths()["stdlib"])
    val_files = set(data.val_files)
    split: dict[bool, list[tuple[str, str, str]]] = {False: [], True: []}
    for path in stdlib_files()[:max_files]:
        name = path.relative_to(root).as_posix()
        text = path.read_bytes().decode("utf-8", errors="replace")
        split[name in val_files] += [(f"{name}:{fn}", code, doc) for fn, code, doc in function_docstrings(text)]
    return tuple(_tokenize(split[held_out], data, max_source_tokens, max_target_tokens) for held_out in (False, True))


def _tokenize(found: list[tuple[str, str, str]], data: PreparedData, max_source: int, max_target: int) -> Pairs:
    encode = lambda texts: [e.ids for e in data.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]  # noqa: E731
    codes, docs = encode([c for _, c, _ in found]), encode([d for _, _, d in found])
    pairs = Pairs([], [], [])
    for (name, _, _), code, doc in zip(found, codes, docs):
        if code and len(doc) + 1 <= max_target:
            pairs.sources.append(code[:max_source])
            pairs.targets.append(doc + [data.eos_id])
            pairs.names.append(name)
    return pairs


def pad_batch(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows -> (b, W) right-padded with `pad`, and the mask (b, W) of real tokens."""
    width = max(len(r) for r in rows)
    tokens = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return tokens, torch.arange(width) < torch.tensor([len(r) for r in rows])[:, None]
