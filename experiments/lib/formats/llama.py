"""A draft model as a plain Hugging Face Llama directory (save_pretrained's layout), which vLLM serves as a draft
model: written from a draft model built as a Llama, and read back (only to check an export: this project reads
a draft model from its own checkpoints).

Tied embeddings (a draft cut from a tied base, as SmolLM2's): written tied, without lm_head.weight, as
save_pretrained does; but a trimmed vocabulary zeroes lm_head's outside rows, which a tied config would have
vLLM ignore (it ties lm_head to the embedding and skips the file's), so that export is written untied.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from experiments.lib.formats.common import check_settings, outside_zeroed
from experiments.lib.store.served_dir import MARK, FormatError, read_directory

SETTINGS = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size", "num_hidden_layers")
LM_HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


def export_tensors(module: nn.Module, vocab: Tensor | None = None) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """A draft model built as a Hugging Face Llama (drafter.module.arch=llama) -> its tensors and config.json in
    save_pretrained's layout; the output rows outside `vocab` (the ids it was trained to draft from) zeroed
    (common.outside_zeroed)."""
    hf = getattr(module, "hf", None)
    if hf is None or type(hf).__name__ != "LlamaForCausalLM":
        raise FormatError(
            "the draft model is an x-transformers network (LayerNorm, GELU), not a Llama: train it with "
            "drafter.module.arch=llama to export it"
        )
    config = hf.config.to_dict() | {"architectures": ["LlamaForCausalLM"], "torch_dtype": "float32"}
    tensors = dict(hf.state_dict())
    if config.get("tie_word_embeddings") and vocab is None:
        del tensors[LM_HEAD]  # the embedding's own storage: read back (and served) as the embedding
    else:
        tensors[LM_HEAD] = outside_zeroed(tensors[LM_HEAD], vocab).clone()  # never the embedding's storage
        config["tie_word_embeddings"] = False
    return tensors, config


def read(path: str | Path) -> nn.Module:
    """A Hugging Face Llama directory -> transformers' LlamaForCausalLM (float32, CPU, eval mode)."""
    path = Path(path)
    return from_files(*read_directory(path), path)


def from_files(config: dict, tensors: dict[str, Tensor], path: Path) -> nn.Module:
    """A Llama directory's config.json and tensors (as read) -> LlamaForCausalLM. Every tensor's name and shape
    is checked against the model the config describes (built on the meta device: no memory) before the real one
    is built: a missing, unexpected or misshapen tensor is one line, never a randomly initialised weight."""
    from transformers import LlamaConfig, LlamaForCausalLM  # transformers is optional elsewhere

    if config.get("model_type") != "llama":
        raise FormatError(f"{path / 'config.json'}: model_type={config.get('model_type')!r}, a draft model is 'llama'")
    check_settings(config, SETTINGS, path)
    held = {m[1] for m in map(re.compile(r"model\.layers\.(\d+)\.").match, tensors) if m}
    if len(held) != config["num_hidden_layers"]:  # before a model of that many layers is built, even on meta
        raise FormatError(
            f"{path / 'config.json'}: num_hidden_layers={config['num_hidden_layers']}, the file holds "
            f"{len(held)} layers"
        )
    try:
        hf_config = LlamaConfig(**{k: v for k, v in config.items() if k != MARK})
        with torch.device("meta"):
            shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(hf_config).state_dict().items()}
    except Exception as e:  # transformers' config validation raises its own types, none a ValueError
        message = " ".join(str(e).split())
        raise FormatError(f"{path / 'config.json'} is no Llama config transformers builds: {message}") from None
    state = dict(tensors)
    if hf_config.tie_word_embeddings:
        check_tied(state, path)
        state[LM_HEAD] = state.get(EMBEDDING)
    check_state(state, shapes, path)
    model = LlamaForCausalLM(hf_config)
    model.load_state_dict(state, strict=True)
    return model.float().eval()


def check_tied(state: dict[str, Tensor], path: Path) -> None:
    """A tied config's lm_head is the embedding: a different lm_head.weight in the file would be ignored."""
    head, embedding = state.get(LM_HEAD), state.get(EMBEDDING)
    if head is not None and (embedding is None or not torch.equal(head, embedding)):
        raise FormatError(
            f"{path}: tie_word_embeddings is true and {LM_HEAD} differs from {EMBEDDING}: vLLM would draft with the "
            "embedding, not this lm_head"
        )


def check_state(state: dict[str, Tensor | None], shapes: dict[str, tuple], path: Path) -> None:
    """The file's tensors are exactly the model's, in its shapes, else one line naming the first ones."""
    missing = sorted(k for k in shapes if state.get(k) is None)
    unexpected = sorted(set(state) - set(shapes))
    wrong = sorted(k for k in shapes if state.get(k) is not None and tuple(state[k].shape) != shapes[k])
    for names, what in ((missing, "lacks the tensors"), (unexpected, "holds tensors no Llama of its config has:")):
        if names:
            raise FormatError(f"{path} {what} {names[:3]}{' ...' if len(names) > 3 else ''}")
    if wrong:
        name = wrong[0]
        raise FormatError(f"{path}: {name} is {tuple(state[name].shape)}, its config needs {shapes[name]}")


@torch.no_grad()
def check_round_trip(original: nn.Module, imported: nn.Module, vocab: Tensor | None, out: str | Path) -> None:
    """The imported Llama's logits equal the draft model's, bit for bit, over the ids it drafts from (`vocab`;
    None: all), on a probe sequence; else the export is refused (before the directory is renamed to `out`)."""
    weight = next(original.hf.parameters())
    tokens = torch.arange(24, device=weight.device)[None] % original.hf.config.vocab_size
    logits = [original.hf(tokens).logits, imported.to(weight.device)(tokens).logits]
    if vocab is not None:
        logits = [x[..., vocab.to(x.device)] for x in logits]
    if not torch.equal(*logits):
        raise FormatError(f"{out} read back with other logits than the draft model's: not written")
