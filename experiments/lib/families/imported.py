"""Drafters in serving formats (experiments/lib/store/formats.py) read back as this project's drafters.

`checkpoints.prophet=<dir>` or `checkpoints.medusa=<dir>` may name a directory in a serving format instead of a
project checkpoint: an EAGLE-3 head trained elsewhere (speculators, SpecForge converted to speculators' layout)
or an exported one is then benchmarked here like any trained drafter. Each format is read as vLLM reads it,
defaults included (an EAGLE-3 config without `norm_before_residual` is read as true; Medusa blocks without
`medusa_fc_bias: true` lose their biases), so what this project measures is what vLLM would serve. Reading
an export of this project's own drafter gives back the same weights: a second export is bit-identical.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from experiments.lib.store.checkpoint import fingerprint
from experiments.lib.store.formats import (
    FormatError,
    check_verifier,
    detect,
    layer_shape_from,
    load_layer,
    read_directory,
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
        prophet = Prophet(head=head, dim=dim, arch="eagle", layer=layer_shape_from(config))
        fc = tensors["fc.weight"]  # columns (embedding, feature) -> the prophet's (feature, embedding)
        _copy(prophet.fuse.weight, torch.cat((fc[:, dim:], fc[:, :dim]), dim=1), "fc.weight", path)
        load_layer(prophet.decoder, tensors, path)
        return prophet.eval()
    config, tensors = as_speculators(config, tensors)
    layer_config = config["transformer_layer_config"]
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
    shape = layer_shape_from(layer_config) | {"norm_before_residual": config.get("norm_before_residual", True)}
    prophet = Prophet(head=head, dim=dim, arch="eagle3", layer=shape, fuse_layers=list(layers))
    _copy(prophet.mix.weight, tensors["fc.weight"], "fc.weight", path)
    load_layer(prophet.decoder, tensors, path)
    _copy(prophet.decoder.norm.weight, tensors["norm.weight"], "norm.weight", path)
    ids = draft_ids(tensors, config.get("draft_vocab_size") or base.num_tokens, base.num_tokens, path)
    weight = tensors["lm_head.weight"]
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
    return nested, {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}


def import_medusa(path: str | Path, base: nn.Module) -> MedusaHeads:
    """A vLLM Medusa directory (a head of its own per position, each over all V tokens) -> MedusaHeads on `base`."""
    path = Path(path)
    config, tensors = read_directory(path)
    check_verifier(config, base, path)
    if config.get("original_lm_head") or "token_map" in tensors:
        raise FormatError(f"{path}: a shared or trimmed Medusa output layer (original_lm_head, token_map) is not drawn")
    heads = MedusaHeads.from_base(base, num_heads=config["num_heads"], num_layers=config["num_hidden_layers"])
    with_bias = bool(config.get("medusa_fc_bias", False))  # vLLM's default: no bias, the tensors are dropped
    with torch.no_grad():
        for k, blocks in enumerate(heads.blocks):
            for i, block in enumerate(blocks):
                _copy(block.linear.weight, tensors[f"blocks.{k}.layers.{i}.weight"], f"blocks.{k}.layers.{i}", path)
                bias = tensors.get(f"blocks.{k}.layers.{i}.bias") if with_bias else None
                block.linear.bias.copy_(bias if bias is not None else torch.zeros_like(block.linear.bias))
            _copy(heads.projections[k].weight, tensors[f"lm_heads.{k}.weight"], f"lm_heads.{k}.weight", path)
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
