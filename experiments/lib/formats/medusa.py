"""vLLM's Medusa format: written from Medusa heads, read back as them, and checked from its files.

blocks.{k}.layers.{l}.{weight,bias} with `medusa_fc_bias: true` (without it vLLM builds the blocks bias-free and
drops the trained biases silently) and lm_heads.{k}.weight over all V tokens (vLLM trims only a shared head).
Head k (0-based) predicts token t + 2 + k. Reading follows vLLM, defaults included: a config without
`medusa_fc_bias: true` is read with its blocks' biases dropped, so what this project measures is what vLLM
would serve.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from experiments.lib.formats.common import (
    check_settings,
    check_tensors,
    check_verifier,
    copy_checked,
    llama_config,
    outside_zeroed,
)
from experiments.lib.store.served_dir import FormatError, read_directory, setting, tensor
from medusa.heads import MedusaHeads

SETTINGS = ("hidden_size", "vocab_size", "num_heads", "num_hidden_layers")  # what vLLM builds the heads from


def export_tensors(heads: MedusaHeads, base: nn.Module, vocab: Tensor | None = None) -> tuple[dict[str, Tensor], dict]:
    """Medusa heads in vLLM's layout (every head over all V tokens; the rows outside `vocab`, the ids the heads were
    trained to draft from, zeroed: `outside_zeroed`), and the config that describes them.

    vLLM 0.32 trims a Medusa vocabulary only for one head shared by all (`original_lm_head`): a head of its own
    is a V-row layer, and a token_map would cut the loaded rows below that and fail to load. So heads trained to
    draft from fewer tokens are refused by the exporter (experiments/export.py) unless allow_full_vocab says so."""
    llama_config(base)
    tensors = {}
    for k, blocks in enumerate(heads.blocks):
        for i, block in enumerate(blocks):
            tensors[f"blocks.{k}.layers.{i}.weight"] = block.linear.weight
            tensors[f"blocks.{k}.layers.{i}.bias"] = block.linear.bias
        projection = heads._base_projection[0] if heads.share_base_projection else heads.projections[k]
        if projection.bias is not None:
            raise FormatError(f"head {k}'s output layer has a bias: vLLM's Medusa lm_heads have none")
        tensors[f"lm_heads.{k}.weight"] = outside_zeroed(projection.weight, vocab)
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "hidden_size": heads.dim,
        "vocab_size": heads.vocab_size,
        "truncated_vocab_size": heads.vocab_size,
        "num_heads": heads.num_heads,
        "num_hidden_layers": heads.num_layers,
        "medusa_fc_bias": True,  # without it vLLM builds the blocks bias-free and drops the trained biases
        "torch_dtype": "float32",
    }
    return tensors, config


def read(path: str | Path, base: nn.Module) -> MedusaHeads:
    """A vLLM Medusa directory -> MedusaHeads on `base`."""
    path = Path(path)
    return from_files(*read_directory(path), base, path)


def from_files(config: dict, tensors: dict[str, Tensor], base: nn.Module, path: Path) -> MedusaHeads:
    """A vLLM Medusa directory's config.json and tensors (as read: a head of its own per position, each over all V
    tokens) -> MedusaHeads on `base`, in eval mode."""
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
                copy_checked(block.linear.weight, tensor(tensors, f"{name}.weight", path), name, path)
                bias = tensors.get(f"{name}.bias") if with_bias else None
                block.linear.bias.copy_(bias if bias is not None else torch.zeros_like(block.linear.bias))
            name = f"lm_heads.{k}.weight"
            copy_checked(heads.projections[k].weight, tensor(tensors, name, path), name, path)
    return heads.eval()


def check_files(config: dict, names: set[str], path: Path) -> None:
    """A vLLM Medusa directory from its config.json and its tensors' names, before any model loads: the sizes,
    then every head's blocks and output layer."""
    check_settings(config, SETTINGS, path)
    heads, layers = config["num_heads"], config["num_hidden_layers"]
    needed = [f"blocks.{k}.layers.{i}.weight" for k in range(heads) for i in range(layers)]
    check_tensors(names, needed + [f"lm_heads.{k}.weight" for k in range(heads)], path, "medusa")
