#!/usr/bin/env bash
# The rest of the reference drafters, after medusa: shorter trainings (the session's time), one thread each.
cd /tmp/ref
PY=/work/main/.venv/bin/python
while pgrep -f "drafter=medusa" > /dev/null; do sleep 5; done
echo "$(date +%T) medusa done"
F="features.source=generated features.windows=128 features.prompt_len=256 features.dir=outputs/smollm2_reference/features"
for spec in sequential:8 prophet_block:8 draft:6; do
  fam=${spec%%:*}; min=${spec##*:}
  X=""; case $fam in prophet|prophet_block) X="drafter.module.dim=256";; esac
  echo "$(date +%T) $fam $min min"
  $PY -m experiments.train_drafter base=smollm2 drafter=$fam $F $X max_minutes=$min eval_every=100 eval_blocks=16 logger=none threads=1 hydra.run.dir=outputs/smollm2_reference/$fam > outputs/smollm2_reference/$fam.out 2>&1
  echo "$(date +%T) $fam rc $?"; tail -c 600 outputs/smollm2_reference/$fam.out | grep -o '"best_mean_agree": [0-9.]*'
done
