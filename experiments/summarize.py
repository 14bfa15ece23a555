"""Gather a benchmark multirun into one table and plots.

    python -m experiments.summarize multirun/benchmark/2026-11-22_10-00-00

Every job directory under the multirun holds Hydra's .hydra/overrides.yaml and, when the job got that far,
results.json (experiments/benchmark.py) or failed.json (experiments/lib/common/errors.py: a job that failed). A row of
the summary is one method at one temperature in one job, labelled with that job's swept overrides; a job without
results is listed under "Failed jobs" with its error, or as "no result (killed or still running)" when it
left neither file. Writes summary.md, summary.json (in job order, the rows and one entry per job without
results, each with a "status": ok, failed or no result) and speedup_vs_<setting>.png into the multirun dir, each
atomically (a reader never sees half a file). The plot is drawn against the one numeric setting the jobs sweep
(decode.gamma -> speedup_vs_gamma.png, medusa.module.num_heads -> speedup_vs_num_heads.png, ...; the rows' gamma
when the sweep is over something else): speedup with its 95% interval where the run measured one, and tau. Runs on
prompts with categories (prompts=chat_mix, a Spec-Bench file) also get a table of speedup and tau per category.
"""

from __future__ import annotations

import io
import json
import sys
from collections import defaultdict
from pathlib import Path

import yaml

from experiments.lib.common.errors import FAILED_FILE, one_line, user_message, write_atomic
from experiments.lib.report.by_category import category_table
from experiments.lib.report.results import mode, plt
from experiments.lib.report.spread import format_ratio

COLUMNS = (
    "overrides",
    "name",
    "mode",
    "temperature",
    "gamma",
    "tau",
    "alpha",
    "speedup",
    "efficiency",
    "draft_share",
    "lossless",
    "exact",
)
RESULTS_FILE = "results.json"
NO_RESULT = "no result (killed or still running)"


def job_order(job_dir: Path) -> tuple:
    """Hydra numbers jobs 0, 1, ..., 10: sort numerically."""
    name = job_dir.name
    return (not name.isdigit(), int(name) if name.isdigit() else 0, name)


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Every job directory of the multirun: Hydra writes .hydra/ before the job runs, so a killed job has one."""
    found = {path.parent for name in (RESULTS_FILE, FAILED_FILE, ".hydra") for path in sweep_dir.glob(f"*/{name}")}
    return sorted(found, key=job_order)


def read_overrides(job_dir: Path) -> str:
    path = job_dir / ".hydra" / "overrides.yaml"
    try:
        overrides = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):  # no .hydra (hydra.output_subdir=null) or a broken file: no label
        return ""
    return " ".join(str(o) for o in overrides) if isinstance(overrides, list) else ""


def newer(a: Path, b: Path) -> bool:
    return a.stat().st_mtime_ns >= b.stat().st_mtime_ns


def without_results(job: str, overrides: str, status: str, error: str, error_type: str = "") -> dict:
    """The entry of a job that has no rows: status "failed" (failed.json) or "no result"."""
    return {"job": job, "overrides": overrides, "status": status, "error_type": error_type, "error": error}


def failure_entry(job: str, overrides: str, failed_file: Path) -> dict:
    try:
        failure = json.loads(failed_file.read_text())
        error, error_type = str(failure["message"]), str(failure.get("error_type", ""))
        overrides = overrides or " ".join(failure.get("overrides", []))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        error, error_type = f"{FAILED_FILE} unreadable: {one_line(e)}", ""
    return without_results(job, overrides, "failed", error, error_type)


def result_rows(job: str, overrides: str, results_file: Path) -> list[dict]:
    """The job's rows; a results.json that is not one (cut short by a kill, a full disk) is one line of error."""
    try:
        results = json.loads(results_file.read_text())
    except OSError as e:
        error = f"cannot read {RESULTS_FILE}: {user_message(e) or one_line(e)}"
        return [without_results(job, overrides, "no result", error)]
    except ValueError as e:
        error = f"{RESULTS_FILE} is not valid JSON (cut short?): {one_line(e)}"
        return [without_results(job, overrides, "no result", error)]
    methods = results.get("methods") if isinstance(results, dict) else None
    if not isinstance(methods, list) or not all(isinstance(row, dict) for row in methods):
        error = f'{RESULTS_FILE} has no list of method rows under "methods"'
        return [without_results(job, overrides, "no result", error)]
    return [{"job": job, "overrides": overrides, "status": "ok", "mode": mode(row), **row} for row in methods]


def job_entries(job_dir: Path) -> list[dict]:
    """One job's rows, or one entry saying why it has none."""
    job, overrides = job_dir.name, read_overrides(job_dir)
    results_file, failed_file = job_dir / RESULTS_FILE, job_dir / FAILED_FILE
    if failed_file.exists() and not (results_file.exists() and newer(results_file, failed_file)):
        return [failure_entry(job, overrides, failed_file)]
    if results_file.exists():
        return result_rows(job, overrides, results_file)
    return [without_results(job, overrides, "no result", NO_RESULT)]


def job_rows(sweep_dir: Path) -> list[dict]:
    return [entry for job_dir in job_dirs(sweep_dir) for entry in job_entries(job_dir)]


def swept(rows: list[dict]) -> list[dict]:
    """Label each row by the overrides that differ between jobs (the swept values), not the shared ones."""
    split = [set(row["overrides"].split()) for row in rows]
    shared = set.intersection(*split) if split else set()
    return [{**row, "overrides": " ".join(sorted(o - shared)) or row["overrides"]} for row, o in zip(rows, split)]


def sweep_axis(rows: list[dict]) -> str:
    """The one override the jobs sweep when its values are numbers ('medusa.module.num_heads'), else 'gamma' (the
    rows' own gamma: a sweep over a non-numeric setting, or over two settings at once)."""
    values = defaultdict(set)
    for row in rows:
        for override in row["overrides"].split():
            key, _, value = override.partition("=")
            values[key].add(value)
    keys = [key for key, seen in values.items() if len(seen) > 1]
    if len(keys) == 1 and all(_number(v) is not None for v in values[keys[0]]):
        return keys[0]
    return "gamma"


def _number(text: object) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def axis_value(row: dict, axis: str) -> float | None:
    """The row's x on the plot: its value of the swept override, or its gamma."""
    if axis == "gamma":
        return _number(row.get("gamma"))
    found = [o.partition("=")[2] for o in row["overrides"].split() if o.partition("=")[0] == axis]
    return _number(found[0]) if found else None


def cell(value: object) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|")  # a message with a pipe must not split the markdown row


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        if row["status"] == "ok":
            lines.append("| " + " | ".join(_column(row, c) for c in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def _column(row: dict, column: str) -> str:
    """A table cell; the speedup with its 95% interval where the run measured one ('1.14x [1.02, 1.27]')."""
    if column == "speedup" and isinstance(row.get("speedup"), (int, float)):
        return format_ratio(row["speedup"], row.get("speedup_lo"), row.get("speedup_hi"), row.get("cells"))
    return cell(row.get(column, "-"))


def categories(rows: list[dict]) -> str:
    """Speedup and tau per prompt category of every row that has them (a run on a set with categories,
    such as prompts=chat_mix or a Spec-Bench file), each row labelled by its job's swept overrides."""
    ok = [row for row in rows if row["status"] == "ok"]
    return category_table({"methods": ok}, lambda row: f"{row['overrides']} {row['mode']}".strip())


def failed_table(rows: list[dict]) -> str:
    """The jobs without results: empty when every job has its results."""
    failed = [row for row in rows if row["status"] != "ok"]
    if not failed:
        return ""
    lines = ["", "## Failed jobs", "", "| job | overrides | error |", "|---|---|---|"]
    lines += [f"| {cell(row['job'])} | {cell(row['overrides'])} | {cell(row['error'])} |" for row in failed]
    return "\n".join(lines) + "\n"


def plot_sweep(rows: list[dict], axis: str) -> bytes:
    """Speedup (with its 95% interval where measured) and tau against the swept setting, a line per method,
    setting and temperature."""
    series = defaultdict(list)
    for row in rows:
        x = axis_value(row, axis)
        if x is None or any(key not in row for key in ("name", "temperature", "speedup")):
            continue  # a results.json of another schema: in the table, not on the plot
        series[(row["name"], row["mode"], row["temperature"])].append((x, row))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for (name, setting, temperature), points in sorted(series.items()):
        points.sort(key=lambda point: point[0])
        xs, found = [x for x, _ in points], [row for _, row in points]
        speedups = [row["speedup"] for row in found]
        low = [s - _bound(row, "speedup_lo", s) for s, row in zip(speedups, found)]  # no interval: no bar
        high = [_bound(row, "speedup_hi", s) - s for s, row in zip(speedups, found)]
        label = f"{name} {setting} T={temperature:g}"
        line = left.errorbar(xs, speedups, yerr=[low, high], marker="o", capsize=3, label=label)
        taus = [(x, row["tau"]) for x, row in points if isinstance(row.get("tau"), (int, float))]
        if taus:
            right.plot([x for x, _ in taus], [t for _, t in taus], marker="o", color=line[0].get_color(), label=label)
    left.axhline(1.0, color="k", lw=0.8)
    name = "gamma (chain length / tree depth)" if axis == "gamma" else axis
    left.set_xlabel(name)
    right.set_xlabel(name)
    left.set_ylabel("speedup over plain decoding (95% interval)")
    right.set_ylabel("tau (tokens per target forward)")
    left.legend(fontsize=7)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    return png.getvalue()


def _bound(row: dict, key: str, speedup: float) -> float:
    value = row.get(key)
    return value if isinstance(value, (int, float)) else speedup


def plot_name(axis: str) -> str:
    """speedup_vs_gamma.png, speedup_vs_num_heads.png, ...: the setting's last component."""
    return f"speedup_vs_{axis.rsplit('.', 1)[-1]}.png"


def summarize(sweep_dir: str | Path) -> list[dict]:
    """Write the summary files; return the rows of summary.json (rows with status "ok" carry results)."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"multirun directory {sweep_dir} does not exist")
    rows = job_rows(sweep_dir)
    if not rows:
        raise ValueError(
            f"{sweep_dir} holds no */results.json and no job directories: is it a benchmark multirun directory?"
        )
    rows = swept(rows)
    write_atomic(sweep_dir / "summary.md", table(rows) + categories(rows) + failed_table(rows))
    write_atomic(sweep_dir / "summary.json", json.dumps(rows, indent=2, default=str) + "\n")
    ok = [row for row in rows if row["status"] == "ok"]
    if ok:  # a sweep where every job failed has nothing to plot
        axis = sweep_axis(ok)
        write_atomic(sweep_dir / plot_name(axis), plot_sweep(ok, axis))
    return rows


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m experiments.summarize <multirun dir>", file=sys.stderr)
        return 2
    try:
        rows = summarize(argv[0])
    except (ValueError, OSError) as e:  # a missing or empty directory, one we may not write into, a full disk
        print(f"error: {user_message(e) or one_line(e)}", file=sys.stderr)
        return 2
    print(table(rows) + categories(rows) + failed_table(rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
