"""Answers shipped with the repository: an answer directory's whole shards, gzipped under results/answers/<name>/,
copied into a new machine's answer cache instead of being generated again.

Answering is the slow part of the data engine on a CPU: SmolLM2-135M answers 130-190 tokens/s at batch 64 on 2
cores, so the 2.7M tokens answered for 2M training answer tokens (a quarter falls outside the windows) take 4-6
hours, more than one session on a machine that may keep nothing of the last one. The answers themselves are small
(a shard of 32 questions, ~12,000 answer tokens, is ~17 kB gzipped), so answers generated once are committed and
every later run starts from them. An answer directory is named by a hash of everything that decides its contents
(experiments/lib/training/answers.py: the base, the questions, the length, the dtype, the seed), so a shipped
directory of the same name holds the answers of that very setting. They are the base's own answers to those
questions with those seeds; another CPU's kernels may round differently, so an answer generated here may differ
from the shipped one in a sampled token, never in what it is.

Layout of a shipped directory:
    meta.json                 the answer directory's spec and format, and each shipped shard's name, sha256 (of the
                              unpacked bytes) and record count
    answers-00000.jsonl.gz    the answer shards, gzipped without a timestamp (the same shard packs to the same bytes)
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
from pathlib import Path

from experiments.lib.common.errors import write_atomic
from experiments.lib.training.answers import _shard_path, _write_json, shards_written

__all__ = ["seed_answers", "ship_answers"]

log = logging.getLogger(__name__)


def ship_answers(directory: str | Path, out_root: str | Path) -> Path:
    """Pack every whole shard of the answer directory `directory` into out_root/<its name>/ (shards already
    shipped are rewritten only when their bytes differ). Returns the shipped directory."""
    directory = Path(directory)
    meta = _read_meta(directory / "meta.json")
    shards = shards_written(directory)
    if shards == 0:
        raise ValueError(f"answer directory {directory} holds no whole shard: nothing to ship")
    out = Path(out_root) / directory.name
    out.mkdir(parents=True, exist_ok=True)
    listed = []
    for i in range(shards):
        raw = _shard_path(directory, i).read_bytes()
        packed = out / (_shard_path(directory, i).name + ".gz")
        data = gzip.compress(raw, compresslevel=9, mtime=0)
        if not packed.exists() or packed.read_bytes() != data:
            write_atomic(packed, data)
        listed.append({"name": packed.name, "sha256": hashlib.sha256(raw).hexdigest(), "records": raw.count(b"\n")})
    _write_json(out / "meta.json", {"spec": meta["spec"], "format": meta["format"], "shipped": listed})
    return out


def seed_answers(shipped_root: str | Path, directory: str | Path) -> int:
    """Copy into the answer directory `directory` the shipped shards (shipped_root/<its name>/) it lacks; returns
    how many. Nothing shipped under that name: 0. A shipped copy of another setting, or a damaged one, is refused
    in one line before anything is written."""
    directory, source = Path(directory), Path(shipped_root) / Path(directory).name
    if not (source / "meta.json").exists():
        return 0
    shipped = _read_meta(source / "meta.json")
    setting = {"spec": shipped["spec"], "format": shipped["format"]}
    found = _read_meta(directory / "meta.json") if (directory / "meta.json").exists() else setting
    if {k: found.get(k) for k in setting} != setting:
        raise ValueError(f"shipped answers {source} were written for another setting than {directory}: delete one")
    missing = [i for i, s in enumerate(shipped["shipped"]) if not (directory / s["name"].removesuffix(".gz")).exists()]
    unpacked = {i: _unpack(source, shipped["shipped"][i]) for i in missing}  # every one checked before any is written
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / "meta.json").exists():
        _write_json(directory / "meta.json", setting | {"shards": len(shipped["shipped"])})
    for i, raw in unpacked.items():
        write_atomic(_shard_path(directory, i), raw)
    if missing:
        log.info("%d answer shards copied from %s (%d now written)", len(missing), source, shards_written(directory))
    return len(missing)


def _unpack(source: Path, listed: dict) -> bytes:
    path = source / listed["name"]
    try:
        raw = gzip.decompress(path.read_bytes())
    except (OSError, EOFError) as e:
        raise ValueError(
            f"shipped answer shard {path} is damaged ({e}): restore it (git checkout) or delete it"
        ) from None
    if hashlib.sha256(raw).hexdigest() != listed["sha256"]:
        raise ValueError(f"shipped answer shard {path} does not match its sha256 in meta.json: restore or delete it")
    return raw


def _read_meta(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not an answer directory's meta.json ({e}): delete it") from None
