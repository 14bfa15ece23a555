"""The draft cost of early exit on SmolLM2, per exit layer: one draft step (the first `layer` blocks on the target's
own cache, then an exit head over the 2,048-token trimmed vocabulary) over one plain decoding step (all 30 blocks
and the full 49,152-token output layer), both eager at batch 1 on a 128-token prompt, in interleaved rounds so a
change of machine load lands on both. A fresh head (the logit lens) costs what a trained one does.

    python results/early_exit/2026-11-28-smollm2/draft_cost.py --layers 4 8 12 16 20 24 --dtype bf16 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from experiments.lib.families import early_exit as exit_family
from verify.backends.hf import load_hf_base
from verify.backends.lean import lean
from verify.backends.target import Target

BASE = "artifacts/pretrained/smollm2-b179c9523d0e"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", required=True)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base = load_hf_base(BASE, dtype=DTYPES[args.dtype])
    vocab = torch.arange(2048)  # the size of the trimmed vocabulary the benchmark drafts from (which ids: no matter)
    heads = {layer: exit_family.build(base, layer=layer).eval().for_decoding(vocab) for layer in args.layers}
    engine = lean(base)
    target = Target(base)
    prompt = torch.randint(0, base.num_tokens, (1, 128), generator=torch.Generator().manual_seed(0)).tolist()
    target.prefill(prompt)
    token = torch.tensor([[42]])
    keep = torch.zeros(1, 1, dtype=torch.bool)

    @torch.inference_mode()
    def plain() -> None:  # a decode step, then its entry rewound: the cache stays at the prompt's length
        target.extend(token)
        target.cache.commit(keep, prefix=True)

    def draft(layer: int):
        @torch.inference_mode()
        def step() -> None:  # what EarlyExitDrafter.propose does per drafted token, and its rewind
            heads[layer](engine.first_blocks(token, target.cache, blocks=layer))
            target.cache.commit(keep, prefix=True)

        return step

    runs = {"plain": plain} | {f"layer {layer}": draft(layer) for layer in args.layers}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():  # warm-up
        run()
    for _ in range(args.rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            for _ in range(args.reps):
                run()
            seconds[name].append((time.perf_counter() - start) / args.reps)
    step = statistics.median(seconds["plain"])
    print(f"plain step {1e3 * step:.2f} ms ({args.dtype}, {args.threads} thread(s), median of {args.rounds} rounds)")
    print("| layer | draft step (ms) | draft / plain step | layer / 30 |")
    print("|---|---|---|---|")
    for layer in args.layers:
        ms = statistics.median(seconds[f"layer {layer}"])
        print(f"| {layer} | {1e3 * ms:.2f} | {ms / step:.3f} | {layer / 30:.3f} |")


if __name__ == "__main__":
    main()
