#!/usr/bin/env bash
# Two lanes on one thread each, as the reference's: (a) the EAGLE-3 prophet for the reference's 30 minutes with the
# 3-step training-time test at 64 anchors; (b) the sequential heads for 10 minutes each with a draft vocabulary of
# 4,096 and of 8,192 tokens (the reference: 2,048), everything else the reference's.
set -euo pipefail
cd /work/main
PY=.venv/bin/python
OUT=outputs/recipe_2026-11-29
data=(base=smollm2 features.source=generated features.windows=8032 features.prompt_len=256
      features.dir=outputs/data/features-smollm2-2m features.mapped=true eval_every=150 eval_blocks=32 logger=none threads=1)
lane_a() {
  $PY -m experiments.train_drafter "${data[@]}" drafter=prophet drafter.module.arch=eagle3 'drafter.module.fuse_layers=[2,15,27]' \
    drafter.loss.unroll=3 drafter.loss.anchors=64 max_minutes=30 hydra.run.dir=$OUT/prophet_ttt3 > $OUT/prophet_ttt3.log 2>&1
}
lane_b() {
  for v in 4096 8192; do
    $PY -m experiments.train_drafter "${data[@]}" drafter=sequential vocab=$v max_minutes=10 \
      hydra.run.dir=$OUT/sequential_vocab$v > $OUT/sequential_vocab$v.log 2>&1
  done
}
lane_a & a=$!
lane_b & b=$!
wait $a; wait $b
echo done
