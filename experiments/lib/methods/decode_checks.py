"""The decoding entry points' checks (experiments/benchmark.py, generate.py, baseline.py, peer.py): every
setting they read, before anything loads or trains, and after decoding, the exactness of a lossless method.

Each check says in one line which value is wrong and what is allowed (a ValueError: the command line
prints it as `error: ...`, exit 2). A bad value found after minutes of training, or a NaN that decodes one
token and vanishes from the table, is worse than none. The validators of single values are
experiments/lib/training/settings.py's; the method registry the checks name is experiments/lib/methods/registry.py's.
The speculative loop's settings are built from a decode config here and only here (spec_from).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, ListConfig, OmegaConf

from experiments.lib.data.prompts import read_questions, select_questions
from experiments.lib.families.registry import FAMILIES, TREE_FAMILIES
from experiments.lib.formats.common import detect
from experiments.lib.formats.registry import check_served
from experiments.lib.methods.prompt_set import PROMPT_SETS
from experiments.lib.methods.registry import (
    DRAFTER_KINDS,
    artifact_overrides,
    check_methods,
    checkpoint_kinds,
    checkpoint_recipe,
    shipped_directories,
)
from experiments.lib.store.checkpoint import (
    CheckpointError,
    check_lm_meta,
    is_hf_directory,
    read_meta,
    tokenizer_mismatch,
)
from experiments.lib.store.rundir import check_writable
from experiments.lib.training.artifacts import ENTRY, check_artifact
from experiments.lib.training.precision import resolve_decode_dtype
from experiments.lib.training.settings import check_bool, check_int, check_number, resolve_device
from verify.backends.graphs import check_mode
from verify.drafters.hybrid import check_hybrid
from verify.drafters.prompt_lookup import PromptLookupDrafter
from verify.loop.acceptance import RULES, check_rule, is_lossless
from verify.loop.sampling import SamplingConfig
from verify.loop.speculative import SpecConfig
from verify.loop.tree import CANDIDATES

# budget=auto's tree candidates (budget_search.<family>_trees): a head tree's size and depth; a grown tree
# (prophet's, expanded from its own top-k at each level) also takes the children per node.
BUDGET_TREE_KEYS = {
    name: {"tree_nodes", "depth"} | (set() if FAMILIES[name].head_tree else {"top_k"}) for name in TREE_FAMILIES
}


class ExactnessError(RuntimeError):
    """A lossless method did not reproduce plain greedy decoding."""


def check_exact(
    method: str,
    plain: list[int] | list[list[int]],
    speculative: list[int] | list[list[int]],
    *,
    rule: str,
    delta: float,
    greedy: bool,
) -> tuple[bool | None, bool]:
    """(exact, lossless) of a method's new tokens (one row, or every row) against plain decoding's on the same
    prompts and seeds: exact is None when sampling (two samples may differ by chance); a lossless rule that is
    not exact at temperature 0 raises ExactnessError: the loop or the drafter is wrong, and no figure of it
    may stand."""
    exact = plain == speculative if greedy else None
    lossless = is_lossless(rule, delta=delta)
    if exact is False and lossless:
        raise ExactnessError(f"{method} at temperature 0 differs from plain greedy decoding: a lossless rule must not")
    return exact, lossless


# ------------------------------------------------------------------------------------------ shared settings


def as_list(value: Any, name: str, allowed: str) -> list:
    """A config value that may be one setting or a list of settings -> a non-empty list."""
    values = list(value) if isinstance(value, (list, tuple, ListConfig)) else [value]
    if not values:
        raise ValueError(f"{name}=[]: give {allowed}, or a list of them")
    return values


def check_run(cfg: DictConfig) -> torch.device:
    """device and seed, as every entry point takes them."""
    if not isinstance(cfg.device, str):
        raise ValueError(f"device={cfg.device!r}: must be auto, cpu or cuda[:N]")
    check_int("seed", cfg.seed, minimum=0)
    return resolve_device(cfg.device)


def check_temperature(name: str, value: Any) -> float:
    """A sampling temperature: a finite number >= 0 (the sampler refuses tiny ones itself, in sampling_for)."""
    return check_number(name, value, "a finite number >= 0 (0 = greedy)", lambda t: t >= 0)


def spec_from(d: DictConfig) -> SpecConfig:
    """The speculative loop's settings from a decode config (conf/decode): the one place they are built.
    max_gamma only caps adaptive gamma; without adaptation a gamma above it is no contradiction."""
    max_gamma = d.max_gamma if d.adaptive_gamma else max(d.max_gamma, d.gamma)
    return SpecConfig(
        gamma=d.gamma,
        rule=d.rule,
        delta=float(d.delta),
        typical_epsilon=float(d.typical_epsilon),
        typical_alpha=float(d.typical_alpha),
        adaptive_gamma=d.adaptive_gamma,
        max_gamma=max_gamma,
    )


def sampling_for(d: DictConfig, temperature: float) -> tuple[SamplingConfig, str]:
    """The sampling transform at one temperature, and the acceptance rule resolved for it."""
    sampling = SamplingConfig(temperature=temperature, top_k=d.top_k, top_p=float(d.top_p))
    return sampling, check_rule(d.rule, delta=float(d.delta), temperature=temperature)


def check_decode(d: DictConfig) -> tuple[list[float], SpecConfig]:
    """Every key of a decode config, named in its error: (temperatures, spec)."""
    temperatures = [
        check_temperature(f"decode.temperatures[{i}]", t)
        for i, t in enumerate(as_list(d.temperatures, "decode.temperatures", "a number >= 0"))
    ]
    if len(set(temperatures)) < len(temperatures):
        raise ValueError(f"decode.temperatures={temperatures}: give each temperature once")
    check_int("decode.top_k", d.top_k, allow_null=True)
    check_number("decode.top_p", d.top_p, "a number in (0, 1] (1 = no nucleus filter)", lambda p: 0 < p <= 1)
    for key in ("max_new_tokens", "batch_size", "gamma", "max_gamma"):
        check_int(f"decode.{key}", d[key])
    check_bool("decode.ordered", d.get("ordered", True))
    if check_bool("decode.adaptive_gamma", d.adaptive_gamma) and d.max_gamma < d.gamma:
        raise ValueError(
            f"decode.max_gamma={d.max_gamma}: must be >= decode.gamma={d.gamma} "
            "(with adaptive_gamma it caps how far gamma grows)"
        )
    if not isinstance(d.rule, str) or d.rule not in RULES:
        raise ValueError(f"decode.rule={d.rule!r}: must be one of {', '.join(RULES)}")
    check_number(
        "decode.delta", d.delta, "a number in [0, 1] (0 = lossless speculative sampling)", lambda x: 0 <= x <= 1
    )
    check_number(
        "decode.typical_epsilon",
        d.typical_epsilon,
        "a number in (0, 1] (typical acceptance's probability cap)",
        lambda x: 0 < x <= 1,
    )
    check_number(
        "decode.typical_alpha", d.typical_alpha, "a number > 0 (typical acceptance's entropy scale)", lambda x: x > 0
    )
    for t in temperatures:
        sampling_for(d, t)  # the rule at each temperature: greedy acceptance needs T = 0
    return temperatures, spec_from(d)


def check_prompt_lookup(node: Any) -> dict:
    """prompt_lookup's {max_ngram, min_ngram}, as the drafter takes them."""
    if not isinstance(node, DictConfig) or not set(node) <= {"max_ngram", "min_ngram"}:
        raise ValueError(f"prompt_lookup={node!r}: must be {{max_ngram: N, min_ngram: M}}")
    for key in node:
        check_int(f"prompt_lookup.{key}", node[key])
    PromptLookupDrafter(vocab_size=1, **node)  # min_ngram <= max_ngram
    return dict(node)


def check_hybrid_config(node: Any) -> dict:
    """hybrid's {max_ngram, min_match, learned_gamma, branches}, as the hybrid drafter takes them."""
    keys = {"max_ngram", "min_match", "learned_gamma", "branches"}
    if not isinstance(node, DictConfig) or not set(node) <= keys:
        raise ValueError(
            f"hybrid={node!r}: must be {{max_ngram: N, min_match: M, learned_gamma: G or null, branches: bool}}"
        )
    given = {k: node[k] for k in node if k != "branches"}
    check_hybrid(**{"max_ngram": 3, "min_match": 2, "learned_gamma": None, **given})
    check_bool("hybrid.branches", node.get("branches", False))
    return dict(node)


def check_prompts(node: DictConfig) -> None:
    """prompts.num_prompts and prompt_len, the set, chat and turns settings, and a prompts file: read and
    parsed once before any work."""
    check_int("prompts.num_prompts", node.num_prompts)
    check_int("prompts.prompt_len", node.prompt_len)
    chosen = node.get("set")
    if chosen is not None and chosen not in PROMPT_SETS:
        raise ValueError(
            f"prompts.set={chosen!r}: must be null (held-out windows or prompts.file) or one of {PROMPT_SETS}"
        )
    chat = check_bool("prompts.chat", node.get("chat", False))
    system = node.get("system")
    if system is not None and (not isinstance(system, str) or not system.strip()):
        raise ValueError(f"prompts.system={system!r}: give a non-empty text, or null for the template's own")
    turns = node.get("turns", 1)
    if isinstance(turns, bool) or turns not in (1, 2):
        raise ValueError(f"prompts.turns={turns!r}: must be 1 or 2")
    if turns == 2 and not chat:
        raise ValueError("prompts.turns=2: a second turn follows the model's answer in a chat; set prompts.chat=true")
    path = node.get("file")
    if path is None:
        return
    if chosen is not None:
        raise ValueError(f"prompts.file={path!r} and prompts.set={chosen!r}: give one of them")
    if not isinstance(path, str):
        raise ValueError(f"prompts.file={path!r}: must be a path or null")
    if Path(path).is_dir():
        raise ValueError(f"prompts.file={path!r} is a directory: give a .jsonl file or a text file")
    if path.endswith(".json"):  # read as plain text, JSON syntax and all: refuse rather than prompt with it
        raise ValueError(
            f'prompts.file={path!r}: name a JSON-lines file .jsonl (one {{"prompt": ...}} a line), '
            "or give plain text (.txt)"
        )
    try:
        questions = read_questions(path)
    except UnicodeDecodeError as e:
        raise ValueError(f"prompts.file={path!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if node.num_prompts > len(questions):
        raise ValueError(
            f"prompts.num_prompts={node.num_prompts}: prompts.file={path!r} holds {len(questions)} prompts; "
            f"give prompts.num_prompts={len(questions)} or fewer"
        )
    if turns == 2 and not any(len(q.turns) > 1 for q in select_questions(questions, node.num_prompts)):
        raise ValueError(
            f"prompts.turns=2: none of the {node.num_prompts} questions taken from prompts.file={path!r} has a "
            "second turn (Spec-Bench's 'turns' list of two messages); set prompts.turns=1"
        )


def check_family_decode(cfg: DictConfig) -> None:
    """The drafter families' own decode settings (conf/drafter/*.yaml `decode:`), which only reach a
    drafter once its checkpoint is loaded or trained: checked here, before that."""
    for family in DRAFTER_KINDS:
        decode = cfg[family].decode
        for key in decode:
            name, value = f"{family}.decode.{key}", decode[key]
            if key in ("tree_nodes", "top_k", "depth"):
                check_int(name, value)
            elif key == "share_cache":
                check_bool(name, value)
            elif key == "candidates" and value not in CANDIDATES:
                raise ValueError(f"{name}={value!r}: must be one of {', '.join(CANDIDATES)} (a tree's nodes at T > 0)")
            elif key == "tree" and value is not None:
                paths = value if isinstance(value, ListConfig) else None
                if not paths or not all(
                    isinstance(p, ListConfig)
                    and len(p) > 0
                    and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p)
                    for p in paths
                ):
                    raise ValueError(
                        f"{name}={value!r}: must be null (the default tree) or a non-empty list of "
                        "rank paths, e.g. [[0], [1], [0, 0]]"
                    )


# ------------------------------------------------------------------------------------------------ checkpoints


def command_line_keys() -> set[str]:
    """The keys the user typed on the command line (Hydra's task overrides, `key=value` or `+key=value`);
    empty outside a Hydra app. Defaults and experiment presets are not among them."""
    if not HydraConfig.initialized():
        return set()
    return {o.key_or_group for o in OverridesParser.create().parse_overrides(list(HydraConfig.get().overrides.task))}


def check_typed_settings(kind: str, directory: str, meta: dict, cfg: DictConfig, typed: set[str]) -> None:
    """A drafter setting the user typed (`medusa.module.num_heads=64`) must be what the given checkpoint was
    trained with: the checkpoint decides what runs, so a different value would be recorded but not run.
    Values from defaults or presets are not compared: the results record the checkpoint's own."""
    recipe = checkpoint_recipe(meta)
    for key in sorted(typed):
        parts = key.split(".")
        if parts[0] != kind or len(parts) < 2 or parts[1] not in ("module", "loss"):
            continue
        part = parts[1]
        node = OmegaConf.to_container(cfg[kind][part], resolve=True)
        for name in parts[2:3] or list(node):
            wanted, found = node.get(name), (recipe[part] or {}).get(name, "<absent>")
            if wanted != found:
                trained = "records none" if found == "<absent>" else f"was trained with {json.dumps(found)}"
                raise ValueError(
                    f"{kind}.{part}.{name}={json.dumps(wanted)} was set on the command line, but "
                    f"checkpoints.{kind}={directory} {trained}: drop the override to run that checkpoint, "
                    f"or set checkpoints.{kind}=null to train one with it"
                )


def check_checkpoints(cfg: DictConfig, kinds: list[str]) -> None:
    """The checkpoints of `kinds` (base, assistant, draft, drafter families), from their meta.json only,
    before anything loads or trains: each given directory exists, is complete and is of the kind its
    setting takes (a drafter of that family, trained on the given base, with the settings the user typed);
    a missing one comes from the artifact cache, so artifacts.root must be writable."""
    typed = command_line_keys()
    given = {}
    for kind in kinds:
        path = cfg.checkpoints[kind]
        if path is not None and not isinstance(path, str):
            raise ValueError(
                f"checkpoints.{kind}={path!r}: must be a checkpoint directory or null (from the artifact cache)"
            )
        if path is None:
            recipe = cfg.artifacts[kind]
            if not isinstance(recipe, ListConfig) or not all(isinstance(o, str) for o in recipe):
                raise ValueError(f"artifacts.{kind}={recipe!r}: must be a list of Hydra overrides (key=value)")
            if kind in ENTRY:  # the recipe's own settings, now rather than after the artifacts before it trained
                check_artifact(kind, artifact_overrides(cfg, kind, "/placeholder/base/checkpoint", None))
        else:
            given[kind] = path
    if len(given) < len(kinds):
        check_writable(cfg.artifacts.root, "artifacts.root")
    base = None  # (meta, tokenizer) of a given base checkpoint of this project
    for kind, path in given.items():
        if kind in ("base", "assistant"):
            if not is_hf_directory(Path(path)):
                meta = read_meta(path)
                role = "base_checkpoint" if kind == "base" and "base_checkpoint" in cfg else f"checkpoints.{kind}"
                tokenizer = check_lm_meta(path, meta, role)
                base = (meta, tokenizer) if kind == "base" else base
            continue
        served = detect(path) if Path(path).is_dir() else None
        if served is not None:  # a serving-format directory: its files checked now, read when the drafters load
            check_served(path, kind, given.get("base"))
            continue
        meta = read_meta(path)
        package = meta["model_config"].get("package") if meta.get("kind") == "drafter" else None
        if kind == "draft" and package is None:  # an independent LM on the base's tokenizer
            tokenizer = check_lm_meta(path, meta, "checkpoints.draft")
            if base is not None and tokenizer.to_str() != base[1].to_str():
                raise ValueError(
                    tokenizer_mismatch(
                        f"checkpoints.draft={path}", tokenizer, base[1], "train it on the base's data config"
                    )
                )
        elif package is None:
            raise CheckpointError(
                f"checkpoints.{kind}={path} is a base LM checkpoint (kind={meta.get('kind')!r}), not a "
                f"drafter: train one on it with python -m experiments.train_drafter drafter={kind} "
                f"base_checkpoint={path}"
            )
        elif package != kind:
            raise CheckpointError(f"checkpoints.{kind}={path} is a {package} drafter checkpoint, not a {kind} one")
        if package is not None and base is not None and meta.get("base_fingerprint") != base[0]["fingerprint"]:
            raise CheckpointError(
                f"checkpoints.{kind}={path} was trained on base {meta.get('base_fingerprint')}, not on "
                f"base_checkpoint={cfg.checkpoints.base} ({base[0]['fingerprint']}): train it on this base"
            )
        check_typed_settings(kind, path, meta, cfg, typed)


# ------------------------------------------------------------------------------------- the benchmark's own


def check_settings(cfg: DictConfig) -> list[tuple[int | None, bool | str]]:
    """(threads, compile mode) pairs to time side by side; one-line errors before any work."""
    threads = [
        check_int("threads", t, allow_null=True) for t in as_list(cfg.threads, "threads", "null or an integer >= 1")
    ]
    modes = [check_mode(c) for c in as_list(cfg.compile, "compile", "true, false or graph")]
    return [(t, c) for t in threads for c in modes]


def check_budget(cfg: DictConfig) -> None:
    """budget and budget_search, checked before any model loads (one-line errors)."""
    if cfg.budget not in ("fixed", "auto"):
        raise ValueError(f"budget={cfg.budget!r}: must be fixed (decode.gamma and the drafters' tree settings) or auto")
    search = cfg.budget_search
    check_int("budget_search.max_gamma", search.max_gamma)
    check_int("budget_search.pilot_prompts", search.pilot_prompts)
    for family, allowed in BUDGET_TREE_KEYS.items():
        candidates = search[f"{family}_trees"]
        if not isinstance(candidates, ListConfig) or len(candidates) == 0:
            raise ValueError(
                f"budget_search.{family}_trees={candidates!r}: must be a non-empty list of {{tree_nodes, depth}}"
            )
        for c in candidates:
            if not isinstance(c, DictConfig) or set(c) - allowed or not {"tree_nodes", "depth"} <= set(c):
                raise ValueError(
                    f"budget_search.{family}_trees entry {c!r}: needs tree_nodes and depth (allowed keys: "
                    f"{sorted(allowed)})"
                )
            for key, value in c.items():
                check_int(f"budget_search.{family}_trees {key}", value)


def check_benchmark(cfg: DictConfig) -> tuple[list[tuple[int | None, bool]], list[float], SpecConfig]:
    """Every setting the benchmark reads, before anything loads or trains: (threads/compile settings,
    temperatures, spec)."""
    resolve_decode_dtype(cfg.dtype, check_run(cfg))
    settings = check_settings(cfg)
    check_bool("stop_at_eos", cfg.stop_at_eos)
    check_int("repeats", cfg.repeats)
    check_int("vocab", cfg.vocab, allow_null=True)
    temperatures, spec = check_decode(cfg.decode)
    check_budget(cfg)
    methods = check_methods(cfg.methods)
    check_prompt_lookup(cfg.prompt_lookup)
    check_hybrid_config(cfg.hybrid)
    check_family_decode(cfg)
    check_prompts(cfg.prompts)
    check_checkpoints(cfg, checkpoint_kinds(methods))
    shipped_directories(cfg, methods)
    check_writable(cfg.out_dir, "out_dir")
    if cfg.budget == "auto":
        check_writable(cfg.budget_search.cache_dir, "budget_search.cache_dir")
    return settings, temperatures, spec
