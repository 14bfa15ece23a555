"""Training curves of drafter runs: agreement with the base's top-1 per draft position over wall time.

    python -m experiments.curves out=curves.png outputs/reference/medusa outputs/reference/prophet ...

Reads each run's metrics.jsonl (the "val" rows train_drafter writes) and plots, per run, the agreement at
every draft position it reports (`head{k}_agree`, `step{j}_agree`, `agree`) against minutes of training;
prints the last validation row of each run as a markdown table. A run directory written before
agreement had these names reports it as `head{k}_rank0` (Medusa) or `step{j}_top1` (prophet): read as the same.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

AGREE = re.compile(r"^(head\d+_agree|step\d+_agree|agree)$")
LEGACY = {re.compile(r"^head(\d+)_rank0$"): "head{}_agree", re.compile(r"^step(\d+)_top1$"): "step{}_agree"}


def agreement(row: dict) -> dict[str, float]:
    """The agreement figures of one validation row, by position name, in position order."""
    found = {k: v for k, v in row.items() if AGREE.match(k)}
    if not found:  # an older run: its names for the same figures
        for pattern, name in LEGACY.items():
            found |= {name.format(m.group(1)): v for k, v in row.items() if (m := pattern.match(k))}
    return dict(sorted(found.items(), key=lambda kv: int(re.sub(r"\D", "", kv[0]) or 0)))


def val_rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl" if run.is_dir() else run
    if not path.is_file():
        raise ValueError(f"{run}: no metrics.jsonl (a train_drafter run directory, or its metrics file)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("kind") == "val" and agreement(r)]


def plot(runs: list[Path], out: Path) -> str:
    """Write the figure; return the markdown table of each run's last validation."""
    fig, ax = plt.subplots(figsize=(11, 5))
    lines = ["| run | minutes | agreement by position |", "|---|---|---|"]
    for color, run in enumerate(runs):
        rows, name_of_run = val_rows(run), run.name if run.is_dir() else run.stem
        if not rows:
            raise ValueError(f"{run}: no validation rows with agreement figures")
        for i, name in enumerate(list(agreement(rows[-1]))[:3]):  # later positions only crowd the figure
            ax.plot(
                [r["elapsed_s"] / 60 for r in rows],
                [agreement(r)[name] for r in rows],
                marker=".",
                color=f"C{color % 10}",
                linestyle=("-", "--", ":")[i],
                label=f"{name_of_run} {name}",
            )
        last = rows[-1]
        lines.append(
            f"| {name_of_run} | {last['elapsed_s'] / 60:.1f} | "
            + " ".join(f"{v:.2f}" for v in agreement(last).values())
            + " |"
        )
    ax.set_xlabel("training minutes")
    ax.set_ylabel("agreement with the base's top-1")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the axes: no curve hidden
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    outs = [a for a in argv if a.startswith("out=")]
    runs = [Path(a) for a in argv if not a.startswith("out=")]
    if not runs:
        print("usage: python -m experiments.curves out=curves.png <run dir> [<run dir> ...]", file=sys.stderr)
        return 2
    try:
        print(
            plot(runs, Path(outs[-1][4:] if outs else "curves.png"))
        )  # one colour per run, one line style per position
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
