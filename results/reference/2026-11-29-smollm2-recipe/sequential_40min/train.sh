#!/usr/bin/env bash
# The sequential heads trained for 40 minutes on both cores (the reference's recipe otherwise; the reference trains
# them for 10 minutes on one thread): the shipped results/drafters/sequential. Resumable: run again to go on.
# FEATURES: the reference's feature cache (experiments/smollm2_reference.sh builds it); OUT: where the run goes.
# The shipped run: OUT=outputs/seq40 FEATURES=outputs/data/features-smollm2-2m (2026-11-29, 40.1 minutes, 3,378 steps).
set -euo pipefail
PY=${PY:-.venv/bin/python}; OUT=${OUT:-outputs/seq40}; FEATURES=${FEATURES:-outputs/data/features-smollm2-2m}
mkdir -p "$OUT"
$PY -m experiments.train_drafter base=smollm2 features.source=generated features.windows=8032 features.prompt_len=256 \
  features.dir="$FEATURES" features.mapped=true drafter=sequential max_minutes=40 eval_every=300 \
  eval_blocks=32 logger=none threads=2 hydra.run.dir="$OUT/sequential" > "$OUT/sequential.log" 2>&1
