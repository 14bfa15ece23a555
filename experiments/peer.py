"""Peer benchmark: this project's decoding against transformers' own `generate`, on the same Hugging Face
model, assistant and prompts, in one process.

    python -m experiments.peer                      # trains (once, cached) a Llama base and assistant
    python -m experiments.peer checkpoints.base=<dir> checkpoints.assistant=<dir>

Pairs, each at temperature 0 where both must emit the same tokens:
- plain: our plain decoding vs `generate(do_sample=False)`;
- draft: our draft-model speculative decoding vs assisted generation (`assistant_model=`) with the same
  assistant, at our gamma with its confidence threshold off ("same gamma"), and at transformers' own
  defaults (20 tokens, confidence threshold 0.4, adjusted as it goes);
- prompt lookup: ours vs `prompt_lookup_num_tokens=gamma, max_matching_ngram_size=max_ngram`.
Batch 1 for every pair (transformers' assisted generation and prompt lookup take one row); at larger
batch sizes our batched decoding is timed beside transformers' batched plain generate.
tau = new tokens per forward of the target (for transformers counted by a hook on the target's
backbone); tokens/s = new tokens over wall time; ratio = ours / theirs, median over interleaved rounds.
Its settings are checked with experiments/lib/methods/decode_checks.py's and experiments/lib/training/settings.py's
validators.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from experiments.lib.cli.preflight import hydra_preflight
from experiments.lib.common.errors import exit_on_user_error, write_atomic
from experiments.lib.common.machine import cpu_model, device_info, device_line
from experiments.lib.data.pipeline import base_data_config, prepare_data
from experiments.lib.data.prompts import heldout_prompts
from experiments.lib.methods.decode_checks import check_checkpoints, check_prompt_lookup, check_run
from experiments.lib.store.checkpoint import is_hf_directory, load_lm, read_meta, tokenizer_mismatch
from experiments.lib.store.rundir import check_writable
from experiments.lib.training.artifacts import ensure
from experiments.lib.training.settings import check_bool, check_int
from verify.backends.choose import ENGINES, make_target
from verify.backends.hf import HFBase
from verify.drafters.draft_model import DraftModelDrafter
from verify.drafters.prompt_lookup import PromptLookupDrafter
from verify.loop.plain import Generation, plain_generate
from verify.loop.speculative import SpecConfig, speculative_generate

log = logging.getLogger(__name__)
PAIRS = ("plain", "draft", "prompt_lookup")


def check_config(cfg: DictConfig) -> None:
    """One-line errors for every setting, before any model loads or trains."""
    check_run(cfg)
    check_int("prompts.num_prompts", cfg.prompts.num_prompts)
    check_int("prompts.prompt_len", cfg.prompts.prompt_len)
    for key in ("max_new_tokens", "gamma", "repeats"):
        check_int(key, cfg[key])
    sizes = list(cfg.batch_sizes)
    if not sizes:
        raise ValueError(f"batch_sizes={sizes!r}: must be a non-empty list of integers >= 1")
    for i, size in enumerate(sizes):
        check_int(f"batch_sizes[{i}]", size)
    check_int("threads", cfg.threads, allow_null=True)
    check_prompt_lookup(cfg.prompt_lookup)
    settings = list(cfg.ours)
    if not settings or any(set(s) != {"engine", "compile"} or s["engine"] not in ENGINES for s in settings):
        raise ValueError(
            f"ours={OmegaConf.to_container(cfg.ours)!r}: must be a non-empty list of {{engine: "
            f"{'|'.join(ENGINES)}, compile: true|false}}"
        )
    for i, setting in enumerate(settings):
        check_bool(f"ours[{i}].compile", setting["compile"])
    if any(s["engine"] == "hf" and s["compile"] for s in settings):
        raise ValueError(
            "ours: {engine: hf, compile: true}: the transformers adapter runs eager only; compile the lean engine"
        )
    check_checkpoints(cfg, ["base", "assistant"])
    for name in ("base", "assistant"):  # a checkpoint of this project must hold a Llama (arch=llama)
        path = cfg.checkpoints[name]
        if (
            path is not None
            and not is_hf_directory(Path(path))
            and read_meta(path)["model_config"].get("arch") != "llama"
        ):
            raise ValueError(
                f"checkpoints.{name}={path} is an x-transformers LM: the peer benchmark compares against "
                "transformers, so both models must be Hugging Face models (train_base base=llama_small, "
                "or a save_pretrained directory)"
            )
    check_writable(cfg.out_dir, "out_dir")


def load_pair(cfg: DictConfig, device: torch.device) -> tuple[HFBase, HFBase, Any, dict, str]:
    """The target and assistant (trained by their recipes when no checkpoint is given), both Hugging Face models."""
    base_dir = cfg.checkpoints.base or str(ensure("base", list(cfg.artifacts.base), root=cfg.artifacts.root))
    base, tokenizer, meta = load_lm(base_dir, device=str(device), role="checkpoints.base")
    assistant_dir = cfg.checkpoints.assistant
    if assistant_dir is None:  # the assistant learns the base's corpus with the base's tokenizer
        data = [f"data.{k}={json.dumps(v)}" for k, v in sorted(base_data_config(meta, {}).items())]
        assistant_dir = str(ensure("base", [*cfg.artifacts.assistant, *data], root=cfg.artifacts.root))
    assistant, assistant_tokenizer, _ = load_lm(assistant_dir, device=str(device), role="checkpoints.assistant")
    for name, model in (("base", base), ("assistant", assistant)):
        if not isinstance(model, HFBase):
            raise ValueError(
                f"{name} {type(model).__name__}: the peer benchmark compares against transformers, so both "
                "models must be Hugging Face models (train_base base=llama_small, or a save_pretrained directory)"
            )
    if assistant_tokenizer.to_str() != tokenizer.to_str():
        raise ValueError(
            tokenizer_mismatch(
                f"assistant {assistant_dir}", assistant_tokenizer, tokenizer, "train it on the base's data config"
            )
        )
    return base, assistant, tokenizer, meta, base_dir


class ForwardCounter:
    """Counts forwards of a module (the target's backbone): one hook for the whole run."""

    def __init__(self, module: torch.nn.Module):
        self.calls = 0
        module.register_forward_hook(lambda *_: setattr(self, "calls", self.calls + 1))


def theirs(
    base: HFBase, assistant: HFBase, pair: str, prompts: list[list[int]], cfg: DictConfig, variant: str
) -> list[list[int]]:
    """transformers' generate on a batch of equal-length prompts (no padding needed) -> new tokens per row."""
    ids = torch.tensor(prompts, device=base.to_logits.weight.device)
    kwargs: dict[str, Any] = dict(
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=cfg.max_new_tokens,
        eos_token_id=None,
        pad_token_id=0,
    )
    if pair == "draft":
        kwargs["assistant_model"] = assistant.hf
        gen = assistant.hf.generation_config
        if variant == "same_gamma":
            gen.num_assistant_tokens, gen.num_assistant_tokens_schedule, gen.assistant_confidence_threshold = (
                cfg.gamma,
                "constant",
                0.0,
            )
        else:  # transformers' defaults, reset at every call (within a call it adapts the threshold)
            gen.num_assistant_tokens, gen.num_assistant_tokens_schedule, gen.assistant_confidence_threshold = (
                20,
                "constant",
                0.4,
            )
    elif pair == "prompt_lookup":
        kwargs.update(prompt_lookup_num_tokens=cfg.gamma, max_matching_ngram_size=cfg.prompt_lookup.max_ngram)
    with torch.inference_mode():
        out = base.hf.generate(ids, **kwargs)
    return out[:, ids.shape[1] :].tolist()


def ours(
    base: HFBase, assistant: HFBase, pair: str, prompts: list[list[int]], cfg: DictConfig, setting: dict
) -> Generation:
    """Our decoding of a batch: plain, or the one speculative loop with the assistant or prompt lookup."""
    target = make_target(base, engine=setting["engine"], compile=setting["compile"], widths=(1, cfg.gamma + 1))
    if pair == "plain":
        return plain_generate(target, prompts, max_new_tokens=cfg.max_new_tokens)
    if pair == "draft":  # the assistant runs on the same engine as the target
        drafter = DraftModelDrafter(assistant, compile=setting["compile"], engine=setting["engine"])
    else:
        drafter = PromptLookupDrafter(vocab_size=base.num_tokens, **cfg.prompt_lookup)
    # Not decode_checks.spec_from: the peer config has no decode group, only `gamma` (transformers'
    # num_assistant_tokens and prompt_lookup_num_tokens), at a fixed length: max_gamma, which only caps adaptive
    # gamma, is gamma itself (SpecConfig's default 16 would refuse gamma=20); the rest is SpecConfig's defaults.
    spec = SpecConfig(gamma=cfg.gamma, max_gamma=cfg.gamma)
    return speculative_generate(target, drafter, prompts, max_new_tokens=cfg.max_new_tokens, spec=spec)


def run(fn, batches: list[list[list[int]]], counter: ForwardCounter) -> dict[str, Any]:
    """Decode every batch with fn: tokens, seconds, new tokens and row-forwards (a target forward serves
    every row of its batch). Our loops count their own forwards per row; transformers' are counted on the
    target's backbone, times the batch's rows (they run to max_new_tokens together: there is no EOS stop)."""
    start, tokens, row_forwards = time.perf_counter(), [], 0
    for batch in batches:
        calls = counter.calls
        out = fn(batch)
        if isinstance(out, Generation):
            tokens, row_forwards = tokens + out.tokens, row_forwards + int(out.stats.forwards.sum())
        else:
            tokens, row_forwards = tokens + out, row_forwards + (counter.calls - calls) * len(batch)
    seconds = time.perf_counter() - start
    return dict(tokens=tokens, seconds=seconds, row_forwards=row_forwards, new=sum(len(t) for t in tokens))


def contenders(cfg: DictConfig, base: HFBase, assistant: HFBase) -> dict[str, tuple[str, Any]]:
    """name -> (pair, decode function of a batch), for every pair, our engine settings and transformers' variants."""
    out = {}
    for pair in PAIRS:
        for setting in cfg.ours:
            setting = dict(setting)
            name = f"ours[{setting['engine']}{'+compile' if setting['compile'] else ''}]/{pair}"
            out[name] = (pair, lambda b, p=pair, s=setting: ours(base, assistant, p, b, cfg, s))
        variants = ("same_gamma", "defaults") if pair == "draft" else ("defaults",)
        for v in variants:
            out[f"transformers/{pair}/{v}"] = (pair, lambda b, p=pair, v=v: theirs(base, assistant, p, b, cfg, v))
    return out


def bench_batch(
    cfg: DictConfig, base: HFBase, assistant: HFBase, prompts: list[list[int]], batch_size: int, counter: ForwardCounter
) -> list[dict]:
    """Every contender that can decode at this batch size, timed in interleaved rounds after a warm-up."""
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    named = contenders(cfg, base, assistant)
    if batch_size > 1:  # transformers' assisted generation and prompt lookup refuse batches; say so, keep plain
        named = {n: c for n, c in named.items() if n.startswith("ours") or n == "transformers/plain/defaults"}
    shapes = list({len(b): b for b in batches}.values())  # one batch of each size: a compiled step per shape
    for _, fn in named.values():
        run(fn, shapes, counter)  # warm-up (compiles)
    rounds: dict[str, list[dict]] = {name: [] for name in named}
    for r in range(cfg.repeats):
        order = list(named) if r % 2 == 0 else list(reversed(named))  # neither side always runs on a warmer machine
        for name in order:
            rounds[name].append(run(named[name][1], batches, counter))
    reference = rounds["transformers/plain/defaults"][0]["tokens"]
    rows = []
    for name, (pair, _) in named.items():
        first = rounds[name][0]
        rows.append(
            dict(
                name=name,
                pair=pair,
                batch_size=batch_size,
                tau=first["new"] / max(first["row_forwards"], 1),
                tokens_per_s=statistics.median(x["new"] / x["seconds"] for x in rounds[name]),
                rounds_tokens_per_s=[x["new"] / x["seconds"] for x in rounds[name]],
                identical=all(x["tokens"] == reference for x in rounds[name]),
            )
        )
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """ours / theirs per pair and batch size, against transformers' fastest variant of the same method."""
    out = []
    for row in rows:
        if not row["name"].startswith("ours"):
            continue
        peers = [
            r
            for r in rows
            if r["batch_size"] == row["batch_size"]
            and r["name"].startswith("transformers/")
            and (r["pair"] == row["pair"] or row["batch_size"] > 1)
        ]
        best = max(peers, key=lambda r: r["tokens_per_s"])
        out.append(
            dict(
                ours=row["name"],
                pair=row["pair"],
                batch_size=row["batch_size"],
                against=best["name"],
                ratio=row["tokens_per_s"] / best["tokens_per_s"],
            )
        )
    return out


def markdown(rows: list[dict], summary: list[dict], header: dict) -> str:
    lines = [
        f"# Peer benchmark: ours vs transformers {header['transformers']} generate",
        "",
        f"{device_line(header)}; threads {header['threads']}; {header['prompts']} held-out prompts x "
        f"{header['max_new_tokens']} new tokens; gamma {header['gamma']}; temperature 0; float32; transformers eager.",
        "",
        "| batch | contender | tau | tokens/s | identical to transformers' greedy |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['batch_size']} | {r['name']} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} | "
        f"{'yes' if r['identical'] else 'NO'} |"
        for r in rows
    ]
    lines += ["", "| batch | ours | ours / transformers' fastest | against |", "|---|---|---|---|"]
    lines += [f"| {s['batch_size']} | {s['ours']} | {s['ratio']:.2f}x | {s['against']} |" for s in summary]
    return "\n".join(lines) + "\n"


def peer(cfg: DictConfig) -> dict[str, Any]:
    check_config(cfg)
    device = check_run(cfg)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    base, assistant, tokenizer, meta, base_dir = load_pair(cfg, device)
    data = prepare_data(**base_data_config(meta, OmegaConf.to_container(cfg.data, resolve=True)))
    prompts = heldout_prompts(
        data, num_prompts=cfg.prompts.num_prompts, prompt_len=cfg.prompts.prompt_len, seed=cfg.seed
    )
    make_target(base, engine="hf").check_tokens(prompts, max_new_tokens=cfg.max_new_tokens)
    counter = ForwardCounter(base.hf.base_model)
    rows = [row for b in cfg.batch_sizes for row in bench_batch(cfg, base, assistant, prompts, b, counter)]
    import transformers

    header = dict(
        cpu=cpu_model(),  # kept for readers of results written before device_info
        device_info=device_info(device),
        threads=torch.get_num_threads(),
        prompts=len(prompts),
        max_new_tokens=cfg.max_new_tokens,
        gamma=cfg.gamma,
        transformers=transformers.__version__,
        base=base_dir,
        torch=torch.__version__,
    )
    summary = ratios(rows)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / "results.json", json.dumps(dict(header=header, rows=rows, summary=summary), indent=2))
    write_atomic(out_dir / "results.md", markdown(rows, summary, header))
    log.info("\n%s", markdown(rows, summary, header))
    return dict(header=header, summary=summary)


@hydra_preflight
@hydra.main(version_base="1.3", config_path="../conf", config_name="peer")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    print(json.dumps(peer(cfg)), file=sys.stdout)


if __name__ == "__main__":
    main()
