"""Plain decoding against x-transformers' own AutoregressiveWrapper.generate on the same weights and prompts.

    python -m experiments.baseline base_checkpoint=outputs/reference/base_small/checkpoint

Our plain decoding is the baseline of every speedup, so it must be at least as fast as the library's
generate. Both run greedy with a KV cache, batch 1, one prompt at a time, interleaved over `repeats`
rounds after a warm-up; the outputs must be identical. Prints one JSON object as the last line.
It reads the benchmark's config, checked by experiments/lib/methods/decode_checks.py; its prompts and base checkpoint
come from experiments/lib/methods/registry.py, as the benchmark's do.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import hydra
import torch
from omegaconf import DictConfig, ListConfig
from x_transformers import AutoregressiveWrapper

from experiments.lib.cli.preflight import hydra_preflight
from experiments.lib.common.errors import exit_on_user_error
from experiments.lib.methods.decode_checks import (
    check_checkpoints,
    check_decode,
    check_prompts,
    check_run,
    command_line_keys,
)
from experiments.lib.methods.prompt_set import get_prompts
from experiments.lib.methods.registry import checkpoint_for
from experiments.lib.store.checkpoint import load_lm
from experiments.lib.training.settings import check_bool, check_int
from verify.backends.hf import HFBase
from verify.backends.target import Target
from verify.loop.plain import plain_generate


def _ours(target: Target, prompts: list[list[int]], n: int) -> list[list[int]]:
    return [plain_generate(target, [p], max_new_tokens=n).tokens[0] for p in prompts]


def _theirs(wrapper: AutoregressiveWrapper, prompts: list[list[int]], n: int, device) -> list[list[int]]:
    outs = []
    for p in prompts:
        x = torch.tensor([p], device=device)
        outs.append(wrapper.generate(x, n, temperature=0.0, cache_kv=True)[0].tolist())
    return outs


def _timed(fn) -> tuple[list, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def check_config(cfg: DictConfig) -> None:
    """Every setting the baseline reads (of the benchmark's config), before anything loads or trains."""
    check_run(cfg)
    for key, allowed in (("threads", "null or an integer >= 1"), ("compile", "true or false")):
        if isinstance(cfg[key], ListConfig):  # the benchmark times a list of settings side by side
            raise ValueError(f"{key}={cfg[key]!r}: the baseline takes one setting, {allowed}")
    check_int("threads", cfg.threads, allow_null=True)
    check_bool("compile", cfg.compile)
    check_int("repeats", cfg.repeats)
    check_decode(cfg.decode)  # it decodes greedily, decode.max_new_tokens tokens: the rest is checked, not read
    typed = sorted(k for k in command_line_keys() if k.startswith("decode.") and k != "decode.max_new_tokens")
    if typed:
        raise ValueError(
            f"{typed[0]} is not read by the baseline: it decodes greedily, one prompt at a time, "
            "decode.max_new_tokens tokens"
        )
    check_prompts(cfg.prompts)
    check_checkpoints(cfg, ["base"])


def compare(cfg: DictConfig) -> dict:
    check_config(cfg)
    device = check_run(cfg)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    base, tokenizer, meta = load_lm(checkpoint_for(cfg, "base"), device=str(device))
    if isinstance(base, HFBase):
        raise ValueError(
            "the baseline compares against x-transformers' generate; for a Hugging Face base run "
            "python -m experiments.peer (against transformers' generate)"
        )
    prompts = get_prompts(cfg, tokenizer, meta)
    n = cfg.decode.max_new_tokens
    target, wrapper = Target(base, compile=cfg.compile), AutoregressiveWrapper(base)
    with torch.inference_mode():
        _ours(target, prompts[:1], n), _theirs(wrapper, prompts[:1], n, device)  # warm-up
        ours_tps, theirs_tps = [], []
        for r in range(cfg.repeats):  # alternate who goes first, so neither always runs on a warmer machine
            if r % 2:
                theirs, t_theirs = _timed(lambda: _theirs(wrapper, prompts, n, device))
            ours, t_ours = _timed(lambda: _ours(target, prompts, n))
            if not r % 2:
                theirs, t_theirs = _timed(lambda: _theirs(wrapper, prompts, n, device))
            ours_tps.append(len(prompts) * n / t_ours)
            theirs_tps.append(len(prompts) * n / t_theirs)
    if ours != theirs:
        raise RuntimeError("plain greedy decoding differs from x-transformers' generate on the same weights")
    ratios = [a / b for a, b in zip(ours_tps, theirs_tps)]
    return {
        "parameters": sum(p.numel() for p in base.parameters()),
        "prompts": len(prompts),
        "max_new_tokens": n,
        "plain_tokens_per_s": statistics.median(ours_tps),
        "xtransformers_generate_tokens_per_s": statistics.median(theirs_tps),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "identical": True,
        "device": str(device),
        "compiled": cfg.compile,
        "threads": torch.get_num_threads(),
    }


@hydra_preflight
@hydra.main(version_base="1.3", config_path="../conf", config_name="benchmark")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    print(json.dumps(compare(cfg)), file=sys.stdout)


if __name__ == "__main__":
    main()
