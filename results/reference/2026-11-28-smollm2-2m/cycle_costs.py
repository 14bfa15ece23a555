"""Where a speculative cycle's time goes on SmolLM2 (bf16, 2 threads, batch 1, 200 random prompt tokens).

    .venv/bin/python results/reference/2026-11-28-smollm2-2m/cycle_costs.py > cycle_costs.txt

1. One target extend of k tokens and its rollback (commit with nothing kept: the gather/scatter a tree's
   commit does; a chain's commit is a length rewind), medians of 30 at a fixed cache length.
2. The decode loop with prompt lookup (gamma 3, greedy): each extend, greedy acceptance and commit timed inside
   the loop, against plain decoding's extends over the same prompt.
"""

import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
import verify.loop.speculative as loop  # noqa: E402
from experiments.lib.store.checkpoint import load_lm  # noqa: E402
from verify.backends.choose import make_target  # noqa: E402
from verify.drafters.prompt_lookup import PromptLookupDrafter  # noqa: E402
from verify.loop.plain import plain_generate  # noqa: E402

torch.set_num_threads(2)
base, _, _ = load_lm(next((ROOT / "artifacts" / "pretrained").glob("smollm2-*")))
target = make_target(base.to(torch.bfloat16).eval())
prompt = torch.randint(100, 40000, (200,), generator=torch.Generator().manual_seed(0)).tolist()


@torch.inference_mode()
def extend_and_rollback(k: int, n: int = 30) -> tuple[float, float]:
    target.prefill([prompt], last_logits=True)
    times = []
    for i in range(n + 5):
        tokens = torch.randint(100, 40000, (1, k))
        start = time.perf_counter()
        target.extend(tokens)
        mid = time.perf_counter()
        target.commit(torch.zeros((1, k), dtype=torch.bool))
        if i >= 5:
            times.append((mid - start, time.perf_counter() - mid))
    return statistics.median(t for t, _ in times), statistics.median(r for _, r in times)


for k in (1, 2, 4, 5, 8):
    e, r = extend_and_rollback(k)
    print(f"extend k={k}: {e * 1e3:.2f} ms; rollback of all {k} (gather/scatter): {r * 1e3:.3f} ms")

timed: dict[str, list[float]] = {"extend": [], "greedy_accept": [], "commit": []}


def timing(name, fn):
    def wrapped(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        timed[name].append(time.perf_counter() - start)
        return out

    return wrapped


target.extend, target.commit = timing("extend", target.extend), timing("commit", target.commit)
loop.greedy_accept = timing("greedy_accept", loop.greedy_accept)
drafter = PromptLookupDrafter(vocab_size=target.vocab_size)
for _ in range(3):  # the last of three runs (the first ones warm up)
    for v in timed.values():
        v.clear()
    start = time.perf_counter()
    loop.speculative_generate(
        target, drafter, [prompt], max_new_tokens=64, spec=loop.SpecConfig(gamma=3, rule="greedy")
    )
    total = time.perf_counter() - start
print(f"prompt lookup, gamma 3: {len(timed['extend'])} cycles, {total * 1e3:.1f} ms in all (prefill included)")
for name, values in timed.items():
    print(f"  {name}: median {statistics.median(values) * 1e3:.3f} ms per cycle, {sum(values) * 1e3:.1f} ms in all")
for _ in range(2):
    timed["extend"].clear()
    start = time.perf_counter()
    plain_generate(target, [prompt], max_new_tokens=64)
    total = time.perf_counter() - start
print(
    f"plain: {len(timed['extend'])} steps, median {statistics.median(timed['extend']) * 1e3:.3f} ms, "
    f"{total * 1e3:.1f} ms in all (prefill included)"
)
