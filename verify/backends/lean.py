"""`lean(module)`: the lean engine of any base this project runs, built once per module and checked.

An x-transformers TransformerWrapper gets verify/backends/engine.py's LeanLM; an HFBase around a transformers
Llama gets verify/backends/lean_llama.py's LeanLlama; AttentionLayers (the prophet's decoder) get whatever
`build` names. The engine is rebuilt only when the module's parameters changed in place, checked
numerically against the module's own forward, and optionally compiled with static shapes.
"""

from __future__ import annotations

import os
import weakref

import torch
from torch import Tensor, nn

from verify.backends.engine import LeanLM, UnsupportedModel
from verify.backends.graphs import check_mode, static_step
from verify.backends.lean_llama import LeanLlama
from verify.common.numerics import NonFiniteError

# Measured on the 10.5M base's 1-token step here (AMD EPYC, 1 thread, full-buffer attention): eager 3.8 ms,
# plain compile 3.6 ms, with Inductor's freezing 3.4 ms (within noise: the weights are plain tensors passed
# as inputs, so there is little to fold), with freezing and the C++ wrapper 3.1 ms (less per-call Python).
# Adding max_autotune measured 2.60 ms against 2.66 eager on a quiet machine: not worth its compile time.
COMPILE_OPTIONS = {"freezing": True, "cpp_wrapper": True}
RECOMPILE_LIMIT = 256

_BUILT: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()


def _weights_version(params: tuple[Tensor, ...]) -> tuple[int, int]:
    # in-place updates (optimizer steps, load_state_dict) bump a tensor's version counter; a cast or a move
    # (`module.to(torch.bfloat16)`, as dtype=bf16 decodes) swaps the parameters' storage instead, which the
    # first one's address shows (the engine holds the old tensors: it would still compute in fp32)
    return sum(p._version for p in params), params[0].data_ptr() if params else 0


def lean(module: nn.Module, build=None, *, compile: bool | str = False, vocab: Tensor | None = None):
    """The lean engine of `module` (a TransformerWrapper, an HFBase around a transformers Llama, or
    AttentionLayers with `build=LeanDecoder`), built once and rebuilt only when its parameters changed in
    place (optimizer steps, load_state_dict); checked against the module's own forward. `vocab`: a LeanLM's
    output layer trimmed to these ids (see `LeanLM`).

    compile=True: the engine's step goes through torch.compile with static shapes (one compiled
    program per input width; Inductor's on-disk cache makes a second process reuse them). compile="graph":
    the eager step with the same static shapes, captured as a CUDA graph per width (verify/backends/graphs.py).
    Either way `engine.compiled` is True: callers pass whole cache buffers, so shapes stay fixed."""
    check_mode(compile)
    if build is None:  # a Hugging Face Llama (verify.backends.hf.HFBase) has an engine of its own
        build = LeanLlama if hasattr(module, "hf") else LeanLM
    built = _BUILT.setdefault(module, {})
    key = (build, compile, None if vocab is None else tuple(vocab.tolist()))
    cached = built.get(key)  # (parameters, their version then, engine)
    # The prophet calls this every draft step: checking the stored parameters' versions costs a few
    # microseconds, where walking module.parameters() again cost ~50.
    if cached is not None and _weights_version(cached[0]) == cached[1]:
        return cached[2]
    params = tuple(module.parameters())
    engine = build(module) if vocab is None else build(module, vocab)
    if not compile and hasattr(engine, "pack_weights"):  # eager bf16 on a CPU: weights prepacked for oneDNN
        engine.pack_weights()
    check_against_reference(module, engine)
    if compile is True:
        # Inductor's on-disk cache lets a second process skip code generation (26 s -> 7 s here); keep
        # it with the project's other caches unless the user chose a place.
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(os.path.join(".cache", "inductor")))
        # One program per input width and thread count, and all targets share one code object: past
        # torch's default of 8 it would silently run eager while reported as compiled. Fail instead.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT
        )
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    if compile:  # torch.compile'd, or the eager step captured as CUDA graphs (graphs.py)
        engine.step, engine.compiled = static_step(engine.forward, compile, options=COMPILE_OPTIONS), True
    built[key] = (params, _weights_version(params), engine)
    return engine


def engine_dtype(engine) -> torch.dtype:
    """The dtype a lean engine computes in (its weights')."""
    return engine.decoder.dtype if hasattr(engine, "decoder") else engine.dtype


@torch.inference_mode()
def check_against_reference(module: nn.Module, engine, *, tolerance: float | None = None) -> None:
    """Run 6 positions through both: a difference means an option the structural checks missed.

    The default tolerance (relative to the largest output) follows the engine's dtype: 1e-3 in fp32; in
    bf16 the two forwards round differently (measured 2e-2 on logits of magnitude ~3 on a random 8-block
    model), so 6e-2 there. An unimplemented option changes outputs by order 1 in either."""
    if tolerance is None:
        tolerance = 1e-3 if engine_dtype(engine).itemsize >= 4 else 6e-2
    was_training = module.training
    module.eval()
    device = next(module.parameters()).device
    gen = torch.Generator(device=device).manual_seed(0)  # any inputs do: both forwards read the same ones
    try:
        if isinstance(engine, LeanLM):
            tokens = torch.randint(0, engine.vocab_size, (1, 6), generator=gen, device=device)
            ref = module(tokens) if engine.vocab is None else module(tokens)[..., engine.vocab.to(device)]
            ours = engine(tokens, engine.decoder.new_cache(1, 8))[0]
        else:
            x = torch.randn(1, 6, engine.dim, generator=gen, device=device).to(engine.dtype)
            ref, ours = module(x), engine(x, engine.new_cache(1, 8))
    finally:
        module.train(was_training)
    if not bool(torch.isfinite(ref).all()):  # else the difference below is NaN and blames the engine
        raise NonFiniteError("the model's own forward gives NaN/inf on 6 random inputs: its weights hold NaN/inf")
    err = float((ref.float() - ours.float()).abs().max())
    if not err <= tolerance * max(1.0, float(ref.float().abs().max())):
        raise UnsupportedModel(
            f"the lean engine differs from the model's own forward by {err:.2e}: "
            "the model uses an option it does not implement"
        )
