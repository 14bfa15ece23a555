"""The machine a run measured on, as results, peer, engine_costs and the cost caches describe it: the CPU's model,
the device (a GPU's name, memory and CUDA version), torch's version and threads."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

__all__ = ["cpu_model", "describe_device", "device_description", "device_info", "device_line", "machine_key"]


def cpu_model() -> str:
    """The CPU's model name: lscpu, else /proc/cpuinfo, else what platform knows."""
    try:
        out = subprocess.run(
            ["lscpu"], capture_output=True, text=True, timeout=10, env={**os.environ, "LC_ALL": "C"}
        ).stdout
        for line in out.splitlines():
            if line.strip().startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def device_info(device: torch.device | str = "cpu") -> dict[str, Any]:
    """What ran a benchmark, for results.json beside its `cpu` key: the device type and torch version; on a
    CPU its model and threads, on a GPU its name, total memory (GiB), CUDA version and the host CPU."""
    device = torch.device(device)
    info: dict[str, Any] = {"type": device.type, "torch": torch.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "name": props.name,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "cuda": torch.version.cuda,
            "host_cpu": cpu_model(),  # the loop's bookkeeping and the host reads still run on it
        }
    else:
        info |= {"name": cpu_model(), "threads": torch.get_num_threads()}
    return info


def describe_device(info: dict[str, Any]) -> str:
    """A results header's device line from device_info's dict: 'GPU: <name> (<memory> GiB), torch <version>,
    CUDA <version>; host CPU: <model>', or 'CPU: <model>' (the line results had before GPUs ran them)."""
    if info.get("type") == "cuda":
        return (
            f"GPU: {info['name']} ({info['memory_gib']:.1f} GiB), torch {info['torch']}, CUDA {info['cuda']}; "
            f"host CPU: {info['host_cpu']}"
        )
    return f"CPU: {info['name']}"


def device_description(device: torch.device | str = "cpu") -> str:
    """describe_device of this machine's `device`."""
    return describe_device(device_info(device))


def device_line(results: dict[str, Any]) -> str:
    """The device line of a results dict: from its `device_info`, or from its `cpu` alone for results written
    before device_info was recorded; "" when it has neither."""
    if results.get("device_info"):
        return describe_device(results["device_info"])
    return f"CPU: {results['cpu']}" if results.get("cpu") else ""


def machine_key(device: torch.device | str = "cpu") -> str:
    """What makes forward timings differ between runs: CPU model, torch version, threads, device type, and
    on a GPU its name and CUDA version (a cost table measured on one device must never serve another)."""
    device_type = torch.device(device).type
    key = f"{cpu_model()} | torch {torch.__version__} | {torch.get_num_threads()} threads | {device_type}"
    if device_type == "cuda":
        key += f" | {torch.cuda.get_device_name(device)} | CUDA {torch.version.cuda}"
    return key
