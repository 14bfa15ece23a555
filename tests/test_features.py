"""The feature cache and the self-distillation targets: the cache holds exactly what the frozen base
computes, refuses another base or setting, resumes; the teacher is the base's own distribution; the draft
model family trains only itself toward the base."""

import hashlib
import json
from dataclasses import asdict, replace

import pytest
import torch

from experiments.lib.families import draft as draft_family
from experiments.lib.store.lm import build_lm
from experiments.lib.training.features import (
    FORMAT_VERSION,
    FeatureCache,
    FeatureSpec,
    StaleFeatures,
    check_features_config,
    corpus_windows,
    open_features,
    teacher_batch,
    write_features,
)
from experiments.lib.training.mapped import MappedRows
from prophet.model import base_features
from verify.backends.target import Target
from verify.loop.plain import plain_generate
from verify.training.distill import accepted_mass, agreement, distill_loss, subset_index

V = 97


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_base(seed: int = 0, depth: int = 3):
    torch.manual_seed(seed)
    base = build_lm(num_tokens=V, dim=32, depth=depth, heads=2, max_seq_len=64).eval()
    return base.requires_grad_(False)


def stream(n: int = 2000, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, V, (n,), generator=torch.Generator().manual_seed(seed))


def spec_for(**over) -> FeatureSpec:
    fields = dict(base_fingerprint="base-a", data_key="data-a", seq_len=16, windows=20, top_k=8, dtype="float32")
    return FeatureSpec(**{**fields, **over})


# ------------------------------------------------------------------------------------------ the cache


@pytest.mark.parametrize("dtype, tol", [("float32", 0.0), ("float16", 2e-3)])
def test_cache_holds_exactly_what_the_base_computes(tmp_path, dtype, tol):
    base, ids, spec = make_base(), stream(), spec_for(dtype=dtype, layers=(1, 2))
    cache = open_features(base, ids, spec, directory=tmp_path / "f")
    windows = corpus_windows(ids, seq_len=16, windows=20, seed=0)
    assert cache.data["tokens"].shape == (20, 17)
    rows = torch.tensor([0, 7, 19])
    batch = cache.batch(rows)
    assert torch.equal(batch.tokens, windows[rows])
    assert all(any(torch.equal(w, ids[s : s + 17]) for s in range(0, 2000 - 16, 16)) for w in windows)  # corpus windows
    hidden, logits, layers = base_features(base, windows[rows][:, :-1], (1, 2))
    assert torch.allclose(batch.hidden, hidden, atol=tol, rtol=tol) and batch.hidden.dtype == torch.float32
    assert torch.allclose(batch.layers, layers, atol=tol * 10, rtol=tol)
    logp = logits.log_softmax(-1)
    assert torch.equal(batch.top_ids[..., 0], logits.argmax(-1))  # the teacher's top-1 is the base's greedy token
    assert torch.allclose(batch.top_logp, logp.gather(-1, batch.top_ids), atol=1e-5)
    assert bool((batch.top_logp[..., :-1] >= batch.top_logp[..., 1:]).all())  # most likely first


def test_cache_refuses_another_base_data_or_setting(tmp_path):
    base, ids = make_base(), stream()
    open_features(base, ids, spec_for(), directory=tmp_path / "f")
    for change, word in [
        ({"base_fingerprint": "base-b"}, "base_fingerprint"),
        ({"data_key": "data-b"}, "data_key"),
        ({"top_k": 4}, "top_k"),
        ({"layers": (1,)}, "layers"),
        ({"source": "greedy", "prompt_len": 4}, "source"),
        ({"batch": 8}, "batch"),
    ]:
        with pytest.raises(StaleFeatures, match=word) as info:
            FeatureCache(tmp_path / "f", spec_for(**change))
        assert "\n" not in str(info.value)
        with pytest.raises(StaleFeatures):  # nor is it overwritten by a writer with another spec
            write_features(tmp_path / "f", base, ids, spec_for(**change))
    assert FeatureCache(tmp_path / "f", spec_for()).windows == 20


def test_a_cache_with_more_layers_serves_fewer(tmp_path):
    base, ids = make_base(), stream()
    full = open_features(base, ids, spec_for(layers=(1, 2)), directory=tmp_path / "f")
    assert "layers" not in FeatureCache(tmp_path / "f", spec_for()).data  # not loaded when not asked for
    two = FeatureCache(tmp_path / "f", spec_for(layers=(2,))).batch(torch.tensor([3]))
    assert torch.equal(two.layers[:, :, 0], full.batch(torch.tensor([3])).layers[:, :, 1])
    with pytest.raises(StaleFeatures, match="layers"):
        FeatureCache(tmp_path / "f", spec_for(layers=(1, 3)))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_mapped_cache_reads_what_a_loaded_one_holds(tmp_path, dtype):
    """Mapped (how training reads a cache): every window's states as loaded, the asked layers in the asked order,
    across shards (the last one short), the first windows of a larger cache."""
    base, d = make_base(depth=4), tmp_path / "m"
    write_features(d, base, stream(), spec_for(layers=(1, 2, 3), dtype=dtype), shard_windows=6)  # shards 6,6,6,2
    for spec in (spec_for(layers=(3, 1), dtype=dtype), spec_for(windows=13, dtype=dtype)):
        loaded, mapped = FeatureCache(d, spec), FeatureCache(d, spec, mapped=True)
        assert isinstance(mapped.data["hidden"], MappedRows) and isinstance(mapped.data["tokens"], torch.Tensor)
        assert mapped.data["hidden"].shape == loaded.data["hidden"].shape
        if spec.layers:
            assert mapped.data["layers"].shape == loaded.data["layers"].shape == (20, 16, 2, 32)
        rows = torch.tensor([0, 5, 6, spec.windows - 1, 11, 0, -1])
        for a, b in ((loaded.batch(rows), mapped.batch(rows)), (loaded.sample(**SAMPLE), mapped.sample(**SAMPLE))):
            for name in ("tokens", "hidden", "top_ids", "top_logp", "layers"):
                x, y = getattr(a, name), getattr(b, name)
                assert (x is None and y is None) or (x.dtype == y.dtype and torch.equal(x, y)), name
    with pytest.raises(IndexError, match="window 13 asked of a cache of 13"):
        FeatureCache(d, spec_for(windows=13, dtype=dtype), mapped=True).data["hidden"][torch.tensor([13])]


SAMPLE = dict(step=3, seed=1, batch_size=5)


def test_default_directory_is_keyed_by_the_spec(tmp_path):
    base, ids = make_base(), stream()
    a = open_features(base, ids, spec_for(), root=tmp_path)
    b = open_features(base, ids, spec_for(base_fingerprint="base-b"), root=tmp_path)
    assert a.directory != b.directory and a.directory.parent == b.directory.parent == tmp_path


def test_the_caching_batch_names_the_cache_except_the_old_default():
    # 16 was the batch of every cache written before it was a setting: their directories keep their names
    old = {**asdict(spec_for()), "format": FORMAT_VERSION}
    del old["batch"], old["answer_tokens"]  # answer_tokens names generated caches only
    del old["questions"], old["self_questions"], old["self_steering"]  # so do questions other than the bank's
    del old["teacher"]  # and a teacher other than fp32
    assert spec_for().key() == hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:16]
    assert spec_for(batch=64).key() != spec_for().key()


def test_an_interrupted_cache_resumes_where_it_stopped(tmp_path):
    base, ids, spec = make_base(), stream(), spec_for(windows=20)
    d = tmp_path / "f"
    write_features(d, base, ids, spec, shard_windows=6)
    shards = sorted(d.glob("shard-*.safetensors"))
    assert len(shards) == 4
    full = FeatureCache(d, spec).data
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps({**meta, "complete": False}))  # as if killed before the last shard
    shards[-1].unlink()
    with pytest.raises(ValueError, match="missing or incomplete"):
        FeatureCache(d, spec)
    kept = {p: p.stat().st_mtime_ns for p in shards[:-1]}
    write_features(d, base, ids, spec, shard_windows=5)  # resumes with the shard size it began with
    assert {p: p.stat().st_mtime_ns for p in shards[:-1]} == kept  # written shards are not recomputed
    again = FeatureCache(d, spec).data
    assert all(torch.equal(full[k], again[k]) for k in full)


def test_greedy_source_caches_the_bases_own_continuations(tmp_path):
    base, ids = make_base(), stream()
    spec = spec_for(source="greedy", prompt_len=5, windows=4)
    cache = open_features(base, ids, spec, directory=tmp_path / "g")
    tokens = cache.data["tokens"].long()
    prompts = corpus_windows(ids, seq_len=16, windows=4, seed=0)[:, :5]
    assert torch.equal(tokens[:, :5], prompts)
    plain = plain_generate(Target(base), prompts.tolist(), max_new_tokens=12).tokens
    assert tokens[:, 5:].tolist() == plain
    assert torch.equal(
        cache.data["top_ids"][:, 4:, 0].long(), tokens[:, 5:]
    )  # greedy text: base's top-1 is the next token


def test_sampling_is_a_function_of_seed_and_step(tmp_path):
    cache = open_features(make_base(), stream(), spec_for(), directory=tmp_path / "f")
    a, b = cache.sample(step=3, seed=1, batch_size=5), cache.sample(step=3, seed=1, batch_size=5)
    c = cache.sample(step=4, seed=1, batch_size=5)
    assert torch.equal(a.tokens, b.tokens) and not torch.equal(a.tokens, c.tokens)
    assert a.hidden.shape == (5, 16, 32) and a.tokens.shape == (5, 17) and a.hidden.dtype == torch.float32


@pytest.mark.parametrize(
    "change, match",
    [
        ({"source": "web"}, "features.source='web'"),
        ({"dtype": "int8"}, "features.dtype='int8'"),
        ({"top_k": 0}, "features.top_k=0"),
        ({"windows": 0}, "features.windows=0"),
        ({"use": "yes"}, "features.use"),
        ({"prompt_len": -1}, "features.prompt_len=-1"),
        ({"batch": 0}, "features.batch=0"),
        ({"answer_tokens": 0}, "features.answer_tokens=0"),
        ({"answer_batch": 0}, "features.answer_batch=0"),
        ({"answer_batch": True}, "features.answer_batch=True"),
        ({"answers_root": ""}, "features.answers_root=''"),
        ({"answers_shipped": 3}, "features.answers_shipped=3: give a directory of shipped answers, or null"),
        ({"teacher": "fp16"}, "features.teacher='fp16'"),
        ({"mapped": "yes"}, "features.mapped must be true or false, got 'yes'"),
    ],
)
def test_bad_feature_settings_are_one_line_errors(change, match):
    config = {
        "use": True,
        "dir": None,
        "root": "x",
        "windows": None,
        "source": "corpus",
        "prompt_len": 4,
        "top_k": 8,
        "dtype": "float16",
        "seed": 0,
        "answer_tokens": 512,
        "answers_root": ".cache/answers",
        "answers_shipped": "results/answers",
        "answer_batch": 64,
        "batch": 16,
        "questions": "bank",
        "self_questions": 1024,
        "self_steering": True,
        "teacher": "auto",
        "mapped": False,
    }
    with pytest.raises(ValueError, match=match) as info:
        check_features_config({**config, **change})
    assert "\n" not in str(info.value)


def test_too_many_windows_is_refused_before_work():
    with pytest.raises(ValueError, match="holds only"):
        corpus_windows(stream(100), seq_len=16, windows=50, seed=0)


def test_batch_shapes_are_checked():
    batch = teacher_batch(make_base(), stream(34).view(2, 17), top_k=4)
    assert batch.check() == (2, 16)
    with pytest.raises(ValueError, match=r"tokens \(2, 5\)"):
        replace(batch, tokens=batch.tokens[:, :5]).check()


# ------------------------------------------------------------------------------------------ distillation


def test_kl_target_is_cross_entropy_to_the_renormalised_top_k():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(6, V, generator=g), torch.randn(6, V, generator=g).log_softmax(-1)
    top = teacher.topk(5, dim=-1)
    p = top.values.exp() / top.values.exp().sum(-1, keepdim=True)
    expected = -(p * student.log_softmax(-1).gather(-1, top.indices)).sum(-1).mean()
    assert torch.allclose(distill_loss(student, top_ids=top.indices, top_logp=top.values), expected)
    argmax = -student.log_softmax(-1).gather(-1, top.indices[:, :1]).mean()
    assert torch.allclose(distill_loss(student, top_ids=top.indices, top_logp=top.values, target="argmax"), argmax)
    full = teacher.topk(V, dim=-1)  # k = V: exactly the KL plus the teacher's entropy
    kl = torch.nn.functional.kl_div(student.log_softmax(-1), teacher, log_target=True, reduction="batchmean")
    entropy = -(teacher.exp() * teacher).sum(-1).mean()
    assert torch.allclose(distill_loss(student, top_ids=full.indices, top_logp=full.values), kl + entropy, atol=1e-5)


def test_tv_target_is_one_minus_the_acceptance_rate_of_speculative_sampling():
    """With k = V the tv loss is exactly the total variation 1 - sum min(p, q) = 0.5 |p - q|_1, the probability that
    speculative sampling rejects a draft drawn from q; kl_tv adds the kl target's cross-entropy."""
    g = torch.Generator().manual_seed(1)
    student, teacher = torch.randn(6, V, generator=g), (2 * torch.randn(6, V, generator=g)).log_softmax(-1)
    full = teacher.topk(V, dim=-1)
    tv = 0.5 * (teacher.exp() - student.softmax(-1)).abs().sum(-1).mean()
    assert torch.allclose(distill_loss(student, top_ids=full.indices, top_logp=full.values, target="tv"), tv)
    kl = distill_loss(student, top_ids=full.indices, top_logp=full.values)
    kl_tv = distill_loss(student, top_ids=full.indices, top_logp=full.values, target="kl_tv")
    assert torch.allclose(kl_tv, kl + tv)
    same = distill_loss(teacher, top_ids=full.indices, top_logp=full.values, target="tv")
    assert abs(float(same)) < 1e-6  # q = p: every draft accepted
    # a top-k teacher: the mass outside it counts as no overlap, so the loss bounds the rejection rate from above
    top = teacher.topk(4, dim=-1)
    assert distill_loss(student, top_ids=top.indices, top_logp=top.values, target="tv") >= tv - 1e-6


def test_accepted_mass_is_the_acceptance_rate_of_speculative_sampling():
    """sum min(p, q) over the teacher's top-k: with k = V exactly 1 - the total variation, the rate at which
    speculative sampling accepts a draft drawn from q, which an empirical count of accepted draws reproduces; a
    top-k teacher bounds it from below; a trimmed vocabulary counts only what its columns can propose."""
    g = torch.Generator().manual_seed(3)
    student, teacher = torch.randn(5, V, generator=g), (2 * torch.randn(5, V, generator=g)).log_softmax(-1)
    p, q = teacher.exp(), student.softmax(-1)
    full = teacher.topk(V, dim=-1)
    exact = torch.minimum(p, q).sum(-1)  # (5,)
    assert torch.allclose(accepted_mass(student, full.indices, full.values), exact, atol=1e-6)
    assert torch.allclose(accepted_mass(teacher, full.indices, full.values), torch.ones(5), atol=1e-5)  # q = p
    draws = torch.multinomial(q, 20_000, replacement=True, generator=g)  # (5, n) drafts from q
    accept = torch.rand(draws.shape, generator=g) < (p.gather(-1, draws) / q.gather(-1, draws)).clamp(max=1)
    assert torch.allclose(accept.float().mean(-1), exact, atol=0.015), (accept.float().mean(-1), exact)
    top = teacher.topk(4, dim=-1)
    assert (accepted_mass(student, top.indices, top.values) <= exact + 1e-6).all()
    vocab = torch.tensor([0, 3, 7, 20])  # a subset: the student's logits over these 4 columns; ids past 20 outside
    sub = student[:, vocab]
    expected = torch.minimum(p[:, vocab], sub.softmax(-1)).sum(-1)
    assert torch.allclose(accepted_mass(sub, full.indices, full.values, vocab), expected, atol=1e-6)


def test_tv_target_trains_a_student_to_be_accepted():
    """Gradient steps on the tv loss raise the acceptance rate sum min(p, q) of a random student to near the most a
    top-16 teacher lets it see."""
    g = torch.Generator().manual_seed(2)
    teacher = (2 * torch.randn(4, V, generator=g)).log_softmax(-1)
    top = teacher.topk(16, dim=-1)
    student = torch.randn(4, V, generator=g).requires_grad_()
    accepted = lambda: float(torch.minimum(teacher.exp(), student.softmax(-1)).sum(-1).mean())  # noqa: E731
    before = accepted()
    optimizer = torch.optim.Adam([student], lr=0.1)
    for _ in range(300):
        optimizer.zero_grad()
        distill_loss(student, top_ids=top.indices, top_logp=top.values, target="tv").backward()
        optimizer.step()
    reachable = float(top.values.exp().sum(-1).mean())  # the overlap the top-16 can show (the rest counts as none)
    assert before < 0.5 and accepted() > 0.95 * reachable, (before, accepted(), reachable)


def test_trimmed_vocabulary_drops_teacher_tokens_outside_it():
    vocab = torch.tensor([3, 10, 50])
    index = subset_index(vocab, V, torch.device("cpu"))
    student = torch.randn(2, 3)
    ids = torch.tensor([[10, 4, 50], [5, 6, 7]])  # row 2 has no token in the subset: left out of the mean
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.4, 0.3, 0.3]]))
    p = torch.tensor([0.5, 0.2]) / 0.7
    expected = -(p * student[0].log_softmax(-1)[torch.tensor([1, 2])]).sum()
    assert torch.allclose(distill_loss(student, top_ids=ids, top_logp=logp, index=index), expected)
    assert agreement(torch.tensor([[0.0, 5.0, 0.0]]), torch.tensor([[10, 3]]), vocab) == 1.0
    assert agreement(torch.tensor([[0.0, 5.0, 0.0]]), torch.tensor([[3, 10]]), vocab) == 0.0


# ------------------------------------------------------------------------------------------ the draft model family


def test_draft_model_learns_the_base_and_only_itself():
    base = make_base(depth=2)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, V, (8, 4), generator=g).tolist()
    text = torch.tensor(
        [p + c for p, c in zip(prompts, plain_generate(Target(base), prompts, max_new_tokens=28).tokens)]
    )
    batch = teacher_batch(base, text, top_k=V)
    torch.manual_seed(0)
    draft = draft_family.build(base, dim=32, depth=1, heads=2)
    before = draft_family.evaluate(draft, base, batch)
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-2)
    for _ in range(80):
        loss, metrics = draft_family.loss(draft, base, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(p.grad is None for p in base.parameters())
    assert all(p.grad is not None for p in draft.parameters() if p.requires_grad)
    after = draft_family.evaluate(draft, base, batch)
    assert set(after) == {"agree", "top1", "mass", "chain_tau", "chain_mass"}
    assert after["agree"] > 0.8 > before["agree"], (before, after)
    assert after["mass"] > before["mass"] and 1 <= after["chain_mass"] <= 4  # T = 1 acceptance rises too
    assert after["chain_tau"] > 1 + after["agree"] > before["chain_tau"]  # chains of 3 drafts: runs past the first
    trimmed = draft_family.evaluate(draft, base, batch, vocab=torch.arange(0, V, 3))
    assert trimmed["agree"] < after["agree"]  # the subset cannot hold every greedy token


def test_draft_model_refuses_another_vocabulary():
    base, other = make_base(), build_lm(num_tokens=50, dim=16, depth=1, heads=2, max_seq_len=64)
    batch = teacher_batch(base, stream(34).view(2, 17), top_k=4)
    with pytest.raises(ValueError, match="50 tokens, the base 97"):
        draft_family.loss(other, base, batch)


def test_default_window_is_independent_of_a_long_context():
    """seq_len null: the base's context, but never a pretrained base's 8,192 positions per window."""
    from experiments.lib.training.features import DEFAULT_WINDOW, default_seq_len

    assert DEFAULT_WINDOW == 512
    assert default_seq_len(None, 8192) == 512 and default_seq_len(None, 256) == 256
    assert default_seq_len(1024, 8192) == 1024  # an explicit window is the user's


def test_a_failed_shard_write_leaves_no_temporary_file_and_the_old_shard_whole(tmp_path, monkeypatch):
    """A full disk mid-shard (shards are gigabytes): the write raises, no temporary file stays behind, the shard it
    was replacing (a grown cache's short last one) keeps its bytes, and the next run completes the cache."""
    from experiments.lib.training import features

    base, ids, d = make_base(), stream(), tmp_path / "f"
    write_features(d, base, ids, spec_for(windows=20), shard_windows=6)  # its last shard holds 2 windows
    last = d / "shard-00003.safetensors"
    before = last.read_bytes()

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 1000)  # part of a shard, then the disk is full
        raise OSError(28, "No space left on device", filename)

    monkeypatch.setattr(features, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_features(d, base, ids, spec_for(windows=24))  # grows: the short last shard is written again
    assert last.read_bytes() == before
    assert [p.name for p in d.iterdir() if p.name.endswith(".tmp")] == []
    monkeypatch.undo()
    write_features(d, base, ids, spec_for(windows=24))
    assert FeatureCache(d, spec_for(windows=24)).data["tokens"].shape == (24, 17)


def test_a_killed_runs_temporary_shard_is_removed_by_the_next_run(tmp_path):
    """SIGKILL or out of memory mid-shard leaves the temporary file (nothing can clean up then): the next run
    removes it once its process is gone and it is an hour old, and leaves a live writer's alone."""
    import os
    import subprocess

    base, ids, d = make_base(), stream(), tmp_path / "f"
    d.mkdir()
    child = subprocess.Popen(["true"])
    child.wait()  # reaped: its pid names no process now
    dead = child.pid
    orphan = d / f".shard-00000.safetensors.{dead}.0badc0de.tmp"
    live = d / f".shard-00001.safetensors.{os.getpid()}.0badc0de.tmp"
    for path in (orphan, live):
        path.write_bytes(b"\0" * 100)
        os.utime(path, (0, 0))  # long ago
    write_features(d, base, ids, spec_for(windows=20), shard_windows=6)
    assert not orphan.exists() and live.exists()
