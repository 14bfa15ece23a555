"""The data pipeline's entry point: corpus -> file-level split -> byte-level BPE -> token ids, cached on disk.

`prepare_data` returns a `PreparedData` with the tokenizer and the train/validation token streams
(documents joined with EOS). It ties the three parts together: the corpus and its split (sources.py, with
packages.py for the installed packages), the tokenizer (tokenizer.py) and the cache entry that holds the
ids (id_cache.py), built on the first call and memory-mapped on every call. Also here: which data settings
a base's recorded config means for a later run (`base_data_config`, `base_data_fix`), and what training
reads from a stream: random windows (`sample_batch`) and token frequencies (`token_counts`). Validation
blocks are experiments/lib/training/loop.py's `validation_blocks`; prompts live in prompts.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch

from experiments.lib.data.id_cache import PreparedData, build_entry, key_head, load_entry
from experiments.lib.data.sources import SOURCES, UNDECODABLE, Undecodable, open_corpus, scan_corpus
from experiments.lib.data.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

COUNT_CHUNK = 1 << 24  # ids per bincount in token_counts: 128 MiB as int64


def _check_args(
    source: str,
    paths: list[str] | None,
    hub_name: str | None,
    val_fraction: float,
    vocab_size: int,
    max_files: int | None,
    streaming: bool,
    tokenizer_max_bytes: int | None,
    undecodable: str,
    include: list[str] | None,
    max_bytes: int | None,
) -> None:
    if source not in SOURCES:
        raise ValueError(f"source={source!r} is unknown; use one of {', '.join(SOURCES)}")
    if source != "packages" and (include is not None or max_bytes is not None):
        raise ValueError(
            f"include={include!r} and max_bytes={max_bytes!r} are for source='packages'; "
            f"source={source!r} takes neither (leave both null)"
        )
    if source == "packages" and paths is not None and len(paths) != 1:
        raise ValueError(f"source='packages' takes paths=null (site-packages) or one directory, got paths={paths!r}")
    if include is not None and (
        isinstance(include, str) or not include or not all(isinstance(p, str) and p for p in include)
    ):
        raise ValueError(f"include={include!r} must be a non-empty list of file-name patterns such as ['*.py']")
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
        raise ValueError(f"max_bytes={max_bytes!r} must be a positive integer (bytes) or None (the whole corpus)")
    if source == "files" and not paths:
        raise ValueError(f"source='files' needs paths (files, directories or globs), got paths={paths!r}")
    if source == "hub" and not hub_name:
        raise ValueError(f"source='hub' needs hub_name (a datasets hub name), got hub_name={hub_name!r}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction!r} must lie strictly between 0 and 1")
    if vocab_size < 257:
        raise ValueError(f"vocab_size={vocab_size!r} must be at least 257 (256 bytes + EOS)")
    if max_files is not None and max_files < 1:
        raise ValueError(f"max_files={max_files!r} must be a positive integer or None")
    if not isinstance(streaming, bool):
        raise ValueError(f"streaming={streaming!r} must be true or false")
    if streaming and source != "hub":
        raise ValueError(f"streaming=true is for source='hub'; source={source!r} is always read one file at a time")
    if tokenizer_max_bytes is not None and (
        isinstance(tokenizer_max_bytes, bool) or not isinstance(tokenizer_max_bytes, int) or tokenizer_max_bytes < 1
    ):
        raise ValueError(
            f"tokenizer_max_bytes={tokenizer_max_bytes!r} must be a positive integer or None (all the training text)"
        )
    if undecodable not in UNDECODABLE:
        raise ValueError(
            f"undecodable={undecodable!r} is unknown; use skip (leave out files that are not UTF-8) "
            "or replace (decode them with U+FFFD)"
        )


def prepare_data(
    *,
    source: str = "stdlib",
    paths: list[str] | None = None,
    hub_name: str | None = None,
    hub_split: str = "train",
    text_field: str = "text",
    val_fraction: float = 0.05,
    vocab_size: int = 8192,
    max_files: int | None = None,
    cache_dir: str = ".cache/data",
    tokenizer: str | None = None,
    streaming: bool = False,
    tokenizer_max_bytes: int | None = None,
    undecodable: str = "skip",
    include: list[str] | None = None,
    max_bytes: int | None = None,
) -> PreparedData:
    """Load the corpus, split it by file, train the tokenizer on train (or take `tokenizer`, a model's own:
    a tokenizer.json or the model directory holding it; vocab_size is then the tokenizer's), tokenize both
    sides; cached.

    streaming (hub only): read the dataset with datasets' streaming mode, no local copy. Its entry is
    then keyed by the dataset's name, split and field, not by its text (hashing the text would mean
    reading the whole dataset on every run just to find the entry): delete the entry if the dataset
    changes. tokenizer_max_bytes: train the BPE on at most this much training text, documents taken
    evenly over the split; None, all of it. undecodable: a stdlib or files corpus file that is not UTF-8
    is left out ('skip') or decoded with U+FFFD ('replace'); either way it is counted and logged, and a
    corpus where most bytes are in such files is refused. include and max_bytes (packages only):
    file-name patterns (default ['*.py']) and a cap on the corpus's bytes (experiments/lib/data/packages.py)."""
    _check_args(
        source,
        paths,
        hub_name,
        val_fraction,
        vocab_size,
        max_files,
        streaming,
        tokenizer_max_bytes,
        undecodable,
        include,
        max_bytes,
    )
    own = None if tokenizer is None else load_tokenizer(tokenizer)[0]  # a bad path fails before the corpus is read
    corpus = open_corpus(
        source, paths, hub_name, hub_split, text_field, max_files, streaming, undecodable, include, max_bytes
    )
    described = f"hub:{hub_name}:{hub_split}:{text_field}" if source == "hub" else source
    if streaming:
        described = "streaming-" + described
    if own is not None:  # the tokenizer's content, not its path, decides the entry
        described += ":tokenizer:" + hashlib.sha256(own.to_str().encode()).hexdigest()
    head = key_head(described, val_fraction, vocab_size, max_files, tokenizer_max_bytes, corpus.by_package)
    if streaming:
        scan, key = None, hashlib.sha256(json.dumps(head, sort_keys=True).encode()).hexdigest()[:16]
    else:
        scan = scan_corpus(corpus, head)
        key = scan.key
    entry = Path(cache_dir) / key
    if not (entry / "meta.json").exists():
        scan = scan or scan_corpus(corpus, None)
        build_entry(entry, corpus, scan, val_fraction, vocab_size, key, tokenizer, tokenizer_max_bytes, undecodable)
    seen = scan.undecodable if scan is not None else Undecodable()  # a streamed hub scan: rows are text already
    if seen.files:
        log.warning(
            "%d of %d corpus files (%d of %d bytes) are not UTF-8 and were %s (data.undecodable=%s), e.g. %s",
            seen.files,
            len(corpus.files),
            seen.bytes,
            seen.total_bytes,
            "left out" if undecodable == "skip" else "decoded with U+FFFD",
            undecodable,
            ", ".join(seen.examples),
        )
    return load_entry(entry, seen.record(undecodable))


def base_data_config(base_meta: dict, fallback: dict) -> dict:
    """prepare_data's arguments for a base: those it was trained with (its meta), else `fallback` (the
    run's data config), with the base's own tokenizer when it brings one (a Hugging Face directory)."""
    data = base_meta.get("data") or {}
    config = dict(data.get("config") or fallback)
    if data.get("config") and "undecodable" not in config:
        config["undecodable"] = "replace"  # recorded before the setting existed: files were decoded with U+FFFD
    if data.get("tokenizer_path"):
        config["tokenizer"] = data["tokenizer_path"]
    return config


def base_data_fix(base_meta: dict, run_data: dict) -> str:
    """What to pass when the run's data config does not give the base's tokenizer: the base's corpus as its
    config group (data=stdlib|packages|files|hub) when the sources differ, else the recorded settings that
    differ from the run's; the generic advice when the base records no data config."""
    recorded = (base_meta.get("data") or {}).get("config") or {}
    source = recorded.get("source")
    if source and source != run_data.get("source"):
        return f"the base was trained on data={source}: pass data={source}"
    differ = [f"data.{k}={v!r}" for k, v in recorded.items() if k in run_data and run_data[k] != v]
    return "use the base's data config" + (f" ({', '.join(differ)})" if differ else "")


# ---------------------------------------------------------------- batches


def _check_batch(batch_size: int, seq_len: int) -> None:
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size={batch_size} and seq_len={seq_len} must both be at least 1")


def sample_batch(
    ids: torch.Tensor,
    *,
    batch_size: int,
    seq_len: int,
    generator: torch.Generator | None = None,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """(batch_size, seq_len + 1) int64 random windows: inputs = x[:, :-1], targets = x[:, 1:]."""
    _check_batch(batch_size, seq_len)
    n = ids.numel()
    if n < seq_len + 1:
        raise ValueError(f"seq_len={seq_len} needs at least {seq_len + 1} tokens, the stream has {n}")
    starts = torch.randint(0, n - seq_len, (batch_size,), generator=generator)  # (B,)
    index = starts[:, None] + torch.arange(seq_len + 1)  # (B, T+1)
    return ids[index].long().to(device)


def token_counts(data: PreparedData, vocab_size: int) -> torch.Tensor:
    """(V,) int64: how often each token occurs in the training split (what a trimmed drafter vocabulary
    keeps the most frequent of). Training split only, like the tokenizer: validation stays unseen.

    Counted COUNT_CHUNK ids at a time: the stream may be a memory map larger than memory."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size!r}: must be an integer >= 1")
    ids = data.train_ids
    counts = torch.zeros(vocab_size, dtype=torch.int64)  # grows if an id >= vocab_size turns up
    for start in range(0, ids.numel(), COUNT_CHUNK):
        found = torch.bincount(ids[start : start + COUNT_CHUNK].long())  # (max id in chunk + 1,)
        if found.numel() > counts.numel():
            counts = torch.cat((counts, counts.new_zeros(found.numel() - counts.numel())))
        counts[: found.numel()] += found
    if counts.numel() > vocab_size:
        largest = int(counts.nonzero().max())
        raise ValueError(
            f"vocab_size={vocab_size}: must exceed the largest training id {largest} (use the tokenizer's size)"
        )
    return counts
