"""What a decode step of a base costs on this machine, per precision and compile mode: the regime every
speedup of a drafter belongs to.

    python -m experiments.engine_costs base=smollm2
    python -m experiments.engine_costs base=smollm2 'compile=[false,true]' dtypes=[bf16]
    python -m experiments.engine_costs base_checkpoint=<dir> generate=false

For each (dtype, compile) setting: the base's 1-token step on the project's lean engine, the cost of verifying
k tokens relative to it (verify(k)/step: a drafter pays only where this stays near 1), prefill tokens/s,
the compile time of each width (compiled settings), and for a Hugging Face base plain greedy decoding on the
lean engine against transformers' own `generate` on the same weights and dtype (tokens/s, median over
rounds). The base is loaded in fp32 and cast per setting on a copy. Writes costs.json and costs.md into
the run directory and prints the table, then one JSON object as the last line.

Then, per dtype and attention (`attention`: ordered, the exact position-ordered sums; fused, SDPA's kernel), the
eager engine across `contexts` x `batches`: plain greedy decoding tokens/s (prefill excluded) beside
transformers' `generate` on the same prompts, and at batch 1 the step and what chains and binary trees of 4, 8
and 16 tokens cost over it at that context. Which ordered attention ran (the C++ operator or the pure-torch
form, PROPHET_MEDUSA_KERNEL=0) is in the header and costs.json.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, ListConfig

from experiments.lib.cli.preflight import hydra_preflight
from experiments.lib.common.errors import exit_on_user_error, write_atomic
from experiments.lib.common.machine import device_info, device_line
from experiments.lib.methods.calibrate import measure_verify_cost
from experiments.lib.methods.decode_checks import check_run
from experiments.lib.store.checkpoint import load_lm
from experiments.lib.training.precision import DTYPES
from experiments.lib.training.settings import check_bool, check_int
from verify.backends.choose import make_target
from verify.backends.graphs import check_mode
from verify.backends.hf import HFBase
from verify.backends.ordered_kernel import kernel_name
from verify.loop.plain import plain_generate


def check_config(cfg: DictConfig) -> None:
    """One-line errors for every setting, before the base loads."""
    check_run(cfg)
    for name in ("prompt_len", "repeats", "max_new_tokens", "rounds"):
        check_int(name, cfg[name])
    check_bool("generate", cfg.generate)
    for name in ("grid_new_tokens", "max_grid_tokens"):
        check_int(name, cfg[name])
    attention = cfg.attention
    if not isinstance(attention, ListConfig) or not attention or any(a not in ("ordered", "fused") for a in attention):
        raise ValueError(f"attention={attention!r}: give a non-empty list of ordered, fused")
    for key in ("contexts", "batches"):
        if not isinstance(cfg[key], ListConfig) or not all(isinstance(v, int) and v >= 1 for v in cfg[key]):
            raise ValueError(f"{key}={cfg[key]!r}: give a list of integers >= 1 ([] for none)")
    for key in ("dtypes", "ks", "compile", "compile_widths"):
        if not isinstance(cfg[key], ListConfig) or not cfg[key]:
            raise ValueError(f"{key}={cfg[key]!r}: give a non-empty list")
    for d in cfg.dtypes:
        if d not in DTYPES:
            raise ValueError(f"dtypes={list(cfg.dtypes)!r}: {d!r} is not one of {', '.join(DTYPES)}")
    for k in list(cfg.ks) + list(cfg.compile_widths):
        check_int("ks and compile_widths entries", k)
    for mode in cfg.compile:
        check_mode(mode)


def time_plain(target, model, prompt: list[int], *, new: int, rounds: int, hf: bool) -> dict[str, float]:
    """tokens/s of plain greedy decoding on the lean engine and (a Hugging Face base) transformers' generate,
    interleaved, `new` tokens each (EOS ignored, so both emit the same number), medians over rounds."""
    ours, theirs = [], []
    for _ in range(rounds + 1):  # the first round warms both up
        start = time.perf_counter()
        plain_generate(target, [prompt], max_new_tokens=new)
        ours.append(new / (time.perf_counter() - start))
        if hf:
            start = time.perf_counter()
            with torch.inference_mode():
                model.hf.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
            theirs.append(new / (time.perf_counter() - start))
    out = {"lean_tokens_per_s": statistics.median(ours[1:])}
    if hf:
        out["generate_tokens_per_s"] = statistics.median(theirs[1:])
        out["ratio"] = out["lean_tokens_per_s"] / out["generate_tokens_per_s"]
    return out


def compile_times(target, widths: list[int], prompt_len: int) -> dict[int, float]:
    """Seconds of the first extend of each width: the compilation (or capture) a compiled setting pays once."""
    target.prefill([list(range(1, prompt_len + 1))])
    seconds = {}
    for k in widths:
        start = time.perf_counter()
        target.extend(torch.ones(1, k, dtype=torch.long, device=target.device))
        target.commit(torch.zeros(1, k, dtype=torch.bool, device=target.device))
        seconds[k] = time.perf_counter() - start
    return seconds


def measure_setting(base, dtype: str, mode, cfg: DictConfig, prompt: list[int]) -> dict[str, Any]:
    model = base if dtype == "fp32" else copy.deepcopy(base).to(DTYPES[dtype])
    widths = tuple(sorted(set(cfg.compile_widths) | set(cfg.ks))) if mode else (1,)
    target = make_target(model, compile=mode, widths=widths)
    row: dict[str, Any] = {"dtype": dtype, "compile": mode}
    if mode:
        row["compile_s"] = compile_times(target, list(cfg.compile_widths), cfg.prompt_len)
    costs = measure_verify_cost(target, ks=tuple(cfg.ks), prompt_len=cfg.prompt_len, repeats=cfg.repeats)
    row["step_ms"] = 1e3 * costs[1]
    row["verify_over_step"] = {k: c / costs[1] for k, c in costs.items()}
    start = time.perf_counter()
    target.prefill([list(range(1, cfg.prompt_len + 1))])
    row["prefill_tokens_per_s"] = cfg.prompt_len / (time.perf_counter() - start)
    if cfg.generate:
        hf = isinstance(model, HFBase) and not mode  # generate is eager: compared with the eager engine only
        row |= time_plain(target, model, prompt, new=cfg.max_new_tokens, rounds=cfg.rounds, hf=hf)
    return row


def decode_rate(decode, prompts: list[list[int]], new: int) -> float:
    """Decoding tokens/s of `decode(prompts, n)` (n new tokens per row), without its prefill: the time of
    new + 1 tokens less that of 1 (a prefill and its first token), rows counted."""
    start = time.perf_counter()
    decode(prompts, 1)
    first = time.perf_counter() - start
    start = time.perf_counter()
    decode(prompts, new + 1)
    return len(prompts) * new / max(time.perf_counter() - start - first, 1e-9)


WIDTHS = (4, 8, 16)  # the chains and trees each batch-1 cell prices


def grid_cell(model, target, context: int, batch: int, cfg: DictConfig, hf: bool) -> dict[str, Any]:
    """One (context, batch) cell: plain greedy decoding tokens/s on the lean engine and (a Hugging Face base)
    transformers' generate, interleaved, median over rounds; at batch 1 also the step and the cost of chains
    and binary trees of WIDTHS tokens over it."""
    g = torch.Generator().manual_seed(context + batch)
    prompts = torch.randint(0, target.vocab_size, (batch, context), generator=g).tolist()

    def ours(rows, n):
        plain_generate(target, rows, max_new_tokens=n)

    def theirs(rows, n):
        with torch.inference_mode():
            model.hf.generate(torch.tensor(rows), max_new_tokens=n, min_new_tokens=n, do_sample=False)

    new, lean, generate = cfg.grid_new_tokens, [], []
    for _ in range(cfg.rounds):
        lean.append(decode_rate(ours, prompts, new))
        if hf:
            generate.append(decode_rate(theirs, prompts, new))
    cell: dict[str, Any] = {"context": context, "batch": batch, "lean_tokens_per_s": statistics.median(lean)}
    if hf:
        cell["generate_tokens_per_s"] = statistics.median(generate)
        cell["ratio"] = cell["lean_tokens_per_s"] / cell["generate_tokens_per_s"]
    if batch == 1:
        chain = measure_verify_cost(target, ks=(1, *WIDTHS), prompt_len=context, repeats=cfg.repeats)
        tree = measure_verify_cost(target, ks=WIDTHS, prompt_len=context, repeats=cfg.repeats, tree=True)
        cell["step_ms"] = 1e3 * chain[1]
        cell |= {f"chain{k}_over_step": chain[k] / chain[1] for k in WIDTHS if k in chain}
        cell |= {f"tree{k}_over_step": tree[k] / chain[1] for k in WIDTHS if k in tree}
    return cell


def measure_grid(base, dtype: str, attention: str, cfg: DictConfig) -> list[dict[str, Any]]:
    """Every (context, batch) cell of the eager engine in `dtype` whose batch x context is at most
    cfg.max_grid_tokens (the others are listed as skipped: a 64 x 2,048 prefill alone takes minutes on 2 cores)."""
    model = base if dtype == "fp32" else copy.deepcopy(base).to(DTYPES[dtype])
    target, hf = make_target(model, ordered=attention == "ordered"), isinstance(model, HFBase)
    plain_generate(target, [[1, 2, 3]], max_new_tokens=4)  # warm-up
    cells = []
    for context in cfg.contexts:
        for batch in cfg.batches:
            key = {"dtype": dtype, "attention": attention, "context": context, "batch": batch}
            if context * batch > cfg.max_grid_tokens:
                cells.append(key | {"skipped": True})
                continue
            cells.append(key | grid_cell(model, target, context, batch, cfg, hf))
    return cells


def grid_table(cells: list[dict]) -> str:
    """Markdown: a row per (dtype, attention, context, batch)."""
    shapes = [f"{kind}({k})" for kind in ("chain", "tree") for k in WIDTHS]
    head = "| dtype | attention | context | batch | plain tok/s | generate tok/s | ratio | step ms | "
    head += " | ".join(shapes) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in cells:
        key = f"| {c['dtype']} | {c['attention']} | {c['context']} | {c['batch']} "
        if c.get("skipped"):
            lines.append(key + "| skipped (max_grid_tokens) |" + " |" * (3 + len(shapes)))
            continue
        costs = " | ".join(_cell(c.get(f"{kind}{k}_over_step"), ".2f") for kind in ("chain", "tree") for k in WIDTHS)
        lines.append(
            key + f"| {_cell(c.get('lean_tokens_per_s'))} | {_cell(c.get('generate_tokens_per_s'))} "
            f"| {_cell(c.get('ratio'), '.2f')} | {_cell(c.get('step_ms'))} | {costs} |"
        )
    return "\n".join(lines) + "\n"


def _cell(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict], ks: list[int]) -> str:
    """Markdown: a row per setting; v(k) = verify(k) / step."""
    wide = [k for k in ks if k > 1]
    head = "| dtype | mode | step ms | " + " | ".join(f"v({k})" for k in wide)
    head += " | prefill tok/s | plain tok/s | generate tok/s | ratio | compile s |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        mode = {False: "eager", True: "compiled"}.get(r["compile"], str(r["compile"]))
        ratios = " | ".join(_cell(r["verify_over_step"].get(k), ".2f") for k in wide)
        compiled = ", ".join(f"{k}: {s:.0f}" for k, s in r.get("compile_s", {}).items()) or "-"
        lines.append(
            f"| {r['dtype']} | {mode} | {r['step_ms']:.1f} | {ratios} | {r['prefill_tokens_per_s']:.0f} "
            f"| {_cell(r.get('lean_tokens_per_s'))} | {_cell(r.get('generate_tokens_per_s'))} "
            f"| {_cell(r.get('ratio'), '.2f')} | {compiled} |"
        )
    return "\n".join(lines) + "\n"


def ordered_kernel_name(base) -> str:
    """ "cpp" or "torch": the ordered attention the base's engine runs ("-" where the engine has none)."""
    decoder = make_target(base).engine.decoder
    if not decoder.orders_attention:
        return "-"
    return kernel_name(next(base.parameters()).device, decoder.dim_head)


def run(cfg: DictConfig) -> dict[str, Any]:
    check_config(cfg)
    device = check_run(cfg)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    base, tokenizer, _ = load_lm(cfg.base_checkpoint, device=str(device))
    prompt = tokenizer.encode("The history of the printing press begins", add_special_tokens=False).ids
    rows = [measure_setting(base, d, m, cfg, prompt) for d in cfg.dtypes for m in cfg.compile]
    grid = []
    if cfg.contexts:
        grid = [cell for d in cfg.dtypes for a in cfg.attention for cell in measure_grid(base, d, a, cfg)]
    info = device_info(device)
    kernel = ordered_kernel_name(base)
    header = f"{device_line({'device_info': info})}; {torch.get_num_threads()} threads; prompt {cfg.prompt_len}; "
    header += f"ordered attention: {kernel}\n\n"
    text = header + table(rows, list(cfg.ks))
    if grid:
        text += (
            f"\nPlain greedy decoding by context and batch (eager; {cfg.grid_new_tokens} new tokens per row, "
            "prefill excluded; chain(k), tree(k): a k-token chain and a k-node binary tree over the step, "
            "at batch 1)\n\n"
        )
        text += grid_table(grid)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {"base_checkpoint": str(cfg.base_checkpoint), "device_info": info, "threads": torch.get_num_threads()}
    results["ordered_attention"] = kernel
    results["rows"], results["grid"] = rows, grid
    write_atomic(out / "costs.json", json.dumps(results, indent=2, default=str))
    write_atomic(out / "costs.md", text)
    print(text)
    return results


@hydra_preflight
@hydra.main(version_base="1.3", config_path="../conf", config_name="engine_costs")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    results = run(cfg)
    print(json.dumps({"rows": results["rows"]}, default=str), file=sys.stdout)


if __name__ == "__main__":
    main()
