"""The decoding methods and how a config becomes their drafters, shared by the decoding entry points
(experiments/benchmark.py, generate.py, baseline.py).

A method is plain decoding's rival: `draft_model` (an LM drafting a chain), `prompt_lookup` (n-grams of the
prompt, no weights), `<family>_<mode>` for each drafter family of experiments/lib/families/registry.py and each of
its modes (chain, tree), or `hybrid_<family>_<mode>`: prompt lookup where the context repeats itself, that
family's drafter elsewhere (verify/drafters/hybrid.py). This module holds the registry (METHODS, HYBRID_METHODS, and
check_methods of a config's list of them), where each method's checkpoint comes from (an explicit directory, or the
artifact cache of experiments/lib/training/artifacts.py, trained on first use), and make_methods, which loads them
and returns one factory of a fresh drafter per method. The prompts every method decodes are
experiments/lib/methods/prompt_set.py's. The rest of a decoding config's checks, before any of this runs, are
experiments/lib/methods/decode_checks.py's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from experiments.lib.data.pipeline import base_data_config, prepare_data, token_counts
from experiments.lib.families.registry import FAMILIES, TREE_FAMILIES, call_with_settings, load_drafter
from experiments.lib.families.registry import family as find_family
from experiments.lib.store.checkpoint import CheckpointError, is_hf_directory, load_lm, read_meta, tokenizer_mismatch
from experiments.lib.store.lm import build_lm
from experiments.lib.store.shipped_drafters import SHIPPABLE
from experiments.lib.training.artifacts import compose_recipe, ensure
from medusa.trees import accuracies_from_metrics
from verify.common.vocab import frequent_tokens
from verify.drafters.draft_model import DraftModelDrafter
from verify.drafters.hybrid import HybridDrafter
from verify.drafters.prompt_lookup import PromptLookupDrafter

log = logging.getLogger(__name__)

# Checkpoint kinds train_drafter trains on the frozen base: one per family (the draft model's among them).
DRAFTER_KINDS = tuple(FAMILIES)
# <family>_<mode> -> (family, mode), for every family but the draft model's, whose one method is draft_model.
FAMILY_METHODS: dict[str, tuple[str, str]] = {
    f"{name}_{mode}": (name, mode) for name, f in FAMILIES.items() if name != "draft" for mode in f.modes
}
METHODS = ("draft_model", "prompt_lookup", *FAMILY_METHODS)  # the order of results tables; the default benchmark
# hybrid_<family>_<mode> -> (family, mode): not in the default benchmark (each doubles its family's decoding time);
# configs name the hybrids they compare
HYBRID_METHODS: dict[str, tuple[str, str]] = {f"hybrid_{name}": fm for name, fm in FAMILY_METHODS.items()}
# shipped_<method>: a family's or hybrid's method drafting with the trained drafter committed under
# shipped_drafters/<family> (experiments/lib/store/shipped_drafters.py), beside the one the config trains or names
SHIPPED = "shipped_"
SHIPPED_METHODS: dict[str, tuple[str, str]] = {
    SHIPPED + name: fm for name, fm in {**FAMILY_METHODS, **HYBRID_METHODS}.items() if fm[0] in SHIPPABLE
}
ALL_METHODS = (*METHODS, *HYBRID_METHODS, *SHIPPED_METHODS)


def family_mode(name: str) -> tuple[str | None, str]:
    """(family, mode) of a family's, a hybrid's or a shipped method; (None, "chain") for draft_model and
    prompt_lookup."""
    return FAMILY_METHODS.get(name) or HYBRID_METHODS.get(name) or SHIPPED_METHODS.get(name) or (None, "chain")


def shipped_directories(cfg: DictConfig, names: list[str]) -> dict[str, Path]:
    """family -> the shipped drafter its shipped_* methods read, each checked present and whole (its header read,
    no weights): a missing one fails before any work."""
    families = sorted({SHIPPED_METHODS[n][0] for n in names if n in SHIPPED_METHODS})
    directories = {f: Path(cfg.shipped_drafters) / f for f in families}
    for directory in directories.values():
        read_meta(directory)
    return directories


def method_kind(name: str) -> str | None:
    """The checkpoint kind method `name` reads (a drafter family), None for prompt lookup (no weights) and for a
    shipped method (its drafter is the shipped one, not a configured checkpoint)."""
    if name in SHIPPED_METHODS:
        return None
    return "draft" if name == "draft_model" else family_mode(name)[0]


def check_methods(methods: Any) -> list[str]:
    """The method names (one name alone is a list of one); unknown or repeated names are errors."""
    names = list(methods) if isinstance(methods, (list, tuple, ListConfig)) else [methods]
    unknown = [m for m in names if m not in ALL_METHODS]
    if unknown:
        raise ValueError(f"methods contain {unknown}: each must be one of {', '.join(ALL_METHODS)}")
    if len(set(names)) < len(names):
        raise ValueError(f"methods={names}: give each method once")
    return names


def checkpoint_kinds(methods: list[str]) -> list[str]:
    """The checkpoints the methods read: the base, then the draft model and each drafter family once."""
    kinds = ["base"]
    for name in methods:
        kind = method_kind(name)
        if kind is not None and kind not in kinds:
            kinds.append(kind)
    return kinds


def verify_widths(cfg: DictConfig, gammas: Iterable[int]) -> tuple[int, ...]:
    """Widths (tokens verified in one target forward) a compiled target pads to: 1 (plain decoding), a
    chain's gamma + 1 for each of `gammas`, each tree family's decode.tree_nodes + 1 (its drafts plus the
    pending token)."""
    return (1, *(g + 1 for g in gammas), *(cfg[f].decode.tree_nodes + 1 for f in TREE_FAMILIES))


# --------------------------------------------------------------------------------- where checkpoints come from


def drafter_overrides(node: DictConfig, prefix: str) -> list[str]:
    """The parts of a drafter config that change its training (module, loss) as Hydra overrides of `prefix`."""
    out = []
    for part in ("module", "loss"):
        items = OmegaConf.to_container(node[part], resolve=True).items()
        out += [f"{prefix}.{part}.{key}={json.dumps(value)}" for key, value in sorted(items)]
    return out


def artifact_overrides(cfg: DictConfig, kind: str, base_ckpt: str | None, base_meta: dict | None) -> list[str]:
    """The Hydra overrides of train_base / train_drafter that train the `kind` artifact."""
    overrides = list(cfg.artifacts[kind])
    data_cfg = base_data_config(base_meta or {}, {}) if base_meta else None
    if data_cfg:
        overrides += [f"data.{key}={json.dumps(value)}" for key, value in sorted(data_cfg.items())]
    if kind in DRAFTER_KINDS:
        overrides += [f"drafter={kind}", f"base_checkpoint={base_ckpt}"]
        overrides += drafter_overrides(cfg[kind], "drafter")
    return overrides


def checkpoint_for(cfg: DictConfig, kind: str, base_ckpt: str | None = None, base_meta: dict | None = None) -> str:
    """An explicit checkpoint from the config, or the artifact cache's (trained on first use).

    Every recipe trained beside a base uses the base's own data config, so the tokenizers match."""
    given = cfg.checkpoints[kind]
    if given is not None:
        return given
    overrides = artifact_overrides(cfg, kind, base_ckpt, base_meta)
    reuse_stale = cfg.artifacts.get("reuse_stale", False)  # true: an artifact trained by older code serves, warned
    return str(ensure(kind, overrides, root=cfg.artifacts.root, reuse_stale=reuse_stale))


def checkpoint_recipe(meta: dict) -> dict[str, Any]:
    """What a checkpoint was trained as: {"module", "loss"}; a base LM (an independent draft model) has
    its LM config as module and no distillation loss."""
    if meta.get("kind") == "drafter":
        return {"module": meta["model_config"]["module"], "loss": (meta.get("drafter") or {}).get("loss")}
    return {"module": meta["model_config"], "loss": None}


# ------------------------------------------------------------------------------------- config -> drafters


def check_untrained_drafters(cfg: DictConfig, base: torch.nn.Module, *, stand_in: bool = False) -> None:
    """Build every drafter the artifact cache will train, once, on the loaded base and drop it: a module setting
    its training would refuse (medusa.module.num_heads=0, fuse_layers beyond the base) fails now, not after
    the artifacts before it trained. On a weightless `stand_in` a family whose build must compute (early exit
    checks its lean engine against the base's forward) cannot run: that family is checked on the real base."""
    for name in check_methods(cfg.methods):
        kind = method_kind(name)
        if kind is not None and cfg.checkpoints[kind] is None:
            module = OmegaConf.to_container(cfg[kind].module, resolve=True)
            try:  # a refused setting is a ValueError, raised either way
                call_with_settings(find_family(kind).build, f"{kind}.module", base, **module)
            except (RuntimeError, NotImplementedError):
                if not stand_in:
                    raise


def check_drafters_before_base(cfg: DictConfig) -> None:
    """check_untrained_drafters on a weightless stand-in of the base (meta device: shapes, no weights, no time),
    before the base loads or its artifact trains, so `medusa.module.num_heads=0` does not wait for either.
    The shape comes from the base checkpoint's meta, or from the recipe that would train it; a Hugging Face
    directory (whose config only transformers reads) is checked once it has loaded, by make_methods."""
    path = cfg.checkpoints.base
    if path is None:
        recipe = compose_recipe("base", artifact_overrides(cfg, "base", None, None))
        config = OmegaConf.to_container(recipe.base, resolve=True)
    elif is_hf_directory(Path(path)):
        return
    else:
        config = dict(read_meta(path)["model_config"])
    config.pop("_target_", None)
    with torch.device("meta"):
        stand_in = build_lm(**config)
    check_untrained_drafters(cfg, stand_in, stand_in=True)


def make_methods(
    cfg: DictConfig, base: torch.nn.Module, base_meta: dict, base_ckpt: str, tokenizer
) -> tuple[dict[str, Callable[..., Any]], dict[str, dict]]:
    """Method name -> a factory of a fresh drafter (state is per batch, so one per generate call), and
    per checkpoint kind what was loaded (checkpoint path, fingerprint, step, module and loss as trained).

    A factory takes `compile` (the drafter's own decoder steps through torch.compile) and drafter
    keyword overrides (a tree budget chosen by `budget=auto`)."""
    names = check_methods(cfg.methods)
    # Prompt lookup drafts from the context alone: the trimmed vocabulary (counted over the training corpus,
    # seconds on a large tokenizer) is read only by the drafters that have an output layer.
    vocab = drafter_vocab(cfg, base_meta, base.num_tokens) if set(names) - {"prompt_lookup"} else None
    check_untrained_drafters(cfg, base)
    shipped = shipped_directories(cfg, names)
    for directory in shipped.values():  # another base's shipped drafter: refused before any artifact trains
        check_base(directory, read_meta(directory), base_meta)
    methods: dict[str, Callable[..., Any]] = {}
    loaded: dict[str, dict] = {}
    trained: dict[str, tuple] = {}  # family -> (module, family, accuracies): chain and tree share one checkpoint
    for name in names:
        if name == "draft_model":
            directory = checkpoint_for(cfg, "draft", base_ckpt, base_meta)
            draft_lm, meta, own = load_draft_model(directory, base, base_meta, tokenizer, vocab)
            loaded["draft"] = loaded_record(directory, meta)
            methods[name] = lambda lm=draft_lm, v=own, compile=False: DraftModelDrafter(lm, compile=compile, vocab=v)
        elif name == "prompt_lookup":
            methods[name] = lambda compile=False: PromptLookupDrafter(vocab_size=base.num_tokens, **cfg.prompt_lookup)
        else:
            family, mode = family_mode(name)
            source = SHIPPED + family if name in SHIPPED_METHODS else family  # one load per checkpoint
            if source not in trained:
                directory = (
                    shipped[family] if name in SHIPPED_METHODS else checkpoint_for(cfg, family, base_ckpt, base_meta)
                )
                module, package, meta = load_drafter(directory, base, base_meta)
                own = checkpoint_vocab(meta, vocab, family)
                trained[source] = module, package, head_accuracies(family, module, meta), own
                loaded[source] = loaded_record(directory, meta)
            module, package, accuracies, own = trained[source]
            decode = {**OmegaConf.to_container(cfg[family].decode, resolve=True), "mode": mode, **accuracies}
            if mode == "chain" and "tree" in decode:  # a static tree configures the tree method only
                decode["tree"] = None
            compiles = FAMILIES[family].compiles  # heads have no decoder to compile
            methods[name] = lambda m=module, p=package, d=decode, c=compiles, v=own, compile=False, **over: (
                p.make_drafter(m, base, **{**d, **over}, vocab=v, **({"compile": compile} if c else {}))
            )
            # a hybrid: lookup's settings, and the learned side's cap (budget=auto: its chain's gamma)
            if name.removeprefix(SHIPPED) in HYBRID_METHODS:
                methods[name] = lambda learned=methods[name], compile=False, learned_gamma=None, **over: HybridDrafter(
                    learned(compile=compile, **over),
                    **{**cfg.hybrid, **({} if learned_gamma is None else {"learned_gamma": learned_gamma})},
                )
    return methods, loaded


def check_base(directory: Path, meta: dict, base_meta: dict) -> None:
    """A one-line CheckpointError for a shipped drafter trained on another base than the one decoding."""
    if meta.get("base_fingerprint") != base_meta["fingerprint"]:
        raise CheckpointError(
            f"shipped drafter {directory} was trained on base {meta.get('base_fingerprint')}, not on this base "
            f"({base_meta['fingerprint']}): decode it on the base it shipped for, or leave out the shipped_* methods"
        )


def loaded_record(directory: str, meta: dict) -> dict[str, Any]:
    """What results.json records of a loaded checkpoint: where, which (fingerprint, step; "selected": "best" for
    the best validation of its run, "last" for the latest, null for one written before runs kept both, with the
    run's last step) and its recipe."""
    return {
        "checkpoint": str(directory),
        "kind": meta.get("kind"),
        "fingerprint": meta["fingerprint"],
        "step": meta.get("step"),
        "selected": meta.get("selected"),
        "last_step": meta.get("last_step"),
        **checkpoint_recipe(meta),
    }


def recorded_config(cfg: DictConfig, loaded: dict[str, dict]) -> dict[str, Any]:
    """The run's config for results.json, with each drafter's module and loss as its checkpoint was
    trained: that is what ran, whatever defaults the composed config holds."""
    config = OmegaConf.to_container(cfg, resolve=True)
    for kind, record in loaded.items():
        if kind in config:  # shipped drafters (shipped_<family>) keep their recipe in results.json's loaded record
            config[kind]["module"], config[kind]["loss"] = record["module"], record["loss"]
    return config


def head_accuracies(family: str, module: torch.nn.Module, meta: dict) -> dict:
    """{"accuracies": ...} for head families whose checkpoint measured its heads' rank accuracies on
    validation: their default trees grow from them (not from typical Medusa accuracies); else {}."""
    if not FAMILIES[family].head_tree or "head1_rank0" not in meta.get("metrics", {}):
        return {}
    return {"accuracies": accuracies_from_metrics(meta["metrics"], module.num_heads)}


def checkpoint_vocab(meta: dict, vocab: torch.Tensor | None, name: str) -> torch.Tensor | None:
    """The vocabulary a drafter drafts from: the ids its checkpoint was trained on when it records them (a
    vocabulary counted over the base's own answers), of the configured size; else the shared `vocab`."""
    ids = meta.get("train_vocab_ids")
    if meta.get("imported"):  # a serving-format drafter drafts from its own file's vocabulary (an EAGLE-3's own
        return None  # output layer and draft ids), whatever the config says; the others from every token
    if ids is None or vocab is None or len(ids) != vocab.numel():
        check_train_vocab(meta, vocab, name)
        return vocab
    return torch.tensor(ids, dtype=torch.long, device=vocab.device)


def check_train_vocab(meta: dict, vocab: torch.Tensor | None, name: str) -> None:
    """Warn when a drafter drafts from another vocabulary than it was trained on: rows it never trained
    (a distilled draft model's are at their initialisation) would draft, losslessly but badly."""
    trained_on, drafting = meta.get("train_vocab"), None if vocab is None else vocab.numel()
    if trained_on != drafting:
        log.warning(
            "%s was trained on %s but drafts from %s: set vocab=%s",
            name,
            f"{trained_on} tokens" if trained_on else "the full vocabulary",
            f"{drafting} tokens" if drafting else "the full vocabulary",
            trained_on or "null",
        )


def load_draft_model(
    directory: str, base: torch.nn.Module, base_meta: dict, tokenizer, vocab: torch.Tensor | None
) -> tuple[torch.nn.Module, dict, torch.Tensor | None]:
    """The draft LM, its checkpoint's meta and the vocabulary it drafts from: one distilled from this base (a
    `draft` drafter checkpoint) or an independent LM trained on the corpus (a base checkpoint with the base's
    tokenizer)."""
    if read_meta(directory).get("kind") == "drafter":
        module, _, meta = load_drafter(directory, base, base_meta)
        return module, meta, checkpoint_vocab(meta, vocab, "the draft model")
    weight = next(base.parameters())
    draft_lm, draft_tokenizer, meta = load_lm(directory, device=str(weight.device), role="checkpoints.draft")
    draft_lm.to(weight.dtype)  # decodes in the base's dtype
    if draft_tokenizer.to_str() != tokenizer.to_str():
        raise ValueError(
            tokenizer_mismatch("the draft model", draft_tokenizer, tokenizer, "train it on the base's data config")
        )
    return draft_lm, meta, vocab


def drafter_vocab(cfg: DictConfig, base_meta: dict, vocab_size: int) -> torch.Tensor | None:
    """The drafters' trimmed vocabulary: ids (N,) of the `vocab` most frequent training tokens, or None."""
    n = cfg.get("vocab")
    if n is None:
        return None
    data_cfg = base_data_config(base_meta, OmegaConf.to_container(cfg.data, resolve=True))
    ids = frequent_tokens(token_counts(prepare_data(**data_cfg), vocab_size), n)
    if ids is not None:
        log.info("drafter vocabulary: the %d most frequent training tokens of %d", ids.numel(), vocab_size)
    return ids
