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


def test_a_cache_grows_keeping_its_whole_shards(tmp_path, monkeypatch):
    """An answer set that grows grows its cache: the smaller cache's whole shards are kept, its short last shard and
    the new windows computed, and the result is the larger cache written from scratch; an interrupted grow resumes."""
    from experiments.lib.training import features

    base, answered = make_base(), answered_windows(9)
    first = lambda n: (answered[0][:n], answered[1][:n])  # noqa: E731
    d, fresh = tmp_path / "g", tmp_path / "fresh"
    write_features(d, base, None, spec_for(windows=5), answered=first(5), shard_windows=2, batch_size=2)
    kept = {i: (d / f"shard-{i:05d}.safetensors").stat().st_mtime_ns for i in (0, 1)}
    seen = []
    teach = features.teacher_batch
    monkeypatch.setattr(features, "teacher_batch", lambda b, t, **kw: seen.append(t.shape[0]) or teach(b, t, **kw))
    calls = 0

    def cut_short(*args, **kwargs):  # the grow is interrupted after its first new shard
        nonlocal calls
        calls += 1
        if calls == 2:
            raise KeyboardInterrupt
        return write_shard(*args, **kwargs)

    write_shard = features._write_shard
    monkeypatch.setattr(features, "_write_shard", cut_short)
    with pytest.raises(KeyboardInterrupt):
        write_features(d, base, None, spec_for(windows=9), answered=answered, shard_windows=2, batch_size=2)
    monkeypatch.setattr(features, "_write_shard", write_shard)
    with pytest.raises(ValueError, match="windows: cached 9, wanted 5"):
        FeatureCache(d, spec_for(windows=5))  # half grown: the larger cache, incomplete, not the smaller one
    write_features(d, base, None, spec_for(windows=9), answered=answered, shard_windows=2, batch_size=2)
    assert sum(seen) == 9 - 4  # windows 0-3 (two whole shards) never recomputed
    assert {i: (d / f"shard-{i:05d}.safetensors").stat().st_mtime_ns for i in (0, 1)} == kept
    write_features(fresh, base, None, spec_for(windows=9), answered=answered, shard_windows=2, batch_size=2)
    grown, want = FeatureCache(d, spec_for(windows=9)).data, FeatureCache(fresh, spec_for(windows=9)).data
    assert grown.keys() == want.keys() and all(torch.equal(grown[k], want[k]) for k in want)
    with pytest.raises(ValueError, match="seq_len: cached 16, wanted 8"):  # another setting is not grown
        write_features(d, base, None, spec_for(windows=11, seq_len=8), answered=answered, shard_windows=2)


def padded_answers(n: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Answered turns of different lengths, padded with 0 past each answer (as conversation_windows pads them)."""
    g = torch.Generator().manual_seed(3)
    windows, mask = torch.randint(1, V, (n, 17), generator=g), torch.zeros(n, 16, dtype=torch.bool)
    for i in range(n):
        start = int(torch.randint(2, 6, (1,), generator=g))
        end = 17 if i == 0 else int(torch.randint(start + 2, 17, (1,), generator=g))  # tokens in the turn
        mask[i, start - 1 : end - 1] = True
        windows[i, end:] = 0
    return windows, mask


def test_the_teacher_runs_each_batch_to_its_longest_answer_only(tmp_path, monkeypatch):
    """Windows go to the teacher by length, each batch cut after its longest answer: every answer position holds
    what the base computes on the whole window (to float rounding), positions past the answer hold zeros, and the
    teacher computes fewer positions than the windows hold."""
    from experiments.lib.training import features

    base, (windows, mask) = make_base(), padded_answers()
    seen = []
    teach = features.teacher_batch
    monkeypatch.setattr(features, "teacher_batch", lambda b, t, **kw: seen.append(t.shape) or teach(b, t, **kw))
    d = tmp_path / "g"
    write_features(d, base, None, spec_for(windows=7), answered=(windows, mask), shard_windows=7, batch_size=2)
    cache = FeatureCache(d, spec_for(windows=7)).data
    assert torch.equal(cache["tokens"].long(), windows) and torch.equal(cache["mask"], mask)
    whole = teach(base, windows, top_k=8)
    last = torch.tensor([int(row.nonzero().max()) for row in mask])  # each window's last answer position
    used = torch.arange(16)[None, :] <= last[:, None]  # what the loss may read: every position up to it
    for name in ("hidden", "top_logp"):
        got, want = cache[name], getattr(whole, name)
        assert torch.allclose(got[used], want[used], atol=1e-5, rtol=1e-5), name
    computed = cache["hidden"].abs().sum(-1) > 0
    assert bool(computed[used].all()) and not bool(computed.all())  # some positions past an answer never computed
    assert torch.equal(cache["top_ids"][mask], whole.top_ids[mask].int())
    assert len(seen) == 4 and sum(s[0] * s[1] for s in seen) < 7 * 17  # cut batches
    lengths = [s[1] for s in seen]
    assert lengths == sorted(lengths) and lengths[-1] == 17  # by length; the full window last


def test_a_bf16_teacher_names_its_cache_and_computes_in_bf16(tmp_path):
    """teacher=bf16: the features are what the base computes in bf16 (what it decodes in), in another cache."""
    from experiments.lib.training.features import teacher_batch
    from experiments.lib.training.precision import cast_copy

    base, answered = make_base(), answered_windows(4)
    spec = spec_for(windows=4, teacher="bf16")
    assert spec.key() != spec_for(windows=4).key()
    cache = open_features(base, None, spec, answered=answered, directory=tmp_path / "b").batch(torch.arange(4))
    want = teacher_batch(cast_copy(base, "bf16"), answered[0], top_k=8)
    assert torch.equal(cache.hidden, want.hidden.float()) and torch.equal(cache.top_logp, want.top_logp)
    fp32 = teacher_batch(base, answered[0], top_k=8)
    assert not torch.equal(cache.hidden, fp32.hidden)
    assert next(base.parameters()).dtype == torch.float32  # the base itself stays fp32
    with pytest.raises(ValueError, match="teacher"):
        FeatureCache(tmp_path / "b", spec_for(windows=4))  # an fp32 run does not read bf16 features


def test_validation_uses_the_teacher_of_the_training_features():
    """Held-out answers are computed by the same teacher as the cache (its dtype): chain_tau on bf16 features is
    measured on bf16 states; the batches are a category's each."""
    from types import SimpleNamespace

    from experiments.lib.training.drafter_trainer import validation_batches
    from experiments.lib.training.features import teacher_batch
    from experiments.lib.training.precision import cast_copy

    base, (windows, mask) = make_base(), answered_windows(3)
    records = [{"category": c} for c in ("qa", "rag", "qa")]
    cfg = SimpleNamespace(eval_blocks=3, features=SimpleNamespace(top_k=8))
    rows = {"qa": [0, 2], "rag": [1]}

    def windows_of(chosen):  # the windows of the held-out records given (here: by their category)
        picked = rows[chosen[0]["category"]]
        return windows[picked], mask[picked]

    for teacher in ("bf16", "fp32"):
        batches = SimpleNamespace(spec=spec_for(teacher=teacher), layers=(), held_out=lambda n: records,
                                  windows=windows_of)  # fmt: skip
        got = validation_batches(cfg, base, None, batches, seq_len=16, device=torch.device("cpu"))
        assert [c for c, _ in got] == ["qa", "rag"]
        for category, batch in got:
            want = teacher_batch(cast_copy(base, teacher), windows[rows[category]], top_k=8)
            assert torch.equal(batch.hidden, want.hidden) and torch.equal(batch.mask, mask[rows[category]])


def test_validation_reports_chain_tau_by_category():
    """chain_tau over every held-out answer position (what picks the best checkpoint, as before), and per category:
    a category's figure is the mean over its own positions."""
    from types import SimpleNamespace

    from experiments.lib.training.drafter_trainer import validate

    def batch(rows: int, tau: float):
        return SimpleNamespace(tokens=torch.zeros(rows, 4), mask=None, tau=tau)

    family = SimpleNamespace(evaluate=lambda module, base, b, vocab: {"chain_tau": b.tau, "agree": b.tau / 4})
    batches = [batch(2, 1.0), batch(1, 2.5), batch(1, 4.0)]
    got = validate(family, torch.nn.Identity(), None, batches, vocab=None, categories=["qa", "rag", "qa"])
    assert got["chain_tau"] == pytest.approx((2 * 1.0 + 2.5 + 4.0) / 4)
    assert got["chain_tau/qa"] == pytest.approx((2 * 1.0 + 4.0) / 3) and got["chain_tau/rag"] == 2.5
    plain = validate(family, torch.nn.Identity(), None, batches, vocab=None)  # a corpus's windows: no categories
    assert not [k for k in plain if k.startswith("chain_tau/")] and plain["chain_tau"] == got["chain_tau"]


def test_teacher_auto_follows_the_answers_dtype():
    from experiments.lib.training.features import teacher_dtype
    from experiments.lib.training.generated import answer_dtype

    cpu = torch.device("cpu")
    assert teacher_dtype("auto", "generated", cpu) == answer_dtype(cpu)
    assert teacher_dtype("auto", "corpus", cpu) == "fp32" and teacher_dtype("auto", "greedy", cpu) == "fp32"
    assert teacher_dtype("bf16", "corpus", cpu) == "bf16" and teacher_dtype("fp32", "generated", cpu) == "fp32"
