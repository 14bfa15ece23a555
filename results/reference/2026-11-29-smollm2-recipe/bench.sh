#!/usr/bin/env bash
# The SmolLM2 reference benchmark with the new prophet recipe (the 3-step anchored training-time test, 30 minutes;
# every other family the 2026-11-29 reference's checkpoints, trained by the unchanged recipe), then the held-out
# questions of 10 categories with the chains and the hybrids.
set -euo pipefail
cd /work/main
PY=.venv/bin/python
REF=outputs/smollm2_reference_kernel
OUT=outputs/recipe_2026-11-29
ck=()
for f in medusa sequential prophet_block draft early_exit; do ck+=("checkpoints.$f=$REF/$f/checkpoint"); done
ck+=("checkpoints.prophet=$OUT/prophet_ttt3/checkpoint")
echo "[$(date +%T)] reference benchmark"
$PY -m experiments.benchmark experiment=smollm2_reference "${ck[@]}" hydra.run.dir=$OUT/benchmark > $OUT/benchmark.log 2>&1
echo "[$(date +%T)] held-out benchmark"
$PY -m experiments.benchmark experiment=smollm2_reference "${ck[@]}" prompts.set=null prompts.num_prompts=20 \
  prompts.file=results/reference/2026-11-28-smollm2-engine/heldout_questions.jsonl \
  'methods=[prompt_lookup,medusa_chain,prophet_chain,sequential_chain,hybrid_medusa_chain,hybrid_prophet_chain,hybrid_sequential_chain]' \
  hydra.run.dir=$OUT/benchmark_heldout > $OUT/benchmark_heldout.log 2>&1
echo "[$(date +%T)] done"
