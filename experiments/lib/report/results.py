"""Benchmark results as files people read: results.json, a markdown table and PNG plots.

Columns: tau = tokens emitted per target forward (bonus included; plain = 1);
rep4 (`repeat4` in results.json) = share of PLAIN decoding's output tokens at the row's temperature that repeat
an earlier 4-gram of their row (prompt included): the base's degeneration, which inflates tau at T = 0;
alpha = accepted / proposed draft tokens (for a tree: accepted depth / tree depth);
speedup = median over rounds of method tokens/s over the FASTEST plain decoding's tokens/s in the same round
(over every threads/compile setting of the run, so plain rows below 1.00 are the slower plain settings), with
its interval in brackets: a paired bootstrap over the (round, batch) cells (experiments/lib/report/spread.py);
tau, alpha and the time split are pooled over the rounds that median takes (the middle one, or the middle
two of an even count: experiments/lib/methods/rounds.py middle_rounds);
the verdict names a method only where the interval's lower end is above 1.0, and none in a run
experiments/lib/report/disturbed.py finds disturbed (a ratio above what its forwards and verify cost allow,
or plain decoding's own rate varying between rounds; category cells too small to judge only warn);
mode = eager, compiled (torch.compile'd decode steps) or graph (steps replayed as CUDA graphs) and the number
of torch threads;
efficiency = speedup / tau (the share of the algorithmic gain that survives drafting and verifying);
draft % = share of wall time spent in the drafter; rest % = share spent neither drafting nor in the target's
forward and acceptance (the loop's own bookkeeping, cache commits, host reads);
verify/step and draft/step = the target's (verification) and the drafter's seconds per decoding step over plain
decoding's seconds per step in the same setting (a step of every row of a batch: per token at batch 1): the regime
a speedup has to come from;
exact = token-identical to plain at temperature 0;
lossless = the acceptance rule keeps the target's distribution (a lenient `delta` or typical acceptance does not).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import matplotlib

from experiments.lib.common.errors import write_atomic
from experiments.lib.common.machine import device_line
from experiments.lib.methods.calibrate import format_cost_table
from experiments.lib.report.by_category import category_table
from experiments.lib.report.disturbed import disturbed_note, small_cell_note
from experiments.lib.report.spread import format_ratio, spread_note

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

# Why plain decoding's tokens/s is lower at T > 0 than at T = 0. Measured on SmolLM2 (bf16, 2 threads, AMD EPYC,
# 2026-11-28): a torch.profiler run of plain_generate (32 tokens) puts the sampling ops at about 1.5% of T=1's CPU
# time, and T=0 and T=1 calls interleaved in one process took the same target time per token within the noise.
# The 18-22% T=1 deficits of earlier demos came with the old protocol, which timed each temperature in its own
# pass, minutes apart, in one round. The draw cannot be made cheaper without changing which tokens a seed gives.
SAMPLING_NOTE = (
    "Plain decoding at T > 0 samples each token by the exponential race (verify/loop/sampling.py): one "
    "exponential variate per vocabulary entry, drawn on one core (torch's CPU generator; about 0.9 ms for "
    "SmolLM2's 49,152 entries), then a softmax and an argmax (about 0.2 ms): 2-4% of a SmolLM2 step. The draw "
    "fixes every sampled token for a seed, so it stays. Beyond that, T > 0 rows that stop at EOS sooner make the "
    "prefill (counted in tokens/s) weigh more. Both temperatures are timed in the same interleaved rounds here."
)

HEADER = (
    "| method | mode | T | rule | lossless | tau | rep4 | alpha | tokens/s | speedup | efficiency "
    "| verify/step | draft/step | draft % | rest % | exact |"
)


def repeated_ngram_share(prompts: list[list[int]], outputs: list[list[int]], n: int = 4) -> float:
    """Share of generated tokens that complete an n-gram already seen earlier in the same row.

    Row r is the sequence s = prompts[r] + outputs[r]; each output token at index i >= n - 1 of s counts,
    and repeats when s[i-n+1 : i+1] also ends at an earlier index j (n - 1 <= j < i). Pooled over rows:
    repeats summed over tokens counted, so long rows weigh more. 0.0 when no output token is counted.
    A base stuck in a loop scores near 1, and copying its own loop is easy to draft: a tau measured
    on such output says little about a drafter's skill."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r}: must be an integer >= 1")
    if len(prompts) != len(outputs):
        raise ValueError(f"{len(prompts)} prompts but {len(outputs)} outputs: need one output per prompt")
    repeats = counted = 0
    for prompt, output in zip(prompts, outputs):
        s = [*prompt, *output]
        seen: set[tuple[int, ...]] = set()  # n-grams ending before index i
        for i in range(n - 1, len(s)):
            gram = tuple(s[i - n + 1 : i + 1])
            if i >= len(prompt):
                counted += 1
                repeats += gram in seen
            seen.add(gram)
    return repeats / counted if counted else 0.0


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def mode(row: dict) -> str:
    """A setting in a few characters: 'eager 1t', 'compiled 2t', 'graph 1t' (torch threads)."""
    compiled = row.get("compiled")
    name = "graph" if compiled == "graph" else "compiled" if compiled else "eager"
    return f"{name} {row.get('threads', '?')}t"


def markdown_table(results: dict) -> str:
    """Plain decoding in every setting, then every method, per temperature."""
    lines = [HEADER, "|" + "|".join(["---"] * (HEADER.count("|") - 1)) + "|"]
    for t in dict.fromkeys(p["temperature"] for p in results["plain"]):
        for plain in (p for p in results["plain"] if p["temperature"] == t):
            lines.append(
                f"| plain | {mode(plain)} | {t:g} | - | yes | 1.00 | {plain['repeat4']:.2f} | - "
                f"| {plain['tokens_per_s']:.1f} | {ratio(plain)} | - | 1.00 | - | 0 | - | - |"
            )
        for row in (r for r in results["methods"] if r["temperature"] == t):
            step = plain_step(results, row)
            rest = 1 - row["draft_share"] - row["target_share"]
            lines.append(
                f"| {row['name']} | {mode(row)} | {t:g} | {row['rule']} | {_fmt(row['lossless'])} | {row['tau']:.2f} "
                f"| {row['repeat4']:.2f} | {row['alpha']:.2f} | {row['tokens_per_s']:.1f} | {ratio(row)} "
                f"| {row['efficiency']:.2f} | {row['target_seconds_per_step'] / step:.2f} "
                f"| {row['draft_seconds_per_step'] / step:.2f} | {100 * row['draft_share']:.0f} | {100 * rest:.0f} "
                f"| {_fmt(row['exact'])} |"
            )
    return "\n".join(lines) + "\n"


def ratio(row: dict) -> str:
    """A row's speedup with its interval: '1.14x [1.02, 1.27]', '1.14x n=1' (one cell), or '1.14x' (a row
    written before intervals)."""
    return format_ratio(row["speedup"], row.get("speedup_lo"), row.get("speedup_hi"), row.get("cells"))


def header_line(results: dict) -> str:
    """'<device line>; base: <size>' and a blank line, or nothing when neither is known. The device line is
    'CPU: <model>', or 'GPU: <name> (<memory> GiB), torch <version>, CUDA <version>; host CPU: <model>' for a
    run on a GPU (machine.device_line; results written before device_info have their cpu alone)."""
    header = [device_line(results)] if device_line(results) else []
    header += [f"base: {base_line(results['base'], results.get('dtype', 'float32'))}"] if results.get("base") else []
    header += [prompts_line(results)] if results.get("prompt_set") else []
    return "; ".join(header) + "\n\n" if header else ""


def prompts_line(results: dict) -> str:
    """'prompts: 12 from chat_mix, chat template, turns 1 and 2 (coding 2, qa 2, ...)'."""
    ps = results["prompt_set"]
    turns = ", turns 1 and 2" if ps.get("turns") == 2 else ""
    counts = ", ".join(f"{c} {n}" for c, n in ps.get("categories", {}).items())
    chat = ", chat template" if ps.get("chat") else ""
    return f"prompts: {results['prompts']} from {ps['source']}{chat}{turns} ({counts})"


def base_line(base: dict, dtype: str = "float32") -> str:
    """'10.5M parameters (256 x 8), bfloat16 decoding': the target's size, which sets what a draft can win, and
    the precision it decoded in (results.json's `dtype`, read from the decoded weights)."""
    shape = f" ({base['dim']} x {base['depth']})" if "dim" in base and "depth" in base else ""
    return f"{base['parameters'] / 1e6:.1f}M parameters{shape}, {dtype} decoding"


def plain_step(results: dict, row: dict) -> float:
    """Plain decoding's seconds per step (one forward of every row of a batch) in `row`'s setting and temperature:
    its seconds per token times its tokens per step, the batch's rows (1 at batch 1, and for results written
    before the benchmark counted forwards). Per token, a batch of 4 would show a verification at 4x its cost."""
    plain = next(p for p in results["plain"] if mode(p) == mode(row) and p["temperature"] == row["temperature"])
    per_step = plain["tokens"] / plain["call_forwards"] if plain.get("call_forwards") else 1.0
    return per_step / plain["tokens_per_s"]


def verdict(results: dict) -> str:
    """One line: per temperature the fastest of the methods whose speedup interval lies above 1.0 (and the
    others that do), beside plain decoding's rep4 (a base that repeats itself flatters every tau at T = 0);
    'no method measurably faster' where no interval does. A disturbed run names no winner at all."""
    disturbed = bool(results.get("disturbed"))
    parts = []
    for t in dict.fromkeys(r["temperature"] for r in results["methods"]):
        at_t = [r for r in results["methods"] if r["temperature"] == t]
        rep4 = max(p["repeat4"] for p in results["plain"] if p["temperature"] == t)
        faster = sorted(
            (r for r in at_t if r.get("speedup_lo") is not None and r["speedup_lo"] > 1.0),
            key=lambda r: r["speedup"],
            reverse=True,
        )
        best = faster[0] if faster and not disturbed else max(at_t, key=lambda r: r["speedup"])
        figure = f"{best['name']} ({mode(best)}{'' if best['lossless'] else ', NOT lossless'}) at {ratio(best)}"
        if disturbed:
            parts.append(f"at T={t:g} no winner named, the run was disturbed (highest: {figure}, not a result)")
        elif not faster:
            parts.append(f"at T={t:g} no method measurably faster (highest: {figure}; plain rep4 {rep4:.2f})")
        else:
            also = f"; also above 1.0: {', '.join(r['name'] for r in faster[1:])}" if faster[1:] else ""
            parts.append(
                f"at T={t:g} {figure} the fastest plain decoding (tau {best['tau']:.2f}; plain rep4 {rep4:.2f}){also}"
            )
    return f"\nVerdict: {'; '.join(parts)}.\n" if parts else ""


def notes(results: dict) -> str:
    """What the reader needs before the table: a disturbed run's warning, what the brackets mean, and why
    plain decoding is slower at T > 0 than at T = 0."""
    out = disturbed_note(results.get("disturbed") or []) + small_cell_note(results.get("disturbed_warnings") or [])
    if any("speedup_lo" in r for r in results["plain"] + results["methods"]):
        out += spread_note() + "\n\n"
    if any(p["temperature"] > 0 for p in results["plain"]):
        out += SAMPLING_NOTE + "\n\n"
    return out


def checkpoint_lines(results: dict) -> str:
    """Which checkpoint the base and each drafter row used: its step, and whether it is its run's best validation or its
    latest (a checkpoint written before runs kept both says neither)."""
    out = []
    records = {"base": results["base_record"]} if results.get("base_record") else {}
    for family, record in {**records, **results.get("checkpoints", {})}.items():
        selected = record.get("selected")
        which = f"{selected} of its run" if selected else "best/last not recorded"
        last = f", run's last step {record['last_step']}" if record.get("last_step") is not None else ""
        out.append(f"- {family}: {record['checkpoint']} step {record.get('step')} ({which}{last})")
    return "\nCheckpoints:\n" + "\n".join(out) + "\n" if out else ""


def warmup_lines(results: dict) -> str:
    """Compile (warm-up) time per setting, reported apart from tokens/s."""
    out = [
        f"- {setting}: cost calibration {s:.1f} s (about 0 when read from its cache"
        f"{'; on a fresh machine it includes compiling every verify width' if 'compiled' in setting else ''}"
        f"{'; it includes capturing every verify width' if 'graph' in setting else ''})"
        for setting, s in results.get("calibration_s", {}).items()
    ]
    for row in results["plain"] + results["methods"]:
        if row.get("compiled"):
            out.append(
                f"- {row.get('name', 'plain')} {mode(row)} T={row['temperature']:g}: warm-up incl. "
                f"{'capturing CUDA graphs' if row['compiled'] == 'graph' else 'compilation'} "
                f"{row['warmup_s']:.1f} s"
            )
    return "\n".join(out) + ("\n" if out else "")


def plot_speedup_tau(results: dict, path: Path) -> None:
    rows = results["methods"]
    labels = [f"{r['name']}\n{mode(r)} T={r['temperature']:g}" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, len(rows) * 1.1), 4))
    for ax, key, title in zip(
        axes, ("speedup", "tau"), ("speedup over plain decoding", "tau (tokens per target forward)")
    ):
        ax.bar(range(len(rows)), [r[key] for r in rows], color=["C0" if r["lossless"] else "C3" for r in rows])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_title(title)
    save_figure(fig, path)


def save_figure(fig, path: Path) -> None:
    """Render the PNG in memory, then write it atomically (a full disk leaves no half image)."""
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    write_atomic(path, png.getvalue())


def plot_acceptance(results: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results["methods"]:
        acc = r["acceptance_by_position"]
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{r['name']} {mode(r)} T={r['temperature']:g}")
    ax.set_xlabel("draft position (tree: depth)")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def cost_lines(results: dict) -> str:
    """budget=auto's measured target cost by width k per setting, with each drafter's seconds per step
    (from the benchmark rounds at the first temperature)."""
    out = []
    for setting, costs in results.get("cost_tables", {}).items():
        t0 = results["methods"][0]["temperature"] if results["methods"] else None
        drafters = {
            r["name"]: r["draft_seconds_per_step"]
            for r in results["methods"]
            if mode(r) == setting and r["temperature"] == t0
        }
        out.append(f"\nMeasured costs, {setting} (target forward of k new tokens; drafters per verification step):\n")
        trees = results.get("tree_cost_tables", {}).get(setting)
        trees = {int(k): v for k, v in trees.items()} if trees else None
        out.append(format_cost_table({int(k): v for k, v in costs.items()}, drafters, tree_cost=trees))
    return "\n".join(out) + ("\n" if out else "")


def write_report(results: dict, out_dir: Path) -> None:
    """results.json, results.md and the plots, each written atomically (old or whole new, never a part)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / "results.json", json.dumps(results, indent=2, default=str))
    cpu = header_line(results) + notes(results)
    table = markdown_table(results) + verdict(results) + category_table(results, mode)
    text = cpu + table + checkpoint_lines(results) + warmup_lines(results) + cost_lines(results)
    write_atomic(out_dir / "results.md", text)
    if results["methods"]:
        plot_speedup_tau(results, out_dir / "speedup_tau.png")
        plot_acceptance(results, out_dir / "acceptance_by_position.png")
