#!/usr/bin/env bash
# The device check for a lent GPU machine (the `device` tool's `run`, carry [".whl", ".gpu_shape"]):
#   1. the CUDA tests (pytest -m cuda);
#   2. engine costs of a base of SmolLM2-135M's shape (30 x 576, 9/3 heads, vocabulary 49,152) with random
#      weights: SmolLM2's 98 MB file cannot be carried there, and a step's cost does not depend on the weights;
#   3. a short GPU benchmark of the toy base's drafters (eager and CUDA graphs, bf16).
# Every stage has its own time limit so that a slow one cannot eat the others'; logs and tables go to $OUT.
set -uo pipefail
# The machine's own huggingface-hub matches its transformers; the carried 2.x (for datasets) breaks its import.
wheels=$(ls .whl/*.whl | grep -v huggingface_hub); rm -rf "$HOME"/site/huggingface_hub*
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$HOME"/site $wheels \
  && export PYTHONPATH="$HOME"/site:$PWD PYTHONUNBUFFERED=1 || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

timeout 170 python3 -m pytest -m cuda tests/test_cuda.py -q -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tail -40 > "$OUT/pytest_cuda.txt"
echo "pytest rc ${PIPESTATUS[0]}" >> "$OUT/pytest_cuda.txt"

shape=/tmp/smollm2_shape
python3 - "$shape" <<'PY'
import shutil, sys, pathlib, torch
from transformers import LlamaConfig, LlamaForCausalLM
out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig.from_pretrained(".gpu_shape"))
model.save_pretrained(out)
for f in pathlib.Path(".gpu_shape").iterdir():
    if f.name != "config.json":
        shutil.copy(f, out / f.name)
print("random-weight base of SmolLM2's shape:", sum(p.numel() for p in model.parameters()), "parameters")
PY
timeout 200 python3 -m experiments.engine_costs base_checkpoint=$shape device=cuda dtypes=[bf16,fp32] \
  'compile=[false,graph]' max_new_tokens=64 hydra.run.dir="$OUT/engine_costs" 2>&1 | tail -60 > "$OUT/engine_costs.txt"

[ "${TOY_LIMIT:-200}" = 0 ] || timeout "${TOY_LIMIT:-200}" python3 -m experiments.benchmark experiment=demo device=cuda dtype=auto \
  'compile=[false,graph]' 'methods=[prompt_lookup,medusa_tree,prophet_chain,prophet_tree]' \
  'artifacts.base=["experiment=base_small","max_minutes=1","logger=none","batch_size=64"]' \
  'artifacts.medusa=["max_minutes=0.3","eval_every=100","logger=none","features.windows=2000"]' \
  'artifacts.prophet=["max_minutes=0.4","eval_every=100","logger=none","features.windows=2000"]' \
  logger=none hydra.run.dir="$OUT/toy_benchmark" 2>&1 | tail -60 > "$OUT/toy_benchmark.txt"
find "$OUT" -name '*.safetensors' -delete
ls -R "$OUT" | head -40
