#!/usr/bin/env bash
# Both cores on one training: the sequential heads and the anchored-TTT EAGLE-3 prophet, 5 minutes each on 2 threads,
# one after the other, alone on the machine; everything else the reference's. Against two side-by-side lanes of one
# thread, a 2-thread training pays only if it makes more than twice a lane's steps per minute.
set -euo pipefail
cd /work/main
PY=.venv/bin/python
OUT=outputs/threads_2026-11-29
data=(base=smollm2 features.source=generated features.windows=8032 features.prompt_len=256
      features.dir=outputs/data/features-smollm2-2m features.mapped=true eval_every=150 eval_blocks=32 logger=none threads=2)
$PY -m experiments.train_drafter "${data[@]}" drafter=sequential max_minutes=5 hydra.run.dir=$OUT/sequential_2t \
  > $OUT/sequential_2t.log 2>&1
$PY -m experiments.train_drafter "${data[@]}" drafter=prophet drafter.module.arch=eagle3 'drafter.module.fuse_layers=[2,15,27]' \
  drafter.loss.unroll=3 drafter.loss.anchors=64 max_minutes=5 hydra.run.dir=$OUT/prophet_ttt3_2t > $OUT/prophet_ttt3_2t.log 2>&1
echo done
