"""Training questions for regenerated data: chat prompts the base answers, disjoint from every benchmark prompt.

Medusa-2 and EAGLE train their heads on the base's own answers to chat prompts (ShareGPT questions answered
again by the base) rather than on a corpus: the drafter then learns the text it will really draft, in the
base's own style. `features.source=generated` does the same here, and this module supplies the questions.

They are built with the templates of the embedded chat set (experiments/lib/data/chat_mix.py), from text of
the stdlib corpus's TRAINING files only, so no benchmark prompt, and no text a benchmark prompt quotes, is ever
in them (chat_mix quotes validation files, installed packages' METADATA and the stdlib's pydoc_data topics;
none of those is used here):
- coding / explanation / documentation: a training-file function, as chat_mix's templates put it;
- qa: "What does the function <module>.<name> do?" about a training-file function;
- summarization / rag: a prose passage of a training module's docstring, to summarize or to answer from.
Categories take turns, and within a category candidates come in the order of a hash of their key, so the
list is the same on every machine with the same Python; its first n questions are used.
"""

from __future__ import annotations

import ast
import functools
import sysconfig
import warnings
from pathlib import Path

from experiments.lib.data.chat_mix import STDLIB_VAL_FRACTION, code_question, passage, rank, stdlib_functions
from experiments.lib.data.sources import is_validation, stdlib_files

__all__ = ["TRAIN_CATEGORIES", "chat_train_questions"]

TRAIN_CATEGORIES = ("coding", "explanation", "documentation", "qa", "summarization", "rag")


def _module_docs() -> dict[str, tuple[str, str]]:
    """Training-file module path -> (dotted module name, a prose passage of its docstring)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = {}
    for path in stdlib_files():
        name = path.relative_to(root).as_posix()
        if is_validation(name, STDLIB_VAL_FRACTION):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                doc = ast.get_docstring(ast.parse(path.read_bytes().decode("utf-8", errors="replace")))
        except (SyntaxError, ValueError):
            continue
        text = passage(doc or "", prose_only=True)
        if text:
            found[name] = (name.removesuffix(".py").removesuffix("/__init__").replace("/", "."), text)
    return found


@functools.cache  # chat_train_questions(n) for every n reads the same lists: built once per process
def _by_category() -> dict[str, list[str]]:
    functions = stdlib_functions(validation=False)
    keys = sorted(functions, key=rank)
    code = {c: [code_question(c, functions[k]) for k in keys[i::4]] for i, c in enumerate(TRAIN_CATEGORIES[:3])}
    module = lambda k: k.split(":")[0].removesuffix(".py").replace("/", ".")  # noqa: E731
    code["qa"] = [
        f"What does the Python function {module(k)}.{functions[k][0]} do? Explain it briefly, with an example."
        for k in keys[3::4]
    ]
    docs = _module_docs()
    doc_keys = sorted(docs, key=rank)
    code["summarization"] = [
        f"Summarize the following documentation of the Python module {docs[k][0]} in a few sentences:\n\n{docs[k][1]}"
        for k in doc_keys[0::2]
    ]
    code["rag"] = [
        f"Answer using only the documentation below.\n\nDocumentation:\n{docs[k][1]}\n\n"
        f"Question: what is the module {docs[k][0]} for, according to this documentation?"
        for k in doc_keys[1::2]
    ]
    return code


def chat_train_questions(n: int | None = None) -> list[tuple[str, str]]:
    """The first n (category, question) pairs (None: all), categories taking turns while each has questions
    left."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"n={n!r}: the number of training questions must be an integer >= 1")
    texts = _by_category()
    out: list[tuple[str, str]] = []
    for i in range(max(len(v) for v in texts.values())):
        out += [(c, texts[c][i]) for c in TRAIN_CATEGORIES if i < len(texts[c])]
    if n is not None and len(out) < n:
        raise ValueError(f"n={n}: this Python's stdlib gives only {len(out)} training questions")
    return out if n is None else out[:n]
