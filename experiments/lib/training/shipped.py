"""Answers shipped with the repository: an answer directory's whole shards, gzipped under results/answers/<name>/,
copied into a new machine's answer cache instead of being generated again.

Answering is the slow part of the data engine on a CPU: SmolLM2-135M answers 130-190 tokens/s at batch 64 on 2
cores, so the 2.7M tokens answered for 2M training answer tokens (a quarter falls outside the windows) take 4-6
hours, more than one session on a machine that may keep nothing of the last one. The answers themselves are small
(a shard of 32 questions, ~12,000 answer tokens, is ~17 kB gzipped), so answers generated once are committed and
every later run starts from them. An answer directory is named by a hash of the setting that decides its answers
(experiments/lib/training/answers.py: the base, the length, the dtype, the seed; a directory of format 1 also by its
question list), so a run copies in every shipped directory of its setting and finds its questions' answers there
(answer_store.py). They are the base's own answers to those questions with those seeds; another CPU's kernels may
round differently, so an answer generated here may differ from the shipped one in a sampled token, never in what
it is.

Layout of a shipped directory:
    meta.json                 the answer directory's spec and format, and each shipped shard's name, sha256 (of the
                              unpacked bytes) and record count
    answers-<name>.jsonl.gz   the answer shards, gzipped without a timestamp (the same shard packs to the same bytes)
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
from pathlib import Path

from experiments.lib.common.errors import write_atomic
from experiments.lib.training.answers import AnswerSpec, shard_files

__all__ = ["seed_answers", "seed_directory", "ship_answers"]

log = logging.getLogger(__name__)


def ship_answers(directory: str | Path, out_root: str | Path) -> Path:
    """Pack every shard of the answer directory `directory` (a shard that exists is whole) into out_root/<its
    name>/ (shards already shipped are rewritten only when their bytes differ). Returns the shipped directory."""
    directory = Path(directory)
    meta = _read_meta(directory / "meta.json")
    shards = shard_files(directory)
    if not shards:
        raise ValueError(f"answer directory {directory} holds no whole shard: nothing to ship")
    out = Path(out_root) / directory.name
    out.mkdir(parents=True, exist_ok=True)
    listed = []
    for shard in shards:
        raw = shard.read_bytes()
        packed = out / (shard.name + ".gz")
        data = gzip.compress(raw, compresslevel=9, mtime=0)
        if not packed.exists() or packed.read_bytes() != data:
            write_atomic(packed, data)
        listed.append({"name": packed.name, "sha256": hashlib.sha256(raw).hexdigest(), "records": raw.count(b"\n")})
    shipped = {"spec": meta["spec"], "format": meta["format"], "shipped": listed}
    write_atomic(out / "meta.json", json.dumps(shipped, indent=1))
    return out


def seed_answers(shipped_root: str | Path, answers_root: str | Path, spec: AnswerSpec) -> int:
    """Copy into answers_root every shipped directory of spec's setting (shipped_root/<name>/ -> answers_root/
    <name>/), the shards each lacks; returns how many shards were copied."""
    setting, copied = spec.setting(), 0
    for meta in sorted(Path(shipped_root).glob("*/meta.json")):
        shipped = _read_meta(meta)
        if {k: shipped.get("spec", {}).get(k) for k in setting} == setting:
            copied += seed_directory(meta.parent, Path(answers_root) / meta.parent.name)
    return copied


def seed_directory(source: str | Path, directory: str | Path) -> int:
    """Copy into the answer directory `directory` the shards of the shipped directory `source` it lacks; returns
    how many. A shipped copy of another setting, or a damaged one, is refused in one line before anything is
    written."""
    source, directory = Path(source), Path(directory)
    shipped = _read_meta(source / "meta.json")
    setting = {"spec": shipped["spec"], "format": shipped["format"]}
    found = _read_meta(directory / "meta.json") if (directory / "meta.json").exists() else setting
    if {k: found.get(k) for k in setting} != setting:
        raise ValueError(f"shipped answers {source} were written for another setting than {directory}: delete one")
    missing = [s for s in shipped["shipped"] if not (directory / s["name"].removesuffix(".gz")).exists()]
    unpacked = [(s["name"], _unpack(source, s)) for s in missing]  # every one checked before any is written
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / "meta.json").exists():
        write_atomic(directory / "meta.json", json.dumps(setting | {"shards": len(shipped["shipped"])}, indent=1))
    for name, raw in unpacked:
        write_atomic(directory / name.removesuffix(".gz"), raw)
    if missing:
        log.info("%d answer shards copied from %s (%d now written)", len(missing), source, len(shard_files(directory)))
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
