#!/usr/bin/env bash
# The anchored-TTT prophet chain at a fixed gamma of 3 (budget=auto picks 1), beside lookup and the sequential chain.
cd "$(dirname "$0")/../../../.."
.venv/bin/python -m experiments.benchmark experiment=smollm2_reference \
  checkpoints.prophet=outputs/recipe_2026-11-29/prophet_ttt3/checkpoint \
  checkpoints.sequential=outputs/smollm2_reference_kernel/sequential/checkpoint \
  'methods=[prompt_lookup,prophet_chain,sequential_chain]' budget=fixed decode.gamma=3 logger=none \
  hydra.run.dir=outputs/diag_prophet_gamma3 > outputs/diag_prophet_gamma3.log 2>&1
