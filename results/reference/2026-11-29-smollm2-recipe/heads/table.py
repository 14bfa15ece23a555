"""The head-recipe ablation's table: per run, its training steps and its best validation (the checkpoint kept).
Usage: python results/reference/2026-11-29-smollm2-recipe/heads/table.py [DIR]
DIR: a lanes.sh output directory (<run>/metrics.jsonl), or this directory's committed <run>.metrics.jsonl (default)."""

import json
import sys
from pathlib import Path

out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
print("| run | steps | minutes | head 1 / 2 / 3 / 4 agreement | head 1 mass | chain tau | chain mass |")
print("|---|---|---|---|---|---|---|")
for path in sorted([*out.glob("*/metrics.jsonl"), *out.glob("*.metrics.jsonl")]):
    name = path.parent.name if path.name == "metrics.jsonl" else path.name.removesuffix(".metrics.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = [r for r in rows if r["kind"] == "train"]
    val = [r for r in rows if r["kind"] != "train" and "chain_tau" in r]
    if not train or not val:
        continue
    best = max(val, key=lambda r: r["chain_tau"])
    short = lambda x: f"{x:.3f}".lstrip("0")  # noqa: E731  .414, as the other ablation tables
    agree = " / ".join(short(best[f"head{k}_agree"]) for k in range(1, 5))
    minutes = train[-1]["elapsed_s"] / 60
    print(
        f"| {name} | {train[-1]['step']} | {minutes:.1f} | {agree} | {short(best['head1_mass'])} | "
        f"{best['chain_tau']:.3f} | {best['chain_mass']:.3f} |"
    )
