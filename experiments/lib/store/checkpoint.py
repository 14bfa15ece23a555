"""Checkpoint I/O: a directory of safetensors plus JSON, written atomically, never unpickled.

Layout of a checkpoint directory:

    model.safetensors   weights (the model's state_dict)
    optim.safetensors   optional optimizer state: its tensors, with the non-tensor parts as JSON in the
                        safetensors header metadata (so the file is self-contained)
    tokenizer.json      the tokenizer, beside the weights, for tools that want it as a file
    meta.json           model config kwargs, tokenizer JSON string, step, fingerprint of the weights,
                        provenance, plus whatever the caller passed as `extra` (tokens seen, metrics, ...)

Atomicity: everything is written into `.<name>.tmp` beside the target (each file with the project's atomic
writer, experiments.lib.common.errors: fsync'd, so the swap never puts in place a directory whose files the
disk has not yet got), then the old checkpoint is renamed
to `.<name>.old`, the new one renamed into place, and the backup deleted. Renames within one directory are
atomic, so at every instant either the old or the new complete checkpoint exists under one of two names.
If a crash fell between the two renames, loading reads the backup, and the next save first puts it back
(`_recover`). Loading never changes the filesystem, so readers may run while a trainer saves.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer

from experiments.lib.common.errors import atomic_path, fsync_directory, one_line, write_atomic
from experiments.lib.data.tokenizer import load_tokenizer
from experiments.lib.store.lm import build_lm
from verify.common.numerics import is_int

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "fingerprint",
    "save_checkpoint",
    "update_meta",
    "load_checkpoint",
    "load_lm",
    "load_model",
    "checkpoint_exists",
    "read_meta",
    "check_lm_meta",
    "hf_config_lacks",
    "is_hf_directory",
    "tokenizer_mismatch",
]

MODEL_FILE = "model.safetensors"
OPTIM_FILE = "optim.safetensors"
META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
FORMAT = "prophet-medusa/checkpoint-v1"
RESERVED_META_KEYS = {"format", "model_config", "tokenizer", "step", "fingerprint", "provenance", "has_optimizer"}


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupted, or does not match what the caller expects."""


@dataclass
class Checkpoint:
    state_dict: dict[str, torch.Tensor]
    meta: dict[str, Any]
    optimizer_state: dict[str, Any] | None


# ----------------------------------------------------------------------------------------- fingerprint


def fingerprint(state_dict: dict[str, torch.Tensor]) -> str:
    """sha256 over sorted (name, shape, dtype, raw bytes): equal iff the weights are bit-identical."""
    digest = sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        # view as bytes so bf16 (which numpy cannot hold) hashes too; reshape(-1) lets 0-dim tensors be viewed
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


# ------------------------------------------------------------------------------ optimizer (de)flattening


def _flatten_optimizer(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], str]:
    """torch optimizer state_dict -> (tensors named "state.<param>.<key>", JSON of everything else)."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for param_id, param_state in state["state"].items():
        for key, value in param_state.items():
            if torch.is_tensor(value):
                tensors[f"state.{param_id}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{param_id}.{key}"] = value
    rest = {"param_groups": state["param_groups"], "scalars": scalars}
    return tensors, json.dumps(rest)


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], rest_json: str) -> dict[str, Any]:
    rest = json.loads(rest_json)
    state: dict[int, dict[str, Any]] = {}
    for name, tensor in tensors.items():
        _, param_id, key = name.split(".", 2)
        state.setdefault(int(param_id), {})[key] = tensor
    for name, value in rest["scalars"].items():
        param_id, key = name.split(".", 1)
        state.setdefault(int(param_id), {})[key] = value
    return {"state": state, "param_groups": rest["param_groups"]}


# ------------------------------------------------------------------------------------------ provenance


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def _provenance() -> dict[str, Any]:
    import x_transformers  # imported here: only needed for its version

    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git_commit": _git_commit(),
        "torch": torch.__version__,
        "x_transformers": getattr(x_transformers, "__version__", None) or _dist_version("x-transformers"),
        "python": platform.python_version(),
    }


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------- saving


def _siblings(directory: Path) -> tuple[Path, Path]:
    """(temporary, backup) paths beside `directory`, on the same filesystem so renames are atomic."""
    return directory.with_name(f".{directory.name}.tmp"), directory.with_name(f".{directory.name}.old")


def _recover(directory: Path) -> None:
    """Finish or undo a swap that a crash interrupted; remove a half-written temporary directory."""
    tmp, backup = _siblings(directory)
    if backup.exists():
        if directory.exists():  # crashed after the new checkpoint was in place: the backup is stale
            shutil.rmtree(backup)
        else:  # crashed between the two renames: the backup is the last complete checkpoint
            os.replace(backup, directory)
    if tmp.exists():
        shutil.rmtree(tmp)


def _write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, its I/O failures raised as the OSError they are (a full disk: ENOSPC), so
    callers and the command line treat them like any other failed write."""
    try:
        with atomic_path(path) as tmp:  # fsync'd before the directory holding it is swapped into place
            save_file(tensors, str(tmp), metadata=metadata)
    except SafetensorError as e:
        found = re.search(r"\(os error (\d+)\)", str(e))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None


def _write_contents(
    tmp: Path,
    *,
    state_dict: dict[str, torch.Tensor],
    meta: dict[str, Any],
    optimizer: torch.optim.Optimizer | None,
) -> None:
    tmp.mkdir(parents=True)
    _save_tensors(state_dict, tmp / MODEL_FILE)
    if optimizer is not None:
        tensors, rest_json = _flatten_optimizer(optimizer.state_dict())
        _save_tensors(tensors, tmp / OPTIM_FILE, metadata={"optimizer": rest_json})
    if meta["tokenizer"] is not None:
        write_atomic(tmp / TOKENIZER_FILE, meta["tokenizer"])
    _write_json(tmp / META_FILE, meta)  # last: a directory with meta.json was written to the end


def save_checkpoint(
    directory: str | Path,
    *,
    model: torch.nn.Module,
    model_config: dict[str, Any],
    tokenizer_json: str | None,
    step: int,
    extra: dict[str, Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> Path:
    """Write a complete checkpoint to `directory`, replacing any previous one atomically."""
    directory = Path(directory)
    extra = dict(extra or {})
    clash = RESERVED_META_KEYS & extra.keys()
    if clash:
        raise ValueError(f"extra checkpoint fields clash with reserved meta keys: {sorted(clash)}")
    # clone: safetensors refuses tensors that share storage, and a copy freezes the weights being hashed
    state_dict = {k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}
    meta = {
        "format": FORMAT,
        "model_config": dict(model_config),
        "tokenizer": tokenizer_json,
        "step": int(step),
        "fingerprint": fingerprint(state_dict),
        "has_optimizer": optimizer is not None,
        "provenance": _provenance(),
        **extra,
    }
    directory.parent.mkdir(parents=True, exist_ok=True)
    _recover(directory)
    if directory.exists() and any(directory.iterdir()) and not (directory / META_FILE).is_file():
        # the old directory is deleted after the swap: never let a mistyped path delete a run directory
        raise CheckpointError(f"refusing to replace {directory}: it exists and is not a checkpoint")
    tmp, backup = _siblings(directory)
    try:
        _write_contents(tmp, state_dict=state_dict, meta=meta, optimizer=optimizer)
        if directory.exists():
            os.replace(directory, backup)
        os.replace(tmp, directory)
        fsync_directory(directory.parent)  # make the renames themselves durable
    finally:
        _recover(directory)  # on success: drops the backup; on failure: restores it and drops tmp
    return directory


def update_meta(directory: str | Path, changes: dict[str, Any]) -> Path:
    """Change fields of a checkpoint's meta.json without rewriting its weights: the file is replaced
    atomically (write_atomic: a reader sees the old meta or the new one), the weights and so the fingerprint
    stay as they are. Used to mark a best checkpoint written earlier in the run as the run's finished result
    (experiments/lib/training/loop.py). The reserved fields (format, step, fingerprint, ...) describe the weights
    and may not change."""
    directory = Path(directory)
    clash = RESERVED_META_KEYS & changes.keys()
    if clash:
        raise ValueError(f"meta fields {sorted(clash)} describe the weights and cannot be updated in place")
    _recover(directory)  # a swap a crash interrupted: the complete checkpoint back under its name first
    meta = read_meta(directory)
    write_atomic(directory / META_FILE, json.dumps({**meta, **changes}, indent=2, sort_keys=True) + "\n")
    return directory


# --------------------------------------------------------------------------------------------- loading


def _readable(directory: Path) -> Path:
    """The directory to read: `directory`, or its backup when a save crashed between its two renames."""
    _, backup = _siblings(directory)
    if not directory.is_dir() and (backup / META_FILE).is_file():
        return backup
    return directory


def checkpoint_exists(directory: str | Path) -> bool:
    """True when `directory` holds (or a crashed save left recoverable) a checkpoint."""
    return (_readable(Path(directory)) / META_FILE).is_file()


def _read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"corrupted or truncated {path}: {one_line(e)}") from None


def _read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"corrupted {path}: {one_line(e)}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} meta file")
    missing = sorted(RESERVED_META_KEYS - meta.keys())
    if missing:
        raise CheckpointError(f"{path} lacks required fields: {missing}")
    return meta


def _check_config(directory: Path, found: dict[str, Any], expected: dict[str, Any]) -> None:
    keys = sorted(set(found) | set(expected))
    diffs = [
        f"{k}: checkpoint {found.get(k, '<absent>')!r} vs expected {expected.get(k, '<absent>')!r}"
        for k in keys
        if found.get(k, "<absent>") != expected.get(k, "<absent>")
    ]
    if diffs:
        raise CheckpointError(f"checkpoint {directory} has a different model config: " + "; ".join(diffs))


def _read_optimizer(path: Path) -> dict[str, Any]:
    tensors, header = _read_safetensors(path)
    try:
        return _unflatten_optimizer(tensors, header["optimizer"])
    except (KeyError, ValueError, json.JSONDecodeError) as e:
        raise CheckpointError(f"corrupted optimizer state in {path}: {one_line(e)}") from None


def _not_a_checkpoint(directory: Path) -> CheckpointError:
    """The error for a directory without meta.json: says what it looks like instead, when it can."""
    if (directory / "checkpoint" / META_FILE).is_file():
        return CheckpointError(f"{directory} is a run directory, not a checkpoint: give {directory / 'checkpoint'}")
    if (directory / "config.json").is_file():
        lacks = hf_config_lacks(directory)
        if lacks is not None:  # a config.json alone ({}, say) makes no Hugging Face model
            return CheckpointError(
                f"{directory} is neither a checkpoint of this project (no {META_FILE}) nor a Hugging Face model "
                f"directory: {lacks}"
            )
        return CheckpointError(
            f"{directory} is a Hugging Face model directory, not a checkpoint of this project "
            f"(no {META_FILE}): only a base LM can be one"
        )
    if not (directory / MODEL_FILE).is_file():
        return CheckpointError(f"{directory} is not a checkpoint directory (no {META_FILE}, no {MODEL_FILE})")
    return CheckpointError(f"checkpoint {directory} is incomplete: {META_FILE} is missing")


def read_meta(directory: str | Path) -> dict[str, Any]:
    """A checkpoint's meta.json, after checking the files are there and the weights file is complete
    (its header covers the whole file), without reading any weights: entry points call it on every
    checkpoint they were given before any work starts, so a wrong path fails in milliseconds."""
    directory = _readable(Path(directory))
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {directory}")
    if not (directory / META_FILE).is_file():
        raise _not_a_checkpoint(directory)
    if not (directory / MODEL_FILE).is_file():
        raise CheckpointError(f"checkpoint {directory} is incomplete: {MODEL_FILE} is missing")
    meta = _read_meta(directory / META_FILE)
    try:  # opening reads only the header, and refuses a file the header does not exactly cover (truncated)
        with safe_open(str(directory / MODEL_FILE), framework="pt"):
            pass
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"corrupted or truncated {directory / MODEL_FILE}: {one_line(e)}") from None
    return meta


def load_checkpoint(directory: str | Path, *, expected_config: dict[str, Any] | None = None) -> Checkpoint:
    """Read and verify a checkpoint; safetensors and JSON only."""
    meta = read_meta(directory)
    directory = _readable(Path(directory))
    if expected_config is not None:
        _check_config(directory, meta["model_config"], dict(expected_config))
    state_dict, _ = _read_safetensors(directory / MODEL_FILE)
    found = fingerprint(state_dict)
    if found != meta["fingerprint"]:
        raise CheckpointError(
            f"checkpoint {directory}: weights fingerprint {found} does not match meta.json's {meta['fingerprint']}"
        )
    optimizer_state = None
    if meta["has_optimizer"]:
        if not (directory / OPTIM_FILE).is_file():
            raise CheckpointError(f"checkpoint {directory} is incomplete: {OPTIM_FILE} is missing")
        optimizer_state = _read_optimizer(directory / OPTIM_FILE)
    return Checkpoint(state_dict=state_dict, meta=meta, optimizer_state=optimizer_state)


def check_lm_meta(directory: str | Path, meta: dict[str, Any], role: str = "base_checkpoint") -> Tokenizer:
    """A base LM checkpoint's meta, checked before its weights are read; its tokenizer.

    Refuses a drafter checkpoint (its config builds no LM), a missing or unreadable tokenizer, a tokenizer
    with more tokens than the model's embedding (ids past num_tokens would index out of it or, on a
    device without bounds checks, read garbage) and an EOS id outside the vocabulary."""
    kind = meta.get("kind")
    if kind == "drafter":
        raise CheckpointError(
            f"{directory} is a drafter checkpoint (kind=drafter); {role} takes a base LM checkpoint "
            "(experiments.train_base)"
        )
    if meta.get("tokenizer") is None:
        raise CheckpointError(
            f"checkpoint {directory} has no tokenizer: {role} takes a base LM checkpoint (experiments.train_base)"
        )
    try:
        tokenizer = Tokenizer.from_str(meta["tokenizer"])
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise CheckpointError(f"checkpoint {directory}: its tokenizer does not load ({one_line(e)})") from None
    num_tokens = meta["model_config"].get("num_tokens")
    if isinstance(num_tokens, int):
        _check_vocabulary(f"checkpoint {directory}", tokenizer, num_tokens, (meta.get("data") or {}).get("eos_id"))
    return tokenizer


def _check_vocabulary(name: str, tokenizer: Tokenizer, num_tokens: int, eos_id: Any) -> None:
    size = tokenizer.get_vocab_size()
    if size > num_tokens:
        raise CheckpointError(
            f"{name}: its tokenizer has {size} tokens, more than the model's {num_tokens} "
            "(num_tokens): the tokenizer does not belong to these weights"
        )
    # One id, or several (a Hugging Face model's generation_config may list several: a row ends at any).
    if isinstance(eos_id, list):
        if not eos_id or not all(is_int(i) and 0 <= i < size for i in eos_id):
            raise CheckpointError(
                f"{name}: its EOS ids {eos_id!r} must be a non-empty list of tokens of its {size}-token tokenizer"
            )
    elif eos_id is not None and not (is_int(eos_id) and 0 <= eos_id < size):
        raise CheckpointError(f"{name}: its EOS id {eos_id!r} is not a token of its {size}-token tokenizer")


def load_lm(
    directory: str | Path, *, device: str | torch.device = "cpu", role: str = "base_checkpoint"
) -> tuple[torch.nn.Module, Tokenizer, dict[str, Any]]:
    """Rebuild a base LM from its checkpoint: (model in eval mode, tokenizer, meta). A Hugging Face model
    directory (config.json, *.safetensors, tokenizer.json; no meta.json) loads too, as an HFBase.
    `role` names the setting the directory came from, for the errors (check_lm_meta)."""
    if is_hf_directory(Path(directory)):
        return _load_hf(Path(directory), device)
    tokenizer = check_lm_meta(directory, read_meta(directory), role)
    model, meta = load_model(directory, build_lm, device=device)
    return model, tokenizer, meta


def load_model(
    directory: str | Path, build, *, device: str | torch.device = "cpu"
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Rebuild a model from its checkpoint with `build(**meta["model_config"])`: (model in eval mode, meta)."""
    ckpt = load_checkpoint(directory)
    try:
        model = build(**ckpt.meta["model_config"])
    except TypeError as e:  # a config of another kind of model: keys the builder does not take
        raise CheckpointError(
            f"checkpoint {directory} (kind={ckpt.meta.get('kind')!r}) holds no model this loader builds: {one_line(e)}"
        ) from None
    try:
        model.load_state_dict(ckpt.state_dict, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint {directory} does not fit its model config: {one_line(e)}") from None
    return model.to(device).eval(), ckpt.meta


def is_hf_directory(directory: Path) -> bool:
    """A save_pretrained directory: a config.json transformers builds a model from (hf_config_lacks), no meta.json."""
    config = directory / "config.json"
    return config.is_file() and not (directory / META_FILE).exists() and hf_config_lacks(directory) is None


def hf_config_lacks(directory: Path) -> str | None:
    """What the directory's config.json lacks to be a Hugging Face model's, in words (None: nothing): a JSON object
    naming its model_type, which transformers builds the model from."""
    file = directory / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"its {file.name} is not readable JSON ({one_line(e)})"
    if not isinstance(config, dict):
        return f"its {file.name} holds a JSON {type(config).__name__}, not an object"
    if not isinstance(config.get("model_type"), str) or not config["model_type"].strip():
        return f"its {file.name} names no 'model_type' (keys: {sorted(config)[:5] or 'none'})"
    return None


def tokenizer_mismatch(what: str, theirs: Tokenizer, ours: Tokenizer, fix: str, *, reference: str = "the base") -> str:
    """One line for a tokenizer that is not `reference`'s, naming both vocabulary sizes (or, where they are
    equal, saying the tokens differ)."""
    a, b = theirs.get_vocab_size(), ours.get_vocab_size()
    sizes = f"{a} tokens against {b}" if a != b else f"both {a} tokens, not the same ones"
    return f"{what} uses another tokenizer than {reference} ({sizes}): {fix}"


def hf_eos_id(directory: Path, tokenizer_eos: int) -> Any:
    """The EOS a Hugging Face model generates until, as transformers' generate takes it: eos_token_id of
    generation_config.json, else of config.json (an int, or a list: Llama 3 ends at any of several), else the
    tokenizer's end-of-text token. Returned unchecked (int or list); _check_vocabulary checks it."""
    for name in ("generation_config.json", "config.json"):
        file = directory / name
        if file.is_file():
            data = json.loads(file.read_text())  # malformed: a ValueError, the caller's one-line error
            found = data.get("eos_token_id") if isinstance(data, dict) else None
            if found is not None:
                return found
    return tokenizer_eos


def _load_hf(directory: Path, device: str | torch.device) -> tuple[torch.nn.Module, Tokenizer, dict[str, Any]]:
    """A model saved by transformers' save_pretrained, with its own tokenizer. Its meta names no corpus:
    entry points take the run's data config, with this tokenizer (experiments.lib.data.pipeline.base_data_config)."""
    from verify.backends.hf import load_hf_base  # transformers is optional

    try:
        tokenizer, tokenizer_eos = load_tokenizer(str(directory))
        eos_id = hf_eos_id(directory, tokenizer_eos)
        base = load_hf_base(directory, device=device)
    except (ValueError, OSError) as e:
        raise CheckpointError(f"Hugging Face model {directory}: {one_line(e)}") from None
    _check_vocabulary(f"Hugging Face model {directory}", tokenizer, base.num_tokens, eos_id)
    meta = {
        "fingerprint": fingerprint(base.state_dict()),
        "model_config": {"arch": "hf", "path": str(directory.resolve())},
        "tokenizer": tokenizer.to_str(),
        "data": {"config": None, "eos_id": eos_id, "tokenizer_path": str(directory.resolve())},
    }
    return base, tokenizer, meta
