"""Ship trained drafters with the repository: trimmed bf16 copies that `make demo`, generate and the benchmark load as
the shipped_<method> methods (experiments/lib/store/shipped_drafters.py).

    python -m experiments.ship_drafters sequential=outputs/smollm2_reference_kernel/sequential/checkpoint \\
        medusa=outputs/smollm2_reference_kernel/medusa/checkpoint --command "bash experiments/smollm2_reference.sh"

Each <family>=<checkpoint> is written to results/drafters/<family>/ (`--out DIR` elsewhere): the weights, the meta with
the command that trained it (`--command`) and its minutes, and SHA256SUMS. Each copy is then loaded on the base it was
trained on and checked to hold its source's weights in bf16 wherever the drafter reads them, before any replaces what
was shipped; every checkpoint is checked before any is written, and the copies together must stay within 40 MB.
Then commit results/drafters.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

from experiments.lib.families.registry import load_drafter
from experiments.lib.store.checkpoint import CheckpointError, load_lm, read_meta
from experiments.lib.store.shipped_drafters import (
    LIMIT_BYTES,
    SHIPPABLE,
    check_shippable,
    copy_bytes,
    shipped_size,
    stage,
    swap_in,
    trimmed_copy,
)


def parse_pairs(pairs: list[str]) -> dict[str, Path]:
    """["family=dir", ...] -> {family: dir}, each family shippable and given once."""
    out = {}
    for pair in pairs:
        family, sep, directory = pair.partition("=")
        if not sep or family not in SHIPPABLE or family in out:
            raise ValueError(f"{pair!r}: give <family>=<checkpoint directory> once per family, family one of "
                             f"{', '.join(SHIPPABLE)}")  # fmt: skip
        out[family] = Path(directory)
    return out


def check_copy(source: Path, copy: Path, base: torch.nn.Module, base_meta: dict) -> None:
    """Raises unless the copy, loaded on the base, holds the source's weights in bf16 wherever the drafter reads them
    (a trimmed tensor's rows of the drafted vocabulary, every other tensor whole)."""
    original, _, meta = load_drafter(source, base, base_meta)
    shipped, _, _ = load_drafter(copy, base, base_meta)
    trimmed = set(read_meta(copy)["shipped"]["trimmed"])
    rows = torch.tensor(meta["train_vocab_ids"], dtype=torch.long) if trimmed else None
    mine = shipped.state_dict()
    for key, want in original.state_dict().items():
        got = mine[key]
        if key in trimmed:
            want, got = want[rows], got[rows]
        if not torch.equal(want.to(torch.bfloat16), got.to(torch.bfloat16)):
            raise CheckpointError(f"{copy}: {key} differs from {source}'s in bf16")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.ship_drafters", description=__doc__.split("\n")[0])
    parser.add_argument("pairs", nargs="+", help="<family>=<checkpoint directory>")
    parser.add_argument("--out", type=Path, default=Path("results/drafters"), help="where to ship (results/drafters)")
    parser.add_argument("--command", required=True, help="the command that trained them (recorded in meta.json)")
    args = parser.parse_args(argv)
    try:
        pairs = parse_pairs(args.pairs)
        metas = {family: read_meta(directory) for family, directory in pairs.items()}  # all checked before any ships
        for family, directory in pairs.items():
            if check_shippable(metas[family], directory) != family:
                found = metas[family]["model_config"]["package"]
                raise ValueError(f"{directory} holds a {found} drafter, not {family}")
        bases = {m.get("base_checkpoint") for m in metas.values()}
        if len(bases) != 1:
            raise ValueError(f"the checkpoints were trained on different bases: {sorted(map(str, bases))}")
        base, _, base_meta = load_lm(bases.pop())
        copies = {}
        for family, directory in pairs.items():
            minutes = round(metas[family].get("elapsed_s", 0.0) / 60, 1)
            copies[family] = trimmed_copy(directory, vocab_size=base.num_tokens, command=args.command, minutes=minutes)
        kept = sum(shipped_size(d) for d in args.out.glob("*") if d.is_dir() and d.name not in copies)
        total = kept + sum(copy_bytes(state, meta) for state, meta in copies.values())
        if total > LIMIT_BYTES:  # before anything is written
            limit = LIMIT_BYTES / 2**20
            raise ValueError(f"{args.out} would hold {total / 2**20:.1f} MiB of drafters: at most {limit:.0f}")
        staged = {}
        try:
            for family, copy in copies.items():
                staged[family] = stage(args.out / family, *copy)
            for family, tmp in staged.items():  # every copy checked before any replaces what was shipped
                check_copy(pairs[family], tmp, base, base_meta)  # loads on its base: sums, fingerprint, values
        except BaseException:
            for tmp in staged.values():
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        for family, tmp in staged.items():
            out = swap_in(tmp, args.out / family)
            minutes, size = copies[family][1]["shipped"]["minutes"], shipped_size(out)
            print(f"{out}: {family}, {minutes} min of training, {size / 2**20:.1f} MiB")
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
