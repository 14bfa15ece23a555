"""A prompts file that is not one, or whose turns are not texts, is named for what it is in one line
(experiments/lib/data/prompts.py: read_questions, what benchmark, generate and the question bank read)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from experiments.lib.data.prompts import read_questions


@pytest.mark.parametrize("kind", ["fifo", "device", "directory"])
def test_a_prompts_path_that_is_no_regular_file_is_named_for_what_it_is(tmp_path: Path, kind: str) -> None:
    if kind == "fifo":
        path, what = tmp_path / "prompts.jsonl", "a FIFO"
        os.mkfifo(path)  # reading it would block until a writer came
    elif kind == "device":
        path, what = Path(os.devnull), "a character device"
    else:
        path, what = tmp_path / "prompts.jsonl", "a directory"
        path.mkdir()
    with pytest.raises(ValueError) as excinfo:
        read_questions(str(path))
    expected = f"prompts file {str(path)!r} is not a regular file ({what}): give a .jsonl or text file"
    assert str(excinfo.value) == expected


def test_a_missing_prompts_file_is_still_said_not_to_exist(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_questions(str(tmp_path / "nothing.jsonl"))


@pytest.mark.parametrize(
    "turns, fragment",
    [
        ([1, 2], "turn 1 is 1, a int: 'turns' must be strings"),
        (["fine", None], "turn 2 is None, a NoneType: 'turns' must be strings"),
        (["fine", "  "], "turn 2='  ': give a non-empty text"),  # a string that is blank: still called empty
    ],
)
def test_turns_that_are_not_texts_are_named_as_such(tmp_path: Path, turns: list, fragment: str) -> None:
    path = tmp_path / "questions.jsonl"
    path.write_text(json.dumps({"category": "qa", "turns": turns}) + "\n")
    with pytest.raises(ValueError) as excinfo:
        read_questions(str(path))
    assert fragment in str(excinfo.value) and "line 1" in str(excinfo.value) and "\n" not in str(excinfo.value)
