"""What the serving formats share: which format a directory holds, the one-layer Llama config and tensor names of
an EAGLE draft layer, the checks every reader makes (sizes against the file's tensors before anything is built, no
tensor the reader would ignore), and the read-back an export of a prophet must pass.

Every format is one directory: config.json + model.safetensors (experiments/lib/store/served_dir.py writes and
reads it). What a format cannot hold is refused in one line before anything is written (a bias vLLM would drop,
a base vLLM cannot load, a trimmed vocabulary where the engine drafts from all tokens), so no file loads and
silently drafts otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from experiments.lib.store.served_dir import FormatError, read_config, setting, tensor_names
from medusa.heads import FrozenHead
from prophet.eagle import EagleLayer
from prophet.model import Prophet, base_depth, base_features
from verify.backends.lean_llama import llama_shape

FORMATS = ("eagle3", "eagle", "medusa", "draft_model")
SERVED_FAMILY = {"eagle3": "prophet", "eagle": "prophet", "medusa": "medusa", "draft_model": "draft"}  # who reads it
# What a one-layer Llama config must name for vLLM to build the draft layer (EAGLE-3: its transformer_layer_config).
LAYER_SETTINGS = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


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


# ------------------------------------------------------------------------------------------------- writing


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


def layer_tensors(layer: nn.Module) -> dict[str, Tensor]:
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


@torch.no_grad()
def check_round_trip(
    original: Prophet, imported: Prophet, base: nn.Module, vocab: Tensor | None, out: str | Path
) -> None:
    """The imported prophet's logits equal the original's, bit for bit, on a probe sequence (the first draft at
    every position); else the export is refused (write_directory runs this on the directory before it is renamed
    to `out`, so nothing is left and an earlier export stays)."""
    tokens = torch.arange(24, device=base.to_logits.weight.device)[None] % base.num_tokens  # (1, 24)
    logits = []
    for prophet in (original, imported):  # each with its layers in its own order (an export sorts them)
        hidden, _, layers = base_features(base, tokens, prophet.fuse_layers)
        _, weight, bias = prophet.output_layer(vocab)
        logits.append(torch.nn.functional.linear(prophet.readout(prophet(hidden, tokens, layers)), weight, bias))
    if not torch.equal(*logits):
        raise FormatError(f"{out} read back with other logits than the drafter's: not written")


# ------------------------------------------------------------------------------------------------- reading


def check_settings(config: dict, keys: tuple[str, ...], path: Path, within: str = "") -> None:
    """Each of `keys` in `config` (the file's, or its `within` part), sizes positive integers, else one line."""
    for key in keys:
        setting(config, key, path, within=within)


def check_tensors(names: set[str], needed: Iterable[str], path: Path, kind: str) -> None:
    """Every tensor a `kind` directory needs is among `names` (its weight files' headers), else one line."""
    missing = sorted(set(needed) - names)
    if missing:
        raise FormatError(f"{path} lacks the tensors {missing[:3]}{' ...' if len(missing) > 3 else ''} of a {kind}")


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


def new_prophet(base: nn.Module, arch: str, layer: dict[str, Any], fuse_layers: list[int] | None = None) -> Prophet:
    """An untrained prophet of `arch` ("eagle" / "eagle3") on `base`, its draft layer of shape `layer`."""
    head = FrozenHead(embedding=base.token_emb.emb, to_logits=base.to_logits, depth=base_depth(base))
    return Prophet(head=head, dim=base.to_logits.in_features, arch=arch, layer=layer, fuse_layers=fuse_layers)


def check_layer_fits(arch: str, shape: dict[str, Any], tensors: dict[str, Tensor], path: Path) -> set[str]:
    """The draft layer a config describes (`shape`, EagleLayer's keywords) has exactly the file's layers.0.*
    tensors, names and shapes: checked on a layer of the meta device (no memory), before the real one is built,
    so a config whose sizes are not its tensors' (an intermediate_size of 1e9) allocates nothing. Returns the
    layer's tensor names."""
    try:
        layer = EagleLayer(arch=arch, **shape, device="meta")
    except ValueError as e:
        raise FormatError(f"{path}: {' '.join(str(e).split())}") from None
    load_layer(layer, tensors, path, copy=False)
    return set(layer_tensors(layer))


def shared_embedding(tensors: dict[str, Tensor], base: nn.Module, path: Path) -> set[str]:
    """An EAGLE directory may carry a copy of the base's token embedding (SpecForge writes one): accepted when it
    is the base's (what this project's drafter reads), refused when it differs (vLLM would draft with it).
    Returns the name, when present, as one the reader has read."""
    name = "embed_tokens.weight"
    if name not in tensors:
        return set()
    own = base.token_emb.emb.weight.detach().float().cpu()
    if tensors[name].shape != own.shape or not torch.equal(tensors[name].float(), own):
        raise FormatError(
            f"{path}: {name} {tuple(tensors[name].shape)} is not the base's token embedding, which this project's "
            "drafter reads (vLLM would draft with the file's): remove it, or use the base it was trained on"
        )
    return {name}


def check_known(names: Iterable[str], known: Iterable[str], path: Path, kind: str) -> None:
    """Every tensor of the directory is one the `kind` reader reads: one it would ignore is refused, named (a
    file with it is not what the reader takes it for, and vLLM may read it)."""
    unknown = sorted(set(names) - set(known))
    if unknown:
        listed = f"{unknown[:3]}{' ...' if len(unknown) > 3 else ''}"
        raise FormatError(f"{path} holds {len(unknown)} tensor(s) no {kind} reader reads: {listed}")


def load_layer(layer: nn.Module, tensors: dict[str, Tensor], path: Path, *, copy: bool = True) -> None:
    """Copy layers.0.* into an EagleLayer (copy=False: check only); a tensor the layer lacks (an input norm in
    EAGLE-1), misses or has in another shape is refused."""
    ours = layer_tensors(layer)  # vLLM's name -> the layer's own parameter
    extra = sorted(k for k in tensors if k.startswith("layers.0.") and k not in ours)
    missing = sorted(k for k in ours if k not in tensors)
    if extra or missing:
        raise FormatError(f"{path}: tensors {extra or missing} do not fit a {layer.arch} layer")
    with torch.no_grad():
        for name, param in ours.items():
            if tensors[name].shape != param.shape:
                shape = tuple(tensors[name].shape)
                raise FormatError(f"{path}: {name} is {shape}, the layer needs {tuple(param.shape)}")
            if copy:
                param.copy_(tensors[name])


def copy_checked(param: Tensor, value: Tensor, name: str, path: Path) -> None:
    """param <- value (the file's tensor `name`), refused in one line when the shapes differ."""
    if value.shape != param.shape:
        raise FormatError(f"{path}: {name} is {tuple(value.shape)}, expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(value)
