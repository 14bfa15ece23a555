"""features.source=generated: the base's own answers to training chat questions disjoint from the benchmark's.

Each window is one answered turn [prompt + the base's answer] with a mask over the answer's tokens, kept in the
feature cache's shards (the answers themselves: tests/test_answers.py); the stdlib questions come from training
files only, never from what the benchmark set quotes."""

import json

import pytest
import torch

from experiments.lib.data import chat_mix
from experiments.lib.data.chat_train import TRAIN_CATEGORIES, chat_train_questions
from experiments.lib.data.sources import is_validation
from experiments.lib.store.lm import build_lm
from experiments.lib.training.features import FeatureCache, FeatureSpec, open_features, write_features
from experiments.lib.training.generated import generated_windows

V = 97
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def questions():
    return chat_train_questions()


def make_base(seed: int = 0):
    torch.manual_seed(seed)
    return build_lm(num_tokens=V, dim=32, depth=2, heads=2, max_seq_len=64).eval().requires_grad_(False)


def prompts_of(lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, V, (n,), generator=g).tolist() for n in lengths]


def spec_for(**over) -> FeatureSpec:
    fields = dict(base_fingerprint="b", data_key="d", seq_len=16, windows=6, top_k=8, dtype="float32")
    return FeatureSpec(**{**fields, "source": "generated", "prompt_len": 8, **over})


# ------------------------------------------------------------------------------------------ the questions


def test_training_questions_are_disjoint_from_the_benchmark_set(questions):
    train = stdlib_train = chat_mix.stdlib_functions(validation=False)
    assert train and not any(is_validation(key.split(":")[0], chat_mix.STDLIB_VAL_FRACTION) for key in stdlib_train)
    bench = chat_mix.chat_mix_questions()
    texts = {q for _, q in questions}
    assert not texts & {q.turns[0] for q in bench}
    # nothing a benchmark question quotes (held-out code, METADATA and pydoc_data passages) is in a training one
    quoted = [q.turns[0].split("\n\n", 1)[1] for q in bench if q.category in ("explanation", "summarization", "rag")]
    joined = "\n".join(texts)
    assert not [block for block in quoted if block[:200] in joined]


def test_training_questions_take_turns_by_category_and_are_deterministic(questions):
    assert [c for c, _ in questions[:12]] == list(TRAIN_CATEGORIES) * 2
    assert chat_train_questions(7) == questions[:7]
    assert len(questions) > 1000


@pytest.mark.parametrize("n", [0, -1, 2.5, True, 10**7])
def test_bad_question_counts_are_refused(n):
    with pytest.raises(ValueError, match=f"n={n!r}"):
        chat_train_questions(n)


def test_generated_windows_need_a_chat_template(tmp_path):
    with pytest.raises(ValueError, match="no chat template"):
        generated_windows(
            spec_for(), make_base(), None, {"model_config": {"arch": "x-transformers"}}, root=tmp_path,
            max_new_tokens=4, batch=2,
        )  # fmt: skip


# ------------------------------------------------------------------------------------------ the windows


def answered_windows(n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    windows = torch.randint(1, V, (n, 17), generator=g)
    mask = torch.arange(16)[None, :] >= torch.randint(1, 10, (n, 1), generator=g)  # each window's answer start
    return windows, mask


def test_the_cache_keeps_each_windows_answer_mask_and_resumes(tmp_path):
    base, spec = make_base(), spec_for(windows=6)
    answered = answered_windows()
    d = tmp_path / "g"
    write_features(d, base, None, spec, answered=answered, shard_windows=4, batch_size=2)
    cache = FeatureCache(d, spec)
    assert torch.equal(cache.data["tokens"].long(), answered[0])
    assert torch.equal(cache.data["mask"], answered[1])
    batch = cache.batch(torch.tensor([4, 1]))
    assert torch.equal(batch.mask, answered[1][[4, 1]])
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps({**meta, "complete": False}))
    (d / "shard-00001.safetensors").unlink()
    write_features(d, base, None, spec, answered=answered)
    again = FeatureCache(d, spec).data
    assert all(torch.equal(cache.data[k], again[k]) for k in cache.data)


def test_a_corpus_cache_has_no_mask(tmp_path):
    base = make_base()
    spec = FeatureSpec(base_fingerprint="b", data_key="d", seq_len=16, windows=3, top_k=8, dtype="float32")
    ids = torch.randint(1, V, (200,), generator=torch.Generator().manual_seed(0))
    cache = open_features(base, ids, spec, directory=tmp_path / "c")
    assert "mask" not in cache.data and cache.batch(torch.tensor([0])).mask is None


def test_generated_cache_needs_one_window_per_answer(tmp_path):
    with pytest.raises(ValueError, match=r"needs windows \(6, 17\), got \(2, 17\)"):
        open_features(make_base(), None, spec_for(), answered=answered_windows(2), directory=tmp_path / "x")


def test_generated_answers_do_not_name_the_cache_by_batch():
    """Continuous batching never changes an answer: the batch is not part of a generated cache's name."""
    assert spec_for(batch=16).key() == spec_for(batch=64).key()
    assert spec_for(answer_tokens=256).key() != spec_for().key()
    corpus = dict(source="corpus")
    assert spec_for(**corpus, answer_tokens=256).key() == spec_for(**corpus).key()


def test_a_checkpoint_drafts_from_the_vocabulary_it_recorded():
    """A drafter trained on the base's own answers records the ids it was trained over; decoding uses them."""
    from experiments.lib.methods.registry import checkpoint_vocab

    shared = torch.tensor([1, 2, 3])
    own = checkpoint_vocab({"train_vocab": 3, "train_vocab_ids": [1, 5, 9]}, shared, "medusa")
    assert own.tolist() == [1, 5, 9]
    assert checkpoint_vocab({"train_vocab": 3}, shared, "medusa") is shared  # an older checkpoint
    assert checkpoint_vocab({"train_vocab": 2, "train_vocab_ids": [1, 5]}, shared, "medusa") is shared
    assert checkpoint_vocab({"train_vocab_ids": [1, 5, 9]}, None, "medusa") is None  # full vocabulary asked


def test_a_larger_cache_serves_its_first_windows(tmp_path):
    """A data-scaling study caches the largest size once; each smaller run reads its first windows."""
    base, answered = make_base(), answered_windows(6)
    d = tmp_path / "g"
    write_features(d, base, None, spec_for(windows=6), answered=answered, shard_windows=4, batch_size=2)
    small = FeatureCache(d, spec_for(windows=3))
    assert small.windows == 3 and torch.equal(small.data["tokens"].long(), answered[0][:3])
    assert torch.equal(small.data["mask"], answered[1][:3]) and small.data["hidden"].shape[0] == 3
    with pytest.raises(ValueError, match="windows: cached 6, wanted 7"):  # more than it holds: another setting
        FeatureCache(d, spec_for(windows=7))
    with pytest.raises(ValueError, match="seq_len: cached 16, wanted 8"):
        FeatureCache(d, spec_for(windows=3, seq_len=8))
