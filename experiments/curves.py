"""Training curves of drafter runs: agreement with the base's top-1 per draft position over wall time; and with
`scaling=true`, a data-scaling study: each run's best chain_tau against the answer tokens it trained on.

    python -m experiments.curves out=curves.png outputs/reference/medusa outputs/reference/prophet ...
    python -m experiments.curves scaling=true out=scaling.png outputs/scaling/medusa-w120 ...

Reads each run's metrics.jsonl (the "val" rows train_drafter writes) and plots, per run, the agreement at
every draft position it reports (`head{k}_agree`, `step{j}_agree`, `agree`) against minutes of training;
prints the last validation row of each run as a markdown table. A run directory written before
agreement had these names reports it as `head{k}_rank0` (Medusa) or `step{j}_top1` (prophet): read as the same.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import matplotlib
from omegaconf import OmegaConf

from experiments.lib.common.errors import atomic_path

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
    save_figure(fig, out)
    return "\n".join(lines)


def scaling_point(run: Path) -> dict:
    """A run's family, training answer tokens (its best checkpoint's meta) and chain_tau curve (its metrics)."""
    meta_path = run / "checkpoint" / "meta.json"
    if not meta_path.is_file():
        raise ValueError(f"{run}: no checkpoint/meta.json (a finished train_drafter run directory)")
    meta = json.loads(meta_path.read_text())
    rows = [r for r in val_rows(run) if "chain_tau" in r]
    if not rows or "train_tokens" not in meta:
        raise ValueError(f"{run}: no chain_tau validations or no train_tokens (a run from before the data engine)")
    config = meta["model_config"]
    arch = (config.get("module") or {}).get("arch")
    family = config["package"] + (f"-{arch}" if arch and arch != "xtransformers" else "") + _budget(run)
    return {
        "run": run.name,
        "family": family,
        "teacher": _teacher(meta),
        "tokens": meta["train_tokens"],
        "best": max(r["chain_tau"] for r in rows),
        "minutes": [r["elapsed_s"] / 60 for r in rows],
        "tau": [r["chain_tau"] for r in rows],
    }


def _budget(run: Path) -> str:
    """A run's time budget (max_minutes in its Hydra config) as a series label: a 6-minute run and a 30-minute one are
    two curves, not one."""
    config = run / ".hydra" / "config.yaml"
    minutes = OmegaConf.load(config).get("max_minutes") if config.is_file() else None
    return f", {minutes:g} min" if minutes is not None else ""


def _teacher(meta: dict) -> str:
    """What the base computed the run's features in: the checkpoint's record, else its feature cache's meta (a run
    from before the record), else "?" (the cache is gone: a committed copy of an old run)."""
    if "feature_teacher" in meta:
        return meta["feature_teacher"]
    cache = Path(meta["features"]) / "meta.json" if meta.get("features") else None
    if cache is None or not cache.is_file():
        return "?"
    return json.loads(cache.read_text())["spec"].get("teacher", "fp32")


def fit_log(points: list[dict]) -> tuple[float, float] | None:
    """Least squares tau = a + b log10(tokens) over one family's points (None with fewer than two sizes)."""
    xs, ys = [math.log10(p["tokens"]) for p in points], [p["best"] for p in points]
    if len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def plot_scaling(runs: list[Path], out: Path) -> str:
    """Best chain_tau against training answer tokens (log axis, a log-linear fit per family extrapolated to 1M and
    4M tokens) and chain_tau against training minutes; returns the markdown tables."""
    points = [scaling_point(run) for run in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    lines = ["| run | family | teacher | answer tokens | best chain_tau |", "|---|---|---|---|---|"]
    fits = ["| family | tau = a + b log10(tokens) | at 1M tokens | at 4M tokens |", "|---|---|---|---|"]
    for color, family in enumerate(sorted({p["family"] for p in points})):
        mine = sorted((p for p in points if p["family"] == family), key=lambda p: p["tokens"])
        left.plot([p["tokens"] for p in mine], [p["best"] for p in mine], "o-", color=f"C{color}", label=family)
        for p in mine:
            shade = 0.4 + 0.6 * p["tokens"] / mine[-1]["tokens"]  # more data, a darker line
            label = f"{family} {p['tokens'] / 1e3:.0f}k"
            right.plot(p["minutes"], p["tau"], ".-", color=f"C{color}", alpha=shade, label=label)
            lines.append(f"| {p['run']} | {family} | {p['teacher']} | {p['tokens']:,} | {p['best']:.3f} |")
        fit = fit_log(mine)
        if fit:
            a, b = fit
            xs = [mine[0]["tokens"], 4e6]
            left.plot(xs, [a + b * math.log10(x) for x in xs], ":", color=f"C{color}")
            fits.append(f"| {family} | {a:.3f} + {b:.3f} log10 | {a + 6 * b:.2f} | {a + b * math.log10(4e6):.2f} |")
    left.set_xscale("log")
    left.set_xlabel("training answer tokens")
    left.set_ylabel("best chain_tau (3 drafts, T=0, held-out answers)")
    right.set_xlabel("training minutes")
    right.set_ylabel("chain_tau")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, out)
    return "\n".join(lines) + "\n\n" + "\n".join(fits)


def save_figure(fig, out: Path) -> None:
    """The figure in the format its name says (.png, .pdf, .svg), written atomically: a run that fails or is killed
    leaves the old plot or the whole new one, never a part of it."""
    fig.tight_layout()
    try:
        with atomic_path(out) as tmp:  # the temporary name ends in .tmp: the format is given, not guessed from it
            fig.savefig(tmp, dpi=120, format=out.suffix[1:] or "png")
    finally:
        plt.close(fig)


def main(argv: list[str]) -> int:
    outs = [a for a in argv if a.startswith("out=")]
    scaling = "scaling=true" in argv
    runs = [Path(a) for a in argv if not a.startswith(("out=", "scaling="))]
    if not runs:
        print(
            "usage: python -m experiments.curves [scaling=true] out=curves.png <run dir> [<run dir> ...]",
            file=sys.stderr,
        )
        return 2
    try:
        draw = plot_scaling if scaling else plot  # plot: one colour per run, one line style per position
        print(draw(runs, Path(outs[-1][4:] if outs else "curves.png")))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
