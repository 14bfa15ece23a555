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
import copy
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


def resolve_decode_dtype(
    requested: Any, device: torch.device, measured: dict[str, float] | None = None
) -> dict[str, Any]:
    """The dtype the target and every drafter decode in: {"requested", "used" ("bf16" or "fp32"), "reason",
    "dtype" (the torch dtype)}; a one-line ValueError for anything but auto, fp32 or bf16.

    auto is bf16 on a GPU that computes it natively. On a CPU it follows measurement: `measured` holds each
    dtype's cost of a decode step plus an 8-token verification on this base and machine
    (experiments/lib/methods/calibrate.py `measure_decode_dtypes`), and auto takes bf16 only where the CPU computes
    it natively (AMX or AVX512_BF16) and it measured cheaper. Why not a fixed rule: on the project's 10.5M
    base an eager bf16 step took 8.1 ms against 6.4 ms in fp32 (per-op overhead dominates and bf16 adds
    conversions), while on SmolLM2-135M with prepacked weights an 8-token verification costs about half of
    fp32's. Without a measurement, auto stays fp32 on a CPU. Losslessness is relative to the target in the
    chosen precision: bf16 speculative output equals bf16 plain decoding, not fp32's."""
    if not isinstance(requested, str) or requested not in PRECISIONS:
        raise ValueError(f"dtype={requested!r}: must be one of {', '.join(PRECISIONS)}")
    if requested != "auto":
        used, reason = requested, f"{requested} requested"
    elif device.type == "cuda":
        native, reason = native_bf16(device)
        used = "bf16" if native else "fp32"
    else:
        native, why = native_bf16(device)
        if not native or measured is None:
            used, reason = "fp32", f"{device.type}: {why}; " + ("not measured" if native else "bf16 would be emulated")
        else:
            used = "bf16" if measured["bf16"] < measured["fp32"] else "fp32"
            ms = {k: f"{1e3 * v:.1f} ms" for k, v in measured.items()}
            reason = f"{device.type}: {why}; step + 8-token verify {ms['bf16']} in bf16, {ms['fp32']} in fp32"
    return {"requested": requested, "used": used, "reason": reason, "dtype": DTYPES[used]}


def cast_copy(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """`model` itself for "fp32", else a copy in that dtype ("bf16"): the fp32 original stays for what reads it in
    fp32 (a drafter's loss backpropagates through the base's output layer)."""
    return model if dtype == "fp32" else copy.deepcopy(model).to(DTYPES[dtype])


def decode_in(model: torch.nn.Module, precision: dict[str, Any]) -> torch.nn.Module:
    """`model` (loaded in fp32) cast to the resolved decode dtype, in place; on a GPU, fp32 matmuls may use
    TF32 (10-bit mantissa inputs, fp32 accumulation): what an fp32 result on a GPU is exact against."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return model.to(precision["dtype"])
