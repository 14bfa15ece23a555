"""Calibrate draft budgets on this machine: time target forwards by width, run short pilots, pick budgets.

    cost = cached_verify_cost(target, key_parts={"base": fingerprint, "dtype": "float32", "compile": False})
    chain = choose_chain_budget(target, factory, prompts, verify_cost=cost, max_gamma=8, ...)   # -> gamma
    tree = choose_tree_budget(target, make, prompts, candidates=[...], verify_cost=cost, ...)  # -> kwargs, gamma

The cost model is verify/plan/budget.py's; this module only measures its inputs. Verify costs are cached
per machine and model (a few seconds to measure, but a benchmark may start many times); pilots are
not, since they depend on the drafter, the prompts and the sampling settings.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from hashlib import sha256
from pathlib import Path
from typing import Any

import torch

from experiments.lib.common.errors import write_atomic
from experiments.lib.common.machine import machine_key
from experiments.lib.common.sources import source_version
from experiments.lib.training.precision import native_bf16, resolve_decode_dtype
from verify.backends.target import Target
from verify.common.numerics import EosId
from verify.loop.sampling import SamplingConfig
from verify.loop.speculative import SpecConfig, speculative_generate
from verify.plan.budget import best_chain, best_tree, interpolate_cost

log = logging.getLogger(__name__)

KS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)
MEASURE_DEFAULTS: dict[str, Any] = dict(ks=KS, prompt_len=64, repeats=5, warmup=2, batch_size=1, tree=False)


# ------------------------------------------------------------------------------------- verify cost


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # kernels run asynchronously: without a sync the timer stops too early
        torch.cuda.synchronize(device)


def binary_tree(k: int) -> torch.Tensor:
    """parents (k,) of a k-node binary tree (node i under (i - 1) // 2): the shape whose cost stands for a draft
    tree's of k nodes (an engine's tree forward costs what its node count and depth make it, not the branching)."""
    return torch.tensor([-1] + [(i - 1) // 2 for i in range(1, k)])


def _time_extend(target: Target, tokens: torch.Tensor, parents: torch.Tensor | None = None) -> float:
    """Seconds of one extend of tokens (b, k) (a tree with parents (k,)) plus the rollback of all of it (the
    cache length stays)."""
    _sync(target.device)
    start = time.perf_counter()
    target.extend(tokens, parents=parents)
    target.commit(torch.zeros(tokens.shape, dtype=torch.bool, device=target.device))
    _sync(target.device)
    return time.perf_counter() - start


@torch.inference_mode()
def measure_verify_cost(
    target: Target,
    *,
    ks: tuple[int, ...] = KS,
    prompt_len: int = 64,
    repeats: int = 5,
    warmup: int = 2,
    batch_size: int = 1,
    tree: bool = False,
) -> dict[int, float]:
    """{k: median seconds of target.extend over k new tokens, then a full rollback} on a prompt of
    `prompt_len` random ids, `batch_size` rows. Sizes k past max_seq_len - prompt_len are skipped.
    tree: the k tokens form a binary tree (binary_tree), as a tree verification does; an engine that sums
    attention in position order gathers each node's keys, so a tree of k nodes costs more than a chain of k.

    The rounds run every k in turn (not all repeats of one k, then the next), so a slow patch of a
    shared machine lands on all sizes alike. A compiled target pads k to its next width, so its
    table is the cost of the padded forward, which is what decoding pays. The cost of attention
    grows with the cached length; prompt_len should be near the lengths decoding runs at."""
    for name, value in dict(prompt_len=prompt_len, repeats=repeats, batch_size=batch_size).items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be an integer >= 1")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup={warmup!r}: must be an integer >= 0")
    room = target.max_seq_len - prompt_len
    fits = sorted({int(k) for k in ks if 1 <= int(k) <= room})
    if not fits:
        raise ValueError(
            f"ks={tuple(ks)}: none fits beside prompt_len={prompt_len} "
            f"(need 1 <= k <= max_seq_len - prompt_len = {room})"
        )
    skipped = sorted(set(int(k) for k in ks) - set(fits))
    if skipped:
        log.info("verify cost: skipping k=%s (more than max_seq_len - prompt_len = %d)", skipped, room)
    generator = torch.Generator().manual_seed(0)
    random_ids = lambda *shape: torch.randint(0, target.vocab_size, shape, generator=generator)  # noqa: E731
    target.prefill(random_ids(batch_size, prompt_len).tolist())
    tokens = {k: random_ids(batch_size, k).to(target.device) for k in fits}
    parents = {k: binary_tree(k).to(target.device) if tree else None for k in fits}
    for _ in range(warmup):  # allocator, lazy inits, compilation of each width
        for k in fits:
            _time_extend(target, tokens[k], parents[k])
    times: dict[int, list[float]] = {k: [] for k in fits}
    for _ in range(repeats):
        for k in fits:
            times[k].append(_time_extend(target, tokens[k], parents[k]))
    return {k: statistics.median(t) for k, t in times.items()}


def _cache_path(cache_dir: str | Path, key: dict) -> Path:
    digest = sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"verify_cost-{digest}.json"


def _read_costs(path: Path, key: dict) -> dict[int, float] | None:
    """The cached table, or None if the file is missing, unreadable or not a table for `key`."""
    try:
        data = json.loads(path.read_text())
        if data["key"] != json.loads(json.dumps(key, sort_keys=True, default=str)):
            raise ValueError("a different key (a hash collision or an edited file)")
        costs = {int(k): float(s) for k, s in data["costs"].items()}
        if not costs or any(not math.isfinite(s) or s <= 0 for s in costs.values()):
            raise ValueError("empty or non-positive costs")
        return costs
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        log.warning("verify cost cache %s is unusable (%s): measuring again", path, " ".join(str(error).split()))
        return None


def engine_version() -> str:
    """A hash of the decode engine's sources (verify/backends/*.py): what a verify-cost table was measured on."""
    return source_version(("verify/backends",))


def cached_verify_cost(
    target: Target, *, key_parts: dict, cache_dir: str | Path = ".cache/calibration", **kw: Any
) -> dict[int, float]:
    """measure_verify_cost(target, **kw), cached in a JSON file keyed by the machine, `key_parts`
    (the caller passes the base model's fingerprint, dtype, compile mode) and the measuring settings.

    A corrupt or foreign cache file is ignored, measured again and rewritten."""
    settings = {**MEASURE_DEFAULTS, **kw}
    unknown = sorted(set(settings) - set(MEASURE_DEFAULTS))
    if unknown:
        raise ValueError(f"cached_verify_cost got {unknown}: measuring settings are {', '.join(MEASURE_DEFAULTS)}")
    settings["ks"] = [int(k) for k in settings["ks"]]
    key = {
        "machine": machine_key(target.device),
        "engine": engine_version(),  # a changed engine measures again, never reuses an old engine's table
        "ordered": target.ordered,
        "ordered_attention": target.ordered_attention,  # the C++ operator and the torch form cost differently
        "target_compiled": target.mode,
        "target_widths": list(target.widths),
        "max_seq_len": target.max_seq_len,
        "settings": settings,
        "parts": key_parts,
    }
    path = _cache_path(cache_dir, key)
    costs = _read_costs(path, key)
    if costs is not None:
        log.info("verify cost: read %s", path)
        return costs
    costs = measure_verify_cost(target, **{**settings, "ks": tuple(settings["ks"])})
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(
        path, json.dumps({"key": key, "costs": {str(k): s for k, s in costs.items()}}, indent=1, sort_keys=True)
    )
    log.info("verify cost: measured and wrote %s", path)
    return costs


# ------------------------------------------------------------------------------------ decode precision

CALIBRATION_DIR = ".cache/calibration"  # benchmark.yaml's budget_search.cache_dir; generate has no setting of it
DTYPE_KS = (1, 8)  # a plain step and an 8-token verification: what decoding a draft alternates between


def measure_decode_dtypes(
    base: torch.nn.Module, *, key_parts: dict, cache_dir: str | Path = ".cache/calibration"
) -> dict[str, float]:
    """{"fp32", "bf16"}: seconds of a 1-token step plus an 8-token verification of `base` (loaded in fp32) on
    its eager lean engine in each dtype, measured on a bf16 copy (the fp32 weights stay as they are) and
    cached like verify costs. What dtype=auto decides by on a CPU (precision.resolve_decode_dtype)."""
    return {name: sum(costs.values()) for name, costs in _dtype_costs(base, key_parts, cache_dir).items()}


def _dtype_costs(base: torch.nn.Module, key_parts: dict, cache_dir: str | Path) -> dict[str, dict[int, float]]:
    """{"fp32", "bf16"}: each dtype's verify cost table {1: step seconds, 8: 8-token verify seconds}."""
    from verify.backends.choose import make_target  # the lean engine of either kind of base

    tables = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = base if dtype == torch.float32 else copy.deepcopy(base).to(dtype)
        tables[name] = cached_verify_cost(
            make_target(model), key_parts={**key_parts, "dtype": name}, cache_dir=cache_dir, ks=DTYPE_KS
        )
    return tables


def decode_precision(
    requested: Any, base: torch.nn.Module, device: torch.device, *, key_parts: dict, cache_dir: str | Path
) -> dict[str, Any]:
    """precision.resolve_decode_dtype, with the measurement auto needs on a CPU that computes bf16 natively;
    where it measured, "verify_cost" is the chosen dtype's eager table {1: step, 8: 8-token verify} (seconds),
    which the benchmark's check for impossible ratios reads (experiments/lib/report/disturbed.py)."""
    if not (requested == "auto" and device.type == "cpu" and native_bf16(device)[0]):
        return resolve_decode_dtype(requested, device, None)
    tables = _dtype_costs(base, key_parts, cache_dir)
    chosen = resolve_decode_dtype(requested, device, {name: sum(t.values()) for name, t in tables.items()})
    return {**chosen, "verify_cost": tables[chosen["used"]]}


# ------------------------------------------------------------------------------------------- pilots


class _BeginTimer:
    """A drafter that times its inner drafter's `begin`: a cost per batch, not per verification step."""

    def __init__(self, drafter: Any):
        self.drafter, self.vocab_size, self.seconds = drafter, drafter.vocab_size, 0.0

    def __getattr__(self, name: str) -> Any:
        # the optional parts of the drafter protocol (target_layers, attach) are the inner drafter's
        return getattr(self.__dict__["drafter"], name)

    def begin(self, prompts, prefill, pending) -> None:
        _sync(pending.device)
        start = time.perf_counter()
        self.drafter.begin(prompts, prefill, pending)
        _sync(pending.device)
        self.seconds += time.perf_counter() - start

    def propose(self, gamma, sampling, generator):
        return self.drafter.propose(gamma, sampling, generator)

    def commit(self, verdict) -> None:
        self.drafter.commit(verdict)


def pilot(
    target: Target,
    drafter_factory: Callable[[], Any],
    prompts: list[list[int]],
    *,
    spec: SpecConfig,
    sampling: SamplingConfig,
    eos_id: EosId,
    max_new_tokens: int,
    seed: int,
    batch_size: int = 1,
) -> dict[str, Any]:
    """Decode `prompts` speculatively (after one untimed warm-up batch) and measure what the cost model needs.

    Returns
      tau                      tokens per verification step, per row (the first token, which the
                               prefill produces, is left out: DecodeStats.tau counts it)
      acceptance               [P(accepted >= i + 1)] for each drafted position (a tree: each depth)
      draft_tokens_per_step    mean drafted tokens (a tree: its depth) per row and step
      draft_seconds_per_step   drafter time per verification step, without `begin` (a per-batch cost
                               that does not depend on the budget, like the prefill)
      overhead_seconds_per_step  the loop's own bookkeeping per step (neither drafter nor target)
      begin_seconds_per_batch  the drafter's `begin` per batch (its own prefill, if it has one)
      steps, tokens, seconds   verification steps (batch forwards), tokens emitted, total seconds
    Use the same batch_size as the verify cost table: a step's forward is of the whole batch."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: must be an integer >= 1")
    if not prompts:
        raise ValueError("prompts=[]: a pilot needs at least one prompt")
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    kwargs = dict(max_new_tokens=max_new_tokens, spec=spec, sampling=sampling, eos_id=eos_id)
    generator = torch.Generator(device=target.device).manual_seed(seed)
    speculative_generate(target, drafter_factory(), batches[0], generator=generator, **kwargs)  # warm-up
    generator.manual_seed(seed)
    steps = row_steps = tokens = proposed = 0
    draft = begin = total = target_s = 0.0
    proposed_by_position = accepted_by_position = torch.zeros(0, dtype=torch.long)
    for batch in batches:
        drafter = _BeginTimer(drafter_factory())
        stats = speculative_generate(target, drafter, batch, generator=generator, **kwargs).stats
        steps += int(stats.forwards.max()) - 1  # the loop runs while any row is active; minus the prefill
        row_steps += int(stats.forwards.sum()) - len(batch)
        tokens += int(stats.tokens.sum())
        proposed += int(stats.proposed.sum())
        draft, begin, total, target_s = (
            draft + stats.time_draft,
            begin + drafter.seconds,
            total + stats.time_total,
            target_s + stats.time_target,
        )
        proposed_by_position = _add(proposed_by_position, stats.proposed_by_position)
        accepted_by_position = _add(accepted_by_position, stats.accepted_by_position)
    if steps == 0:
        raise ValueError(
            f"max_new_tokens={max_new_tokens}: no verification step ran; "
            "a pilot needs at least 2 new tokens (and no EOS first)"
        )
    measured = proposed_by_position > 0
    return {
        "tau": (tokens - len(prompts)) / row_steps,
        "acceptance": (accepted_by_position[measured].float() / proposed_by_position[measured].float()).tolist(),
        "draft_tokens_per_step": proposed / row_steps,
        "draft_seconds_per_step": max(draft - begin, 0.0) / steps,
        "overhead_seconds_per_step": max(total - draft - target_s, 0.0) / steps,
        "begin_seconds_per_batch": begin / len(batches),
        "steps": steps,
        "tokens": tokens,
        "seconds": total,
    }


def _add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Sum per-position counts of different lengths (a deeper step adds positions)."""
    k = max(a.shape[0], b.shape[0])
    pad = lambda t: torch.cat((t.long().cpu(), torch.zeros(k - t.shape[0], dtype=torch.long)))  # noqa: E731
    return pad(a) + pad(b)


def choose_chain_budget(
    target: Target,
    drafter_factory: Callable[[], Any],
    prompts: list[list[int]],
    *,
    verify_cost: dict[int, float],
    max_gamma: int,
    sampling: SamplingConfig,
    eos_id: EosId,
    max_new_tokens: int,
    seed: int,
    spec: SpecConfig = SpecConfig(),
    batch_size: int = 1,
) -> dict[str, Any]:
    """One pilot at gamma = max_gamma (spec's rule, no adaptive gamma), then best_chain.

    The pilot measures acceptance at every position up to the depth the drafter actually drafts (a
    Medusa chain stops at its number of heads; short max_new_tokens cut the last steps), and gamma
    is chosen up to that depth. The draft cost is taken as linear in gamma: seconds per drafted
    token = draft seconds per step / drafted tokens per step. That is an approximation. A chain
    drafter costs about one small forward per token, plus a part that does not grow with gamma
    (commit's reseed on the accepted tokens for the prophet and the draft model); spreading that part
    over the tokens makes short chains look cheaper than they are, so the choice leans short. A drafter
    whose whole cost is per step (`flat_draft_cost = True`: Medusa's heads and the block prophet's
    forward run once per step, whatever gamma) is costed as such: its draft seconds per step are fixed.
    The loop's own bookkeeping per step is fixed too.
    Returns {"gamma": g, "table": best_chain's rows, "pilot": pilot's dict}."""
    if isinstance(max_gamma, bool) or not isinstance(max_gamma, int) or max_gamma < 1:
        raise ValueError(f"max_gamma={max_gamma!r}: must be an integer >= 1")
    pilot_spec = replace(spec, gamma=max_gamma, max_gamma=max_gamma, adaptive_gamma=False)
    result = pilot(
        target,
        drafter_factory,
        prompts,
        spec=pilot_spec,
        sampling=sampling,
        eos_id=eos_id,
        max_new_tokens=max_new_tokens,
        seed=seed,
        batch_size=batch_size,
    )
    if not result["acceptance"]:
        raise ValueError("the pilot drafted no tokens: raise max_new_tokens so that steps with drafts run")
    depth = min(max_gamma, len(result["acceptance"]))
    draft, fixed = result["draft_seconds_per_step"], result["overhead_seconds_per_step"]
    if getattr(drafter_factory(), "flat_draft_cost", False):
        draft, fixed = 0.0, fixed + draft
    gamma, table = best_chain(
        result["acceptance"],
        verify_cost=verify_cost,
        draft_step_cost=draft / max(result["draft_tokens_per_step"], 1e-9),
        draft_fixed_cost=fixed,
        max_gamma=depth,
    )
    return {"gamma": gamma, "table": table, "pilot": result}


def choose_tree_budget(
    target: Target,
    make_drafter: Callable[[dict], Callable[[], Any]],
    prompts: list[list[int]],
    *,
    candidates: list[dict],
    verify_cost: dict[int, float],
    sampling: SamplingConfig,
    eos_id: EosId,
    max_new_tokens: int,
    seed: int,
    spec: SpecConfig = SpecConfig(),
    batch_size: int = 1,
) -> dict[str, Any]:
    """A pilot per tree candidate, at spec gamma = its depth; best_tree on the measured tau and costs.

    A candidate is a dict with tree_nodes and depth plus any other drafter kwargs (e.g. top_k).
    make_drafter(candidate) returns a factory of fresh drafters for it; it receives the whole
    candidate, depth included: the prophet takes depth as a kwarg, a Medusa caller drops it (Medusa's
    depth is the loop's gamma). Returns {"drafter_kwargs": the chosen candidate, "gamma": its depth,
    "table": best_tree's rows (each with the candidate, its pilot numbers and predicted tokens/s)}."""
    if not candidates:
        raise ValueError("candidates=[]: need at least one tree candidate")
    rows = []
    for i, candidate in enumerate(candidates):
        for key in ("tree_nodes", "depth"):
            value = candidate.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"candidates[{i}].{key}={value!r}: must be an integer >= 1")
        depth = candidate["depth"]
        pilot_spec = replace(spec, gamma=depth, max_gamma=max(depth, spec.max_gamma), adaptive_gamma=False)
        result = pilot(
            target,
            make_drafter(dict(candidate)),
            prompts,
            spec=pilot_spec,
            sampling=sampling,
            eos_id=eos_id,
            max_new_tokens=max_new_tokens,
            seed=seed,
            batch_size=batch_size,
        )
        rows.append(
            {
                **candidate,
                "tau": result["tau"],
                "draft_seconds_per_step": result["draft_seconds_per_step"],
                "overhead_seconds_per_step": result["overhead_seconds_per_step"],
                "acceptance": result["acceptance"],
            }
        )
    index, table = best_tree(rows, verify_cost=verify_cost)
    return {"drafter_kwargs": dict(candidates[index]), "gamma": candidates[index]["depth"], "table": table}


# ------------------------------------------------------------------------------------------- report


def format_cost_table(
    verify_cost: dict[int, float],
    drafter_costs: dict[str, float] | None = None,
    tree_cost: dict[int, float] | None = None,
) -> str:
    """Markdown: the target's forward seconds by width k and their ratio to k = 1 (with tree_cost, a k-node
    tree's beside a k-token chain's); then, if given, each drafter's seconds per verification step and its
    ratio to a k = 1 forward."""
    one = interpolate_cost(verify_cost, 1)
    if tree_cost:
        lines = ["| k | chain seconds | ratio to k=1 | tree seconds | ratio to k=1 |", "|---:|---:|---:|---:|---:|"]
        lines += [
            f"| {k} | {s:.6f} | {s / one:.2f} | {tree_cost[k]:.6f} | {tree_cost[k] / one:.2f} |"
            for k, s in sorted(verify_cost.items())
            if k in tree_cost
        ]
    else:
        lines = ["| k | seconds | ratio to k=1 |", "|---:|---:|---:|"]
        lines += [f"| {k} | {s:.6f} | {s / one:.2f} |" for k, s in sorted(verify_cost.items())]
    if drafter_costs:
        lines += ["", "| drafter | seconds per step | ratio to a k=1 forward |", "|---|---:|---:|"]
        lines += [f"| {name} | {s:.6f} | {s / one:.2f} |" for name, s in drafter_costs.items()]
    return "\n".join(lines)
