"""A corpus larger than memory: the build streams it, the cache is memory-mapped, nothing else changes.

Proved on small corpora: the ids live in a file mapping, not in memory; the build's peak Python memory
does not grow with the corpus; every consumer of the streams sees what an in-memory int64 copy gives;
an interrupted build leaves nothing a later call would load; bad input fails in one line."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import tracemalloc
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from experiments.lib.common.errors import one_line
from experiments.lib.data import id_cache, sources
from experiments.lib.data import pipeline as D
from experiments.lib.data.id_cache import PreparedData
from experiments.lib.data.pipeline import prepare_data, sample_batch, token_counts
from experiments.lib.data.prompts import document_regions, heldout_prompts
from experiments.lib.data.tokenizer import tokenizer_sample
from experiments.lib.training.features import corpus_windows
from experiments.lib.training.loop import batch_for_step, validation_blocks

WORDS = ["def", "return", "self", "value", "items", "index", "parse", "line", "token", "count", "None", "True"]
needs_proc_maps = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")


def write_corpus(root: Path, n: int, lines: int = 200, seed: int = 0) -> int:
    """n Python-like files of about 45 bytes per line -> their total size in bytes."""
    rng = random.Random(seed)
    root.mkdir(parents=True)
    for i in range(n):
        body = "".join(
            f"def f{i}_{j}({rng.choice(WORDS)}):\n    return {rng.choice(WORDS)}.{rng.choice(WORDS)}({j})\n"
            for j in range(lines)
        )
        (root / f"m{i:04d}.py").write_text(body)
    return sum(p.stat().st_size for p in root.iterdir())


def prepare_files(corpus: Path, cache: Path, **kwargs) -> PreparedData:
    return prepare_data(source="files", paths=[str(corpus)], vocab_size=300, cache_dir=str(cache), **kwargs)


def in_memory(data: PreparedData) -> PreparedData:
    """The same data with both streams as ordinary int64 tensors (what the loader returned before)."""
    return dataclasses.replace(data, train_ids=data.train_ids.clone().long(), val_ids=data.val_ids.clone().long())


def mapped_file(t: torch.Tensor) -> str | None:
    """The file the memory holding t's first element is mapped from; None for anonymous memory (heap)."""
    address = t.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return fields[5].strip() if len(fields) == 6 else None
    return None


@pytest.fixture(autouse=True)
def hf_cache_in_tmp(tmp_path, monkeypatch):
    """datasets writes its Arrow copies (and lock files, even when streaming) here, not in ~/.cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[PreparedData, Path]:
    root = tmp_path_factory.mktemp("scale")
    write_corpus(root / "corpus", 40, lines=60)
    return prepare_files(root / "corpus", root / "cache"), root


# ---------------------------------------------------------------- (a) mapped, not loaded


@needs_proc_maps
def test_ids_are_mapped_from_the_cache_files(built):
    data, root = built
    entry = root / "cache" / data.cache_key
    assert data.train_ids.dtype == torch.uint16 and data.val_ids.dtype == torch.uint16
    assert mapped_file(data.train_ids) == os.path.realpath(entry / "train.npy")
    assert mapped_file(data.val_ids) == os.path.realpath(entry / "val.npy")
    assert torch.equal(data.train_ids.long(), torch.from_numpy(np.load(entry / "train.npy").astype(np.int64)))


def test_a_write_to_the_stream_never_reaches_the_cache(tmp_path):
    write_corpus(tmp_path / "corpus", 4, lines=20)
    data = prepare_files(tmp_path / "corpus", tmp_path / "cache")
    before = np.load(tmp_path / "cache" / data.cache_key / "train.npy")
    data.train_ids[:5] = 7  # copy-on-write: this process's pages only
    assert np.array_equal(np.load(tmp_path / "cache" / data.cache_key / "train.npy"), before)
    assert torch.equal(prepare_files(tmp_path / "corpus", tmp_path / "cache").train_ids, torch.from_numpy(before))


# ---------------------------------------------------------------- (b) bounded memory


def build_peak(corpus: Path, cache: Path) -> int:
    """Peak Python-heap bytes (tracemalloc: Python objects and numpy buffers) while prepare_data builds."""
    tracemalloc.start()
    try:
        prepare_files(corpus, cache)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_build_memory_does_not_grow_with_the_corpus(tmp_path, monkeypatch):
    monkeypatch.setattr(id_cache, "ENCODE_BYTES", 32 << 10)  # small chunks, so 1x is already many chunks
    size1 = write_corpus(tmp_path / "c1", 24)
    size8 = write_corpus(tmp_path / "c8", 24 * 8, seed=1)
    peak1, peak8 = build_peak(tmp_path / "c1", tmp_path / "k1"), build_peak(tmp_path / "c8", tmp_path / "k8")
    # Holding the text or the ids of the whole corpus would give ~8x (the in-memory build measured
    # 7.8x); what grows is only the list of document names.
    assert peak8 < 2 * peak1, (peak1, peak8)
    assert peak8 < size8 / 3, (peak8, size8)  # never near the corpus's own size
    assert size8 > 7 * size1


@pytest.mark.slow
def test_build_memory_bounded_on_a_64x_corpus(tmp_path, monkeypatch):
    monkeypatch.setattr(id_cache, "ENCODE_BYTES", 64 << 10)
    write_corpus(tmp_path / "c1", 32)
    size = write_corpus(tmp_path / "c64", 32 * 64, seed=1)  # ~19 MB of text
    peak1, peak64 = build_peak(tmp_path / "c1", tmp_path / "k1"), build_peak(tmp_path / "c64", tmp_path / "k64")
    # What does grow is per document, not per byte: its name, size and side of the split (the listing
    # of the files, pathlib objects for a moment, ~1 KiB a file; meta.json's file lists).
    assert peak64 < peak1 + 2048 * 32 * 64 and peak64 < size / 5, (peak1, peak64, size)


# ---------------------------------------------------------------- (c) same windows as in memory


def test_every_consumer_sees_what_an_in_memory_copy_gives(built):
    mapped, _ = built
    copy = in_memory(mapped)
    for seed in range(3):
        g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        x = sample_batch(mapped.train_ids, batch_size=8, seq_len=32, generator=g1)
        assert x.dtype == torch.int64 and torch.equal(
            x, sample_batch(copy.train_ids, batch_size=8, seq_len=32, generator=g2)
        )
    # training (base and drafters), features, prompts, benchmark: what they do with the streams
    assert torch.equal(
        validation_blocks(mapped.val_ids, seq_len=16, eval_blocks=7),
        validation_blocks(copy.val_ids, seq_len=16, eval_blocks=7),
    )
    step = dict(step=3, seed=1, batch_size=4, seq_len=16, device=torch.device("cpu"))
    assert torch.equal(batch_for_step(mapped.train_ids, **step), batch_for_step(copy.train_ids, **step))
    assert torch.equal(
        corpus_windows(mapped.train_ids, seq_len=16, windows=9, seed=0),
        corpus_windows(copy.train_ids, seq_len=16, windows=9, seed=0),
    )
    assert document_regions(mapped.val_ids, mapped.eos_id) == document_regions(copy.val_ids, copy.eos_id)
    assert heldout_prompts(mapped, num_prompts=4, prompt_len=8) == heldout_prompts(copy, num_prompts=4, prompt_len=8)
    assert torch.equal(
        token_counts(mapped, mapped.vocab_size), torch.bincount(copy.train_ids, minlength=mapped.vocab_size)
    )


@pytest.mark.parametrize("vocab", [65535, 70_000])  # uint16 up to its last id; int32 beyond
def test_stored_ids_read_back_exactly(tmp_path, vocab):
    ids = torch.randint(0, vocab, (5000,), generator=torch.Generator().manual_seed(0))
    ids[:3] = torch.tensor([0, vocab - 1, 32768])  # the extremes, and the first id a signed int16 would break
    with open(tmp_path / "train.npy", "wb") as f:
        writer = id_cache._IdsWriter(f, id_cache.ids_dtype(vocab))
        for chunk in ids.split(777):  # appended chunk by chunk, as the build does
            writer.append(chunk.numpy())
        assert writer.close() == 5000
    assert np.array_equal(np.load(tmp_path / "train.npy"), ids.numpy())  # a plain .npy, as np.save writes
    mapped = id_cache._load_ids(tmp_path, "train.npy", 5000)
    assert mapped.dtype == (torch.uint16 if vocab <= 65535 else torch.int32)
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    assert torch.equal(
        sample_batch(mapped, batch_size=16, seq_len=64, generator=g1),
        sample_batch(ids, batch_size=16, seq_len=64, generator=g2),
    )
    assert torch.equal(mapped.long(), ids)


def test_token_counts_in_chunks_equal_one_bincount(built, monkeypatch):
    data, _ = built
    monkeypatch.setattr(D, "COUNT_CHUNK", 1000)  # many chunks and a partial last one
    assert data.train_ids.numel() % 1000 != 0
    expected = torch.bincount(data.train_ids.long(), minlength=data.vocab_size)
    assert torch.equal(token_counts(data, data.vocab_size), expected)
    with pytest.raises(ValueError, match=f"largest training id {int(data.train_ids.long().max())}"):
        token_counts(data, 100)


# ---------------------------------------------------------------- (d) interrupted builds


def test_an_interrupted_build_leaves_nothing_to_load(tmp_path, monkeypatch):
    write_corpus(tmp_path / "corpus", 12, lines=60)
    cache = tmp_path / "cache"
    monkeypatch.setattr(id_cache, "ENCODE_CHUNK", 2)
    calls = []
    real_append = id_cache._IdsWriter.append

    def append_then_crash(self, ids):
        real_append(self, ids)
        calls.append(len(ids))
        if len(calls) == 3:  # some ids already on disk
            raise KeyboardInterrupt

    monkeypatch.setattr(id_cache._IdsWriter, "append", append_then_crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_files(tmp_path / "corpus", cache)
    assert list(cache.iterdir()) == []  # cleaned up: neither an entry nor a temporary directory
    # A killed process cannot clean up: its temporary directory stays, and must never be taken for an entry.
    calls.clear()
    monkeypatch.setattr(id_cache.shutil, "rmtree", lambda *args, **kwargs: None)
    with pytest.raises(KeyboardInterrupt):
        prepare_files(tmp_path / "corpus", cache)
    leftovers = list(cache.iterdir())
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".tmp-")
    monkeypatch.undo()
    data = prepare_files(tmp_path / "corpus", cache)  # rebuilds
    assert sorted(p.name for p in cache.iterdir()) == sorted([data.cache_key, leftovers[0].name])
    clean = prepare_files(tmp_path / "corpus", tmp_path / "clean")
    assert torch.equal(data.train_ids, clean.train_ids) and torch.equal(data.val_ids, clean.val_ids)


def test_a_corpus_edited_between_passes_is_refused(tmp_path):
    write_corpus(tmp_path / "corpus", 4, lines=5)
    (tmp_path / "corpus" / "m0001.py").write_text("")  # empty: not a document
    corpus = sources.open_corpus("files", [str(tmp_path / "corpus")], None, "train", "text", None)
    scan = sources.scan_corpus(corpus, None)
    assert scan.doc_ids == ["m0000.py", "m0002.py", "m0003.py"]
    assert [j for j, _ in id_cache._positions(corpus, scan.doc_ids)] == [0, 1, 2]
    (tmp_path / "corpus" / "m0001.py").write_text("x = 1\n")  # as many documents, other ones
    (tmp_path / "corpus" / "m0002.py").write_text("")
    with pytest.raises(
        ValueError, match="the corpus changed while it was read \\(document 1 is 'm0001.py', was 'm0002.py'\\)"
    ):
        list(id_cache._positions(corpus, scan.doc_ids))
    (tmp_path / "corpus" / "m0001.py").write_text("")
    (tmp_path / "corpus" / "m0002.py").write_text("y = 2\n")
    (tmp_path / "corpus" / "m0003.py").write_text("")  # the same documents but the last
    with pytest.raises(ValueError, match="the corpus changed while it was read \\(2 documents, was 3\\)"):
        list(id_cache._positions(corpus, scan.doc_ids))


# ---------------------------------------------------------------- the tokenizer's sample


def test_tokenizer_sample_spreads_and_caps():
    positions, sizes = list(range(100)), [10] * 100
    assert tokenizer_sample(positions, sizes, None) == positions
    picked = tokenizer_sample(positions, sizes, 200)  # 1000 bytes in all: every 5th document
    assert picked == list(range(0, 100, 5)) and sum(sizes[j] for j in picked) <= 200
    assert tokenizer_sample(positions, [10_000] * 100, 5) == [0]  # at least one document


def test_a_capped_tokenizer_learns_from_the_sample_only(built, monkeypatch):
    _, root = built
    learned = []
    real = id_cache.train_tokenizer
    monkeypatch.setattr(id_cache, "train_tokenizer", lambda texts, v: real(learned.extend(texts) or learned, v))
    data = prepare_files(root / "corpus", root / "capped", tokenizer_max_bytes=20_000)
    meta = json.loads((root / "capped" / data.cache_key / "meta.json").read_text())
    assert sum(len(t.encode()) for t in learned) <= 20_000 and len(learned) == meta["tokenizer_files"] < len(
        meta["train_files"]
    )
    assert data.cache_key != built[0].cache_key


# ---------------------------------------------------------------- files that are not UTF-8


def entry_meta(cache: Path, data: PreparedData) -> dict:
    return json.loads((cache / data.cache_key / "meta.json").read_text())


def test_undecodable_files_are_skipped_and_counted_or_replaced(tmp_path, caplog):
    write_corpus(tmp_path / "corpus", 4, lines=5)
    latin1 = "caf\u00e9 = 'cr\u00e8me'\n".encode("latin-1")  # 0xe9, 0xe8: not UTF-8
    (tmp_path / "corpus" / "latin1.py").write_bytes(latin1)
    cache = tmp_path / "cache"
    with caplog.at_level("WARNING", logger=D.__name__):
        skipped = prepare_files(tmp_path / "corpus", cache)  # the default: skip
    counts = {"files": 1, "bytes": len(latin1), "examples": ["latin1.py"], "left_out": True}
    assert skipped.undecodable == counts and entry_meta(cache, skipped)["undecodable"] == counts
    meta = entry_meta(cache, skipped)
    assert "latin1.py" not in meta["train_files"] + meta["val_files"]
    assert len(meta["train_files"] + meta["val_files"]) == 4
    [line] = [r.getMessage() for r in caplog.records if "not UTF-8" in r.getMessage()]
    assert line.startswith(f"1 of 5 corpus files ({len(latin1)} of ") and "left out" in line and "latin1.py" in line

    replaced = prepare_files(tmp_path / "corpus", cache, undecodable="replace")
    assert replaced.cache_key != skipped.cache_key  # a skip entry is never read for replace, nor the reverse
    assert replaced.undecodable == {**counts, "left_out": False}
    meta = entry_meta(cache, replaced)
    assert "latin1.py" in meta["train_files"] + meta["val_files"]
    text = replaced.tokenizer.decode(torch.cat((replaced.train_ids, replaced.val_ids)).long().tolist())
    assert "caf\ufffd = 'cr\ufffdme'" in text
    assert prepare_files(tmp_path / "corpus", cache).cache_key == skipped.cache_key  # skip again: its own entry


def test_a_mostly_undecodable_corpus_is_refused_before_writing(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("x = 1\n" * 20)
    for i in range(3):  # binary without NUL bytes: the walk keeps them as text files
        (corpus / f"blob{i}.bin").write_bytes(bytes(range(128, 256)) * 4)
    for undecodable in ("skip", "replace"):
        with pytest.raises(ValueError) as info:
            prepare_files(corpus, tmp_path / "cache", undecodable=undecodable)
        message = str(info.value)
        assert "\n" not in message and f"corpus in {corpus}: 93% of its bytes (1536 of 1656; 3 of 4 files" in message
        assert "blob0.bin, blob1.bin, blob2.bin" in message and "at most 50% may be" in message, message
        assert not (tmp_path / "cache").exists()  # nothing written, not even a temporary entry


# ---------------------------------------------------------------- hub: streamed and not


def write_jsonl_dataset(root: Path, texts: list[str], field: str = "text") -> Path:
    root.mkdir(parents=True)
    with open(root / "data.jsonl", "w") as f:
        for text in texts:
            f.write(json.dumps({field: text, "n": len(text)}) + "\n")
    return root


def test_hub_streaming_gives_the_same_data(tmp_path, monkeypatch):
    texts = [f"def f{i}(x):\n    return x + {i}\n" * (1 + i % 5) if i % 7 else "" for i in range(60)]
    name = str(write_jsonl_dataset(tmp_path / "ds", texts))
    opened = []
    real_load = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: opened.append(k) or real_load(*a, **k))
    hub = dict(source="hub", hub_name=name, vocab_size=300, cache_dir=str(tmp_path / "cache"))
    local, streamed = prepare_data(**hub), prepare_data(**hub, streaming=True)
    assert [k["streaming"] for k in opened] == [False] * 3 + [True] * 3  # key, split and tokenizer, ids
    assert torch.equal(local.train_ids, streamed.train_ids) and torch.equal(local.val_ids, streamed.val_ids)
    assert local.val_files == streamed.val_files and local.tokenizer.to_str() == streamed.tokenizer.to_str()
    assert local.cache_key != streamed.cache_key
    # A streamed entry is found by name: a cache hit reads nothing from the dataset.
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("read the dataset on a cache hit"))
    assert torch.equal(prepare_data(**hub, streaming=True).train_ids, streamed.train_ids)


# ---------------------------------------------------------------- bad input


def raises_one_line(exc: type[Exception], match: str, fn, *args, **kwargs) -> str:
    with pytest.raises(exc, match=match) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value) and one_line(info.value) == str(info.value)
    return str(info.value)


@pytest.mark.parametrize(
    "damage, match",
    [
        ("truncate", "has .* bytes, its header says"),
        ("meta_count", r"meta.json says \(\d+,\) ids"),
        ("meta_garbage", "meta.json unreadable"),
        ("missing_val", "val.npy is not a readable .npy file"),
    ],
)
def test_a_damaged_cache_entry_is_named_with_the_fix(built, tmp_path, damage, match):
    data, root = built
    cache = tmp_path / "cache"
    shutil.copytree(root / "cache", cache)
    entry = cache / data.cache_key
    if damage == "truncate":
        os.truncate(entry / "train.npy", (entry / "train.npy").stat().st_size - 10)
    elif damage == "meta_count":
        meta = json.loads((entry / "meta.json").read_text())
        (entry / "meta.json").write_text(json.dumps({**meta, "train_tokens": meta["train_tokens"] + 1}))
    elif damage == "meta_garbage":
        (entry / "meta.json").write_text("{not json")
    else:
        (entry / "val.npy").unlink()
    message = raises_one_line(ValueError, match, prepare_files, root / "corpus", cache)
    assert f"delete {entry} and run again" in message


def test_bad_corpora_fail_in_one_line(tmp_path):
    cache = tmp_path / "cache"
    for i in range(3):
        (tmp_path / "empty" / f"e{i}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "empty" / f"e{i}.txt").write_text("")
    raises_one_line(ValueError, "gave an empty corpus", prepare_files, tmp_path / "empty", cache)
    raises_one_line(FileNotFoundError, "nowhere", prepare_files, tmp_path / "nowhere", cache)
    empty_hub = str(write_jsonl_dataset(tmp_path / "empty_ds", ["", ""]))
    raises_one_line(
        ValueError,
        "gave an empty corpus",
        prepare_data,
        source="hub",
        hub_name=empty_hub,
        streaming=True,
        cache_dir=str(cache),
    )
    other_field = str(write_jsonl_dataset(tmp_path / "other_ds", ["x = 1\n"] * 4, field="content"))
    raises_one_line(
        ValueError,
        "text_field='text' is not a column",
        prepare_data,
        source="hub",
        hub_name=other_field,
        streaming=True,
        cache_dir=str(cache),
    )
    raises_one_line(
        FileNotFoundError,
        "nowhere",
        prepare_data,
        source="hub",
        hub_name=str(tmp_path / "nowhere"),
        streaming=True,
        cache_dir=str(cache),
    )
    assert not cache.exists() or [p.name for p in cache.iterdir()] == []  # nothing written
