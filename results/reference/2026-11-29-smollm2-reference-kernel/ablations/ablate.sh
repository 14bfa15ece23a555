#!/usr/bin/env bash
# Two 10-minute trainings side by side on one thread each (as the reference's lanes): the EAGLE-3 prophet with a
# 3-step anchored training-time test, and the sequential heads with the kl_tv loss; everything else the reference's.
set -euo pipefail
cd /work/main
PY=.venv/bin/python
OUT=outputs/ablations_2026-11-29
mkdir -p $OUT
data=(base=smollm2 features.source=generated features.windows=8032 features.prompt_len=256
      features.dir=outputs/data/features-smollm2-2m features.mapped=true eval_every=150 eval_blocks=32 logger=none threads=1)
$PY -m experiments.train_drafter "${data[@]}" drafter=prophet drafter.module.arch=eagle3 'drafter.module.fuse_layers=[2,15,27]' \
  drafter.loss.unroll=3 drafter.loss.anchors=64 max_minutes=10 hydra.run.dir=$OUT/prophet_ttt3_a64 > $OUT/prophet_ttt3_a64.log 2>&1 &
a=$!
$PY -m experiments.train_drafter "${data[@]}" drafter=sequential drafter.loss.target=kl_tv max_minutes=10 \
  hydra.run.dir=$OUT/sequential_kl_tv > $OUT/sequential_kl_tv.log 2>&1 &
b=$!
wait $a; wait $b
echo done
