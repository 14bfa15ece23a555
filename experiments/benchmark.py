"""Benchmark every drafter against plain decoding on the same held-out prompts, in one process.

    python -m experiments.benchmark base_checkpoint=outputs/reference/base_small/checkpoint
    python -m experiments.benchmark experiment=demo                      # what `make demo` runs
    python -m experiments.benchmark -m decode.gamma=1,2,4,8 medusa.module.num_heads=2,3,4,5

Protocol: the same prompts, decoding settings and process for plain decoding and every
method; each method (plain included) is warmed up first; then `repeats` rounds, each timing plain
decoding and every method back to back (interleaved, so a slow patch of the shared machine hits all
of them); speedup = method tokens/s over plain tokens/s within a round, median over rounds. At
temperature 0, a method whose rule is lossless must reproduce plain decoding token for token, or the
run fails loudly. Writes results.json, results.md and PNG plots into its run directory, logs to wandb
and prints one JSON object as the last line of standard output.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf
from tokenizers import Tokenizer, models

from experiments.lib.artifacts import ENTRY, check_artifact, ensure
from experiments.lib.calibrate import cached_verify_cost, choose_chain_budget, choose_tree_budget, cpu_model, format_cost_table
from experiments.lib.checkpoint import CheckpointError, check_lm_meta, is_hf_directory, load_lm, read_meta
from experiments.lib.cli import exit_on_user_error
from experiments.lib.data import base_data_config, prepare_data, token_counts
from experiments.lib.prompts import heldout_prompts, load_prompts
from experiments.lib.report import mode, repeated_ngram_share, write_report
from experiments.lib.rundir import check_writable
from experiments.lib.families import FAMILIES, TREE_FAMILIES, call_with_settings, family as find_family, load_drafter
from experiments.lib.settings import resolve_device
from medusa.trees import accuracies_from_metrics
from verify.acceptance import RULES, check_rule, is_lossless
from verify.draft_model import DraftModelDrafter
from verify.plain import plain_generate
from verify.prompt_lookup import PromptLookupDrafter
from verify.sampling import SamplingConfig
from verify.speculative import SpecConfig, speculative_generate
from verify.target import Target, make_target
from verify.vocab import frequent_tokens

log = logging.getLogger(__name__)
DRAFTER_KINDS = ("draft", "medusa", "prophet", "sequential", "early_exit")  # trained by train_drafter on the frozen base
METHODS = ("draft_model", "prompt_lookup", "medusa_chain", "medusa_tree", "prophet_chain", "prophet_tree",
           "sequential_chain", "sequential_tree", "early_exit_chain")  # <family>_<mode>


class ExactnessError(RuntimeError):
    """A lossless method did not reproduce plain greedy decoding."""


# ------------------------------------------------------------------------ settings, checked before any work
# Every entry point (benchmark, generate, baseline, peer) checks every setting it reads before anything
# loads or trains, and says in one line which value is wrong and what is allowed: a bad value found after
# minutes of training, or a NaN that decodes one token and vanishes from the table, is worse than none.


def _positive_int(name: str, value, *, allow_null: bool = False) -> int | None:
    if allow_null and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: must be {'null or ' if allow_null else ''}an integer >= 1")
    return value


def _number(name: str, value, allowed: str, ok: Callable[[float], bool]) -> float:
    """A finite number (not a bool, a string, NaN or inf) for which ok(value) holds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name}={value!r}: must be {allowed}")
    return float(value)


def _boolean(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: must be true or false")
    return value


def as_list(value, name: str, allowed: str) -> list:
    """A config value that may be one setting or a list of settings -> a non-empty list."""
    values = list(value) if isinstance(value, (list, tuple, ListConfig)) else [value]
    if not values:
        raise ValueError(f"{name}=[]: give {allowed}, or a list of them")
    return values


def check_run(cfg: DictConfig) -> torch.device:
    """device and seed, as every entry point takes them."""
    if not isinstance(cfg.device, str):
        raise ValueError(f"device={cfg.device!r}: must be auto, cpu or cuda[:N]")
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int) or cfg.seed < 0:
        raise ValueError(f"seed={cfg.seed!r}: must be an integer >= 0")
    return resolve_device(cfg.device)


def check_temperature(name: str, value) -> float:
    return _number(name, value, "a finite number >= 0 (0 = greedy)", lambda t: t >= 0)


def spec_from(d: DictConfig) -> SpecConfig:
    """The speculative loop's settings from a decode config (conf/decode): the one place they are built.
    max_gamma only caps adaptive gamma; without adaptation a gamma above it is no contradiction."""
    max_gamma = d.max_gamma if d.adaptive_gamma else max(d.max_gamma, d.gamma)
    return SpecConfig(gamma=d.gamma, rule=d.rule, delta=float(d.delta), typical_epsilon=float(d.typical_epsilon),
                      typical_alpha=float(d.typical_alpha), adaptive_gamma=d.adaptive_gamma, max_gamma=max_gamma)


def sampling_for(d: DictConfig, temperature: float) -> tuple[SamplingConfig, str]:
    """The sampling transform at one temperature, and the acceptance rule resolved for it."""
    sampling = SamplingConfig(temperature=temperature, top_k=d.top_k, top_p=float(d.top_p))
    return sampling, check_rule(d.rule, delta=float(d.delta), temperature=temperature)


def check_decode(d: DictConfig) -> tuple[list[float], SpecConfig]:
    """Every key of a decode config, named in its error: (temperatures, spec)."""
    temperatures = [check_temperature(f"decode.temperatures[{i}]", t)
                    for i, t in enumerate(as_list(d.temperatures, "decode.temperatures", "a number >= 0"))]
    if len(set(temperatures)) < len(temperatures):
        raise ValueError(f"decode.temperatures={temperatures}: give each temperature once")
    _positive_int("decode.top_k", d.top_k, allow_null=True)
    _number("decode.top_p", d.top_p, "a number in (0, 1] (1 = no nucleus filter)", lambda p: 0 < p <= 1)
    _positive_int("decode.max_new_tokens", d.max_new_tokens)
    _positive_int("decode.batch_size", d.batch_size)
    _positive_int("decode.gamma", d.gamma)
    _positive_int("decode.max_gamma", d.max_gamma)
    if _boolean("decode.adaptive_gamma", d.adaptive_gamma) and d.max_gamma < d.gamma:
        raise ValueError(f"decode.max_gamma={d.max_gamma}: must be >= decode.gamma={d.gamma} "
                         "(with adaptive_gamma it caps how far gamma grows)")
    if not isinstance(d.rule, str) or d.rule not in RULES:
        raise ValueError(f"decode.rule={d.rule!r}: must be one of {', '.join(RULES)}")
    _number("decode.delta", d.delta, "a number in [0, 1] (0 = lossless speculative sampling)", lambda x: 0 <= x <= 1)
    _number("decode.typical_epsilon", d.typical_epsilon, "a number in (0, 1] (typical acceptance's probability cap)",
            lambda x: 0 < x <= 1)
    _number("decode.typical_alpha", d.typical_alpha, "a number > 0 (typical acceptance's entropy scale)", lambda x: x > 0)
    for t in temperatures:
        sampling_for(d, t)  # the rule at each temperature: greedy acceptance needs T = 0
    return temperatures, spec_from(d)


def check_methods(methods) -> list[str]:
    """The method names (one name alone is a list of one); unknown or repeated names are errors."""
    names = list(methods) if isinstance(methods, (list, tuple, ListConfig)) else [methods]
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise ValueError(f"methods contain {unknown}: each must be one of {', '.join(METHODS)}")
    if len(set(names)) < len(names):
        raise ValueError(f"methods={names}: give each method once")
    return names


def checkpoint_kinds(methods: list[str]) -> list[str]:
    """The checkpoints the methods read: the base, then the draft model and each drafter family once."""
    kinds = ["base"]
    for name in methods:
        kind = "draft" if name == "draft_model" else None if name == "prompt_lookup" else name.rsplit("_", 1)[0]
        if kind is not None and kind not in kinds:
            kinds.append(kind)
    return kinds


def check_prompt_lookup(node) -> dict:
    if not isinstance(node, DictConfig) or not set(node) <= {"max_ngram", "min_ngram"}:
        raise ValueError(f"prompt_lookup={node!r}: must be {{max_ngram: N, min_ngram: M}}")
    for key in node:
        _positive_int(f"prompt_lookup.{key}", node[key])
    PromptLookupDrafter(vocab_size=1, **node)  # min_ngram <= max_ngram
    return dict(node)


# Stands in for the base's tokenizer when the prompts file is checked before the base exists.
_ANY_TEXT = Tokenizer(models.WordLevel({"?": 0}, unk_token="?"))


def check_prompts(node: DictConfig) -> None:
    """prompts.num_prompts and prompt_len, and a prompts file: read and parsed once before any work."""
    _positive_int("prompts.num_prompts", node.num_prompts)
    _positive_int("prompts.prompt_len", node.prompt_len)
    path = node.get("file")
    if path is None:
        return
    if not isinstance(path, str):
        raise ValueError(f"prompts.file={path!r}: must be a path or null")
    if Path(path).is_dir():
        raise ValueError(f"prompts.file={path!r} is a directory: give a .jsonl file or a text file")
    if path.endswith(".json"):  # read as plain text, JSON syntax and all: refuse rather than prompt with it
        raise ValueError(f"prompts.file={path!r}: name a JSON-lines file .jsonl (one {{\"prompt\": ...}} a line), "
                         "or give plain text (.txt)")
    try:
        load_prompts(path, _ANY_TEXT)
    except UnicodeDecodeError as e:
        raise ValueError(f"prompts.file={path!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def check_family_decode(cfg: DictConfig) -> None:
    """The drafter families' own decode settings (conf/drafter/*.yaml `decode:`), which only reach a
    drafter once its checkpoint is loaded or trained: checked here, before that."""
    for family in DRAFTER_KINDS:
        decode = cfg[family].decode
        for key in decode:
            name, value = f"{family}.decode.{key}", decode[key]
            if key in ("tree_nodes", "top_k", "depth"):
                _positive_int(name, value)
            elif key == "share_cache":
                _boolean(name, value)
            elif key == "tree" and value is not None:
                paths = value if isinstance(value, ListConfig) else None
                if not paths or not all(isinstance(p, ListConfig) and len(p) > 0 and all(
                        isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p) for p in paths):
                    raise ValueError(f"{name}={value!r}: must be null (the default tree) or a non-empty list of "
                                     "rank paths, e.g. [[0], [1], [0, 0]]")


def command_line_keys() -> set[str]:
    """The keys the user typed on the command line (Hydra's task overrides, `key=value` or `+key=value`);
    empty outside a Hydra app. Defaults and experiment presets are not among them."""
    if not HydraConfig.initialized():
        return set()
    return {o.key_or_group for o in OverridesParser.create().parse_overrides(list(HydraConfig.get().overrides.task))}


def checkpoint_recipe(meta: dict) -> dict[str, Any]:
    """What a checkpoint was trained as: {"module", "loss"}; a base LM (an independent draft model) has
    its LM config as module and no distillation loss."""
    if meta.get("kind") == "drafter":
        return {"module": meta["model_config"]["module"], "loss": (meta.get("drafter") or {}).get("loss")}
    return {"module": meta["model_config"], "loss": None}


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
                raise ValueError(f"{kind}.{part}.{name}={json.dumps(wanted)} was set on the command line, but "
                                 f"checkpoints.{kind}={directory} {trained}: drop the override to run that checkpoint, "
                                 f"or set checkpoints.{kind}=null to train one with it")


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
            raise ValueError(f"checkpoints.{kind}={path!r}: must be a checkpoint directory or null (from the artifact cache)")
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
        meta = read_meta(path)
        package = meta["model_config"].get("package") if meta.get("kind") == "drafter" else None
        if kind == "draft" and package is None:  # an independent LM on the base's tokenizer
            tokenizer = check_lm_meta(path, meta, "checkpoints.draft")
            if base is not None and tokenizer.to_str() != base[1].to_str():
                raise ValueError(f"checkpoints.draft={path} uses another tokenizer than the base: train it on the "
                                 "base's data config")
        elif package is None:
            raise CheckpointError(f"checkpoints.{kind}={path} is a base LM checkpoint (kind={meta.get('kind')!r}), not a "
                                  f"drafter: train one on it with python -m experiments.train_drafter drafter={kind} "
                                  f"base_checkpoint={path}")
        elif package != kind:
            raise CheckpointError(f"checkpoints.{kind}={path} is a {package} drafter checkpoint, not a {kind} one")
        if package is not None and base is not None and meta.get("base_fingerprint") != base[0]["fingerprint"]:
            raise CheckpointError(f"checkpoints.{kind}={path} was trained on base {meta.get('base_fingerprint')}, not on "
                                  f"base_checkpoint={cfg.checkpoints.base} ({base[0]['fingerprint']}): train it on this base")
        check_typed_settings(kind, path, meta, cfg, typed)


def check_benchmark(cfg: DictConfig) -> tuple[list[tuple[int | None, bool]], list[float], SpecConfig]:
    """Every setting the benchmark reads, before anything loads or trains: (threads/compile settings,
    temperatures, spec)."""
    check_run(cfg)
    settings = check_settings(cfg)
    _boolean("stop_at_eos", cfg.stop_at_eos)
    _positive_int("repeats", cfg.repeats)
    _positive_int("vocab", cfg.vocab, allow_null=True)
    temperatures, spec = check_decode(cfg.decode)
    check_budget(cfg)
    methods = check_methods(cfg.methods)
    check_prompt_lookup(cfg.prompt_lookup)
    check_family_decode(cfg)
    compile_widths(cfg, spec)
    check_prompts(cfg.prompts)
    check_checkpoints(cfg, checkpoint_kinds(methods))
    check_writable(cfg.out_dir, "out_dir")
    if cfg.budget == "auto":
        check_writable(cfg.budget_search.cache_dir, "budget_search.cache_dir")
    return settings, temperatures, spec


def _overrides(node: DictConfig, prefix: str) -> list[str]:
    """The parts of a drafter config that change its training (module, loss) as Hydra overrides."""
    out = []
    for part in ("module", "loss"):
        items = OmegaConf.to_container(node[part], resolve=True).items()
        out += [f"{prefix}.{part}.{key}={json.dumps(value)}" for key, value in sorted(items)]
    return out


def checkpoint_for(cfg: DictConfig, kind: str, base_ckpt: str | None = None, base_meta: dict | None = None) -> str:
    """An explicit checkpoint from the config, or the artifact cache's (trained on first use).

    Every recipe trained beside a base uses the base's own data config, so the tokenizers match."""
    given = cfg.checkpoints[kind]
    if given is not None:
        return given
    return str(ensure(kind, artifact_overrides(cfg, kind, base_ckpt, base_meta), root=cfg.artifacts.root))


def artifact_overrides(cfg: DictConfig, kind: str, base_ckpt: str | None, base_meta: dict | None) -> list[str]:
    """The Hydra overrides of train_base / train_drafter that train the `kind` artifact."""
    overrides = list(cfg.artifacts[kind])
    data_cfg = base_data_config(base_meta or {}, {}) if base_meta else None
    if data_cfg:
        overrides += [f"data.{key}={json.dumps(value)}" for key, value in sorted(data_cfg.items())]
    if kind in DRAFTER_KINDS:
        overrides += [f"drafter={kind}", f"base_checkpoint={base_ckpt}"]
        overrides += _overrides(cfg[kind], "drafter")
    return overrides


def check_untrained_drafters(cfg: DictConfig, base) -> None:
    """Build every drafter the artifact cache will train, once, on the loaded base and drop it: a module setting
    its training would refuse (medusa.module.num_heads=0, fuse_layers beyond the base) fails now, not after
    the artifacts before it trained."""
    for name in check_methods(cfg.methods):
        kind = "draft" if name == "draft_model" else name.rsplit("_", 1)[0]
        if kind in DRAFTER_KINDS and cfg.checkpoints[kind] is None:
            module = OmegaConf.to_container(cfg[kind].module, resolve=True)
            call_with_settings(find_family(kind).build, f"{kind}.module", base, **module)


def make_methods(cfg: DictConfig, base, base_meta: dict, base_ckpt: str,
                 tokenizer) -> tuple[dict[str, Callable[..., Any]], dict[str, dict]]:
    """Method name -> a factory of a fresh drafter (state is per batch, so one per generate call), and
    per checkpoint kind what was loaded (checkpoint path, fingerprint, step, module and loss as trained).

    A factory takes `compile` (the drafter's own decoder steps through torch.compile) and drafter
    keyword overrides (a tree budget chosen by `budget=auto`)."""
    vocab = drafter_vocab(cfg, base_meta, base.num_tokens)
    check_untrained_drafters(cfg, base)
    methods: dict[str, Callable[..., Any]] = {}
    loaded: dict[str, dict] = {}
    trained: dict[str, tuple] = {}  # family -> (module, package): chain and tree share one checkpoint
    for name in check_methods(cfg.methods):
        if name == "draft_model":
            directory = checkpoint_for(cfg, "draft", base_ckpt, base_meta)
            draft_lm, meta = load_draft_model(directory, base, base_meta, tokenizer, vocab)
            loaded["draft"] = loaded_record(directory, meta)
            methods[name] = lambda lm=draft_lm, compile=False: DraftModelDrafter(lm, compile=compile, vocab=vocab)
        elif name == "prompt_lookup":
            methods[name] = lambda compile=False: PromptLookupDrafter(vocab_size=base.num_tokens, **cfg.prompt_lookup)
        else:
            family, mode = name.rsplit("_", 1)
            if family not in trained:
                directory = checkpoint_for(cfg, family, base_ckpt, base_meta)
                module, package, meta = load_drafter(directory, base, base_meta)
                check_train_vocab(meta, vocab, family)
                trained[family] = module, package, head_accuracies(family, module, meta)
                loaded[family] = loaded_record(directory, meta)
            module, package, accuracies = trained[family]
            decode = {**OmegaConf.to_container(cfg[family].decode, resolve=True), "mode": mode, **accuracies}
            if mode == "chain" and "tree" in decode:  # a static tree configures the tree method only
                decode["tree"] = None
            compiles = FAMILIES[family].compiles  # heads have no decoder to compile
            methods[name] = lambda m=module, p=package, d=decode, c=compiles, compile=False, **over: p.make_drafter(
                m, base, **{**d, **over}, vocab=vocab, **({"compile": compile} if c else {}))
    return methods, loaded


def loaded_record(directory: str, meta: dict) -> dict[str, Any]:
    return {"checkpoint": str(directory), "kind": meta.get("kind"), "fingerprint": meta["fingerprint"],
            "step": meta.get("step"), **checkpoint_recipe(meta)}


def recorded_config(cfg: DictConfig, loaded: dict[str, dict]) -> dict[str, Any]:
    """The run's config for results.json, with each drafter's module and loss as its checkpoint was
    trained: that is what ran, whatever defaults the composed config holds."""
    config = OmegaConf.to_container(cfg, resolve=True)
    for kind, record in loaded.items():
        config[kind]["module"], config[kind]["loss"] = record["module"], record["loss"]
    return config


def head_accuracies(family: str, module, meta: dict) -> dict:
    """{"accuracies": ...} for head families whose checkpoint measured its heads' rank accuracies on
    validation: their default trees grow from them (not from typical Medusa accuracies); else {}."""
    if not FAMILIES[family].head_tree or "head1_rank0" not in meta.get("metrics", {}):
        return {}
    return {"accuracies": accuracies_from_metrics(meta["metrics"], module.num_heads)}


def check_train_vocab(meta: dict, vocab, name: str) -> None:
    """Warn when a drafter drafts from another vocabulary than it was trained on: rows it never trained
    (a distilled draft model's are at their initialisation) would draft, losslessly but badly."""
    trained_on, drafting = meta.get("train_vocab"), None if vocab is None else vocab.numel()
    if trained_on != drafting:
        log.warning("%s was trained on %s but drafts from %s: set vocab=%s", name,
                    f"{trained_on} tokens" if trained_on else "the full vocabulary",
                    f"{drafting} tokens" if drafting else "the full vocabulary", trained_on or "null")


def load_draft_model(directory: str, base, base_meta: dict, tokenizer, vocab) -> tuple[torch.nn.Module, dict]:
    """The draft LM and its checkpoint's meta: one distilled from this base (a `draft` drafter checkpoint)
    or an independent LM trained on the corpus (a base checkpoint with the base's tokenizer)."""
    if read_meta(directory).get("kind") == "drafter":
        module, _, meta = load_drafter(directory, base, base_meta)
        check_train_vocab(meta, vocab, "the draft model")
        return module, meta
    draft_lm, draft_tokenizer, meta = load_lm(directory, device=str(next(base.parameters()).device), role="checkpoints.draft")
    if draft_tokenizer.to_str() != tokenizer.to_str():
        raise ValueError("the draft model uses another tokenizer than the base: train it on the base's data config")
    return draft_lm, meta


def drafter_vocab(cfg: DictConfig, base_meta: dict, vocab_size: int):
    """The drafters' trimmed vocabulary: ids (N,) of the `vocab` most frequent training tokens, or None."""
    n = cfg.get("vocab")
    if n is None:
        return None
    data_cfg = base_data_config(base_meta, OmegaConf.to_container(cfg.data, resolve=True))
    ids = frequent_tokens(token_counts(prepare_data(**data_cfg), vocab_size), n)
    if ids is not None:
        log.info("drafter vocabulary: the %d most frequent training tokens of %d", ids.numel(), vocab_size)
    return ids


def get_prompts(cfg: DictConfig, tokenizer, base_meta: dict) -> list[list[int]]:
    if cfg.prompts.file:
        prompts = load_prompts(cfg.prompts.file, tokenizer)
        return prompts[: cfg.prompts.num_prompts]
    data = prepare_data(**base_data_config(base_meta, OmegaConf.to_container(cfg.data, resolve=True)))
    if data.tokenizer.to_str() != tokenizer.to_str():
        raise ValueError("the data config gives another tokenizer than the base's: pass the base's data config")
    return heldout_prompts(data, num_prompts=cfg.prompts.num_prompts, prompt_len=cfg.prompts.prompt_len, seed=cfg.seed)


def run_once(target: Target, factory, batches, *, sampling: SamplingConfig, spec: SpecConfig, cfg, seed: int, eos_id):
    """Decode every batch with plain decoding (factory None) or a drafter; (tokens, stats list, seconds)."""
    tokens, stats, seconds = [], [], 0.0
    generator = torch.Generator(device=target.device).manual_seed(seed)
    kwargs = dict(max_new_tokens=cfg.decode.max_new_tokens, sampling=sampling, eos_id=eos_id, generator=generator)
    for batch in batches:
        if factory is None:
            out = plain_generate(target, batch, **kwargs)
        else:
            out = speculative_generate(target, factory(), batch, spec=spec, **kwargs)
        tokens += out.tokens
        stats.append(out.stats)
        seconds += out.stats.time_total
    return tokens, stats, seconds


def summarize_stats(stats: list, seconds: float) -> dict[str, Any]:
    tokens = sum(int(s.tokens.sum()) for s in stats)
    forwards = sum(int(s.forwards.sum()) for s in stats)
    proposed = sum(int(s.proposed.sum()) for s in stats)
    accepted = sum(int(s.accepted.sum()) for s in stats)
    k = max(s.proposed_by_position.shape[0] for s in stats)
    pad = lambda t: torch.cat((t, torch.zeros(k - t.shape[0], dtype=torch.long)))  # noqa: E731
    prop = sum(pad(s.proposed_by_position) for s in stats)
    acc = sum(pad(s.accepted_by_position) for s in stats)
    draft, target = sum(s.time_draft for s in stats), sum(s.time_target for s in stats)
    steps = max(sum(int(s.forwards.max()) - 1 for s in stats), 1)  # verification forwards (the prefill is not one)
    return {
        "draft_seconds_per_step": draft / steps, "target_seconds_per_step": target / steps,
        "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
        "tau": tokens / max(forwards, 1), "alpha": accepted / max(proposed, 1),
        "acceptance_by_position": (acc.float() / prop.clamp(min=1).float()).tolist() if k else [],
        "time_draft": draft, "time_target": target, "time_other": max(seconds - draft - target, 0.0),
        "row_tau": [t for s in stats for t in s.row_tau],
    }


def check_settings(cfg: DictConfig) -> list[tuple[int | None, bool]]:
    """(threads, compiled) pairs to time side by side; one-line errors before any work."""
    threads = [_positive_int("threads", t, allow_null=True) for t in as_list(cfg.threads, "threads", "null or an integer >= 1")]
    modes = [_boolean("compile", c) for c in as_list(cfg.compile, "compile", "true or false")]
    return [(t, c) for t in threads for c in modes]


def bench_temperature(cfg, setups: list[dict], batches, temperature: float, eos_id) -> tuple[list[dict], list[dict]]:
    """Plain and every method in every setting at one temperature: warm-up, interleaved rounds, medians.

    Speedup is against the FASTEST plain decoding of the same round (over all settings), so a method
    only counts as faster if it beats the best plain decoder a user could pick instead."""
    sampling, rule = sampling_for(cfg.decode, temperature)
    for s in setups:
        s["chosen"] = choose_budgets(cfg, s, sampling, eos_id) if cfg.budget == "auto" else {}
    entries = [dict(setup=s, name=name, **s["chosen"].get(name, dict(factory=factory, spec=s["spec"])))
               for s in setups for name, factory in {"plain": None, **s["methods"]}.items()]
    for e in entries:  # warm-up (allocator, lazy inits, compilation): timed on its own, never in tokens/s
        torch.set_num_threads(e["setup"]["threads"])
        start = time.perf_counter()
        run_once(e["setup"]["target"], e["factory"], batches[:1], sampling=sampling, spec=e["spec"], cfg=cfg, seed=cfg.seed, eos_id=eos_id)
        e["warmup_s"] = time.perf_counter() - start
        e["rounds"] = []
    for r in range(cfg.repeats):
        for e in entries:
            torch.set_num_threads(e["setup"]["threads"])
            tokens, stats, seconds = run_once(e["setup"]["target"], e["factory"], batches, sampling=sampling, spec=e["spec"],
                                              cfg=cfg, seed=cfg.seed + r, eos_id=eos_id)
            e["rounds"].append((tokens, summarize_stats(stats, seconds)))
    fastest = [max(e["rounds"][r][1]["tokens_per_s"] for e in entries if e["factory"] is None) for r in range(cfg.repeats)]
    plain_of = {id(e["setup"]): e for e in entries if e["factory"] is None}
    # How much of plain decoding's own output at this temperature repeats an earlier 4-gram of its row: a
    # base looping at T=0 makes drafting trivially easy, so every row carries this figure beside its tau.
    # One figure per temperature (the first setting's plain decoding, its rounds pooled: at T=0 they are
    # identical, at T>0 they are more samples); other settings decode the same prompts with the same seeds.
    first_plain = next(e for e in entries if e["factory"] is None)
    prompts = [p for batch in batches for p in batch]
    repeat4 = repeated_ngram_share(prompts * len(first_plain["rounds"]),
                                   [row for tokens, _ in first_plain["rounds"] for row in tokens], n=4)
    plains, rows = [], []
    for e in entries:
        per_round = [m for _, m in e["rounds"]]
        speedups = [m["tokens_per_s"] / f for m, f in zip(per_round, fastest)]
        median = per_round[sorted(range(len(speedups)), key=speedups.__getitem__)[len(speedups) // 2]]
        common = {
            "temperature": temperature, "threads": e["setup"]["threads"], "compiled": e["setup"]["compiled"],
            "repeat4": repeat4, "tokens_per_s": statistics.median(m["tokens_per_s"] for m in per_round),
            "speedup": statistics.median(speedups), "speedups": speedups, "warmup_s": e["warmup_s"],
        }
        if e["factory"] is None:
            plains.append({**common, "tokens_per_s_rounds": [m["tokens_per_s"] for m in per_round]})
            continue
        rows.append(method_row(e, common, median, rule, plain_of[id(e["setup"])], cfg))
    return plains, rows


def method_row(e: dict, common: dict, best: dict, rule: str, plain: dict, cfg) -> dict:
    """One table row; at temperature 0 a lossless method must equal plain decoding of the same setting."""
    exact = e["rounds"][0][0] == plain["rounds"][0][0] if common["temperature"] == 0 else None
    lossless = is_lossless(rule, delta=cfg.decode.delta)
    if exact is False and lossless:
        raise ExactnessError(f"{e['name']} at temperature 0 differs from plain greedy decoding: a lossless rule must not")
    return {
        "name": e["name"], **common, "rule": rule, "lossless": lossless, "exact": exact, "gamma": e["spec"].gamma,
        "budget": e.get("budget"), "tau": best["tau"], "alpha": best["alpha"],
        "efficiency": common["speedup"] / best["tau"], "acceptance_by_position": best["acceptance_by_position"],
        "draft_share": best["time_draft"] / best["seconds"], "target_share": best["time_target"] / best["seconds"],
        "draft_seconds_per_step": best["draft_seconds_per_step"], "target_seconds_per_step": best["target_seconds_per_step"],
        "row_tau": best["row_tau"],
    }


def benchmark(cfg: DictConfig) -> dict[str, Any]:
    """Run the configured benchmark; returns the summary that main prints as its last line."""
    settings, temperatures, spec = check_benchmark(cfg)  # before anything loads or trains
    device = resolve_device(cfg.device)
    base_ckpt = checkpoint_for(cfg, "base")
    base, tokenizer, base_meta = load_lm(base_ckpt, device=str(device))
    eos_id = base_meta.get("data", {}).get("eos_id", 0) if cfg.stop_at_eos else None
    prompts = get_prompts(cfg, tokenizer, base_meta)
    widths = compile_widths(cfg, spec)
    # Every target before any drafter trains: bad prompts, or compile on a base that cannot, fail first.
    targets = [make_target(base, compile=compiled, widths=widths) for _, compiled in settings]
    targets[0].check_tokens(prompts, max_new_tokens=cfg.decode.max_new_tokens)
    methods, loaded = make_methods(cfg, base, base_meta, base_ckpt, tokenizer)
    batches = [prompts[i : i + cfg.decode.batch_size] for i in range(0, len(prompts), cfg.decode.batch_size)]
    setups = []
    for (threads, compiled), target in zip(settings, targets):
        threads = threads if threads is not None else torch.get_num_threads()
        setup = dict(threads=threads, compiled=compiled, target=target, spec=spec, makers=methods)
        setup["methods"] = {name: (lambda f=f, c=compiled: f(compile=c)) for name, f in methods.items()}
        if cfg.budget == "auto":
            torch.set_num_threads(threads)
            start = time.perf_counter()
            setup["verify_cost"] = cached_verify_cost(  # at the batch size and prompt length the pilots decode
                target, key_parts={"base": base_meta["fingerprint"], "dtype": "float32"}, cache_dir=cfg.budget_search.cache_dir,
                batch_size=cfg.decode.batch_size, prompt_len=cfg.prompts.prompt_len)
            setup["calibration_s"] = time.perf_counter() - start  # compiled: includes compiling every width
            log.info("target cost by new tokens (%s):\n%s", mode(setup), format_cost_table(setup["verify_cost"]))
            setup["pilot_prompts"] = pilot_prompts(cfg, tokenizer, base_meta, prompts)
        setups.append(setup)
    plains, rows = [], []
    for temperature in temperatures:
        plain, method_rows = bench_temperature(cfg, setups, batches, temperature, eos_id)
        plains += plain
        rows += method_rows
    results = {
        "cost_tables": {mode(s): s["verify_cost"] for s in setups if "verify_cost" in s},
        "calibration_s": {mode(s): s["calibration_s"] for s in setups if "calibration_s" in s},
        "base_checkpoint": base_ckpt, "base_fingerprint": base_meta["fingerprint"], "cpu": cpu_model(),
        "prompts": len(prompts), "batch_size": cfg.decode.batch_size, "max_new_tokens": cfg.decode.max_new_tokens,
        "repeats": cfg.repeats, "device": str(device), "dtype": "float32",
        "plain": plains, "methods": rows, "checkpoints": loaded, "config": recorded_config(cfg, loaded),
    }
    out_dir = Path(cfg.out_dir)
    write_report(results, out_dir)
    logger = instantiate(cfg.logger, dir=str(out_dir), run_config=results["config"], _convert_="all", _recursive_=False)
    try:
        for i, row in enumerate(rows):
            key = f"{row['name']}/t{row['temperature']}/{mode(row).replace(' ', '/')}"
            logger.log({f"{key}/{k}": v for k, v in row.items() if isinstance(v, (int, float))}, step=i)
    finally:
        logger.finish()
    fastest = max(plains, key=lambda p: (p["temperature"] == plains[0]["temperature"], p["tokens_per_s"]))
    keys = ("name", "temperature", "threads", "compiled", "tau", "repeat4", "alpha", "speedup", "tokens_per_s", "exact",
            "lossless")
    return {"plain_tokens_per_s": fastest["tokens_per_s"], "methods": [{k: row[k] for k in keys} for row in rows]}


TREE_KEYS = {"medusa": {"tree_nodes", "depth"}, "prophet": {"tree_nodes", "depth", "top_k"}, "sequential": {"tree_nodes", "depth"}}


def check_budget(cfg: DictConfig) -> None:
    """budget and budget_search, checked before any model loads (one-line errors)."""
    if cfg.budget not in ("fixed", "auto"):
        raise ValueError(f"budget={cfg.budget!r}: must be fixed (decode.gamma and the drafters' tree settings) or auto")
    search = cfg.budget_search
    _positive_int("budget_search.max_gamma", search.max_gamma)
    _positive_int("budget_search.pilot_prompts", search.pilot_prompts)
    for family, allowed in TREE_KEYS.items():
        candidates = search[f"{family}_trees"]
        if not isinstance(candidates, ListConfig) or len(candidates) == 0:
            raise ValueError(f"budget_search.{family}_trees={candidates!r}: must be a non-empty list of {{tree_nodes, depth}}")
        for c in candidates:
            if not isinstance(c, DictConfig) or set(c) - allowed or not {"tree_nodes", "depth"} <= set(c):
                raise ValueError(f"budget_search.{family}_trees entry {c!r}: needs tree_nodes and depth (allowed keys: {sorted(allowed)})")
            for key, value in c.items():
                _positive_int(f"budget_search.{family}_trees {key}", value)


def compile_widths(cfg: DictConfig, spec: SpecConfig) -> tuple[int, ...]:
    """Verify widths a compiled target pads to: 1 (plain), a chain's gamma + 1, each tree's nodes + 1."""
    trees = [_positive_int(f"{f}.decode.tree_nodes", cfg[f].decode.tree_nodes) for f in TREE_FAMILIES]
    if cfg.budget == "auto":
        trees += [c.tree_nodes for f in TREE_KEYS for c in cfg.budget_search[f"{f}_trees"]]
        return (1, *range(2, cfg.budget_search.max_gamma + 2), *(n + 1 for n in trees))
    return (1, spec.gamma + 1, *(n + 1 for n in trees))


def pilot_prompts(cfg: DictConfig, tokenizer, base_meta: dict, taken: list[list[int]]) -> list[list[int]]:
    """Prompts for `budget=auto`'s pilot runs: drawn with another seed, none equal to a benchmark prompt."""
    n = cfg.budget_search.pilot_prompts
    draw = OmegaConf.merge(cfg, {"seed": cfg.seed + 1, "prompts": {"num_prompts": cfg.prompts.num_prompts + n}})
    return [p for p in get_prompts(draw, tokenizer, base_meta) if p not in taken][:n]


def choose_budgets(cfg: DictConfig, setup: dict, sampling: SamplingConfig, eos_id) -> dict[str, dict]:
    """budget=auto: per method, the gamma (chains) or tree size (trees) with the highest predicted
    tokens/s from this setting's measured verify costs and a pilot run on held-out prompts."""
    search, chosen = cfg.budget_search, {}
    common = dict(verify_cost=setup["verify_cost"], sampling=sampling, eos_id=eos_id, seed=cfg.seed,
                  max_new_tokens=cfg.decode.max_new_tokens, spec=setup["spec"], batch_size=cfg.decode.batch_size)
    torch.set_num_threads(setup["threads"])
    for name, make in setup["makers"].items():
        compile_ = setup["compiled"]
        if name.endswith("_tree"):
            family = name.rsplit("_", 1)[0]
            candidates = [dict(c) for c in search[f"{family}_trees"]]
            # A head tree's depth is the loop's gamma (one head per level), not a drafter argument
            heads = FAMILIES[family].head_tree
            over = (lambda c: {k: v for k, v in c.items() if k != "depth"} | {"tree": None}) if heads else dict
            result = choose_tree_budget(setup["target"], lambda c: (lambda: make(compile=compile_, **over(c))),
                                        setup["pilot_prompts"], candidates=candidates, **common)
            kwargs, gamma = over(result["drafter_kwargs"]), result["gamma"]
            factory = lambda make=make, kwargs=kwargs: make(compile=compile_, **kwargs)  # noqa: E731
        else:
            result = choose_chain_budget(setup["target"], setup["methods"][name], setup["pilot_prompts"],
                                         max_gamma=search.max_gamma, **common)
            gamma, factory, kwargs = result["gamma"], setup["methods"][name], {}
        spec = replace(setup["spec"], gamma=gamma, max_gamma=max(setup["spec"].max_gamma, gamma))
        chosen[name] = dict(factory=factory, spec=spec, budget={"gamma": gamma, **kwargs, "table": result["table"]})
        log.info("budget=auto %s (%s, T=%g): gamma %d %s", name, mode(setup), sampling.temperature, gamma, kwargs)
    return chosen


@hydra.main(version_base="1.3", config_path="../conf", config_name="benchmark")
@exit_on_user_error
def main(cfg: DictConfig) -> None:
    summary = benchmark(cfg)
    print((Path(cfg.out_dir) / "results.md").read_text(), file=sys.stdout)
    print(json.dumps(summary), file=sys.stdout)  # the last line of standard output


if __name__ == "__main__":
    main()
