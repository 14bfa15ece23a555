"""Fast tests for the data pipeline (experiments/lib/data/pipeline.py, sources.py, tokenizer.py, id_cache.py) and
experiments/lib/data/prompts.py (small corpora, tmp cache dirs)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from experiments.lib.data import id_cache, sources
from experiments.lib.data import pipeline as D
from experiments.lib.data.pipeline import prepare_data, sample_batch
from experiments.lib.data.prompts import document_regions, heldout_prompts, load_prompts
from experiments.lib.data.sources import stdlib_files

SMALL = dict(source="stdlib", max_files=40, vocab_size=512)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("data_cache"))


@pytest.fixture(scope="module")
def small(cache_dir):
    return prepare_data(**SMALL, cache_dir=cache_dir)


def _meta(data, cache_dir) -> dict:
    return json.loads((Path(cache_dir) / data.cache_key / "meta.json").read_text())


def _write_corpus(root: Path, n: int = 6) -> None:
    for i in range(n):
        body = "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}  # note\n\n" for j in range(40))
        (root / f"doc{i}.py").write_text(body)


# ---------------------------------------------------------------- corpus and split


def test_stdlib_files_sorted_and_excluded():
    files = stdlib_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    root = Path(sources.sysconfig.get_paths()["stdlib"])
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel)
    assert not any(set(r.split("/")[:-1]) & {"site-packages", "test", "tests", "idlelib"} for r in rel)


def test_split_is_by_file_and_follows_the_rule(small, cache_dir):
    meta = _meta(small, cache_dir)
    train, val = meta["train_files"], small.val_files
    assert not set(train) & set(val)
    assert len(train) + len(val) == len(set(train) | set(val))
    # The documented rule, reproduced independently.
    for name in train + val:
        expect_val = int(hashlib.sha1(name.encode()).hexdigest(), 16) % 10_000 < 0.05 * 10_000
        assert (name in val) == expect_val
    # EOS count equals the number of documents on each side.
    assert int((small.val_ids == small.eos_id).sum()) == len(val)
    assert int((small.train_ids == small.eos_id).sum()) == len(train)


def test_split_is_deterministic():
    names = [f"pkg/mod{i}.py" for i in range(200)]
    assert sources.split_documents(names, 0.1) == sources.split_documents(names, 0.1)
    train, val = sources.split_documents(names, 0.1)
    assert sorted(train + val) == list(range(200)) and 0 < len(val) < 60


def test_split_fallback_fills_an_empty_side():
    names = ["a.py", "b.py", "c.py"]
    # val_fraction so small no hash falls below it: the last train document moves to validation.
    assert sources.split_documents(names, 1e-9) == ([0, 1], [2])
    # and so large every hash does: the last validation document moves to train.
    assert sources.split_documents(names, 1 - 1e-9) == ([2], [0, 1])
    with pytest.raises(ValueError, match="at least 2"):
        sources.split_documents(["a.py"], 0.5)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip(small):
    tok = small.tokenizer
    texts = [
        Path(stdlib_files()[0]).read_text(),
        "def f(x):\r\n\treturn x  \n\n    # héllo wörld 🙂 ∑\n",
        "literal <|endoftext|> stays text",
        "  leading and trailing spaces  ",
    ]
    for text in texts:
        ids = tok.encode(text).ids
        assert small.eos_id not in ids
        assert tok.decode(ids) == text
    assert small.vocab_size == tok.get_vocab_size() <= 512
    assert tok.token_to_id("<|endoftext|>") == small.eos_id


def test_tokenizer_round_trips_validation_documents(small):
    # val ids are encode(original text); decoding must give that text back, so re-encoding is exact.
    for start, end in document_regions(small.val_ids, small.eos_id):
        doc = small.val_ids[start:end].tolist()
        assert small.tokenizer.encode(small.tokenizer.decode(doc)).ids == doc


def test_ids_and_byte_counts(small):
    # uint16 (vocab <= 65535), mapped from the cache; torch has no max() for uint16, hence .long()
    assert small.train_ids.dtype == torch.uint16 and small.val_ids.dtype == torch.uint16
    assert small.train_ids.long().max() < small.vocab_size
    assert small.train_bytes > small.train_ids.numel() > 0 and small.val_bytes > small.val_ids.numel() > 0
    decoded = small.tokenizer.decode(small.val_ids.tolist())  # EOS is skipped on decode
    assert len(decoded.encode("utf-8")) == small.val_bytes


# ---------------------------------------------------------------- cache


def test_cache_hit_does_not_retokenize(small, cache_dir, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("tokenized again on a cache hit")

    monkeypatch.setattr(id_cache, "tokenize_documents", boom)
    monkeypatch.setattr(id_cache, "train_tokenizer", boom)
    again = prepare_data(**SMALL, cache_dir=cache_dir)
    assert again.cache_key == small.cache_key and again.val_files == small.val_files
    assert torch.equal(again.train_ids, small.train_ids) and torch.equal(again.val_ids, small.val_ids)
    assert np.load(Path(cache_dir) / small.cache_key / "train.npy").dtype == np.uint16
    assert id_cache.ids_dtype(65535) == np.uint16 and id_cache.ids_dtype(65536) == np.int32


def test_cache_key_depends_on_arguments(small, cache_dir):
    corpus = sources.open_corpus("stdlib", None, None, "train", "text", 40)
    key = lambda *args: sources.scan_corpus(corpus, id_cache.key_head("stdlib", *args)).key  # noqa: E731
    assert key(0.05, 512, 40, None) == small.cache_key
    assert key(0.05, 1024, 40, None) != small.cache_key
    assert key(0.10, 512, 40, None) != small.cache_key
    assert key(0.05, 512, 40, 10_000) != small.cache_key  # a capped tokenizer sample is another tokenizer


def test_failed_write_leaves_no_entry(tmp_path, monkeypatch):
    corpus, cache = tmp_path / "corpus", tmp_path / "cache"
    corpus.mkdir()
    _write_corpus(corpus)
    real_close = id_cache._IdsWriter.close

    def close_then_fail(self):
        real_close(self)
        raise RuntimeError("disk full")  # crash once train.npy is complete, halfway through the entry

    monkeypatch.setattr(id_cache._IdsWriter, "close", close_then_fail)
    with pytest.raises(RuntimeError, match="disk full"):
        prepare_data(source="files", paths=[str(corpus)], vocab_size=300, cache_dir=str(cache))
    assert list(cache.iterdir()) == []  # neither a final entry nor a temporary directory
    monkeypatch.setattr(id_cache._IdsWriter, "close", real_close)
    data = prepare_data(source="files", paths=[str(corpus)], vocab_size=300, cache_dir=str(cache))
    assert [p.name for p in cache.iterdir()] == [data.cache_key]


# ---------------------------------------------------------------- other sources


def test_files_source_directories_files_and_globs(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    _write_corpus(corpus, 4)
    _write_corpus(corpus / "sub", 2)
    (corpus / "blob.bin").write_bytes(b"\0\1\2binary")  # skipped: not text
    (corpus / "empty.txt").write_text("")  # dropped: empty
    cache = str(tmp_path / "c")
    by_dir = prepare_data(source="files", paths=[str(corpus)], vocab_size=300, cache_dir=cache)
    by_glob = prepare_data(source="files", paths=[str(corpus / "**" / "*.py")], vocab_size=300, cache_dir=cache)
    assert by_dir.cache_key == by_glob.cache_key  # same documents, same ids
    meta = _meta(by_dir, tmp_path / "c")
    assert sorted(meta["train_files"] + by_dir.val_files) == sorted(
        [f"doc{i}.py" for i in range(4)] + [f"sub/doc{i}.py" for i in range(2)]
    )
    text = (corpus / "doc0.py").read_text()
    assert by_dir.tokenizer.decode(by_dir.tokenizer.encode(text).ids) == text


# ---------------------------------------------------------------- batches


def test_sample_batch_shapes_and_shift(small):
    g = torch.Generator().manual_seed(0)
    x = sample_batch(small.train_ids, batch_size=4, seq_len=16, generator=g)
    assert x.shape == (4, 17) and x.dtype == torch.int64
    inputs, targets = x[:, :-1], x[:, 1:]
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    ids = small.train_ids.tolist()
    for row in x.tolist():  # every row is a contiguous window of the stream
        starts = [i for i in range(len(ids) - 16) if ids[i] == row[0] and ids[i : i + 17] == row]
        assert starts
    y = sample_batch(small.train_ids, batch_size=4, seq_len=16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x, y)
    with pytest.raises(ValueError, match="seq_len=100"):
        sample_batch(torch.arange(50), batch_size=2, seq_len=100)


# ---------------------------------------------------------------- prompts


def _regions(data) -> list[list[int]]:
    ids = data.val_ids.tolist()
    return [ids[a:b] for a, b in document_regions(data.val_ids, data.eos_id)]


def _region_of(prompt: list[int], regions: list[list[int]]) -> int:
    n = len(prompt)
    return next(r for r, doc in enumerate(regions) if any(doc[i : i + n] == prompt for i in range(len(doc) - n + 1)))


def test_heldout_prompts(small):
    prompts = heldout_prompts(small, num_prompts=5, prompt_len=32, seed=0)
    assert len(prompts) == 5 and all(len(p) == 32 for p in prompts)
    assert all(small.eos_id not in p for p in prompts)
    regions = _regions(small)
    where = [_region_of(p, regions) for p in prompts]  # raises StopIteration if not from validation
    assert len(set(where[: len(regions)])) == min(5, len(regions))  # spread over different files first
    assert prompts == heldout_prompts(small, num_prompts=5, prompt_len=32, seed=0)
    assert prompts != heldout_prompts(small, num_prompts=5, prompt_len=32, seed=1)


def test_heldout_prompts_many_per_file_do_not_overlap(small):
    prompts = heldout_prompts(small, num_prompts=40, prompt_len=64, seed=3)
    assert len(prompts) == 40 and all(len(p) == 64 and small.eos_id not in p for p in prompts)
    assert len({tuple(p) for p in prompts}) == 40


def test_load_prompts_formats(small, tmp_path):
    tok = small.tokenizer
    jl = tmp_path / "p.jsonl"
    jl.write_text(json.dumps({"prompt": "def f(x):\n"}) + "\n\n" + json.dumps("import os") + "\n")
    assert load_prompts(str(jl), tok) == [tok.encode("def f(x):\n").ids, tok.encode("import os").ids]
    blocks = tmp_path / "p.txt"
    blocks.write_text("def f(x):\n    return x\n---\n\nclass A:\n    pass\n\n---\n")
    assert [tok.decode(p) for p in load_prompts(str(blocks), tok)] == ["def f(x):\n    return x", "class A:\n    pass"]
    lines = tmp_path / "lines.txt"
    lines.write_text("import os\n\n  x = 1\n")
    assert [tok.decode(p) for p in load_prompts(str(lines), tok)] == ["import os", "  x = 1"]


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, exc, named",
    [
        (dict(source="web"), ValueError, "source='web'"),
        (dict(source="files"), ValueError, "paths=None"),
        (dict(source="hub"), ValueError, "hub_name=None"),
        (dict(vocab_size=0), ValueError, "vocab_size=0"),
        (dict(vocab_size=256), ValueError, "vocab_size=256"),
        (dict(max_files=0), ValueError, "max_files=0"),
        (dict(val_fraction=0.0), ValueError, "val_fraction=0.0"),
        (dict(val_fraction=1.0), ValueError, "val_fraction=1.0"),
        (dict(max_files=1), ValueError, "1 non-empty document"),
        (dict(streaming=True), ValueError, "streaming=true is for source='hub'"),
        (dict(streaming="yes"), ValueError, "streaming='yes'"),
        (dict(tokenizer_max_bytes=0), ValueError, "tokenizer_max_bytes=0"),
        (dict(undecodable="ignore"), ValueError, "undecodable='ignore' is unknown; use skip"),
        (dict(undecodable=None), ValueError, "undecodable=None is unknown; use skip"),
    ],
)
def test_prepare_data_rejects_bad_arguments(kwargs, exc, named, tmp_path):
    with pytest.raises(exc, match=named.replace("(", r"\(")) as info:
        prepare_data(**{"cache_dir": str(tmp_path), **kwargs})
    assert "\n" not in str(info.value)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_base_recorded_before_undecodable_reads_its_corpus_as_it_was_built():
    old = {"data": {"config": {"source": "stdlib", "vocab_size": 512}}}  # no undecodable: built with U+FFFD
    assert D.base_data_config(old, {"source": "files"})["undecodable"] == "replace"
    new = {"data": {"config": {"source": "stdlib", "undecodable": "skip"}}}
    assert D.base_data_config(new, {"source": "files"})["undecodable"] == "skip"
    assert "undecodable" not in D.base_data_config({}, {"source": "files"})  # the run's own config, as given


def test_prepare_data_rejects_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="match no files"):
        prepare_data(source="files", paths=[str(tmp_path / "*.nothing")], cache_dir=str(tmp_path / "c"))
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        prepare_data(source="files", paths=[str(tmp_path / "missing.txt")], cache_dir=str(tmp_path / "c"))
    for i in range(3):
        (tmp_path / f"e{i}.txt").write_text("")
    with pytest.raises(ValueError, match="empty corpus"):
        prepare_data(source="files", paths=[str(tmp_path)], cache_dir=str(tmp_path / "c"))


def test_prompts_reject_bad_input(small, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompts(str(tmp_path / "nope.jsonl"), small.tokenizer)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="empty.txt"):
        load_prompts(str(empty), small.tokenizer)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_prompts(str(bad), small.tokenizer)
    with pytest.raises(ValueError, match="num_prompts=0"):
        heldout_prompts(small, num_prompts=0, prompt_len=8)
    with pytest.raises(ValueError, match="prompt_len=0"):
        heldout_prompts(small, num_prompts=1, prompt_len=0)
    with pytest.raises(ValueError, match="num_prompts=10000"):
        heldout_prompts(small, num_prompts=10000, prompt_len=512)


def test_the_tokenizer_fix_names_the_base_s_corpus():
    meta = {"data": {"config": {"source": "packages", "vocab_size": 8192, "max_files": None}}}
    fix = D.base_data_fix(meta, {"source": "stdlib", "vocab_size": 8192})
    assert fix == "the base was trained on data=packages: pass data=packages"
    same_source = D.base_data_fix(meta, {"source": "packages", "vocab_size": 400, "max_files": None})
    assert same_source == "use the base's data config (data.vocab_size=8192)"
    assert D.base_data_fix({}, {"source": "stdlib"}) == "use the base's data config"


def test_chat_text_holds_out_the_stdlib_corpus_validation_files():
    """chat_mix (a benchmark) quotes the stdlib's validation files and the question bank its training files, both
    by the corpus's own split rule at STDLIB_VAL_FRACTION: it must be conf/data/stdlib.yaml's val_fraction, or
    the benchmark's functions would be files a drafter trained on."""
    import yaml

    from experiments.lib.data.chat_mix import STDLIB_VAL_FRACTION

    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "conf" / "data" / "stdlib.yaml").read_text())
    assert STDLIB_VAL_FRACTION == config["val_fraction"]
