"""The corpus: which documents there are, read one at a time, and which side of the split each is on.

Four sources (SOURCES). `stdlib`, the default, is the Python standard library's own source: real code
nobody here wrote, on every machine, no download. `packages` is the Python source of the installed
packages (about 25x larger; its listing and its split by package are experiments/lib/data/packages.py).
`files` is local text files, `hub` a Hugging Face dataset. `open_corpus` resolves any of them to a `Corpus`,
its file list fixed there, so a bad path fails before anything is read.

A corpus may be larger than memory. It is never held whole: a `Corpus` yields one document at a time and
every step of the build is a pass over it. `scan_corpus` is the first pass: the documents' ids and sizes,
the cache key's hash over their text, and the count of files that are not UTF-8 (refused when they are most
of the corpus).

Validation is chosen by document, from a hash of its id (SPLIT_RULE), so no file is on both sides and
adding or removing a file never moves another; a packages corpus is split by whole package instead.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import datasets

from experiments.lib.data.packages import INCLUDE, package_files, site_packages

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
HUB_BATCH = 64  # rows per read of a hub dataset (a row may be a whole book)


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
