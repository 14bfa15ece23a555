"""speculators' EAGLE-3 format, which vLLM serves from the directory alone (the verifier is named inside): written
from an EAGLE-3 prophet (arch=eagle3), read back as one, and checked from its files.

fc [H, A*H] over the base's layer states in ASCENDING layer order (vLLM gathers them while running the layers,
whatever order the config lists): a one-layer Llama `transformer_layer_config`, the layer's tensors under
`layers.0.*`, `norm`, `lm_head` [Vd, H] and, for a trimmed vocabulary, `d2t` [Vd] as OFFSETS (target id = draft
id + d2t[draft id]) and `t2d` [V] bool. Layer id k, in vLLM's convention, is the residual stream entering layer k
(0-based), i.e. after k blocks: this project's layer k (SGLang's k - 1). An EAGLE-3 prophet's fuse_layers ascend
(enforced when it is built), so fc's columns are the prophet's own. `norm_before_residual` is always written:
vLLM defaults it to true, speculators to false.

Reading follows vLLM, defaults included (a config without `norm_before_residual` is read as true), so what this
project measures is what vLLM would serve; an EAGLE-3 head trained elsewhere (speculators, or SGLang / SpecForge,
whose layout is read as speculators') is benchmarked like any trained drafter. Reading an export of this
project's own drafter gives back the same weights: a second export is bit-identical.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from experiments.lib.formats.common import (
    LAYER_SETTINGS,
    check_known,
    check_layer_fits,
    check_settings,
    check_tensors,
    check_verifier,
    copy_checked,
    layer_config,
    layer_shape_from,
    layer_tensors,
    llama_config,
    load_layer,
    new_prophet,
    shared_embedding,
)
from experiments.lib.store.served_dir import MARK, FormatError, read_config, read_directory, tensor
from prophet.model import Prophet

UNSUPPORTED = ("norm_before_fc", "fc_norm", "norm_output")  # speculators options this layer does not draw


# ------------------------------------------------------------------------------------------------- writing


def vocab_offsets(ids: Tensor, vocab_size: int) -> tuple[Tensor, Tensor]:
    """Sorted draft-vocabulary ids (Vd,) -> d2t (Vd,) int64 OFFSETS (target = draft + d2t[draft]) and t2d (V,) bool."""
    ids = ids.long().cpu()
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(ids.numel()), t2d


def export_tensors(prophet: Prophet, vocab: Tensor | None) -> dict[str, Tensor]:
    """An EAGLE-3 prophet's tensors in speculators' layout (its fuse_layers ascend, as vLLM hands the states over).
    `vocab` the sorted ids it drafts from (None: all V); an imported prophet's own output layer wins."""
    tensors = {"fc.weight": prophet.mix.weight} | layer_tensors(prophet.decoder)
    tensors["norm.weight"] = prophet.decoder.norm.weight
    ids, weight, _ = prophet.output_layer(vocab)
    tensors["lm_head.weight"] = weight
    if ids is not None and ids.numel() < prophet.vocab_size:
        tensors["d2t"], tensors["t2d"] = vocab_offsets(ids, prophet.vocab_size)
    return tensors


def export_config(prophet: Prophet, base: nn.Module, *, verifier: str, draft_vocab: int, tokens: int) -> dict[str, Any]:
    """speculators' config.json: the layer, the vocabularies, the layer ids (vLLM's convention), the proposal."""
    config = llama_config(base)
    return {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3DraftModel"],
        "transformer_layer_config": layer_config(base, prophet.decoder),
        "draft_vocab_size": draft_vocab,
        "norm_before_residual": prophet.decoder.norm_before_residual,
        "target_hidden_size": config.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(prophet.fuse_layers),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(config.architectures or ["LlamaForCausalLM"])},
        },
    }


# ------------------------------------------------------------------------------------------------- reading


def read(path: str | Path, base: nn.Module) -> Prophet:
    """An EAGLE-3 directory (speculators' or SGLang's layout) -> an EAGLE-3 Prophet on `base`."""
    path = Path(path)
    return from_files(*read_directory(path), base, path)


def from_files(config: dict, tensors: dict[str, Tensor], base: nn.Module, path: Path) -> Prophet:
    """An EAGLE-3 directory's config.json and tensors (as read) -> an EAGLE-3 Prophet on `base`, in eval mode."""
    config, tensors = as_speculators(config, tensors)
    layer = layer_settings(config, path)
    check_verifier({**layer, "target_hidden_size": config.get("target_hidden_size")}, base, path)
    for key in UNSUPPORTED:
        if config.get(key):
            raise FormatError(f"{path}: {key}=true is an EAGLE-3 variant this project does not draw")
    layers = config.get("eagle_aux_hidden_state_layer_ids")
    if not layers:  # vLLM's default for a Llama verifier
        depth = base.depth
        layers = [2, depth // 2, depth - 3]
    if sorted(layers) != list(layers):
        raise FormatError(f"{path}: eagle_aux_hidden_state_layer_ids={layers} must ascend (vLLM gathers them in order)")
    shape = layer_shape_from(layer, path, "transformer_layer_config")
    shape |= {"norm_before_residual": config.get("norm_before_residual", True)}
    layer_names = check_layer_fits("eagle3", shape, tensors, path)  # before anything of that size is built
    known = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | layer_names
    check_known(tensors, known | shared_embedding(tensors, base, path), path, "EAGLE-3")
    prophet = new_prophet(base, "eagle3", shape, fuse_layers=list(layers))
    copy_checked(prophet.mix.weight, tensor(tensors, "fc.weight", path), "fc.weight", path)
    load_layer(prophet.decoder, tensors, path)
    copy_checked(prophet.decoder.norm.weight, tensor(tensors, "norm.weight", path), "norm.weight", path)
    draft_vocab = config.get("draft_vocab_size")
    ids = draft_ids(tensors, base.num_tokens if draft_vocab is None else draft_vocab, base.num_tokens, path)
    weight = tensor(tensors, "lm_head.weight", path)
    dim = base.to_logits.in_features
    if weight.shape != (ids.numel(), dim):
        raise FormatError(f"{path}: lm_head.weight is {tuple(weight.shape)}, expected {(ids.numel(), dim)}")
    prophet.set_output_layer(weight.float(), ids)
    return prophet.eval()


def draft_ids(tensors: dict[str, Tensor], draft_vocab: int, vocab_size: int, path: Path) -> Tensor:
    """The target ids of an EAGLE-3 draft vocabulary (Vd,), from d2t OFFSETS, checked against t2d."""
    if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int) or not 1 <= draft_vocab <= vocab_size:
        raise FormatError(f"{path}: draft_vocab_size={draft_vocab!r} must be an integer from 1 to {vocab_size}")
    if "d2t" in tensors and tensors["d2t"].shape != (draft_vocab,):
        raise FormatError(f"{path}: d2t is {tuple(tensors['d2t'].shape)}, expected ({draft_vocab},)")
    if "t2d" in tensors and tensors["t2d"].shape != (vocab_size,):
        raise FormatError(f"{path}: t2d is {tuple(tensors['t2d'].shape)}, expected ({vocab_size},)")
    if "d2t" not in tensors:
        if draft_vocab != vocab_size:
            raise FormatError(f"{path}: draft_vocab_size={draft_vocab} < {vocab_size} tokens, and no d2t maps them")
        return torch.arange(vocab_size)
    ids = torch.arange(draft_vocab) + tensors["d2t"].long()
    t2d = tensors.get("t2d")
    in_range = bool(((ids >= 0) & (ids < vocab_size)).all())
    agrees = t2d is None or (in_range and bool(t2d.bool()[ids].all()) and int(t2d.bool().sum()) == draft_vocab)
    if not in_range or not agrees or ids.unique().numel() != draft_vocab:
        raise FormatError(
            f"{path}: d2t does not map the draft vocabulary onto distinct base tokens agreeing with t2d (d2t holds "
            "OFFSETS, target = draft + d2t[draft]; absolute ids are not that format)"
        )
    return ids


def as_speculators(config: dict, tensors: dict[str, Tensor]) -> tuple[dict, dict[str, Tensor]]:
    """SGLang's / SpecForge's EAGLE-3 layout (a plain Llama config, architectures LlamaForCausalLMEagle3, the layer
    under midlayer.*) as speculators' (what vLLM also serves it as): the layer config nested, midlayer.* renamed,
    norm_before_residual false unless given (vLLM reads a plain config so), layer ids from the config or its
    eagle_config, in vLLM's convention (vLLM serves the directory with them as they stand)."""
    if "transformer_layer_config" in config:
        return config, tensors
    ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    nested = {
        "transformer_layer_config": config,
        "draft_vocab_size": config.get("draft_vocab_size"),
        "norm_before_residual": config.get("norm_before_residual", False),
        "target_hidden_size": config.get("target_hidden_size"),
        "eagle_aux_hidden_state_layer_ids": ids,
    }
    return nested, {speculators_name(k): v for k, v in tensors.items()}


def speculators_name(name: str) -> str:
    """SGLang's / SpecForge's tensor name as speculators' (the draft layer under layers.0.)."""
    return name.replace("midlayer.", "layers.0.")


def layer_settings(config: dict, path: Path) -> dict:
    """speculators' transformer_layer_config, checked to be a JSON object."""
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise FormatError(f"{path / 'config.json'}: transformer_layer_config={layer!r} must be a JSON object")
    return layer


# ------------------------------------------------------------------------------------------------- checks


def check_files(config: dict, names: set[str], path: Path, base_path: str | Path | None) -> None:
    """An EAGLE-3 directory from its config.json and its tensors' names, before any model loads: the layer
    config's sizes, fc and norm, and the verifier the config names against the base at `base_path` (its files;
    None: not checked)."""
    config = as_speculators(config, {})[0]
    names = {speculators_name(k) for k in names}
    check_settings(layer_settings(config, path), LAYER_SETTINGS, path, within="transformer_layer_config")
    check_tensors(names, ("fc.weight", "norm.weight"), path, "eagle3")
    known = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight"}
    check_known({n for n in names if not n.startswith("layers.0.")}, known, path, "EAGLE-3")  # the layer's: on read
    if base_path is not None:
        check_verifier_names(config, path, base_path)


def base_identity(base_path: str | Path) -> tuple[set[str], set[str]]:
    """(names, architectures) a base is known by, from its files: a Hugging Face directory's name, the model its
    config and provenance.json name, its architectures; a checkpoint of this project: its directory's names."""
    base = Path(base_path)
    names = {base.name.lower(), base.resolve().name.lower()}
    if (base / "meta.json").is_file():
        arch = json.loads((base / "meta.json").read_text()).get("model_config", {}).get("arch")
        return names | {base.parent.name.lower()}, {"LlamaForCausalLM" if arch == "llama" else "TransformerWrapper"}
    config = read_config(base)
    names.add(Path(str(config.get("_name_or_path") or "")).name.lower())
    if (base / "provenance.json").is_file():  # a converted pretrained base: the model its source file holds
        source = json.loads((base / "provenance.json").read_text()).get("source", {}).get("file", "")
        names.add(source.split(".")[0].lower())
    return names - {""}, set(config.get("architectures") or [])


def check_verifier_names(config: dict, path: Path, base_path: str | Path) -> None:
    """The verifier an EAGLE-3 config names (speculators_config.verifier) is this base: one of its
    architectures, and its name or path (an export of this project names the base by its fingerprint instead,
    checked when the base loads). A config that names none says nothing to check."""
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    names, archs = base_identity(base_path)
    theirs = set(verifier.get("architectures") or [])
    if theirs and archs and not theirs & archs:
        raise FormatError(
            f"{path} drafts for a {'/'.join(sorted(theirs))} verifier; the base {base_path} is a {'/'.join(archs)}"
        )
    named = str(verifier.get("name_or_path") or "").rstrip("/")
    if not named or (config.get(MARK) or {}).get("base_fingerprint"):
        return
    same_path = Path(named).exists() and Path(named).resolve() == Path(base_path).resolve()
    if not same_path and Path(named).name.lower() not in names:
        raise FormatError(
            f"{path} drafts for the verifier {named!r}, not for the base {base_path}: use it with that model (or "
            "set speculators_config.verifier.name_or_path in its config.json if that is this model)"
        )
