"""features.source=generated: the base's own answers to training chat questions disjoint from the benchmark's.

The windows are [prompt + the base's answer]: greedy batches equal plain decoding, sampled batches are a
function of their seed (so an interrupted cache resumes to the same text), batches alternate T = 0 and T = 1;
the questions come from the stdlib's training files only, never from what the benchmark set quotes."""

import json

import pytest
import torch

from experiments.lib.data import chat_mix
from experiments.lib.data.chat_train import TRAIN_CATEGORIES, chat_train_questions
from experiments.lib.data.sources import is_validation
from experiments.lib.store.lm import build_lm
from experiments.lib.training.features import FeatureCache, FeatureSpec, open_features, write_features
from experiments.lib.training.generated import answer_windows, generation_prompts, window_temperature
from verify.backends.target import Target
from verify.loop.plain import plain_generate

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


def test_prompts_need_a_chat_template():
    with pytest.raises(ValueError, match="no chat template"):
        generation_prompts(spec_for(), None, {"model_config": {"arch": "x-transformers"}})
    assert generation_prompts(spec_for(source="corpus"), None, {}) is None


# ------------------------------------------------------------------------------------------ the windows


def test_greedy_answers_are_plain_decoding_cut_to_the_window():
    base, prompts = make_base(), prompts_of([3, 5, 8])
    windows = answer_windows(base, prompts, seq_len=16, temperature=0.0, seed=0)
    assert windows.shape == (3, 17)
    plain = plain_generate(Target(base), prompts, max_new_tokens=14).tokens
    for row, prompt, answer in zip(windows.tolist(), prompts, plain):
        assert row == (prompt + answer)[:17]


def test_sampled_answers_are_a_function_of_the_seed():
    base, prompts = make_base(), prompts_of([4, 4])
    a = answer_windows(base, prompts, seq_len=16, temperature=1.0, seed=3)
    assert torch.equal(a, answer_windows(base, prompts, seq_len=16, temperature=1.0, seed=3))
    assert not torch.equal(a, answer_windows(base, prompts, seq_len=16, temperature=1.0, seed=4))


def test_cache_alternates_greedy_and_sampled_batches_and_resumes(tmp_path):
    base, spec = make_base(), spec_for(windows=6)
    prompts = prompts_of([2, 3, 3, 5, 6, 8])
    d = tmp_path / "g"
    write_features(d, base, None, spec, prompts=prompts, shard_windows=4, batch_size=2)
    full = FeatureCache(d, spec).data
    tokens = full["tokens"].long()
    assert [window_temperature(i) for i in range(3)] == [0.0, 1.0, 0.0]
    for b in (0, 2):  # greedy batches: the base's top-1 is the next token after the prompt
        rows = slice(2 * b, 2 * b + 2)
        greedy = answer_windows(base, prompts[rows], seq_len=16, temperature=0.0, seed=0)
        assert torch.equal(tokens[rows], greedy)
    sampled = tokens[2:4]
    assert not torch.equal(sampled, answer_windows(base, prompts[2:4], seq_len=16, temperature=0.0, seed=0))
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps({**meta, "complete": False}))
    (d / "shard-00001.safetensors").unlink()
    write_features(d, base, None, spec, prompts=prompts)
    again = FeatureCache(d, spec).data
    assert all(torch.equal(full[k], again[k]) for k in full)


def test_generated_cache_needs_one_prompt_per_window(tmp_path):
    with pytest.raises(ValueError, match="needs 6 prompts, got 2"):
        open_features(make_base(), None, spec_for(), prompts=prompts_of([2, 3]), directory=tmp_path / "x")


def test_a_checkpoint_drafts_from_the_vocabulary_it_recorded():
    """A drafter trained on the base's own answers records the ids it was trained over; decoding uses them."""
    from experiments.lib.methods.registry import checkpoint_vocab

    shared = torch.tensor([1, 2, 3])
    own = checkpoint_vocab({"train_vocab": 3, "train_vocab_ids": [1, 5, 9]}, shared, "medusa")
    assert own.tolist() == [1, 5, 9]
    assert checkpoint_vocab({"train_vocab": 3}, shared, "medusa") is shared  # an older checkpoint
    assert checkpoint_vocab({"train_vocab": 2, "train_vocab_ids": [1, 5]}, shared, "medusa") is shared
    assert checkpoint_vocab({"train_vocab_ids": [1, 5, 9]}, None, "medusa") is None  # full vocabulary asked
