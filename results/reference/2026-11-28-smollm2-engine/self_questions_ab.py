"""The base's own questions with the shared prompt's prefill remembered ("on") or run per candidate ("off").

python results/reference/2026-11-28-smollm2-engine/self_questions_ab.py 96 on off
"""

import sys
import time

import torch

from experiments.lib.data.chat import chat_template_for
from experiments.lib.data.self_questions import STEERING, SelfQuestionSpec, generate_self_questions
from experiments.lib.store.checkpoint import load_lm
from experiments.lib.store.pretrained import ensure_pretrained
from verify.backends import target as target_mod


def forget(self, row, prompt, remember=False):
    return original(self, row, prompt, remember=False)


torch.set_num_threads(2)
base, tok, meta = load_lm(str(ensure_pretrained("smollm2", "artifacts")), device="cpu")
base = base.to(torch.bfloat16)
template = chat_template_for(meta)
spec = SelfQuestionSpec(base_fingerprint=meta["fingerprint"], n=int(sys.argv[1]), categories=tuple(STEERING))
original = target_mod.Target.fill_row
results = {}
for mode in sys.argv[2:]:
    target_mod.Target.fill_row = forget if mode == "off" else original
    t0 = time.perf_counter()
    kept, stats = generate_self_questions(base, tok, template, spec, batch=64)
    results[mode] = kept
    seconds = time.perf_counter() - t0
    print(
        mode,
        f"{seconds:.1f} s",
        stats["tokens"],
        "tokens",
        stats["tokens_per_s"],
        "tok/s",
        stats["candidates"],
        "candidates",
    )
if len(results) == 2:
    print("same questions:", results["on"] == results["off"])
