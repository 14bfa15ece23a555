"""What sharing the target's KV cache saves the early-exit drafter, measured (README, "Early exit").

    python results/reference/2026-11-23-families/share_cache.py \
        <base checkpoint> <exit head checkpoint> [threads] [rounds]

The same exit head drafts with share_cache=true (on the target's own cache) and false (an own cache of the
first blocks, prefilled with the prompt), interleaved over rounds on the reference benchmark's held-out
prompts at T=0 and gamma 4, drafting from the 2048 most frequent tokens; both draft the same tokens, so
only the drafter's time differs. Prints the medians per round of the drafter's `begin` per prompt (its own
prefill) and its drafting time per step.
"""

import json
import statistics
import sys

import torch

from experiments.lib.calibrate import pilot
from experiments.lib.checkpoint import load_lm
from experiments.lib.data import prepare_data, token_counts
from experiments.lib.families import load_drafter
from experiments.lib.prompts import heldout_prompts
from verify.sampling import SamplingConfig
from verify.speculative import SpecConfig
from verify.target import Target
from verify.vocab import frequent_tokens

base_dir, head_dir = sys.argv[1], sys.argv[2]
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 2)
base, tokenizer, meta = load_lm(base_dir)
head, family, _ = load_drafter(head_dir, base, meta)
data = prepare_data(**meta["data"]["config"])
prompts = heldout_prompts(data, num_prompts=10, prompt_len=64, seed=0)
vocab = frequent_tokens(token_counts(data, base.num_tokens), 2048)  # the benchmark's trimmed drafter vocabulary
target = Target(base)
rows = {True: [], False: []}
for _ in range(int(sys.argv[4]) if len(sys.argv) > 4 else 5):
    for share in (True, False):
        r = pilot(
            target,
            lambda share=share: family.make_drafter(head, base, share_cache=share, vocab=vocab),
            prompts,
            spec=SpecConfig(gamma=4),
            sampling=SamplingConfig(),
            eos_id=None,
            max_new_tokens=64,
            seed=0,
        )
        rows[share].append(r)
out = {}
for share, runs in rows.items():
    out["shared" if share else "own cache"] = {
        "begin_ms_per_prompt": statistics.median(r["begin_seconds_per_batch"] for r in runs) * 1e3,
        "draft_ms_per_step": statistics.median(r["draft_seconds_per_step"] for r in runs) * 1e3,
        "tau": runs[0]["tau"],
        "threads": torch.get_num_threads(),
        "layer": head.layer,
    }
print(json.dumps(out, indent=1))
