"""Training precision chosen by the machine: bf16 autocast only where the hardware computes bf16 natively.

bf16 autocast pays only where matmuls run in bf16 in hardware. A CPU without AMX or AVX512_BF16 emulates
them (convert to fp32, multiply, convert back), and bf16 autocast there is about 3x SLOWER than plain
fp32; with either it is faster (~1.4-1.7x on the tiny base, AVX512_BF16, measured here). So
`precision=auto` asks the machine instead of trusting a config written on another one.

    resolve_precision("auto", torch.device("cpu"))
    -> {"requested": "auto", "used": "fp32", "reason": "CPU lacks amx_bf16 and avx512_bf16"}
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

PRECISIONS = ("auto", "fp32", "bf16")
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # x86 flags of native bf16 matmuls (/proc/cpuinfo names)


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo, or None where they cannot be read (not Linux, no x86
    `flags` line). A function of its own so tests can pretend to be another CPU."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):  # "flags\t\t: fpu vme ... avx512_bf16 ..."; every core lists the same
            return set(line.partition(":")[2].split())
    return None


def native_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether `device` computes bf16 natively, and a short reason saying why (for logs and metadata)."""
    if device.type == "cuda":
        # without emulation: an emulated bf16 is the slow case this module exists to avoid
        with torch.cuda.device(device):
            ok = torch.cuda.is_bf16_supported(including_emulation=False)
        return ok, f"GPU {'supports' if ok else 'lacks'} native bf16"
    if device.type == "cpu":
        flags = cpu_flags()
        if flags is None:
            return False, "CPU flags unreadable (no flags line in /proc/cpuinfo)"
        present = [f for f in CPU_BF16_FLAGS if f in flags]
        if present:
            return True, f"CPU has {' and '.join(present)}"
        return False, f"CPU lacks {' and '.join(CPU_BF16_FLAGS)}"
    return False, f"no native bf16 check for device type {device.type}"


def check_precision(requested: Any) -> str:
    """`requested` when it is a known precision; a one-line ValueError otherwise (no work done)."""
    if not isinstance(requested, str) or requested not in PRECISIONS:
        raise ValueError(f"precision={requested!r}: must be one of {', '.join(PRECISIONS)}")
    return requested


def resolve_precision(requested: str, device: torch.device) -> dict[str, str]:
    """{"requested", "used" ("bf16" or "fp32"), "reason"}: auto follows the machine, fp32 and bf16 are obeyed.

    bf16 asked explicitly on a machine without it is honoured (one may want to compare), but the reason
    says it will be slow."""
    check_precision(requested)
    if requested == "fp32":
        return {"requested": requested, "used": "fp32", "reason": "fp32 requested"}
    native, why = native_bf16(device)
    if requested == "bf16":
        reason = f"bf16 requested; {why}" + ("" if native else ": emulated bf16 autocast will be slow (~3x on CPU)")
        return {"requested": requested, "used": "bf16", "reason": reason}
    return {"requested": requested, "used": "bf16" if native else "fp32", "reason": why}


def autocast(used: str, device: torch.device) -> AbstractContextManager[Any]:
    """The forward/backward context for a resolved precision: bf16 autocast (weights and optimizer state
    stay fp32) or nothing."""
    if used == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if used == "fp32":
        return contextlib.nullcontext()
    raise ValueError(f"used precision={used!r}: must be bf16 or fp32 (resolve_precision gives one of them)")


# ------------------------------------------------------------------------------------------ decoding

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_decode_dtype(requested: Any, device: torch.device) -> dict[str, Any]:
    """The dtype the target and every drafter decode in: {"requested", "used" ("bf16" or "fp32"), "reason",
    "dtype" (the torch dtype)}; a one-line ValueError for anything but auto, fp32 or bf16.

    auto is bf16 on a GPU that computes it natively and fp32 on every CPU: on this project's reference CPU
    (AMD EPYC with avx512_bf16) an eager 1-token step of the 10.5M base took 8.1 ms in bf16 against 6.4 ms in
    fp32 (one thread: at this size the step is dominated by per-op overhead and bf16 adds conversions), so
    native bf16 on a CPU is no reason to decode in it. Losslessness is relative to the target in the chosen
    precision: bf16 speculative output equals bf16 plain decoding, not fp32's."""
    if not isinstance(requested, str) or requested not in PRECISIONS:
        raise ValueError(f"dtype={requested!r}: must be one of {', '.join(PRECISIONS)}")
    if requested != "auto":
        used, reason = requested, f"{requested} requested"
    elif device.type == "cuda":
        native, reason = native_bf16(device)
        used = "bf16" if native else "fp32"
    else:
        used, reason = "fp32", f"{device.type}: auto decodes in fp32 off the GPU (bf16 steps measured slower)"
    return {"requested": requested, "used": used, "reason": reason, "dtype": DTYPES[used]}


def decode_in(model: torch.nn.Module, precision: dict[str, Any]) -> torch.nn.Module:
    """`model` (loaded in fp32) cast to the resolved decode dtype, in place; on a GPU, fp32 matmuls may use
    TF32 (10-bit mantissa inputs, fp32 accumulation): what an fp32 result on a GPU is exact against."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return model.to(precision["dtype"])
