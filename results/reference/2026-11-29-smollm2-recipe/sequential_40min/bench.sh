#!/usr/bin/env bash
# The 40-minute sequential heads (train.sh here) against the reference's 10-minute ones, as a chain and in the
# hybrid with prompt lookup, budget=auto, on the reference's 12 chat_mix questions and on the 20 held-out questions.
set -euo pipefail
PY=${PY:-.venv/bin/python}; OUT=${OUT:-outputs/seq40}
NEW=${NEW:-$OUT/sequential/checkpoint}
methods='methods=[prompt_lookup,sequential_chain,hybrid_sequential_chain]'
echo "[$(date +%T)] reference questions"
$PY -m experiments.benchmark experiment=smollm2_reference checkpoints.sequential="$NEW" "$methods" logger=none \
  hydra.run.dir="$OUT/benchmark" > "$OUT/benchmark.log" 2>&1
echo "[$(date +%T)] held-out questions"
$PY -m experiments.benchmark experiment=smollm2_reference checkpoints.sequential="$NEW" "$methods" logger=none \
  prompts.set=null prompts.num_prompts=20 prompts.file=results/reference/2026-11-28-smollm2-engine/heldout_questions.jsonl \
  hydra.run.dir="$OUT/benchmark_heldout" > "$OUT/benchmark_heldout.log" 2>&1
echo "[$(date +%T)] done"
