"""vLLM's EAGLE (EAGLE-1) format: written from an EAGLE-1 prophet (arch=eagle), read back as one, and checked
from its files.

A one-layer Llama config (common.layer_config), fc [H, 2H] over cat(embedding, final hidden state), the layer's
tensors under `layers.0.*` with no input norm, no fc bias (vLLM would drop one silently), and the base's own
output layer (nothing of it in the directory). The prophet's own fc reads cat(feature, embedding): the two
column blocks swap on the way out and back.
"""

from __future__ import annotations

from pathlib import Path

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
    layer_shape_from,
    layer_tensors,
    load_layer,
    new_prophet,
    shared_embedding,
)
from experiments.lib.store.served_dir import FormatError, read_directory, tensor
from prophet.model import Prophet


def export_tensors(prophet: Prophet) -> dict[str, Tensor]:
    """An EAGLE-1 prophet: fc over cat(embedding, feature) (the prophet's own columns are (feature, embedding))."""
    if prophet.fuse.bias is not None:
        raise FormatError("the prophet's fc has a bias: vLLM's EAGLE drops fc.bias")
    d = prophet.base_dim
    w = prophet.fuse.weight  # (H, 2H): columns (feature, embedding)
    return {"fc.weight": torch.cat((w[:, d:], w[:, :d]), dim=1)} | layer_tensors(prophet.decoder)


def read(path: str | Path, base: nn.Module) -> Prophet:
    """A vLLM EAGLE directory -> an EAGLE-1 Prophet on `base`."""
    path = Path(path)
    return from_files(*read_directory(path), base, path)


def from_files(config: dict, tensors: dict[str, Tensor], base: nn.Module, path: Path) -> Prophet:
    """A vLLM EAGLE directory's config.json and tensors (as read) -> an EAGLE-1 Prophet on `base`, in eval mode."""
    check_verifier(config, base, path)
    if "fc.bias" in tensors:
        raise FormatError(f"{path}: fc.bias is present, and vLLM's EAGLE drops it: the drafts would differ")
    shape = layer_shape_from(config, path)
    layer_names = check_layer_fits("eagle", shape, tensors, path)  # before anything of that size is built
    check_known(tensors, {"fc.weight"} | layer_names | shared_embedding(tensors, base, path), path, "EAGLE")
    prophet = new_prophet(base, "eagle", shape)
    dim = base.to_logits.in_features
    fc = tensor(tensors, "fc.weight", path)  # columns (embedding, feature) -> the prophet's (feature, embedding)
    copy_checked(prophet.fuse.weight, torch.cat((fc[:, dim:], fc[:, :dim]), dim=1), "fc.weight", path)
    load_layer(prophet.decoder, tensors, path)
    return prophet.eval()


def check_files(config: dict, names: set[str], path: Path) -> None:
    """A vLLM EAGLE directory from its config.json and its tensors' names, before any model loads."""
    check_settings(config, LAYER_SETTINGS, path)
    check_tensors(names, ("fc.weight",), path, "eagle")
    outside_layer = {n for n in names if not n.startswith("layers.0.")}  # the layer's own: checked on read
    check_known(outside_layer, {"fc.weight", "embed_tokens.weight"}, path, "EAGLE")
