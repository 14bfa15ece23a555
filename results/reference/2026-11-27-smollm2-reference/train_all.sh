#!/usr/bin/env bash
# The reference drafters on SmolLM2, one training at a time on one thread (the other core stays free).
cd /tmp/ref
PY=/work/main/.venv/bin/python
F="features.source=generated features.windows=128 features.prompt_len=256 features.dir=outputs/smollm2_reference/features"
for spec in prophet:30 medusa:20 sequential:12 prophet_block:10 draft:10; do
  fam=${spec%%:*}; min=${spec##*:}
  X=""; case $fam in prophet|prophet_block) X="drafter.module.dim=256";; esac
  echo "$(date +%T) $fam $min min"
  $PY -m experiments.train_drafter base=smollm2 drafter=$fam $F $X max_minutes=$min eval_every=100 logger=none threads=1 hydra.run.dir=outputs/smollm2_reference/$fam > outputs/smollm2_reference/$fam.out 2>&1
  echo "$(date +%T) $fam rc $?"; tail -c 600 outputs/smollm2_reference/$fam.out | grep -o '"best_mean_agree": [0-9.]*'
done
