"""vLLM's Medusa format: written from Medusa heads, read back as them, and checked from its files.

blocks.{k}.layers.{l}.{weight,bias} with `medusa_fc_bias: true` (without it vLLM builds the blocks bias-free and
drops the trained biases silently) and lm_heads.{k}.weight over all V tokens (vLLM trims only a shared head).
Head k (0-based) predicts token t + 2 + k. Reading follows vLLM, defaults included: a config without
`medusa_fc_bias: true` is read with its blocks' biases dropped, so what this project measures is what vLLM
would serve.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import torch
from torch import Tensor, nn

from experiments.lib.formats.common import (
    check_known,
    check_settings,
    check_verifier,
    copy_checked,
    llama_config,
    outside_zeroed,
)
from experiments.lib.store.served_dir import FormatError, read_directory
from medusa.heads import MedusaHeads
from prophet.model import base_features

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


def head_logits(heads: MedusaHeads, hidden: Tensor, vocab: Tensor | None) -> Tensor:
    """(..., K, N) logits of every head over `vocab`'s rows (None: all V), each head's own output layer or the
    shared one, computed the same way whichever it is (so an export and its read-back compare bit for bit)."""
    logits = []
    for k, blocks in enumerate(heads.blocks):
        projection = heads._base_projection[0] if heads.share_base_projection else heads.projections[k]
        weight = projection.weight if vocab is None else projection.weight[vocab.to(projection.weight.device)]
        logits.append(torch.nn.functional.linear(blocks(hidden), weight))
    return torch.stack(logits, dim=-2)


@torch.no_grad()
def check_round_trip(
    original: MedusaHeads, imported: MedusaHeads, base: nn.Module, vocab: Tensor | None, out: str | Path
) -> None:
    """The imported heads' logits equal the original's, bit for bit, over `vocab` on a probe sequence (the base's
    features of 24 tokens); else the export is refused (before the directory is renamed to `out`)."""
    tokens = torch.arange(24, device=base.to_logits.weight.device)[None] % base.num_tokens
    hidden = base_features(base, tokens)[0]
    imported = imported.to(hidden.device)
    if not torch.equal(head_logits(original, hidden, vocab), head_logits(imported, hidden, vocab)):
        raise FormatError(f"{out} read back with other logits than the Medusa heads': not written")


def read(path: str | Path, base: nn.Module) -> MedusaHeads:
    """A vLLM Medusa directory -> MedusaHeads on `base`."""
    path = Path(path)
    return from_files(*read_directory(path), base, path)


def from_files(config: dict, tensors: dict[str, Tensor], base: nn.Module, path: Path) -> MedusaHeads:
    """A vLLM Medusa directory's config.json and tensors (as read: a head of its own per position, each over all V
    tokens) -> MedusaHeads on `base`, in eval mode. Every tensor is checked by name before anything is built (a
    num_heads the file does not hold allocates nothing), and by shape as it is copied."""
    check_verifier(config, base, path)
    if config.get("original_lm_head") or "token_map" in tensors:
        raise FormatError(f"{path}: a shared or trimmed Medusa output layer (original_lm_head, token_map) is not drawn")
    num_heads, num_layers, with_bias = layout(config, set(tensors), path)
    dim, vocab_size = base.to_logits.in_features, base.num_tokens
    for name in _names(num_heads, num_layers, with_bias):  # every shape, before the heads are built
        shape = (vocab_size, dim) if name.startswith("lm_heads.") else (dim,) if name.endswith(".bias") else (dim, dim)
        if tuple(tensors[name].shape) != shape:
            raise FormatError(f"{path}: {name} is {tuple(tensors[name].shape)}, expected {shape}")
    heads = MedusaHeads.from_base(base, num_heads=num_heads, num_layers=num_layers)
    with torch.no_grad():
        for k, blocks in enumerate(heads.blocks):
            for i, block in enumerate(blocks):
                name = f"blocks.{k}.layers.{i}"
                copy_checked(block.linear.weight, tensors[f"{name}.weight"], f"{name}.weight", path)
                if with_bias:
                    copy_checked(block.linear.bias, tensors[f"{name}.bias"], f"{name}.bias", path)
                else:  # vLLM's default: blocks without a bias; any bias tensor is dropped
                    block.linear.bias.zero_()
            name = f"lm_heads.{k}.weight"
            copy_checked(heads.projections[k].weight, tensors[name], name, path)
    return heads.eval()


def layout(config: dict, names: set[str], path: Path) -> tuple[int, int, bool]:
    """(num_heads, num_hidden_layers, medusa_fc_bias) of a Medusa directory, checked against its tensors' names:
    the sizes are the file's (bounded: served_dir.SIZE_LIMITS), every block and output layer present, the biases
    present when medusa_fc_bias is true, and no tensor that no Medusa reader reads."""
    check_settings(config, SETTINGS, path)
    num_heads, num_layers = config["num_heads"], config["num_hidden_layers"]
    with_bias = config.get("medusa_fc_bias", False)
    if not isinstance(with_bias, bool):
        raise FormatError(f"{path / 'config.json'}: medusa_fc_bias={with_bias!r} must be true or false")
    missing = list(islice((n for n in _names(num_heads, num_layers, with_bias) if n not in names), 4))
    if missing:  # found lazily: a num_heads of 1e9 with two heads in the file stops at the third
        flag = " (medusa_fc_bias is true)" if with_bias and all(n.endswith(".bias") for n in missing) else ""
        listed = f"{missing[:3]}{' ...' if len(missing) > 3 else ''}"
        raise FormatError(f"{path} lacks the tensors {listed} of a medusa of {num_heads} heads x {num_layers}{flag}")
    # all of them are in the file now, so this is no longer than it; biases without medusa_fc_bias: vLLM drops them
    known = _names(num_heads, num_layers, with_bias=True)
    check_known(names, known, path, f"Medusa of {num_heads} heads x {num_layers} layers")
    return num_heads, num_layers, with_bias


def _names(num_heads: int, num_layers: int, with_bias: bool) -> Iterator[str]:
    """The tensors a Medusa of this size holds, generated (never a list of num_heads items built up front)."""
    for k in range(num_heads):
        for i in range(num_layers):
            yield f"blocks.{k}.layers.{i}.weight"
            if with_bias:
                yield f"blocks.{k}.layers.{i}.bias"
        yield f"lm_heads.{k}.weight"


def check_files(config: dict, names: set[str], path: Path) -> None:
    """A vLLM Medusa directory from its config.json and its tensors' names, before any model loads: the sizes,
    then every head's blocks and output layer (and biases, with medusa_fc_bias), and nothing else."""
    layout(config, names, path)
