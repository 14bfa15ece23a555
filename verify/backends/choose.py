"""`make_target`: which backend runs a base as the target.

The lean engine (verify/backends/target.py's Target over verify/backends/engine.py or, for transformers'
Llama, verify/backends/lean_llama.py) runs every model it implements; verify/backends/hf.py's HFTarget runs
any other Hugging Face causal LM on transformers' own forward and cache. This module sits above both.
"""

from __future__ import annotations

from torch import nn

from verify.backends.hf import HFBase, HFTarget
from verify.backends.target import Target

ENGINES = ("auto", "lean", "hf")


def make_target(model: nn.Module, *, engine: str = "auto", **kwargs) -> Target:
    """The target for a base. engine="lean": the lean engine (x-transformers LMs, and transformers' Llama
    through lean_llama); "hf": the adapter on transformers' own forward and cache (any causal LM wrapped as
    an HFBase); "auto": lean where it runs the model, else the adapter.
    kwargs as `Target` takes them."""
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}: must be one of {', '.join(ENGINES)}")
    if not isinstance(model, HFBase):
        if engine == "hf":
            raise ValueError(f"engine='hf' takes a Hugging Face model (HFBase), got {type(model).__name__}")
        return Target(model, **kwargs)
    if engine == "hf" or (engine == "auto" and type(model.hf).__name__ != "LlamaForCausalLM"):
        return HFTarget(model, **kwargs)
    return Target(model, **kwargs)
