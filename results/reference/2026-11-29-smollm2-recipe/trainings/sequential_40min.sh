#!/usr/bin/env bash
# The sequential heads trained for 40 minutes on both cores (the reference's recipe otherwise; the reference trains
# them for 10 minutes on one thread): the candidate for results/drafters/sequential. Resumable: run again to go on.
set -euo pipefail
PY=${PY:-.venv/bin/python}; OUT=${OUT:-outputs/seq40}
mkdir -p "$OUT"
$PY -m experiments.train_drafter base=smollm2 features.source=generated features.windows=8032 features.prompt_len=256 \
  features.dir=outputs/data/features-smollm2-2m features.mapped=true drafter=sequential max_minutes=40 eval_every=300 \
  eval_blocks=32 logger=none threads=2 hydra.run.dir="$OUT/sequential" > "$OUT/sequential.log" 2>&1
