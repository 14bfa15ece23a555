#!/usr/bin/env bash
# The SmolLM2 reference end to end, on a CPU: the data engine's answers and features, every drafter family trained
# on them (two trainings side by side on one thread each), then the benchmark (experiment=smollm2_reference).
#   bash experiments/smollm2_reference.sh
# Resumable at every stage: run it again after an interruption and answer shards, the feature cache (grown in place
# when WINDOWS is raised) and each training (its max_minutes counting the earlier runs) go on where they stopped.
# A fresh reference needs a fresh OUT (a finished training is not trained again).
# Settings (environment):
#   WINDOWS   answered turns to train on (prompts <= 256 tokens, cut to 512-token windows; about 250 answer tokens
#             each: 8000 for 2M answer tokens), default 8000
#   OUT       the runs' directory, default outputs/smollm2_reference (what the experiment's checkpoints name)
#   FEATURES  the feature cache, default outputs/data/features-smollm2 (hidden states and layers 2, 15, 27 in bf16:
#             about 2.3 KB per layer per position, 18 GB at 8000 windows: the trainings read it through memory maps)
#   SCALE     multiplies every training's minutes (0.02 for a dry run), default 1
#   BENCH     extra overrides of the benchmark (e.g. "prompts.num_prompts=2 decode.max_new_tokens=8")
# Minutes per family (one thread each): prophet 30 (EAGLE-3, layers 2/15/27, with a 3-step training-time test at
# 64 anchors: its steps 2 and 3 agree .33 / .29 with the base at 30 minutes, against .17 / .13 trained one step),
# medusa 20, sequential 10, prophet_block (dim 256) 10, draft (init=base: SmolLM2's first 2 blocks) 10, early_exit
# (layer 2) 5; the two lanes below take 45 and 40 minutes.
set -euo pipefail
PY=${PY:-.venv/bin/python}; WINDOWS=${WINDOWS:-8000}; SCALE=${SCALE:-1}; BENCH=${BENCH:-}
OUT=${OUT:-outputs/smollm2_reference}; FEATURES=${FEATURES:-outputs/data/features-smollm2}
[[ $WINDOWS =~ ^[1-9][0-9]*$ ]] || { echo "error: WINDOWS=$WINDOWS: must be a whole number of windows >= 1" >&2; exit 2; }
[[ $SCALE =~ ^[0-9]*\.?[0-9]+$ ]] && [[ ! $SCALE =~ ^0*\.?0*$ ]] \
  || { echo "error: SCALE=$SCALE: must be a number > 0 (it multiplies each training's minutes)" >&2; exit 2; }
mkdir -p "$OUT"
data=(base=smollm2 features.source=generated features.windows=$WINDOWS features.prompt_len=256
      features.dir=$FEATURES)
stamp() { echo "[$(date +%T)] $*"; }

stamp "answers and features: $WINDOWS windows into $FEATURES (log: $OUT/cache_features.log)"
$PY -m experiments.cache_features "${data[@]}" 'layers=[2,15,27]' threads=2 hydra.run.dir="$OUT/cache_features" \
  > "$OUT/cache_features.log" 2>&1 || { stamp "cache_features failed: tail $OUT/cache_features.log"; exit 1; }

train() {  # <family> <minutes> <overrides...>: one training on one thread, its log beside its run directory
  local family=$1 minutes; minutes=$($PY -c "print(round($2 * $SCALE, 3))"); shift 2
  stamp "train $family for $minutes min (log: $OUT/$family.log)"
  $PY -m experiments.train_drafter "${data[@]}" features.mapped=true drafter="$family" "$@" max_minutes="$minutes" \
    eval_every=150 eval_blocks=32 logger=none threads=1 hydra.run.dir="$OUT/$family" > "$OUT/$family.log" 2>&1 \
    || { stamp "$family failed: tail $OUT/$family.log"; return 1; }
}
lane_a() {
  train prophet 30 drafter.module.arch=eagle3 'drafter.module.fuse_layers=[2,15,27]' drafter.loss.unroll=3 \
    drafter.loss.anchors=64 && train draft 10 \
    drafter.module.init=base && train early_exit 5
}
lane_b() { train medusa 20 && train sequential 10 && train prophet_block 10 drafter.module.dim=256; }
lane_a & a=$!
lane_b & b=$!
failed=0; wait $a || failed=1; wait $b || failed=1
[ $failed = 0 ] || { stamp "a training failed: the benchmark needs every family"; exit 1; }

stamp "benchmark (log: $OUT/benchmark.log)"
checkpoints=()
for family in prophet medusa sequential prophet_block draft early_exit; do
  checkpoints+=("checkpoints.$family=$OUT/$family/checkpoint")
done
# shellcheck disable=SC2086  # BENCH is a list of overrides
$PY -m experiments.benchmark experiment=smollm2_reference "${checkpoints[@]}" hydra.run.dir="$OUT/benchmark" $BENCH \
  > "$OUT/benchmark.log" 2>&1 || { stamp "benchmark failed: tail $OUT/benchmark.log"; exit 1; }
stamp "done: $OUT/benchmark/results.md"
