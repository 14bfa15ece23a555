"""Gather a benchmark multirun into one table and plots.

    python -m experiments.summarize multirun/benchmark/2026-11-22_10-00-00

Every job directory under the multirun holds results.json (experiments/benchmark.py) and Hydra's
.hydra/overrides.yaml; a row of the summary is one method at one temperature in one job, labelled with
that job's overrides. Writes summary.md, summary.json and speedup_vs_gamma.png into the multirun dir.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

from experiments.report import mode, plt

COLUMNS = ("overrides", "name", "mode", "temperature", "gamma", "tau", "alpha", "speedup", "efficiency", "draft_share", "lossless", "exact")


def job_rows(sweep_dir: Path) -> list[dict]:
    rows = []
    def job_order(path: Path) -> tuple:  # Hydra numbers jobs 0, 1, ..., 10: sort numerically
        name = path.parent.name
        return (not name.isdigit(), int(name) if name.isdigit() else 0, name)

    for results_file in sorted(sweep_dir.glob("*/results.json"), key=job_order):
        results = json.loads(results_file.read_text())
        overrides_file = results_file.parent / ".hydra" / "overrides.yaml"
        overrides = overrides_file.read_text().replace("\n- ", " ").strip("- \n") if overrides_file.exists() else ""
        for row in results["methods"]:
            rows.append({"job": results_file.parent.name, "overrides": overrides, "mode": mode(row), **row})
    return rows


def swept(rows: list[dict]) -> list[dict]:
    """Label each row by the overrides that differ between jobs (the swept values), not the shared ones."""
    split = [set(row["overrides"].split()) for row in rows]
    shared = set.intersection(*split) if split else set()
    return [{**row, "overrides": " ".join(sorted(o - shared)) or row["overrides"]} for row, o in zip(rows, split)]


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c]) for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_speedup_vs_gamma(rows: list[dict], path: Path) -> None:
    series = defaultdict(list)
    for row in rows:
        series[(row["name"], row["mode"], row["temperature"])].append((row["gamma"], row["speedup"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    for (name, setting, temperature), points in sorted(series.items()):
        points = sorted(points)
        ax.plot([g for g, _ in points], [s for _, s in points], marker="o", label=f"{name} {setting} T={temperature:g}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("gamma (chain length / tree depth)")
    ax.set_ylabel("speedup over plain decoding")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summarize(sweep_dir: str | Path) -> list[dict]:
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"multirun directory {sweep_dir} does not exist")
    rows = job_rows(sweep_dir)
    if not rows:
        raise ValueError(f"{sweep_dir} holds no */results.json: is it a benchmark multirun directory?")
    rows = swept(rows)
    (sweep_dir / "summary.md").write_text(table(rows))
    (sweep_dir / "summary.json").write_text(json.dumps(rows, indent=2, default=str))
    plot_speedup_vs_gamma(rows, sweep_dir / "speedup_vs_gamma.png")
    return rows


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m experiments.summarize <multirun dir>", file=sys.stderr)
        return 2
    try:
        rows = summarize(argv[0])
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
