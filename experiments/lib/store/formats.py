"""Drafters in the formats serving engines load (vLLM 0.32, speculators 0.9), written and read back.

Formats (one directory each: config.json + model.safetensors):
- "eagle3": speculators' EAGLE-3 layout, which vLLM serves from the directory alone (the verifier is named
  inside). fc [H, A*H] over the base's layer states in ASCENDING layer order (vLLM gathers them while running
  the layers, whatever order the config lists): a one-layer Llama `transformer_layer_config`, the layer's
  tensors under `layers.0.*`, `norm`, `lm_head` [Vd, H] and, for a trimmed vocabulary, `d2t` [Vd] as OFFSETS
  (target id = draft id + d2t[draft id]) and `t2d` [V] bool. Layer id k, in vLLM's convention, is the
  residual stream entering layer k (0-based), i.e. after k blocks: this project's layer k (SGLang's k - 1).
  An EAGLE-3 prophet's fuse_layers ascend (enforced when it is built), so fc's columns are the prophet's own.
  `norm_before_residual` is always written: vLLM defaults it to true, speculators to false.
- "eagle": vLLM's EAGLE-1: a one-layer Llama config, fc [H, 2H] over cat(embedding, final hidden state), no
  input norm in the layer, no fc bias (vLLM would drop one silently), the base's own output layer.
- "medusa": vLLM's Medusa: blocks.{k}.layers.{l}.{weight,bias} with `medusa_fc_bias: true` (without it vLLM
  drops the biases silently) and lm_heads.{k}.weight over all V tokens (vLLM trims only a shared head). Head k
  (0-based) predicts token t + 2 + k.
- "draft_model": a plain Hugging Face Llama directory (save_pretrained).

What a format cannot hold is refused in one line before anything is written (a bias vLLM would drop, a block
or x-transformers prophet, a base vLLM cannot load, a trimmed vocabulary where the engine drafts from all
tokens), so no file loads and silently drafts otherwise. A directory is written under a temporary name and
renamed: a failed export leaves nothing that looks finished.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from experiments.lib.store.served_dir import FormatError, read_config, setting, tensor_names
from verify.backends.lean_llama import llama_shape

FORMATS = ("eagle3", "eagle", "medusa", "draft_model")
SERVED_FAMILY = {"eagle3": "prophet", "eagle": "prophet", "medusa": "medusa", "draft_model": "draft"}  # who reads it


# ------------------------------------------------------------------------------------------------- export


def llama_config(base: nn.Module) -> Any:
    """The Hugging Face LlamaConfig of a base vLLM can load (an HFBase around a LlamaForCausalLM), else refused."""
    config = getattr(getattr(base, "hf", None), "config", None)
    if config is None or getattr(config, "model_type", None) != "llama":
        what = type(base).__name__ if config is None else f"a {config.model_type} model"
        raise FormatError(f"the base is {what}: the serving formats need a Hugging Face Llama base that vLLM loads")
    if base.to_logits.bias is not None:
        raise FormatError("the base's output layer has a bias: a Llama lm_head has none")
    return config


def layer_config(base: nn.Module, layer: nn.Module | None = None) -> dict[str, Any]:
    """A one-layer Llama config of the base's vocabulary: the draft layer's shape (an EagleLayer), or the base's."""
    config = llama_config(base)
    shape = llama_shape(config) | (layer.config() if layer is not None else {})
    theta = shape["rope_theta"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"],
        "head_dim": shape["dim_head"],
        "intermediate_size": shape["hidden"],
        "num_hidden_layers": 1,
        "rms_norm_eps": shape["eps"],
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "torch_dtype": "float32",
    }


def _layer_tensors(layer: nn.Module) -> dict[str, Tensor]:
    """An EagleLayer's weights under vLLM's / speculators' names (layers.0.*)."""
    names = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj"}
    names |= {"o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj"}
    names |= {"down_proj": "mlp.down_proj", "post_attention_layernorm": "post_attention_layernorm"}
    names |= {"input_layernorm": "input_layernorm", "hidden_norm": "hidden_norm"}
    out = {}
    for ours, theirs in names.items():
        if hasattr(layer, ours):
            out[f"layers.0.{theirs}.weight"] = getattr(layer, ours).weight
    return out


def vocab_offsets(ids: Tensor, vocab_size: int) -> tuple[Tensor, Tensor]:
    """Sorted draft-vocabulary ids (Vd,) -> d2t (Vd,) int64 OFFSETS (target = draft + d2t[draft]) and t2d (V,) bool."""
    ids = ids.long().cpu()
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(ids.numel()), t2d


def eagle3_tensors(prophet: nn.Module, vocab: Tensor | None) -> dict[str, Tensor]:
    """An EAGLE-3 prophet's tensors in speculators' layout (its fuse_layers ascend, as vLLM hands the states over).
    `vocab` the sorted ids it drafts from (None: all V); an imported prophet's own output layer wins."""
    tensors = {"fc.weight": prophet.mix.weight} | _layer_tensors(prophet.decoder)
    tensors["norm.weight"] = prophet.decoder.norm.weight
    ids, weight, _ = prophet.output_layer(vocab)
    tensors["lm_head.weight"] = weight
    if ids is not None and ids.numel() < prophet.vocab_size:
        tensors["d2t"], tensors["t2d"] = vocab_offsets(ids, prophet.vocab_size)
    return tensors


def eagle3_config(
    prophet: nn.Module, base: nn.Module, *, verifier: str, draft_vocab: int, tokens: int
) -> dict[str, Any]:
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


def eagle_tensors(prophet: nn.Module) -> dict[str, Tensor]:
    """An EAGLE-1 prophet: fc over cat(embedding, feature) (the prophet's own columns are (feature, embedding))."""
    if prophet.fuse.bias is not None:
        raise FormatError("the prophet's fc has a bias: vLLM's EAGLE drops fc.bias")
    d = prophet.base_dim
    w = prophet.fuse.weight
    return {"fc.weight": torch.cat((w[:, d:], w[:, :d]), dim=1)} | _layer_tensors(prophet.decoder)


def outside_zeroed(weight: Tensor, vocab: Tensor | None) -> Tensor:
    """An output layer (V, d) with the rows of tokens outside `vocab` (sorted ids; None: none) set to zero.

    A format whose engine drafts from all V tokens cannot trim a vocabulary; rows a drafter never trained (copies of
    the base's, on a drafter trained on a subset) would win argmaxes they were never meant to. A zero row scores 0,
    so the trained rows decide whenever one of them scores above 0 (measured on SmolLM2's Medusa heads: the same
    drafts as the trimmed drafter at every step of 6 chat prompts)."""
    if vocab is None:
        return weight
    keep = torch.zeros(weight.shape[0], dtype=torch.bool, device=weight.device)
    keep[vocab.to(weight.device)] = True
    return weight * keep[:, None].to(weight.dtype)


def medusa_tensors(heads: nn.Module, base: nn.Module, vocab: Tensor | None = None) -> tuple[dict[str, Tensor], dict]:
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


# ------------------------------------------------------------------------------------------------- import


def detect(path: str | Path) -> str | None:
    """Which of FORMATS a directory holds (None: not one of them; a project checkpoint has meta.json instead)."""
    path = Path(path)
    if not (path / "config.json").is_file() or (path / "meta.json").is_file():
        return None
    config = read_config(path)
    if config.get("speculators_model_type") == "eagle3":
        return "eagle3"
    if config.get("model_type") == "medusa":
        return "medusa"
    if "LlamaForCausalLMEagle3" in (config.get("architectures") or []):  # SGLang / SpecForge: read as eagle3
        return "eagle3"
    if (
        config.get("model_type") == "llama"
        and config.get("num_hidden_layers") == 1
        and "fc.weight" in tensor_names(path)
    ):
        return "eagle"
    if config.get("model_type") == "llama":
        return "draft_model"
    return None


def check_verifier(config: dict, base: nn.Module, path: Path) -> None:
    """The drafter's base: same width and vocabulary as `base`, else refused."""
    hidden = config.get("target_hidden_size") or setting(config, "hidden_size", path)
    if hidden != base.to_logits.in_features or setting(config, "vocab_size", path) != base.num_tokens:
        raise FormatError(
            f"{path} drafts for a base of width {hidden} and {config.get('vocab_size')} tokens; this base has "
            f"{base.to_logits.in_features} and {base.num_tokens}"
        )


def layer_shape_from(config: dict, path: str | Path, within: str = "") -> dict[str, Any]:
    """A one-layer Llama config (in `path`'s config.json, under `within`) -> EagleLayer's shape keywords."""
    for key in ("num_attention_heads", "hidden_size", "intermediate_size"):
        setting(config, key, path, within=within)  # a missing or bad size: one line naming the file
    if config.get("num_hidden_layers", 1) != 1:
        raise FormatError(f"num_hidden_layers={config['num_hidden_layers']}: this project drafts with one layer")
    return llama_shape(config)


def load_layer(layer: nn.Module, tensors: dict[str, Tensor], path: Path) -> None:
    """Copy layers.0.* into an EagleLayer; a tensor the layer lacks (an input norm in EAGLE-1) or misses is refused."""
    ours = {theirs: getattr(layer, name).weight for theirs, name in _names(layer).items()}
    extra = sorted(k for k in tensors if k.startswith("layers.0.") and k not in ours)
    missing = sorted(k for k in ours if k not in tensors)
    if extra or missing:
        raise FormatError(f"{path}: tensors {extra or missing} do not fit a {layer.arch} layer")
    with torch.no_grad():
        for name, param in ours.items():
            if tensors[name].shape != param.shape:
                shape = tuple(tensors[name].shape)
                raise FormatError(f"{path}: {name} is {shape}, the layer needs {tuple(param.shape)}")
            param.copy_(tensors[name])


def _names(layer: nn.Module) -> dict[str, str]:
    """vLLM name -> EagleLayer attribute, for the weights this layer has."""
    return {theirs: theirs.split(".")[-2] for theirs in _layer_tensors(layer)}
