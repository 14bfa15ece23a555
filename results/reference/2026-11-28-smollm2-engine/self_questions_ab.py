"""A/B: the base's own questions with the shared prefix remembered vs prefilled per question (same questions?)."""
import sys, time, torch
torch.set_num_threads(2)
from experiments.lib.store.checkpoint import load_lm
from experiments.lib.store.pretrained import ensure_pretrained
from experiments.lib.data.chat import chat_template_for
from experiments.lib.data.self_questions import SelfQuestionSpec, generate_self_questions, STEERING
from verify.backends import target as target_mod

base, tok, meta = load_lm(str(ensure_pretrained("smollm2", "artifacts")), device="cpu")
base = base.to(torch.bfloat16)
template = chat_template_for(meta)
spec = SelfQuestionSpec(base_fingerprint=meta["fingerprint"], n=int(sys.argv[1]), categories=tuple(STEERING))
original = target_mod.Target.fill_row
results = {}
for mode in sys.argv[2:]:
    if mode == "off":
        target_mod.Target.fill_row = lambda self, row, prompt, remember=False: original(self, row, prompt, remember=False)
    else:
        target_mod.Target.fill_row = original
    t0 = time.perf_counter()
    kept, stats = generate_self_questions(base, tok, template, spec, batch=64)
    results[mode] = kept
    print(mode, f"{time.perf_counter() - t0:.1f} s", stats["tokens"], "tokens", stats["tokens_per_s"], "tok/s", stats["candidates"], "candidates", flush=True)
if len(results) == 2:
    print("same questions:", results["on"] == results["off"])
