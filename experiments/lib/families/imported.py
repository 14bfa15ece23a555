"""Drafters in serving formats (experiments/lib/store/formats.py) read back as this project's drafters.

`checkpoints.prophet=<dir>` or `checkpoints.medusa=<dir>` may name a directory in a serving format instead of a
project checkpoint: an EAGLE-3 head trained elsewhere (speculators, SpecForge converted to speculators' layout)
or an exported one is then benchmarked here like any trained drafter. Each format is read as vLLM reads it,
defaults included (an EAGLE-3 config without `norm_before_residual` is read as true; Medusa blocks without
`medusa_fc_bias: true` lose their biases), so what this project measures is what vLLM would serve. Reading
an export of this project's own drafter gives back the same weights: a second export is bit-identical.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from experiments.lib.store.checkpoint import fingerprint
from experiments.lib.store.formats import SERVED_FAMILY, check_verifier, detect, layer_shape_from, load_layer
from experiments.lib.store.served_dir import (
    MARK,
    FormatError,
    read_config,
    read_directory,
    setting,
    tensor,
    tensor_names,
)
from medusa.heads import FrozenHead, MedusaHeads
from prophet.model import Prophet, base_depth

UNSUPPORTED_EAGLE3 = ("norm_before_fc", "fc_norm", "norm_output")  # speculators options this layer does not draw


def draft_ids(tensors: dict[str, Tensor], draft_vocab: int, vocab_size: int, path: Path) -> Tensor:
    """The target ids of an EAGLE-3 draft vocabulary (Vd,), from d2t OFFSETS, checked against t2d."""
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


def import_prophet(path: str | Path, base: nn.Module) -> Prophet:
    """An "eagle3" (speculators) or "eagle" (vLLM) directory -> a Prophet of that arch on `base`."""
    path = Path(path)
    kind = detect(path)
    if kind not in ("eagle3", "eagle"):
        raise FormatError(f"{path} holds {kind or 'no serving format'}: a prophet reads eagle3 or eagle directories")
    config, tensors = read_directory(path)
    head = FrozenHead(embedding=base.token_emb.emb, to_logits=base.to_logits, depth=base_depth(base))
    dim = base.to_logits.in_features
    if kind == "eagle":
        check_verifier(config, base, path)
        if "fc.bias" in tensors:
            raise FormatError(f"{path}: fc.bias is present, and vLLM's EAGLE drops it: the drafts would differ")
        prophet = Prophet(head=head, dim=dim, arch="eagle", layer=layer_shape_from(config, path))
        fc = tensor(tensors, "fc.weight", path)  # columns (embedding, feature) -> the prophet's (feature, embedding)
        _copy(prophet.fuse.weight, torch.cat((fc[:, dim:], fc[:, :dim]), dim=1), "fc.weight", path)
        load_layer(prophet.decoder, tensors, path)
        return prophet.eval()
    config, tensors = as_speculators(config, tensors)
    layer_config = layer_settings(config, path)
    check_verifier({**layer_config, "target_hidden_size": config.get("target_hidden_size")}, base, path)
    for key in UNSUPPORTED_EAGLE3:
        if config.get(key):
            raise FormatError(f"{path}: {key}=true is an EAGLE-3 variant this project does not draw")
    layers = config.get("eagle_aux_hidden_state_layer_ids")
    if not layers:  # vLLM's default for a Llama verifier
        depth = base.depth
        layers = [2, depth // 2, depth - 3]
    if sorted(layers) != list(layers):
        raise FormatError(f"{path}: eagle_aux_hidden_state_layer_ids={layers} must ascend (vLLM gathers them in order)")
    shape = layer_shape_from(layer_config, path, "transformer_layer_config")
    shape |= {"norm_before_residual": config.get("norm_before_residual", True)}
    prophet = Prophet(head=head, dim=dim, arch="eagle3", layer=shape, fuse_layers=list(layers))
    _copy(prophet.mix.weight, tensor(tensors, "fc.weight", path), "fc.weight", path)
    load_layer(prophet.decoder, tensors, path)
    _copy(prophet.decoder.norm.weight, tensor(tensors, "norm.weight", path), "norm.weight", path)
    ids = draft_ids(tensors, config.get("draft_vocab_size") or base.num_tokens, base.num_tokens, path)
    weight = tensor(tensors, "lm_head.weight", path)
    if weight.shape != (ids.numel(), dim):
        raise FormatError(f"{path}: lm_head.weight is {tuple(weight.shape)}, expected {(ids.numel(), dim)}")
    prophet.set_output_layer(weight.float(), ids)
    return prophet.eval()


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


# What each format must hold for vLLM to load it: settings of config.json (EAGLE-3: of its layer config) and tensors.
NEEDS = {
    "eagle3": (("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"), ("fc.weight", "norm.weight")),
    "eagle": (("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"), ("fc.weight",)),
    "medusa": (("hidden_size", "vocab_size", "num_heads", "num_hidden_layers"), ()),
}


def check_served(path: str | Path, family: str, base_path: str | Path | None = None) -> str:
    """A serving-format directory named for `family`, checked from its files alone before any model loads: its
    format, config.json's settings and the tensors' names (headers only: a truncated file is refused), and the
    verifier an EAGLE-3 config names against the base at `base_path` (its files). Returns the format."""
    path = Path(path)
    kind = detect(path)
    if kind is None:
        raise FormatError(f"checkpoints.{family}={path} holds no serving format (eagle3, eagle, medusa, draft_model)")
    if SERVED_FAMILY[kind] != family:
        raise FormatError(f"checkpoints.{family}={path} is a {kind} directory: it is a {SERVED_FAMILY[kind]} drafter")
    config, names = read_config(path), tensor_names(path)
    if kind == "draft_model":
        return kind
    if kind == "eagle3":
        config = as_speculators(config, {})[0]
        names = {speculators_name(k) for k in names}
        settings, within = layer_settings(config, path), "transformer_layer_config"
    else:
        settings, within = config, ""
    keys, needed = NEEDS[kind]
    for key in keys:
        setting(settings, key, path, within=within)
    if kind == "medusa":
        heads, layers = config["num_heads"], config["num_hidden_layers"]
        needed = [f"blocks.{k}.layers.{i}.weight" for k in range(heads) for i in range(layers)]
        needed += [f"lm_heads.{k}.weight" for k in range(heads)]
    missing = sorted(set(needed) - names)
    if missing:
        raise FormatError(f"{path} lacks the tensors {missing[:3]}{' ...' if len(missing) > 3 else ''} of a {kind}")
    if kind == "eagle3" and base_path is not None:
        check_verifier_names(config, path, base_path)
    return kind


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


def import_medusa(path: str | Path, base: nn.Module) -> MedusaHeads:
    """A vLLM Medusa directory (a head of its own per position, each over all V tokens) -> MedusaHeads on `base`."""
    path = Path(path)
    config, tensors = read_directory(path)
    check_verifier(config, base, path)
    if config.get("original_lm_head") or "token_map" in tensors:
        raise FormatError(f"{path}: a shared or trimmed Medusa output layer (original_lm_head, token_map) is not drawn")
    num_heads, num_layers = (setting(config, key, path) for key in ("num_heads", "num_hidden_layers"))
    heads = MedusaHeads.from_base(base, num_heads=num_heads, num_layers=num_layers)
    with_bias = bool(config.get("medusa_fc_bias", False))  # vLLM's default: no bias, the tensors are dropped
    with torch.no_grad():
        for k, blocks in enumerate(heads.blocks):
            for i, block in enumerate(blocks):
                name = f"blocks.{k}.layers.{i}"
                _copy(block.linear.weight, tensor(tensors, f"{name}.weight", path), name, path)
                bias = tensors.get(f"{name}.bias") if with_bias else None
                block.linear.bias.copy_(bias if bias is not None else torch.zeros_like(block.linear.bias))
            name = f"lm_heads.{k}.weight"
            _copy(heads.projections[k].weight, tensor(tensors, name, path), name, path)
    return heads.eval()


def import_drafter(directory: str | Path, base: nn.Module, base_meta: dict) -> tuple[nn.Module, str, dict[str, Any]]:
    """A serving-format directory -> (module, family package name, a meta like a trained checkpoint's)."""
    directory = Path(directory)
    kind = detect(directory)
    if kind in ("eagle3", "eagle"):
        module = import_prophet(directory, base)
        package, settings = "prophet", {"arch": kind, "fuse_layers": list(module.fuse_layers) or None}
        ids = getattr(module, "draft_ids", None)
    elif kind == "medusa":
        module, ids = import_medusa(directory, base), None
        package, settings = "medusa", {"num_heads": module.num_heads, "num_layers": module.num_layers}
    else:
        raise FormatError(f"{directory} holds {kind or 'no serving format'}: import reads eagle3, eagle or medusa")
    exported_on = (read_config(directory).get(MARK) or {}).get("base_fingerprint")
    if exported_on is not None and exported_on != base_meta.get("fingerprint"):
        raise FormatError(
            f"{directory} was exported from a drafter of base {exported_on}, not of this base "
            f"({base_meta.get('fingerprint')}): use it with the base it was trained on"
        )
    weight = next(base.parameters())
    module = module.to(device=weight.device, dtype=weight.dtype)
    meta = {
        "kind": "drafter",
        "imported": kind,  # read from a serving format: its vocabulary is the file's, whatever the config says
        "checkpoint": str(directory),
        "fingerprint": fingerprint(module.state_dict()),
        "base_fingerprint": base_meta.get("fingerprint"),
        "model_config": {"package": package, "module": settings},
        "drafter": {"loss": None},
        "train_vocab": None if ids is None else ids.numel(),
        "train_vocab_ids": None if ids is None else ids.tolist(),
    }
    return module, package, meta


def _copy(param: Tensor, value: Tensor, name: str, path: Path) -> None:
    if value.shape != param.shape:
        raise FormatError(f"{path}: {name} is {tuple(value.shape)}, expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(value)
