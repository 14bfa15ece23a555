#!/usr/bin/env bash
# Data-source comparison on SmolLM2: corpus windows (400 x 512, cached) vs the base's own answers (generated).
set -x
cd /work/main
PY=.venv/bin/python
T0=$(date +%s)
$PY -m experiments.cache_features base=smollm2 features.source=generated features.windows=128 features.prompt_len=256 threads=2 features.dir=outputs/s38/features_generated hydra.run.dir=outputs/s38/cache_generated > outputs/s38/cache_generated.json 2> outputs/s38/cache_generated.log
echo "generated cache seconds $(( $(date +%s) - T0 ))"
for src in generated corpus; do
  if [ $src = generated ]; then F="features.source=generated features.windows=128 features.prompt_len=256 features.dir=outputs/s38/features_generated"; else F="features.windows=400"; fi
  for fam in prophet medusa; do
    X=""; [ $fam = prophet ] && X="drafter.module.dim=256"
    $PY -m experiments.train_drafter base=smollm2 drafter=$fam $F $X max_minutes=5 eval_every=100 logger=none threads=2 hydra.run.dir=outputs/s38/${fam}_${src} > outputs/s38/${fam}_${src}.out 2>&1
  done
done
echo "all done $(( $(date +%s) - T0 ))"
