"""precision=auto follows the machine: bf16 autocast only on a CPU with amx_bf16 or avx512_bf16 (flags faked)."""

from __future__ import annotations

import pytest
import torch

from experiments.lib.training import precision
from experiments.lib.training.precision import autocast, check_precision, native_bf16, resolve_precision

CPU = torch.device("cpu")
PLAIN_AVX512 = {"fpu", "sse4_2", "avx2", "avx512f", "avx512bw"}  # AVX-512 without its bf16 extension


def fake_cpu(monkeypatch: pytest.MonkeyPatch, flags: set[str] | None) -> None:
    monkeypatch.setattr(precision, "cpu_flags", lambda: flags)


@pytest.mark.parametrize(
    "flags, used, reason",
    [
        (PLAIN_AVX512, "fp32", "CPU lacks amx_bf16 and avx512_bf16"),
        (PLAIN_AVX512 | {"avx512_bf16"}, "bf16", "CPU has avx512_bf16"),
        (PLAIN_AVX512 | {"amx_bf16", "amx_tile"}, "bf16", "CPU has amx_bf16"),
        (PLAIN_AVX512 | {"amx_bf16", "avx512_bf16"}, "bf16", "CPU has amx_bf16 and avx512_bf16"),
        (None, "fp32", "CPU flags unreadable"),
    ],
)
def test_auto_follows_the_cpu_flags(monkeypatch: pytest.MonkeyPatch, flags, used: str, reason: str) -> None:
    fake_cpu(monkeypatch, flags)
    resolved = resolve_precision("auto", CPU)
    assert resolved["requested"] == "auto" and resolved["used"] == used
    assert resolved["reason"].startswith(reason), resolved
    assert native_bf16(CPU)[0] is (used == "bf16")


def test_explicit_choices_are_obeyed(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cpu(monkeypatch, PLAIN_AVX512 | {"avx512_bf16"})
    assert resolve_precision("fp32", CPU)["used"] == "fp32"  # fp32 even where bf16 is native
    fake_cpu(monkeypatch, PLAIN_AVX512)
    slow = resolve_precision("bf16", CPU)
    assert slow["used"] == "bf16" and "slow" in slow["reason"] and "lacks" in slow["reason"]
    fake_cpu(monkeypatch, PLAIN_AVX512 | {"amx_bf16"})
    assert "slow" not in resolve_precision("bf16", CPU)["reason"]


def test_fp32_never_reads_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreadable():
        raise AssertionError("fp32 needs no look at the machine")

    monkeypatch.setattr(precision, "cpu_flags", unreadable)
    assert resolve_precision("fp32", CPU) == {"requested": "fp32", "used": "fp32", "reason": "fp32 requested"}


def test_other_device_types_are_not_bf16() -> None:
    assert native_bf16(torch.device("meta"))[0] is False


def test_real_cpu_flags_parse() -> None:
    flags = precision.cpu_flags()  # this machine's, when it is Linux on x86
    assert flags is None or (isinstance(flags, set) and all(isinstance(f, str) and " " not in f for f in flags))


@pytest.mark.parametrize("value", ["fp16", "BF16", "", None, True, 16])
def test_bad_values_are_one_line_errors(value) -> None:
    with pytest.raises(ValueError) as excinfo:
        resolve_precision(value, CPU)
    message = str(excinfo.value)
    assert message == f"precision={value!r}: must be one of auto, fp32, bf16", message
    with pytest.raises(ValueError):
        check_precision(value)


def test_autocast_context() -> None:
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with autocast("bf16", CPU):
        assert (a @ b).dtype == torch.bfloat16
    with autocast("fp32", CPU):
        assert (a @ b).dtype == torch.float32
    with pytest.raises(ValueError, match="used precision='auto': must be bf16 or fp32"):
        autocast("auto", CPU)
