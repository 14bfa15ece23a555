#!/usr/bin/env bash
# The prefix-layer sequential heads of heads/lanes.sh decoded on SmolLM2 (12 chat_mix questions, 64 tokens, gamma 3).
cd "$(dirname "$0")/../../../.."
.venv/bin/python -m experiments.benchmark experiment=smollm2_reference \
  checkpoints.sequential=outputs/heads_2026-11-29/sequential_prefix/checkpoint \
  'methods=[sequential_chain,sequential_tree]' budget=fixed decode.gamma=3 logger=none \
  hydra.run.dir=outputs/diag_prefix > outputs/diag_prefix.log 2>&1
