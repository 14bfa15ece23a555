"""One call per direction for every serving format: `write` an export, `read` a directory back as this project's
drafter, `check_served` a directory from its files before any model loads.

`checkpoints.prophet=<dir>` or `checkpoints.medusa=<dir>` may name a directory in a serving format instead of a
project checkpoint: `read` detects the format, reads the directory (config.json and every tensor) once, and
hands both to that format's reader, which builds the drafter; an export of this project is then held to the base
it was trained on (its fingerprint). `write` converts a trained drafter with its format's writer and writes the
directory atomically; every export is read back by its format's reader, its logits compared with the drafter's
bit for bit, before the directory is renamed into place.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from experiments.lib.formats import eagle, eagle3, llama, medusa
from experiments.lib.formats.common import SERVED_FAMILY, check_round_trip, detect, layer_config
from experiments.lib.store.checkpoint import fingerprint
from experiments.lib.store.served_dir import (
    MARK,
    FormatError,
    read_config,
    read_directory,
    tensor_names,
    write_directory,
)

log = logging.getLogger(__name__)

READERS = {"eagle3": eagle3.from_files, "eagle": eagle.from_files, "medusa": medusa.from_files}


def write(
    fmt: str,
    module: nn.Module,
    base: nn.Module,
    out: str | Path,
    *,
    vocab: Tensor | None,
    verifier: str,
    tokens: int,
    provenance: dict[str, Any],
    overwrite: bool,
    keep: Iterable[str | Path],
) -> Path:
    """A trained drafter (float32, on `base`) written to `out` in `fmt`, `provenance` added to its config.json.
    `vocab`: the sorted ids it was trained to draft from (None: all V); `verifier`, `tokens`: the base and the
    draft length an EAGLE-3 config names. `overwrite`, `keep`: as served_dir.check_out."""
    if fmt == "draft_model":
        tensors, config = llama.export_tensors(module, vocab)
    elif fmt == "eagle3":
        tensors = eagle3.export_tensors(module, vocab)
        draft_vocab = tensors["lm_head.weight"].shape[0]
        config = eagle3.export_config(module, base, verifier=verifier, draft_vocab=draft_vocab, tokens=tokens)
    elif fmt == "eagle":
        tensors, config = eagle.export_tensors(module), layer_config(base, module.decoder)
    else:
        tensors, config = medusa.export_tensors(module, base, vocab)

    def check(tmp: Path) -> None:  # every format read back as its reader reads it, before the rename
        if fmt == "draft_model":
            llama.check_round_trip(module, llama.read(tmp), vocab, out)
        elif fmt == "medusa":
            medusa.check_round_trip(module, medusa.read(tmp, base), base, vocab, out)
        else:
            check_round_trip(module, {"eagle3": eagle3.read, "eagle": eagle.read}[fmt](tmp, base), base, vocab, out)

    written = write_directory(out, config | provenance, tensors, overwrite=overwrite, keep=keep, check=check)
    log.info("wrote %s (%s, %d tensors) for verifier %s", written, fmt, len(tensors), verifier)
    print(f"exported {fmt}: {written}")
    return written


def read(directory: str | Path, base: nn.Module, base_meta: dict) -> tuple[nn.Module, str, dict[str, Any]]:
    """A serving-format directory -> (module on the base's device and dtype, family package name, a meta like a
    trained checkpoint's)."""
    directory = Path(directory)
    kind = detect(directory)
    if kind not in READERS:
        raise FormatError(f"{directory} holds {kind or 'no serving format'}: import reads eagle3, eagle or medusa")
    config, tensors = read_directory(directory)
    module = READERS[kind](config, tensors, base, directory)
    package = SERVED_FAMILY[kind]
    if package == "prophet":
        settings = {"arch": kind, "fuse_layers": list(module.fuse_layers) or None}
    else:
        settings = {"num_heads": module.num_heads, "num_layers": module.num_layers}
    ids = getattr(module, "draft_ids", None)  # an EAGLE-3's own draft vocabulary; None: all V tokens
    exported_on = (config.get(MARK) or {}).get("base_fingerprint")
    if exported_on is not None and exported_on != base_meta.get("fingerprint"):
        raise FormatError(
            f"{directory} was exported from a drafter of base {exported_on}, not of this base "
            f"({base_meta.get('fingerprint')}): use it with the base it was trained on"
        )
    weight = next(base.parameters())
    module = module.to(device=weight.device, dtype=weight.dtype)
    meta = {
        "kind": "drafter",
        "imported": kind,  # read from a serving format: its vocabulary is the file's, whatever the config says
        "checkpoint": str(directory),
        "fingerprint": fingerprint(module.state_dict()),
        "base_fingerprint": base_meta.get("fingerprint"),
        "model_config": {"package": package, "module": settings},
        "drafter": {"loss": None},
        "train_vocab": None if ids is None else ids.numel(),
        "train_vocab_ids": None if ids is None else ids.tolist(),
    }
    return module, package, meta


def check_served(path: str | Path, family: str, base_path: str | Path | None = None) -> str:
    """A serving-format directory named for `family`, checked from its files alone before any model loads: its
    format, config.json's settings and the tensors' names (headers only: a truncated file is refused), and the
    verifier an EAGLE-3 config names against the base at `base_path` (its files). Returns the format."""
    path = Path(path)
    kind = detect(path)
    if kind is None:
        raise FormatError(f"checkpoints.{family}={path} holds no serving format (eagle3, eagle, medusa, draft_model)")
    if SERVED_FAMILY[kind] != family:
        raise FormatError(f"checkpoints.{family}={path} is a {kind} directory: it is a {SERVED_FAMILY[kind]} drafter")
    config, names = read_config(path), tensor_names(path)
    if kind == "eagle3":
        eagle3.check_files(config, names, path, base_path)
    elif kind == "eagle":
        eagle.check_files(config, names, path)
    elif kind == "medusa":
        medusa.check_files(config, names, path)
    return kind
