#!/usr/bin/env bash
# Two 10-minute trainings side by side on one thread each (as the reference's lanes): the EAGLE-3 prophet trained
# one step (the equal-minutes control of the anchored test) and with a 5-step anchored training-time test at 64 anchors.
set -euo pipefail
cd /work/main
PY=.venv/bin/python
OUT=outputs/ablations_2026-11-29b
mkdir -p $OUT
data=(base=smollm2 features.source=generated features.windows=8032 features.prompt_len=256
      features.dir=outputs/data/features-smollm2-2m features.mapped=true eval_every=150 eval_blocks=32 logger=none threads=1)
prophet=(drafter=prophet drafter.module.arch=eagle3 'drafter.module.fuse_layers=[2,15,27]' max_minutes=10)
$PY -m experiments.train_drafter "${data[@]}" "${prophet[@]}" hydra.run.dir=$OUT/prophet_onestep > $OUT/prophet_onestep.log 2>&1 &
a=$!
$PY -m experiments.train_drafter "${data[@]}" "${prophet[@]}" drafter.loss.unroll=5 drafter.loss.anchors=64 \
  hydra.run.dir=$OUT/prophet_ttt5_a64 > $OUT/prophet_ttt5_a64.log 2>&1 &
b=$!
wait $a; wait $b
echo done
