"""The on-disk cache of token ids: one entry per corpus, split, tokenizer and settings, built once.

Layout: cache_dir/<cache_key>/{tokenizer.json, train.npy, val.npy, meta.json}. The key hashes `key_head`
(everything but the documents that decides the entry) and every document's id, size and text
(sources.scan_corpus), so any change to what goes in gives another entry. train.npy and val.npy hold
every document's tokens followed by one EOS, as uint16 when the vocabulary has at most 65535 tokens, else
int32. An entry is built in a temporary sibling directory and renamed into place, so an entry that exists
is always complete.

The build never holds the corpus: it trains the tokenizer from a stream of the training documents and
tokenizes chunk by chunk, appending each chunk's ids to its file. The loader checks the files against
their headers and meta.json, then memory-maps them, so training reads only the pages its windows touch.
`PreparedData` is what a loaded entry gives.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from tokenizers import Tokenizer

from experiments.lib.common.errors import fsync_directory, fsync_tree
from experiments.lib.data.packages import PACKAGE_SPLIT_RULE, split_by_package
from experiments.lib.data.sources import SPLIT_RULE, Corpus, CorpusScan, Undecodable, split_documents
from experiments.lib.data.tokenizer import (
    ENCODE_CHUNK,
    EOS,
    configure_tokenizer,
    load_tokenizer,
    tokenize_documents,
    tokenizer_sample,
    train_tokenizer,
)

# Bump whenever what goes into a cache entry changes. Still 1: the streamed build writes byte for byte
# the files the in-memory build wrote, and the loader maps those same .npy files.
FORMAT_VERSION = 1
# One tokenization chunk: at most ENCODE_CHUNK documents and about ENCODE_BYTES of text (a chunk closes
# once it reaches it). The chunk's text and ids are all the build holds, whatever the corpus's size.
ENCODE_BYTES = 8 << 20


@dataclass
class PreparedData:
    """What training, evaluation and generation need: the tokenizer and both token streams.

    The streams are memory-mapped from the cache (read-only in effect: copy-on-write, a write never
    reaches the file). torch implements indexing, slicing, ==, nonzero and .long() for uint16 but not
    reductions (max, bincount, <): gather the windows you need, then .long() them (sample_batch does)."""

    tokenizer: Tokenizer
    train_ids: torch.Tensor  # (N_train,) uint16 (vocab <= 65535) or int32, every document followed by one EOS
    val_ids: torch.Tensor  # (N_val,) same dtype and layout
    train_bytes: int  # UTF-8 bytes of the training text (EOS counts 0): for bits per byte
    val_bytes: int
    eos_id: int
    vocab_size: int  # tokenizer.get_vocab_size()
    val_files: list[str]  # ids of the validation documents, in the order they appear in val_ids
    cache_key: str  # names the cache entry cache_dir/<cache_key>/
    # Corpus files that are not valid UTF-8: {files, bytes, examples, left_out} (see Undecodable.record)
    undecodable: dict = field(default_factory=lambda: Undecodable().record("skip"))


def key_head(
    described: str,
    val_fraction: float,
    vocab_size: int,
    max_files: int | None,
    tokenizer_max_bytes: int | None,
    by_package: bool = False,
) -> dict:
    """Everything but the documents that decides a cache entry. (The include filter and the byte cap need
    no entry of their own: they decide which documents there are, and the key hashes every document.)"""
    head = {
        "format": FORMAT_VERSION,
        "source": described,
        "rule": PACKAGE_SPLIT_RULE if by_package else SPLIT_RULE,
        "val_fraction": val_fraction,
        "vocab_size": vocab_size,
        "max_files": max_files,
    }
    if tokenizer_max_bytes is not None:  # absent when unset, so entries built before the option keep their keys
        head["tokenizer_max_bytes"] = tokenizer_max_bytes
    return head


# ---------------------------------------------------------------- build


def _chunks(documents: Iterator[tuple[int, str]]) -> Iterator[list[tuple[int, str]]]:
    """(position, text) pairs in chunks of at most ENCODE_CHUNK documents and about ENCODE_BYTES of text."""
    chunk, size = [], 0
    for j, text in documents:
        chunk.append((j, text))
        size += len(text)
        if len(chunk) >= ENCODE_CHUNK or size >= ENCODE_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _positions(corpus: Corpus, doc_ids: list[str]) -> Iterator[tuple[int, str]]:
    """(position, text) of every document, checked against the scan: a corpus edited between two passes
    would otherwise silently pair ids with the wrong split."""
    n = 0
    for j, (doc_id, text) in enumerate(corpus.documents()):
        if j >= len(doc_ids) or doc_id != doc_ids[j]:
            was = doc_ids[j] if j < len(doc_ids) else None
            raise ValueError(
                f"the corpus changed while it was read (document {j} is {doc_id!r}, was {was!r}); run again"
            )
        n += 1
        yield j, text
    if n != len(doc_ids):
        raise ValueError(f"the corpus changed while it was read ({n} documents, was {len(doc_ids)}); run again")


def ids_dtype(vocab_size: int) -> np.dtype:
    """uint16 halves the file (and the page cache) whenever every id fits, i.e. vocab <= 65535."""
    return np.dtype("<u2") if vocab_size <= 65535 else np.dtype("<i4")


class _IdsWriter:
    """Appends ids to a .npy file whose length is known only at the end.

    numpy pads a 1-D header with room for any length, so the header written first (length 0) and the
    final one have the same size: close() rewrites it in place, and the file is byte for byte what
    np.save would have written for the whole array."""

    def __init__(self, f: BinaryIO, dtype: np.dtype) -> None:
        self.f, self.dtype, self.count = f, dtype, 0
        self._header()
        self.data_start = f.tell()

    def _header(self) -> None:
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": (self.count,)}
        np.lib.format.write_array_header_1_0(self.f, header)

    def append(self, ids: np.ndarray) -> None:
        self.f.write(ids.astype(self.dtype).tobytes())
        self.count += len(ids)

    def close(self) -> int:
        self.f.seek(0)
        self._header()
        assert self.f.tell() == self.data_start, "the .npy header changed size"
        return self.count


def _write_ids(
    tmp: Path, corpus: Corpus, doc_ids: list[str], val_positions: set[int], tokenizer: Tokenizer, eos_id: int
) -> tuple[int, int]:
    """Tokenize every document chunk by chunk into tmp/train.npy and tmp/val.npy -> (train, val) token counts."""
    dtype = ids_dtype(tokenizer.get_vocab_size())
    with open(tmp / "train.npy", "wb") as train_file, open(tmp / "val.npy", "wb") as val_file:
        train, val = _IdsWriter(train_file, dtype), _IdsWriter(val_file, dtype)
        for chunk in _chunks(_positions(corpus, doc_ids)):
            for writer, held_out in ((train, False), (val, True)):
                texts = [text for j, text in chunk if (j in val_positions) == held_out]
                if texts:
                    writer.append(tokenize_documents(tokenizer, texts, eos_id))
        return train.close(), val.close()


def _temporary_sibling(entry: Path) -> Path:
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.parent / f".tmp-{entry.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def build_entry(
    entry: Path,
    corpus: Corpus,
    scan: CorpusScan,
    val_fraction: float,
    vocab_size: int,
    key: str,
    tokenizer_path: str | None,
    tokenizer_max_bytes: int | None,
    undecodable: str,
) -> None:
    """Split, train the tokenizer, tokenize: three passes over the corpus, written into a temporary
    sibling that is renamed into place last, so readers see a whole entry or none."""
    names = scan.doc_ids
    if corpus.by_package:
        train_idx, val_idx = split_by_package(names, scan.sizes, val_fraction)
    else:
        train_idx, val_idx = split_documents(names, val_fraction)
    tmp = _temporary_sibling(entry)
    try:
        sample = set(tokenizer_sample(train_idx, scan.sizes, tokenizer_max_bytes)) if tokenizer_path is None else set()
        if tokenizer_path is None:  # train split only: no peeking at validation
            tokenizer = train_tokenizer((text for j, text in _positions(corpus, names) if j in sample), vocab_size)
            eos_id = tokenizer.token_to_id(EOS)
        else:  # a model's own tokenizer
            tokenizer, eos_id = load_tokenizer(tokenizer_path)
        tokenizer.save(str(tmp / "tokenizer.json"))
        train_tokens, val_tokens = _write_ids(tmp, corpus, names, set(val_idx), tokenizer, eos_id)
        meta = {
            "format": FORMAT_VERSION,
            "cache_key": key,
            "split_rule": PACKAGE_SPLIT_RULE if corpus.by_package else SPLIT_RULE,
            "val_fraction": val_fraction,
            "requested_vocab_size": vocab_size,
            "vocab_size": tokenizer.get_vocab_size(),
            "eos_id": eos_id,
            "train_bytes": sum(scan.sizes[j] for j in train_idx),
            "val_bytes": sum(scan.sizes[j] for j in val_idx),
            "train_tokens": train_tokens,
            "val_tokens": val_tokens,
            "train_files": [names[j] for j in train_idx],
            "val_files": [names[j] for j in val_idx],
            "undecodable": scan.undecodable.record(undecodable),
        }
        if tokenizer_max_bytes is not None:
            meta["tokenizer_files"] = len(sample)  # training documents the tokenizer learned from
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        fsync_tree(tmp)
        os.rename(tmp, entry)
        fsync_directory(entry.parent)  # the rename itself
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (entry / "meta.json").exists():  # not just another process finishing first
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---------------------------------------------------------------- load


def _damaged(entry: Path, what: str) -> ValueError:
    return ValueError(f"data cache entry {entry} is damaged ({what}): delete {entry} and run again")


def _load_ids(entry: Path, name: str, count: int) -> torch.Tensor:
    """(count,) ids memory-mapped from entry/name, after checking the file holds exactly what its header
    and meta.json say (a truncated file would otherwise fail later, or map garbage)."""
    path = entry / name
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = (
                np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            )
            shape, fortran_order, dtype = read_header(f)
            start = f.tell()
    except (OSError, ValueError) as e:
        raise _damaged(entry, f"{path} is not a readable .npy file: {type(e).__name__}") from None
    if dtype not in (np.dtype("<u2"), np.dtype("<i4")) or fortran_order or shape != (count,):
        raise _damaged(entry, f"{path} holds {dtype} {shape}, meta.json says ({count},) ids")
    size, expected = path.stat().st_size, start + count * dtype.itemsize
    if size != expected:
        raise _damaged(entry, f"{path} has {size} bytes, its header says {expected}")
    # mode "c" (copy-on-write): pages are read when touched, and a stray in-place write stays in this
    # process instead of corrupting the cache (a read-only map would crash it).
    return torch.from_numpy(np.load(path, mmap_mode="c"))


def load_entry(entry: Path, undecodable: dict) -> PreparedData:
    """The entry's data; `undecodable` stands in for meta.json's counts in an entry built before they were
    recorded."""
    try:
        meta = json.loads((entry / "meta.json").read_text())
        counts = meta["train_tokens"], meta["val_tokens"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _damaged(entry, f"meta.json unreadable: {type(e).__name__}") from None
    try:
        tokenizer = configure_tokenizer(Tokenizer.from_file(str(entry / "tokenizer.json")))
    except Exception as e:  # tokenizers raises its own Exception type
        raise _damaged(entry, f"tokenizer.json unreadable: {type(e).__name__}") from None
    return PreparedData(
        tokenizer=tokenizer,
        train_ids=_load_ids(entry, "train.npy", counts[0]),
        val_ids=_load_ids(entry, "val.npy", counts[1]),
        train_bytes=meta["train_bytes"],
        val_bytes=meta["val_bytes"],
        eos_id=meta["eos_id"],
        vocab_size=meta["vocab_size"],
        val_files=meta["val_files"],
        cache_key=meta["cache_key"],
        undecodable=meta.get("undecodable", undecodable),
    )
