"""A draft model as a plain Hugging Face Llama directory (save_pretrained's layout), which vLLM serves as a draft
model. Written only: this project reads a draft model from its own checkpoints, never from this format.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from torch import Tensor, nn

from experiments.lib.formats.common import outside_zeroed
from experiments.lib.store.served_dir import FormatError, write_directory


def write(
    module: nn.Module,
    out: str | Path,
    *,
    vocab: Tensor | None = None,
    overwrite: bool = False,
    provenance: dict | None = None,
    keep: Iterable[str | Path] = (),
) -> Path:
    """A draft model built as a Hugging Face Llama (drafter.module.arch=llama) -> save_pretrained's layout; the
    output rows outside `vocab` (the ids it was trained to draft from) zeroed (common.outside_zeroed)."""
    hf = getattr(module, "hf", None)
    if hf is None or type(hf).__name__ != "LlamaForCausalLM":
        raise FormatError(
            "the draft model is an x-transformers network (LayerNorm, GELU), not a Llama: train it with "
            "drafter.module.arch=llama to export it"
        )
    config = hf.config.to_dict() | {"architectures": ["LlamaForCausalLM"], "torch_dtype": "float32"}
    tensors = dict(hf.state_dict())
    tensors["lm_head.weight"] = outside_zeroed(tensors["lm_head.weight"], vocab)
    return write_directory(out, config | (provenance or {}), tensors, overwrite=overwrite, keep=keep)
