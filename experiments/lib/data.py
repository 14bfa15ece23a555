"""The data pipeline: corpus -> file-level split -> byte-level BPE -> token ids, cached on disk.

One entry point, `prepare_data`, returns a `PreparedData` with the tokenizer and the train/validation
token streams (documents joined with EOS). Batching for training (`sample_batch`, random windows) lives
here too; validation blocks are experiments/lib/training.py's `validation_blocks`; prompts live in prompts.py.

The default corpus is the Python standard library's own source: real code nobody
here wrote, on every machine, no download. `packages` is the Python source of the installed packages
(about 25x larger, split by package: experiments/lib/packages.py). Other corpora are local text files
or a hub dataset.

A corpus may be larger than memory. It is never held whole: a `Corpus` yields one document at a time
and every step is a pass over it (the cache key, the split, the tokenizer's training, the tokenization,
which appends each chunk of ids to its file on disk). The cached ids are memory-mapped when loaded, so
training reads only the pages its windows touch.

Cache layout: cache_dir/<cache_key>/{tokenizer.json, train.npy, val.npy, meta.json}. train.npy and
val.npy hold uint16 ids when the vocabulary has at most 65535 tokens, else int32. An entry is built in
a temporary sibling directory and renamed into place, so an entry that exists is always complete.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import math
import os
import shutil
import sysconfig
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import datasets
import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from experiments.lib.packages import INCLUDE, PACKAGE_SPLIT_RULE, package_files, site_packages, split_by_package

log = logging.getLogger(__name__)

# Bump whenever what goes into a cache entry changes. Still 1: the streamed build writes byte for byte
# the files the in-memory build wrote, and the loader maps those same .npy files.
FORMAT_VERSION = 1
EOS = "<|endoftext|>"
SOURCES = ("stdlib", "packages", "files", "hub")
# What to do with a corpus file that is not valid UTF-8: leave it out, or decode it with U+FFFD for every
# bad byte sequence (a model trained on that learns replacement characters).
UNDECODABLE = ("skip", "replace")
# A corpus where more than this share of the bytes is in files that are not UTF-8 is refused: it is most
# likely binary or in another encoding, and either way not the text the run means to train on.
MAX_UNDECODABLE_SHARE = 0.5
UNDECODABLE_EXAMPLES = 3  # paths named in the log line and meta.json
SPLIT_RULE = "val iff int(sha1(doc_id).hexdigest(), 16) % 10000 < val_fraction * 10000"
# Directories left out of the stdlib corpus. site-packages/dist-packages hold third-party code, not the
# stdlib. test/tests hold deliberately broken files (bad or mixed encodings, invalid syntax, BOM tricks)
# written to exercise the parser; they would teach the model garbage. idlelib is IDLE's GUI application
# with its own idle_test suite, not library code.
STDLIB_EXCLUDE = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib"})
# One tokenization chunk: at most ENCODE_CHUNK documents and about ENCODE_BYTES of text (a chunk closes
# once it reaches it). The chunk's text and ids are all the build holds, whatever the corpus's size.
ENCODE_CHUNK = 256
ENCODE_BYTES = 8 << 20
HUB_BATCH = 64  # rows per read of a hub dataset (a row may be a whole book)
COUNT_CHUNK = 1 << 24  # ids per bincount in token_counts: 128 MiB as int64


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


# ---------------------------------------------------------------- corpus


def stdlib_files() -> list[Path]:
    """The stdlib's .py files (minus STDLIB_EXCLUDE), sorted by relative path so every machine agrees."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_EXCLUDE]  # prune in place: never descend
        found += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _is_text_file(path: Path) -> bool:
    # A NUL byte in the first 8 KiB is the usual sign of a binary file (git uses the same test).
    with open(path, "rb") as f:
        return b"\0" not in f.read(8192)


def _walk_text_files(root: Path) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # skip .git, .venv, ...
        found += [Path(dirpath) / f for f in filenames if not f.startswith(".")]
    return [p for p in found if _is_text_file(p)]


def _expand_paths(paths: list[str]) -> list[Path]:
    """Files named directly, text files under directories, and glob matches (text files only)."""
    found: list[Path] = []
    for p in paths:
        if glob.has_magic(p):
            found += [Path(m) for m in glob.glob(p, recursive=True) if Path(m).is_file() and _is_text_file(Path(m))]
        elif Path(p).is_dir():
            found += _walk_text_files(Path(p))
        elif Path(p).is_file():
            found.append(Path(p))
        else:
            raise FileNotFoundError(f"paths entry {p!r} is not a file, a directory or a glob pattern")
    return sorted({f.resolve() for f in found})


@dataclass
class Undecodable:
    """The corpus files that are not valid UTF-8, counted over one pass (a file counts whole: its bytes
    are all in `bytes`), and every file's bytes in `total_bytes`."""

    files: int = 0
    bytes: int = 0
    total_bytes: int = 0
    examples: list[str] = field(default_factory=list)  # the first few doc ids

    def add(self, doc_id: str, size: int, valid: bool) -> None:
        self.total_bytes += size
        if not valid:
            self.files += 1
            self.bytes += size
            if len(self.examples) < UNDECODABLE_EXAMPLES:
                self.examples.append(doc_id)

    def share(self) -> float:
        return self.bytes / self.total_bytes if self.total_bytes else 0.0

    def record(self, undecodable: str) -> dict:
        """What meta.json and PreparedData keep: the counts, and whether those files were left out."""
        return {
            "files": self.files,
            "bytes": self.bytes,
            "examples": self.examples,
            "left_out": undecodable == "skip" and self.files > 0,
        }


def _read_text(path: Path, undecodable: str) -> tuple[str | None, int, bool]:
    """(text, size in bytes, valid UTF-8); text is None for a file that is not UTF-8 under 'skip'."""
    # Bytes then decode: read_text would also translate \r\n, and we want the file as it is.
    data = path.read_bytes()
    try:
        return data.decode("utf-8"), len(data), True
    except UnicodeDecodeError:
        return (None if undecodable == "skip" else data.decode("utf-8", errors="replace")), len(data), False


def _named_files(files: list[Path], root: Path, max_files: int | None) -> list[tuple[str, str]]:
    """(doc id, path): ids are paths relative to root (posix), sorted, so the order is machine-independent.
    Paths as str: a corpus of a million files keeps this list for the whole build (a Path is ~3x larger)."""
    return sorted((f.relative_to(root).as_posix(), str(f)) for f in files)[:max_files]


@dataclass(frozen=True)
class Corpus:
    """The corpus's documents, read again on every pass and one at a time: never all in memory.

    stdlib and files: `files` lists (doc id, path). hub: rows of a datasets dataset, memory-mapped from
    the local Hugging Face cache, or with `streaming` read over the network without a local copy."""

    source: str
    files: tuple[tuple[str, str], ...] = ()
    hub_name: str = ""
    hub_split: str = "train"
    text_field: str = "text"
    max_files: int | None = None
    streaming: bool = False
    undecodable: str = "skip"  # files that are not UTF-8 (hub rows are text already): one of UNDECODABLE
    root: str = ""  # stdlib and files: the directory the doc ids are relative to (for messages)
    by_package: bool = False  # packages: validation is whole top-level packages, not files chosen by hash

    def documents(self, seen: Undecodable | None = None) -> Iterator[tuple[str, str]]:
        """(doc id, text) of every non-empty document, in the corpus's fixed order; `seen` counts the
        files that are not UTF-8 (left out under undecodable='skip')."""
        rows = self._hub_rows() if self.source == "hub" else self._file_rows(seen)
        for doc_id, text in rows:
            if text:  # an empty document would only add a lone EOS (a few stdlib __init__.py files are empty)
                yield doc_id, text

    def _file_rows(self, seen: Undecodable | None) -> Iterator[tuple[str, str]]:
        for name, path in self.files:
            text, size, valid = _read_text(Path(path), self.undecodable)
            if seen is not None:
                seen.add(name, size, valid)
            if text is not None:
                yield name, text

    def _hub_rows(self) -> Iterator[tuple[str, str]]:
        # needs network, or the user's local Hugging Face cache, or a local dataset directory
        ds = datasets.load_dataset(self.hub_name, split=self.hub_split, streaming=self.streaming)
        columns = ds.column_names  # None for a streamed dataset that does not declare its features
        if columns is not None and self.text_field not in columns:
            raise ValueError(f"text_field={self.text_field!r} is not a column of {self.hub_name!r}; columns: {columns}")
        if self.max_files is not None:
            ds = ds.take(self.max_files) if self.streaming else ds.select(range(min(self.max_files, len(ds))))
        if columns is not None:  # read only the text column
            ds = ds.select_columns([self.text_field])
        # Hub rows have no paths: synthetic ids keep the dataset's own order and feed the same split rule.
        i = 0
        for batch in ds.iter(batch_size=HUB_BATCH):
            if self.text_field not in batch:
                raise ValueError(
                    f"text_field={self.text_field!r} is not a column of {self.hub_name!r}; columns: {sorted(batch)}"
                )
            for text in batch[self.text_field]:
                if text is not None and not isinstance(text, str):
                    raise ValueError(
                        f"{self.hub_name!r} row {i}: text_field={self.text_field!r} "
                        f"holds {type(text).__name__}, not text"
                    )
                yield f"hub:{i}", text or ""
                i += 1


def open_corpus(
    source: str,
    paths: list[str] | None,
    hub_name: str | None,
    hub_split: str,
    text_field: str,
    max_files: int | None,
    streaming: bool = False,
    undecodable: str = "skip",
    include: list[str] | None = None,
    max_bytes: int | None = None,
) -> Corpus:
    """The corpus, its file list resolved now (a bad path fails here, before anything is read)."""
    if source == "packages":
        root = Path(paths[0]) if paths else site_packages()
        files = package_files(root, include=tuple(include or INCLUDE), max_bytes=max_bytes)[:max_files]
        return Corpus(
            source, files=tuple(files), max_files=max_files, undecodable=undecodable, root=str(root), by_package=True
        )
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = tuple(_named_files(stdlib_files(), root, max_files))
        return Corpus(source, files=files, max_files=max_files, undecodable=undecodable, root=str(root))
    if source == "files":
        files = _expand_paths(paths or [])
        if not files:
            raise ValueError(f"paths={paths!r} match no files")
        # Ids relative to the deepest common directory: the split then depends on the corpus's own
        # tree, not on where it sits on disk.
        root = Path(os.path.commonpath([f.parent for f in files]))
        named = tuple(_named_files(files, root, max_files))
        return Corpus(source, files=named, max_files=max_files, undecodable=undecodable, root=str(root))
    return Corpus(
        source,
        hub_name=hub_name or "",
        hub_split=hub_split,
        text_field=text_field,
        max_files=max_files,
        streaming=streaming,
    )


@dataclass
class CorpusScan:
    """One pass over a corpus: what the split, the tokenizer's sample and the byte counts need."""

    doc_ids: list[str]  # every non-empty document, in the corpus's order
    sizes: list[int]  # their UTF-8 bytes
    key: str | None  # the cache key, when the pass hashed the text
    undecodable: Undecodable  # the files that are not UTF-8


def scan_corpus(corpus: Corpus, head: dict | None) -> CorpusScan:
    """Ids and sizes of the documents; with `head` (what else the entry depends on), also the cache key:
    sha256 over head then, per document, its id, UTF-8 size and text (a same-size edit must not hit a
    stale entry), 16 hex digits.

    The key needs no `undecodable` in head: a file that is not UTF-8 is either absent ('skip') or hashed
    with its U+FFFD ('replace'), so the two settings give two keys exactly when they tokenize different
    text, and an all-UTF-8 corpus (the stdlib's) keeps the key it had before the setting existed.

    Refuses a corpus where most bytes are in files that are not UTF-8, before anything is written."""
    h = None if head is None else hashlib.sha256(json.dumps(head, sort_keys=True).encode())
    doc_ids, sizes = [], []
    seen = Undecodable()
    for doc_id, text in corpus.documents(seen):
        data = text.encode("utf-8")
        if h is not None:
            h.update(f"\0{doc_id}\0{len(data)}\0".encode())
            h.update(data)
        doc_ids.append(doc_id)
        sizes.append(len(data))
    if seen.share() > MAX_UNDECODABLE_SHARE:
        raise ValueError(
            f"the source={corpus.source!r} corpus in {corpus.root}: {seen.share():.0%} of its bytes "
            f"({seen.bytes} of {seen.total_bytes}; {seen.files} of {len(corpus.files)} files, e.g. "
            f"{', '.join(seen.examples)}) are not UTF-8 text, at most {MAX_UNDECODABLE_SHARE:.0%} may be "
            "(binary files, or text in another encoding?)"
        )
    if not doc_ids:
        raise ValueError(f"source={corpus.source!r} gave an empty corpus: every document is empty")
    return CorpusScan(doc_ids, sizes, None if h is None else h.hexdigest()[:16], seen)


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


# ---------------------------------------------------------------- split


def is_validation(doc_id: str, val_fraction: float) -> bool:
    """SPLIT_RULE: a stable hash of the id, so adding or removing other files never moves this one."""
    return int(hashlib.sha1(doc_id.encode("utf-8")).hexdigest(), 16) % 10_000 < val_fraction * 10_000


def split_documents(doc_ids: list[str], val_fraction: float) -> tuple[list[int], list[int]]:
    """(train indices, validation indices) into doc_ids, given in the corpus's fixed order."""
    if len(doc_ids) < 2:
        n = len(doc_ids)
        raise ValueError(f"the corpus has {n} non-empty document(s); a train/validation split needs at least 2")
    val = [i for i, d in enumerate(doc_ids) if is_validation(d, val_fraction)]
    train = [i for i, d in enumerate(doc_ids) if not is_validation(d, val_fraction)]
    # Tiny corpora: the hash may put everything on one side; the last document moves to the empty side.
    if not val:
        val = [train.pop()]
    elif not train:
        train = [val.pop()]
    return train, val


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE: every byte is in the alphabet, so any text encodes and decodes back exactly.

    `texts` may be a generator: the trainer pulls documents from it a few at a time and keeps only its
    word counts, not the text."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],  # first special token, so EOS gets id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return _configure(tokenizer)


def load_tokenizer(path: str) -> tuple[Tokenizer, int]:
    """A model's own tokenizer: a tokenizer.json file, or a Hugging Face model directory holding one ->
    (tokenizer, EOS id). EOS is tokenizer_config.json's `eos_token` beside it when there is one, else
    a token named <|endoftext|>, </s> or <eos>: documents are joined with it, as the model was trained."""
    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise ValueError(
            f"tokenizer={path!r}: no such tokenizer.json (give the file or the model directory holding it)"
        )
    tokenizer = _configure(Tokenizer.from_file(str(file)))
    names = [EOS, "</s>", "<eos>"]
    config = file.parent / "tokenizer_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token")
        names = [eos.get("content") if isinstance(eos, dict) else eos] if eos else names
    for name in names:
        if tokenizer.token_to_id(name) is not None:
            return tokenizer, tokenizer.token_to_id(name)
    raise ValueError(f"tokenizer={path!r} has none of the end-of-text tokens {names}: documents need one between them")


def _configure(tokenizer: Tokenizer) -> Tokenizer:
    # A literal "<|endoftext|>" inside a document is text, not a document boundary. This flag is not
    # saved in tokenizer.json, so it is set again on every load.
    tokenizer.encode_special_tokens = True
    return tokenizer


def tokenize_documents(tokenizer: Tokenizer, texts: list[str], eos_id: int) -> np.ndarray:
    """(N,) int64: each document's tokens followed by EOS. encode_batch_fast is encode_batch minus offsets."""
    pieces = []
    for i in range(0, len(texts), ENCODE_CHUNK):
        for enc in tokenizer.encode_batch_fast(texts[i : i + ENCODE_CHUNK], add_special_tokens=False):
            pieces += [np.asarray(enc.ids, dtype=np.int64), np.array([eos_id], dtype=np.int64)]
    return np.concatenate(pieces)


# ---------------------------------------------------------------- cache


def tokenizer_sample(train_positions: list[int], sizes: list[int], max_bytes: int | None) -> list[int]:
    """Which training documents (positions in the corpus) the tokenizer learns from: all of them, or
    with max_bytes every k-th one (k spreads the sample over the whole split), at most max_bytes of text
    and at least one document."""
    if max_bytes is None:
        return list(train_positions)
    total = sum(sizes[j] for j in train_positions)
    picked, taken = [], 0
    for j in train_positions[:: max(1, math.ceil(total / max_bytes))]:
        if picked and taken + sizes[j] > max_bytes:
            break
        picked.append(j)
        taken += sizes[j]
    return picked


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


def _build_entry(
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
        os.rename(tmp, entry)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (entry / "meta.json").exists():  # not just another process finishing first
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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


def _load_entry(entry: Path, undecodable: dict) -> PreparedData:
    """The entry's data; `undecodable` stands in for meta.json's counts in an entry built before they were
    recorded."""
    try:
        meta = json.loads((entry / "meta.json").read_text())
        counts = meta["train_tokens"], meta["val_tokens"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _damaged(entry, f"meta.json unreadable: {type(e).__name__}") from None
    try:
        tokenizer = _configure(Tokenizer.from_file(str(entry / "tokenizer.json")))
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


# ---------------------------------------------------------------- entry point


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
    file-name patterns (default ['*.py']) and a cap on the corpus's bytes (experiments/lib/packages.py)."""
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
        _build_entry(entry, corpus, scan, val_fraction, vocab_size, key, tokenizer, tokenizer_max_bytes, undecodable)
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
    return _load_entry(entry, seen.record(undecodable))


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
