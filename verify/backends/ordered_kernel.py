"""The position-ordered attention as one C++ operator (ordered_kernel.cpp), built on first use, and its plan.

Why a compiled kernel: the pure-torch form (ordered_attention.py) keeps a tree node equal to its path by taking
every query's keys in chunks of 64 positions, gathering a tree's tail per query and adding the chunk results in
a Python loop: on SmolLM2 (2 threads, bf16) a 16-node tree then cost 1.57 one-token steps at 256 tokens of
context, and a step at 2,048 tokens 1.6x a step at 64. The operator walks each query's own visible keys in
position order, so a step, a chain, a tree and a batched row all run the same arithmetic on the same key list,
read nothing else (a batch's rows stop at their own length) and copy nothing.

Built with torch.utils.cpp_extension (ninja and the C++ compiler the machine has; no Python headers) into
~/.cache/prophet-medusa/kernels, named by a hash of the source, the flags, torch's version and the CPU, so a
second process loads it at once and another machine builds its own (-march=native). Where it cannot be built,
one line says why and decoding takes the pure-torch form, which is exact too (slower). PROPHET_MEDUSA_KERNEL=0
chooses the pure-torch form; results record which ran (`kernel_name`).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import warnings
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["DIM_HEADS", "attend_kernel", "fast_bf16", "kernel_available", "kernel_name", "kernel_plan"]

SOURCE = Path(__file__).with_name("ordered_kernel.cpp")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off")  # no fused multiply-add the source did not write
DIM_HEADS = (16, 32, 64, 128)  # the head sizes the operator is instantiated for
ENV = "PROPHET_MEDUSA_KERNEL"


def _cpu_id() -> str:
    """The CPU's model and flags: -march=native code built on one CPU may not run on another."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join(keep)


def _build_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prophet-medusa" / "kernels"
    digest = hashlib.sha256(
        b"\0".join(s.encode() for s in (SOURCE.read_text(), " ".join(FLAGS), torch.__version__, _cpu_id()))
    ).hexdigest()[:16]
    return root / f"ordered-{digest}"


def _missing() -> str | None:
    """What the build lacks, in words; None when it can run."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH; set CXX)"
    try:
        from torch.utils.cpp_extension import include_paths, verify_ninja_availability

        verify_ninja_availability()
    except RuntimeError:
        return "ninja is not installed (pip install ninja)"
    if not (Path(include_paths()[0]) / "torch" / "library.h").exists():
        return f"torch's C++ headers are missing under {include_paths()[0]}"
    return None


def _fake(q: Tensor, k: Tensor, v: Tensor, ctx: Tensor, extra: Tensor, count: Tensor, scale: float) -> Tensor:
    return q.new_empty(q.shape, dtype=torch.float32)  # what a compiled step traces: the output's shape


@cache
def _load() -> str | None:
    """Build (once per machine) and load the operator; None when it loaded, else why not, in one line."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"  # chosen: no warning
    why = _missing()
    if why is None:
        from torch.utils.cpp_extension import load

        build = _build_dir()
        build.mkdir(parents=True, exist_ok=True)
        try:
            # cpp_extension takes a lock file in the build directory: parallel workers build once, the others wait
            load(
                name="prophet_medusa_ordered",
                sources=[str(SOURCE)],
                extra_cflags=list(FLAGS),
                build_directory=str(build),
                is_python_module=False,
                verbose=False,
            )
        except (RuntimeError, OSError) as error:
            why = f"the build failed ({str(error).strip().splitlines()[-1][:200]}); its files are in {build}"
    if why is None:
        torch.library.register_fake("prophet_medusa::attend_ordered")(_fake)  # shapes for torch.compile
    else:
        warnings.warn(
            f"ordered attention: {why}; decoding uses the pure-torch ordered attention (exact, slower)", stacklevel=3
        )
    return why


def kernel_available() -> bool:
    """Whether the C++ operator is loaded (built first if it has to be)."""
    return _load() is None


def kernel_name(device: torch.device | str, dim_head: int) -> str:
    """Which ordered attention a decoder on `device` with heads of `dim_head` runs: "cpp" or "torch"."""
    usable = torch.device(device).type == "cpu" and dim_head in DIM_HEADS
    return "cpp" if usable and kernel_available() else "torch"


@cache
def fast_bf16() -> bool:
    """Whether the operator multiplies bf16 pairs itself (AVX512-BF16), so that a bf16 cache keeps bf16 keys."""
    return kernel_available() and bool(torch.ops.prophet_medusa.fast_bf16())


def kernel_plan(start: Tensor, n: int, allow: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """The keys each of n new queries written from slot start (b,) sees, as the operator takes them: ctx (b, n),
    every slot below it; then extra (b, n, m)[:count (b, n)], window slots in slot order. allow (b, n, r) over the
    last r slots as verify.backends.cache's `visibility` (None: causal, a step or a chain: slots up to its own)."""
    b, device = start.shape[0], start.device
    if allow is None:
        ctx = start[:, None] + torch.arange(1, n + 1, device=device)
        return ctx, torch.zeros(b, n, 0, dtype=torch.long, device=device), torch.zeros_like(ctx)
    r = allow.shape[-1]
    window = start - (r - n)  # (b,) every query sees all slots before it
    order = torch.sort((~allow).to(torch.uint8), dim=-1, stable=True).indices  # visible window slots first, in order
    extra = (window[:, None, None] + order).contiguous()
    return window[:, None].expand(b, n).contiguous(), extra, allow.sum(-1)


def attend_kernel(q: Tensor, k: Tensor, v: Tensor, plan: tuple[Tensor, Tensor, Tensor], scale: float) -> Tensor:
    """q (b, n, h, dh) over the cached k, v (b, g, S, dh) (g kv heads shared by h / g query heads each), every
    query over its own keys in position order (`kernel_plan`) -> (b, n, h dh) in q's dtype."""
    ctx, extra, count = plan
    out = torch.ops.prophet_medusa.attend_ordered(q.contiguous(), k, v, ctx, extra, count, scale)
    return out.to(q.dtype).flatten(2)
