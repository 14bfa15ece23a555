#!/usr/bin/env bash
# Head recipes at equal minutes (10 each), two lanes of one thread, everything else the reference's
# (experiments/smollm2_reference.sh): three pairs, each pair side by side.
#   1. sequential heads: the reference's recipe (the control) | Hydra++'s prefix layer (16 windows per step: the layer
#      runs over whole windows, so 64 would leave a handful of steps; 2,048 positions drawn from them, as the control)
#   2. sequential heads with Hydra++'s dropout 0.1 | Medusa heads from PyTorch's default init (init=random)
#   3. Medusa heads with Medusa-1's init (the control) | sequential heads with the prefix layer and dropout 0.1
# Usage: bash results/reference/2026-11-29-smollm2-recipe/heads/lanes.sh  (OUT=outputs/heads_2026-11-29 by default)
set -euo pipefail
PY=${PY:-.venv/bin/python}; OUT=${OUT:-outputs/heads_2026-11-29}
mkdir -p "$OUT"
data=(base=smollm2 features.source=generated features.windows=8032 features.prompt_len=256
      features.dir=outputs/data/features-smollm2-2m features.mapped=true eval_every=150 eval_blocks=32 logger=none
      threads=1 max_minutes=10)
run() {  # name, overrides...
  local name=$1; shift
  echo "[$(date +%T)] $name"
  $PY -m experiments.train_drafter "${data[@]}" "$@" hydra.run.dir="$OUT/$name" > "$OUT/$name.log" 2>&1
}
run sequential_control drafter=sequential & a=$!
run sequential_prefix drafter=sequential drafter.module.prefix=true drafter.batch_size=16 & b=$!
wait $a; wait $b
run sequential_dropout drafter=sequential drafter.module.dropout=0.1 & a=$!
run medusa_random drafter=medusa drafter.module.init=random & b=$!
wait $a; wait $b
run medusa_control drafter=medusa & a=$!
run sequential_prefix_dropout drafter=sequential drafter.module.prefix=true drafter.module.dropout=0.1 \
  drafter.batch_size=16 & b=$!
wait $a; wait $b
echo "[$(date +%T)] done"
