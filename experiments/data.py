"""The data pipeline: corpus -> file-level split -> byte-level BPE -> token ids, cached on disk.

One entry point, `prepare_data`, returns a `PreparedData` with the tokenizer and the train/validation
token streams (documents joined with EOS). Batching for training (`sample_batch`, random windows) and
for validation (`iter_blocks`, every target once, in order) lives here too; prompts live in prompts.py.

The default corpus is the Python standard library's own source: real code nobody
here wrote, on every machine, no download. Other corpora (local text files, a hub dataset) flow through
the same `datasets.Dataset` with two columns, "path" (a document id) and "text".

Cache layout: cache_dir/<cache_key>/{tokenizer.json, train.npy, val.npy, meta.json}. An entry is built in
a temporary sibling directory and renamed into place, so an entry that exists is always complete.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import sysconfig
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import datasets
import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

FORMAT_VERSION = 1  # bump whenever what goes into a cache entry changes
EOS = "<|endoftext|>"
SOURCES = ("stdlib", "files", "hub")
SPLIT_RULE = "val iff int(sha1(doc_id).hexdigest(), 16) % 10000 < val_fraction * 10000"
# Directories left out of the stdlib corpus. site-packages/dist-packages hold third-party code, not the
# stdlib. test/tests hold deliberately broken files (bad or mixed encodings, invalid syntax, BOM tricks)
# written to exercise the parser; they would teach the model garbage. idlelib is IDLE's GUI application
# with its own idle_test suite, not library code.
STDLIB_EXCLUDE = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib"})
ENCODE_CHUNK = 256  # documents per encode_batch call: bounds the memory held in Encoding objects


@dataclass
class PreparedData:
    """What training, evaluation and generation need: the tokenizer and both token streams."""

    tokenizer: Tokenizer
    train_ids: torch.Tensor  # (N_train,) int64, every document followed by one EOS
    val_ids: torch.Tensor  # (N_val,) int64, same layout
    train_bytes: int  # UTF-8 bytes of the training text (EOS counts 0): for bits per byte
    val_bytes: int
    eos_id: int
    vocab_size: int  # tokenizer.get_vocab_size()
    val_files: list[str]  # ids of the validation documents, in the order they appear in val_ids
    cache_key: str  # names the cache entry cache_dir/<cache_key>/


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


def _read_text(path: Path) -> str:
    # Bytes then decode: read_text would also translate \r\n, and we want the file as it is.
    return path.read_bytes().decode("utf-8", errors="replace")


def _files_dataset(files: list[Path], root: Path, max_files: int | None) -> datasets.Dataset:
    """Documents named by their path relative to root (posix), sorted by it: the order is machine-independent."""
    named = sorted((f.relative_to(root).as_posix(), f) for f in files)[:max_files]
    return datasets.Dataset.from_dict({"path": [n for n, _ in named], "text": [_read_text(f) for _, f in named]})


def _hub_dataset(name: str, split: str, text_field: str, max_files: int | None) -> datasets.Dataset:
    ds = datasets.load_dataset(name, split=split)  # needs network (or the user's local HF cache)
    if text_field not in ds.column_names:
        raise ValueError(f"text_field={text_field!r} is not a column of {name!r}; columns: {ds.column_names}")
    if max_files is not None:
        ds = ds.select(range(min(max_files, len(ds))))
    # Hub rows have no paths: synthetic ids keep the dataset's own order and feed the same split rule.
    return datasets.Dataset.from_dict({"path": [f"hub:{i}" for i in range(len(ds))], "text": list(ds[text_field])})


def load_documents(
    source: str, paths: list[str] | None, hub_name: str | None, hub_split: str, text_field: str, max_files: int | None
) -> datasets.Dataset:
    """Columns "path" (document id) and "text", in the corpus's fixed order, empty documents dropped."""
    if source == "stdlib":
        ds = _files_dataset(stdlib_files(), Path(sysconfig.get_paths()["stdlib"]), max_files)
    elif source == "files":
        files = _expand_paths(paths or [])
        if not files:
            raise ValueError(f"paths={paths!r} match no files")
        # Ids relative to the deepest common directory: the split then depends on the corpus's own
        # tree, not on where it sits on disk.
        ds = _files_dataset(files, Path(os.path.commonpath([f.parent for f in files])), max_files)
    else:
        ds = _hub_dataset(hub_name or "", hub_split, text_field, max_files)
    # An empty document would only add a lone EOS (a few stdlib __init__.py files are empty).
    ds = ds.select([i for i, text in enumerate(list(ds["text"])) if text])
    if len(ds) == 0:
        raise ValueError(f"source={source!r} gave an empty corpus: every document is empty")
    return ds


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


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE: every byte is in the alphabet, so any text encodes and decodes back exactly."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],  # first special token, so EOS gets id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer, length=len(texts))
    return _configure(tokenizer)


def load_tokenizer(path: str) -> tuple[Tokenizer, int]:
    """A model's own tokenizer: a tokenizer.json file, or a Hugging Face model directory holding one ->
    (tokenizer, EOS id). EOS is tokenizer_config.json's `eos_token` beside it when there is one, else
    a token named <|endoftext|>, </s> or <eos>: documents are joined with it, as the model was trained."""
    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise ValueError(f"tokenizer={path!r}: no such tokenizer.json (give the file or the model directory holding it)")
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


def cache_key(source: str, docs: datasets.Dataset, val_fraction: float, vocab_size: int, max_files: int | None) -> str:
    """sha256 over everything the entry depends on, 16 hex digits.

    Per document: id, UTF-8 size and the text itself (a same-size edit must not hit a stale entry)."""
    h = hashlib.sha256()
    head = {"format": FORMAT_VERSION, "source": source, "rule": SPLIT_RULE, "val_fraction": val_fraction,
            "vocab_size": vocab_size, "max_files": max_files}
    h.update(json.dumps(head, sort_keys=True).encode())
    for doc_id, text in sorted(zip(list(docs["path"]), list(docs["text"]))):
        data = text.encode("utf-8")
        h.update(f"\0{doc_id}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:16]


def _save_ids(path: Path, ids: np.ndarray, vocab_size: int) -> None:
    # uint16 halves the file (and the page cache) whenever every id fits, i.e. vocab <= 65535.
    np.save(path, ids.astype(np.uint16 if vocab_size <= 65535 else np.int32))


def _write_entry(entry: Path, tokenizer: Tokenizer, train: np.ndarray, val: np.ndarray, meta: dict) -> None:
    """Build in a temporary sibling, then rename: readers see a whole entry or none."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.parent / f".tmp-{entry.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        tokenizer.save(str(tmp / "tokenizer.json"))
        _save_ids(tmp / "train.npy", train, meta["vocab_size"])
        _save_ids(tmp / "val.npy", val, meta["vocab_size"])
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        os.rename(tmp, entry)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (entry / "meta.json").exists():  # not just another process finishing first
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _build_entry(entry: Path, docs: datasets.Dataset, val_fraction: float, vocab_size: int, key: str,
                 tokenizer_path: str | None) -> None:
    names, texts = list(docs["path"]), list(docs["text"])
    train_idx, val_idx = split_documents(names, val_fraction)
    train_texts, val_texts = [texts[i] for i in train_idx], [texts[i] for i in val_idx]
    if tokenizer_path is None:
        tokenizer = train_tokenizer(train_texts, vocab_size)  # train split only: no peeking at validation
        eos_id = tokenizer.token_to_id(EOS)
    else:  # a model's own tokenizer
        tokenizer, eos_id = load_tokenizer(tokenizer_path)
    train = tokenize_documents(tokenizer, train_texts, eos_id)
    val = tokenize_documents(tokenizer, val_texts, eos_id)
    meta = {
        "format": FORMAT_VERSION, "cache_key": key, "split_rule": SPLIT_RULE, "val_fraction": val_fraction,
        "requested_vocab_size": vocab_size, "vocab_size": tokenizer.get_vocab_size(), "eos_id": eos_id,
        "train_bytes": sum(len(t.encode("utf-8")) for t in train_texts),
        "val_bytes": sum(len(t.encode("utf-8")) for t in val_texts),
        "train_tokens": len(train), "val_tokens": len(val),
        "train_files": [names[i] for i in train_idx], "val_files": [names[i] for i in val_idx],
    }
    _write_entry(entry, tokenizer, train, val, meta)


def _load_entry(entry: Path) -> PreparedData:
    meta = json.loads((entry / "meta.json").read_text())
    tokenizer = _configure(Tokenizer.from_file(str(entry / "tokenizer.json")))

    def ids(name: str) -> torch.Tensor:
        return torch.from_numpy(np.load(entry / name).astype(np.int64))  # np.load: allow_pickle=False

    return PreparedData(
        tokenizer=tokenizer, train_ids=ids("train.npy"), val_ids=ids("val.npy"),
        train_bytes=meta["train_bytes"], val_bytes=meta["val_bytes"], eos_id=meta["eos_id"],
        vocab_size=meta["vocab_size"], val_files=meta["val_files"], cache_key=meta["cache_key"],
    )


# ---------------------------------------------------------------- entry point


def _check_args(source: str, paths: list[str] | None, hub_name: str | None, val_fraction: float,
                vocab_size: int, max_files: int | None) -> None:
    if source not in SOURCES:
        raise ValueError(f"source={source!r} is unknown; use one of {', '.join(SOURCES)}")
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
) -> PreparedData:
    """Load the corpus, split it by file, train the tokenizer on train (or take `tokenizer`, a model's own:
    a tokenizer.json or the model directory holding it; vocab_size is then the tokenizer's), tokenize both
    sides; cached."""
    _check_args(source, paths, hub_name, val_fraction, vocab_size, max_files)
    own = None if tokenizer is None else load_tokenizer(tokenizer)[0]  # a bad path fails before the corpus is read
    docs = load_documents(source, paths, hub_name, hub_split, text_field, max_files)
    described = f"hub:{hub_name}:{hub_split}:{text_field}" if source == "hub" else source
    if own is not None:  # the tokenizer's content, not its path, decides the entry
        described += ":tokenizer:" + hashlib.sha256(own.to_str().encode()).hexdigest()
    key = cache_key(described, docs, val_fraction, vocab_size, max_files)
    entry = Path(cache_dir) / key
    if not (entry / "meta.json").exists():
        _build_entry(entry, docs, val_fraction, vocab_size, key, tokenizer)
    return _load_entry(entry)


def base_data_config(base_meta: dict, fallback: dict) -> dict:
    """prepare_data's arguments for a base: those it was trained with (its meta), else `fallback` (the
    run's data config), with the base's own tokenizer when it brings one (a Hugging Face directory)."""
    data = base_meta.get("data") or {}
    config = dict(data.get("config") or fallback)
    if data.get("tokenizer_path"):
        config["tokenizer"] = data["tokenizer_path"]
    return config


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


def iter_blocks(ids: torch.Tensor, *, batch_size: int, seq_len: int) -> Iterator[torch.Tensor]:
    """Validation blocks in order: (B, seq_len + 1) int64 windows with stride seq_len.

    Consecutive windows share one boundary token, so every token after the first is a target exactly
    once. The last batch is kept even if it has fewer than batch_size rows; only the tail of fewer than
    seq_len tokens after the last full window is dropped."""
    _check_batch(batch_size, seq_len)
    n_windows = (ids.numel() - 1) // seq_len
    offsets = torch.arange(seq_len + 1)  # (T+1,)
    for first in range(0, n_windows, batch_size):
        rows = torch.arange(first, min(first + batch_size, n_windows))  # (B,)
        yield ids[rows[:, None] * seq_len + offsets].long()  # (B, T+1)


# ---------------------------------------------------------------- token counts


def token_counts(data: PreparedData, vocab_size: int) -> torch.Tensor:
    """(V,) int64: how often each token occurs in the training split (what a trimmed drafter vocabulary
    keeps the most frequent of). Training split only, like the tokenizer: validation stays unseen."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size!r}: must be an integer >= 1")
    ids = data.train_ids.long()
    if ids.numel() and int(ids.max()) >= vocab_size:
        raise ValueError(f"vocab_size={vocab_size}: must exceed the largest training id {int(ids.max())} (use the tokenizer's size)")
    return torch.bincount(ids, minlength=vocab_size)


# Prompts live in their own file; re-exported so `from experiments.data import ...` covers the whole API.
from experiments.prompts import heldout_prompts, load_prompts  # noqa: E402

__all__ = [
    "PreparedData", "prepare_data", "sample_batch", "iter_blocks", "heldout_prompts", "load_prompts",
    "stdlib_files", "token_counts",
]
