"""Acceptance of every tree family at T > 0 with ranked against sampled candidates (README, "Trees at T > 0").

    python results/reference/2026-11-25-sampled-trees/tau.py <base checkpoint> [prompts] [seeds]

Each tree drafter of the base (the first medusa-*, sequential-* and prophet-* artifact trained on it) decodes
the benchmark's held-out prompts (64 tokens, 40 new) at T = 1 and 0.7 with gamma 4, its conf/drafter decode
settings (trees of 16 nodes; head trees grown from the checkpoint's measured rank accuracies) and the
benchmark's trimmed drafter vocabulary (2048 tokens), once with candidates=ranked (each node's top guesses,
the trees before sampled candidates) and once with candidates=sampled, over seeded runs. Prints tau (tokens
per target forward): acceptance only, no timing, so a busy machine does not change it.
"""

import glob
import json
import statistics
import sys

import torch
from omegaconf import OmegaConf

from experiments.lib.checkpoint import load_lm
from experiments.lib.data import prepare_data, token_counts
from experiments.lib.families import load_drafter
from experiments.lib.methods import head_accuracies
from experiments.lib.prompts import heldout_prompts
from verify.sampling import SamplingConfig
from verify.speculative import SpecConfig, speculative_generate
from verify.target import Target
from verify.vocab import frequent_tokens

torch.set_num_threads(1)
base_dir = sys.argv[1]
num_prompts, seeds = (int(sys.argv[2]) if len(sys.argv) > 2 else 16), (int(sys.argv[3]) if len(sys.argv) > 3 else 3)
base, tokenizer, meta = load_lm(base_dir)
data = prepare_data(**meta["data"]["config"])
prompts = heldout_prompts(data, num_prompts=num_prompts, prompt_len=64, seed=0)
vocab = frequent_tokens(token_counts(data, base.num_tokens), 2048)  # the benchmark's trimmed drafter vocabulary
out = {"base": base_dir, "prompts": num_prompts, "seeds": seeds, "gamma": 4, "max_new_tokens": 40, "rows": []}
for name in ("medusa", "sequential", "prophet"):
    directory = next(
        d
        for d in sorted(glob.glob(f"artifacts/{name}-*/checkpoint"))
        if json.load(open(f"{d}/meta.json"))["base_fingerprint"] == meta["fingerprint"]
    )
    module, family, drafter_meta = load_drafter(directory, base, meta)
    decode = OmegaConf.to_container(OmegaConf.load(f"conf/drafter/{name}.yaml").decode)
    decode.update(mode="tree", **head_accuracies(name, module, drafter_meta))
    for temperature in (1.0, 0.7):
        for candidates in ("ranked", "sampled"):
            taus = []
            for seed in range(seeds):
                drafter = family.make_drafter(module, base, **{**decode, "candidates": candidates}, vocab=vocab)
                gen = speculative_generate(
                    Target(base),
                    drafter,
                    prompts,
                    max_new_tokens=40,
                    spec=SpecConfig(gamma=4),
                    sampling=SamplingConfig(temperature=temperature),
                    generator=torch.Generator().manual_seed(seed),
                )
                taus.append(float(gen.stats.tau))
            row = dict(method=f"{name}_tree", checkpoint=directory, temperature=temperature, candidates=candidates)
            row.update(tau=statistics.mean(taus), tau_min=min(taus), tau_max=max(taus))
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
print(json.dumps(out, indent=1))
