cd /work/main
for src in generated corpus; do
.venv/bin/python -m experiments.benchmark base=smollm2 prompts=chat_mix prompts.num_prompts=12 'methods=[medusa_chain,medusa_tree,prophet_chain,prophet_tree]' checkpoints.medusa=outputs/s38/medusa_$src/checkpoint checkpoints.prophet=outputs/s38/prophet_$src/checkpoint prophet.module.dim=256 decode.max_new_tokens=48 repeats=1 threads=2 logger=none hydra.run.dir=outputs/s38/bench_$src > outputs/s38/bench_$src.out 2>&1
done
