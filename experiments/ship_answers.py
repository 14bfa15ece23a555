"""Ship answer directories with the repository, so that later machines start from them instead of generating again.

    python -m experiments.ship_answers .cache/answers/<key>

Each directory's shards (a shard that exists is whole) are gzipped under results/answers/<its name>/
(experiments/lib/training/shipped.py; `--out DIR` ships elsewhere). A run with features.source=generated copies every
shipped directory of its setting into features.answers_root before it generates any answer
(features.answers_shipped, default results/answers). Then commit results/answers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from experiments.lib.training.answers import answer_records, shards_written
from experiments.lib.training.shipped import ship_answers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.ship_answers", description=__doc__.split("\n")[0])
    parser.add_argument("directories", nargs="+", type=Path, help="answer directories (under .cache/answers)")
    parser.add_argument("--out", type=Path, default=Path("results/answers"), help="where to ship (results/answers)")
    args = parser.parse_args(argv)
    for directory in args.directories:  # every one checked before any is packed
        if not (directory / "meta.json").is_file():
            print(f"error: {directory}: not an answer directory (no meta.json)", file=sys.stderr)
            return 2
    for directory in args.directories:
        try:
            out = ship_answers(directory, args.out)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        shards = shards_written(directory)
        records = list(answer_records(directory))
        tokens = sum(len(r["answer"]) for r in records)
        size = sum(p.stat().st_size for p in out.iterdir())
        questions = len({r.get("key", r["index"]) for r in records})  # format 1: one list, its positions
        print(f"{out}: {shards} shards, {questions:,} questions, {len(records):,} answered "
              f"turns, {tokens:,} answer tokens, {size / 1e6:.1f} MB")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
