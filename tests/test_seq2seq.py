"""Encoder-decoder targets in the one speculative loop: tiny random x-transformers encoder-decoders (and a
tiny random HF T5) built here, float32. Exactness needs no trained model."""

import itertools
import math

import pytest
import torch
from x_transformers import Decoder, Encoder, TransformerWrapper, XTransformer

from experiments.lib.data.seq2seq import function_docstrings
from tests.test_lossless import NEW, TRIALS, chi_square
from verify.backends.engine import UnsupportedModel
from verify.drafters.prompt_lookup import PromptLookupDrafter
from verify.encdec.seq2seq import Seq2SeqDraftDrafter, Seq2SeqTarget
from verify.loop.plain import plain_generate
from verify.loop.sampling import SamplingConfig, probs_from_logits
from verify.loop.speculative import SpecConfig, speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")

V, BOS = 40, 0
SOURCES = [[5, 6, 7, 8, 9, 5, 6, 7], [3, 4], [10, 11, 12, 13, 10, 11]]  # ragged


def make_encdec(
    *, dim: int = 32, depth: int = 2, seed: int = 0, num_tokens: int = V, scale: float = 1.0, max_len: int = 32
) -> XTransformer:
    torch.manual_seed(seed)
    model = XTransformer(
        dim=dim,
        enc_num_tokens=num_tokens,
        enc_depth=depth,
        enc_heads=2,
        enc_max_seq_len=16,
        enc_rotary_pos_emb=True,
        dec_num_tokens=num_tokens,
        dec_depth=depth,
        dec_heads=2,
        dec_max_seq_len=max_len,
        dec_rotary_pos_emb=True,
    )
    with torch.no_grad():  # random small weights give near-uniform outputs: sharpen them
        model.decoder.net.to_logits.weight.mul_(scale)
    return model.eval()


def noisy_copy(model: XTransformer, noise: float, seed: int = 1) -> XTransformer:
    """The target's weights plus noise: a draft model that is accepted sometimes, rows differing."""
    draft = make_encdec(seed=0)
    draft.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen))
    return draft.eval()


@pytest.fixture(scope="module")
def model():
    return make_encdec(scale=4.0)


def reference_logits(model: XTransformer, source: list[int], decoder_tokens: list[int]) -> torch.Tensor:
    """x-transformers' own forward: (n, V) next-token logits after each decoder token."""
    with torch.no_grad():
        encoded = model.encoder(torch.tensor([source]), return_embeddings=True)
        return model.decoder.net(torch.tensor([decoder_tokens]), context=encoded)[0]


# ------------------------------------------------------------------------------------- exactness


def test_plain_greedy_equals_xtransformers_generate(model):
    out = plain_generate(Seq2SeqTarget(model, bos_id=BOS), SOURCES, max_new_tokens=12)
    for source, tokens in zip(SOURCES, out.tokens):
        ref = model.generate(torch.tensor([source]), torch.tensor([[BOS]]), 12, temperature=0.0)
        assert tokens == ref[0].tolist()
    assert len({tuple(t) for t in out.tokens}) == len(SOURCES)  # the source matters


@pytest.mark.parametrize("drafter", ["self", "noisy", "small", "lookup"])
@pytest.mark.parametrize("gamma", [1, 3])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_speculative_equals_plain(model, drafter, gamma, batch):
    target, sources = Seq2SeqTarget(model, bos_id=BOS), SOURCES[:batch]
    make = {
        "self": lambda: Seq2SeqDraftDrafter(model, bos_id=BOS),  # always accepted
        "noisy": lambda: Seq2SeqDraftDrafter(noisy_copy(model, 0.1), bos_id=BOS),  # sometimes
        "small": lambda: Seq2SeqDraftDrafter(make_encdec(dim=16, depth=1, seed=3), bos_id=BOS),
        "lookup": lambda: PromptLookupDrafter(vocab_size=V),
    }
    plain = plain_generate(target, sources, max_new_tokens=20, eos_id=2)
    spec = speculative_generate(
        target, make[drafter](), sources, max_new_tokens=20, eos_id=2, spec=SpecConfig(gamma=gamma)
    )
    assert spec.tokens == plain.tokens
    if drafter == "self":
        assert spec.stats.alpha == 1.0


def test_noisy_draft_rows_accept_different_lengths(model):
    """The ragged-acceptance case the exactness test above needs to have exercised."""
    target = Seq2SeqTarget(model, bos_id=BOS)
    spec = speculative_generate(
        target,
        Seq2SeqDraftDrafter(noisy_copy(model, 0.1), bos_id=BOS),
        SOURCES,
        max_new_tokens=20,
        spec=SpecConfig(gamma=3),
    )
    assert 0 < spec.stats.alpha < 1
    assert len(set(spec.stats.forwards.tolist())) > 1


def test_prompt_lookup_drafts_from_the_source():
    """The loop hands the drafter the sources as prompts: prompt lookup searches source + generated text
    unchanged, so a generated token that occurs in the source proposes what followed it there."""
    drafter = PromptLookupDrafter(vocab_size=V, max_ngram=2)
    drafter.begin([[10, 11, 12, 13, 14, 15]], None, torch.tensor([12]))  # generated so far: [12]
    assert drafter.propose(3, SamplingConfig(), None).tokens.tolist() == [[13, 14, 15]]


def test_tree_extend_equals_each_path_alone(model):
    target = Seq2SeqTarget(model, bos_id=BOS)
    target.prefill(SOURCES[:2])
    target.extend(torch.tensor([[7, 9], [4, 4]]))  # a cached prefix beyond the start token
    tokens = torch.tensor([[11, 12, 13, 14, 15], [21, 22, 23, 24, 25]])
    parents = torch.tensor([-1, -1, 0, 0, 2])  # two roots; node 4 is root 0's grandchild
    tree = target.extend(tokens, parents=parents).logits
    for b, prefix in enumerate([[BOS, 7, 9], [BOS, 4, 4]]):
        for node, path in enumerate([[0], [1], [0, 2], [0, 3], [0, 2, 4]]):
            ref = reference_logits(model, SOURCES[b], prefix + tokens[b, path].tolist())[-1]
            torch.testing.assert_close(tree[b, node], ref, atol=1e-4, rtol=1e-4)


def test_rollback_then_extend_equals_a_fresh_run(model):
    """Rows keep different prefixes of a chain, then a tree path (a compaction); the next extend's
    logits equal the reference run of exactly the kept tokens."""
    target = Seq2SeqTarget(model, bos_id=BOS)
    target.prefill(SOURCES[:2])
    target.extend(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]))
    target.commit(torch.tensor([[True, True, False, False], [True, False, False, False]]))
    assert target.row_lengths.tolist() == [3, 2]
    target.extend(torch.tensor([[9, 10, 11], [12, 13, 14]]), parents=torch.tensor([-1, -1, 1]))
    target.commit(torch.tensor([[False, True, True], [True, False, False]]))  # row 0: path 1 -> 2, moved down
    out = target.extend(torch.tensor([[17], [18]])).logits[:, -1]
    for b, kept in enumerate([[BOS, 1, 2, 10, 11, 17], [BOS, 5, 12, 18]]):
        torch.testing.assert_close(out[b], reference_logits(model, SOURCES[b], kept)[-1], atol=1e-4, rtol=1e-4)


def test_prefill_returns_the_first_decoder_position(model):
    out = Seq2SeqTarget(model, bos_id=BOS).prefill(SOURCES)
    assert out.logits.shape == (3, 1, V)
    for b, source in enumerate(SOURCES):
        torch.testing.assert_close(out.logits[b, -1], reference_logits(model, source, [BOS])[-1], atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------ losslessness

SOURCE = [1, 2, 3, 1, 2]
SMALL_V = 6


def exact_joint(model: XTransformer, sampling: SamplingConfig) -> dict[tuple, float]:
    """p(x1, x2, x3 | source) under the sampling transform, every decoder prefix enumerated in one forward."""
    prefixes = list(itertools.product(range(SMALL_V), repeat=NEW - 1))
    with torch.no_grad():
        encoded = model.encoder(torch.tensor([SOURCE] * len(prefixes)), return_embeddings=True)
        logits = model.decoder.net(torch.tensor([[BOS, *pre] for pre in prefixes]), context=encoded)
    p = probs_from_logits(logits, sampling)  # (prefixes, NEW, V)
    return {
        pre + (last,): math.prod(float(p[row, i, t]) for i, t in enumerate(pre + (last,)))
        for row, pre in enumerate(prefixes)
        for last in range(SMALL_V)
    }


@pytest.mark.parametrize(
    "drafter, delta, lossless", [("draft", 0.0, True), ("lookup", 0.0, True), ("draft", 0.5, False)]
)
def test_sampling_reproduces_the_target_distribution(drafter, delta, lossless):
    # Short decoders and a small max_draft: 20,000 rows of cache stay a few MB.
    model = make_encdec(dim=16, depth=1, num_tokens=SMALL_V, scale=3.0, max_len=NEW + 2)
    draft = make_encdec(dim=16, depth=1, num_tokens=SMALL_V, seed=5, scale=3.0, max_len=NEW + 2)
    made = Seq2SeqDraftDrafter(draft, bos_id=BOS) if drafter == "draft" else PromptLookupDrafter(vocab_size=SMALL_V)
    sampling = SamplingConfig(temperature=1.0)
    out = speculative_generate(
        Seq2SeqTarget(model, bos_id=BOS, max_draft=2),
        made,
        [SOURCE] * TRIALS,
        max_new_tokens=NEW + 1,
        spec=SpecConfig(gamma=2, delta=delta),
        sampling=sampling,
        generator=torch.Generator().manual_seed(0),
    )
    assert 0 < out.stats.alpha < 1  # both acceptance and rejection were exercised
    stat, critical = chi_square([t[:NEW] for t in out.tokens], exact_joint(model, sampling))
    assert (stat < critical) == lossless, f"chi2 {stat:.1f} vs critical {critical:.1f} (delta {delta})"


# ---------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "sources, max_new, match",
    [
        ([[1, 2], []], 4, r"^source 1 is empty: every source needs at least one token$"),
        ([[1, V]], 4, rf"^source 0 has token id {V}: ids must be in \[0, {V}\)$"),
        ([list(range(17))], 4, r"^source 0 has 17 tokens: the encoder takes at most 16$"),
        (
            [[1, 2]],
            32,
            r"^max_new_tokens=32: the decoder takes at most max_seq_len - 1 = 31 new tokens after its start token$",
        ),
        ([], 4, r"^prompts=\[\]: need at least one source$"),
    ],
)
def test_bad_sources_raise_one_line_errors(model, sources, max_new, match):
    with pytest.raises(ValueError, match=match):
        plain_generate(Seq2SeqTarget(model, bos_id=BOS), sources, max_new_tokens=max_new)


def test_a_draft_encoder_shorter_than_the_source_is_a_one_line_error(model):
    short = XTransformer(
        dim=16,
        enc_num_tokens=V,
        enc_depth=1,
        enc_heads=2,
        enc_max_seq_len=4,
        enc_rotary_pos_emb=True,
        dec_num_tokens=V,
        dec_depth=1,
        dec_heads=2,
        dec_max_seq_len=32,
        dec_rotary_pos_emb=True,
    )
    with pytest.raises(ValueError, match=r"^source 0 has 8 tokens: the encoder takes at most 4$"):
        speculative_generate(
            Seq2SeqTarget(model, bos_id=BOS), Seq2SeqDraftDrafter(short, bos_id=BOS), SOURCES[:1], max_new_tokens=4
        )


def test_layers_and_bad_models_are_refused_in_one_line(model):
    target = Seq2SeqTarget(model, bos_id=BOS)
    target.use_layers(())
    with pytest.raises(
        ValueError, match=r"^layers=\[1\]: an encoder-decoder target gives no layer states \(only \(\) is allowed\)$"
    ):
        target.use_layers((1,))
    with pytest.raises(ValueError, match=rf"^bos_id={V}: must be a token id in \[0, {V}\)$"):
        Seq2SeqTarget(model, bos_id=V)
    encoder = TransformerWrapper(num_tokens=V, max_seq_len=16, attn_layers=Encoder(dim=16, depth=1, heads=2))
    plain = TransformerWrapper(
        num_tokens=V,
        max_seq_len=16,
        use_abs_pos_emb=False,
        attn_layers=Decoder(dim=16, depth=1, heads=2, rotary_pos_emb=True),
    )
    with pytest.raises(
        UnsupportedModel, match=r"cross_attend=False: the lean engine implements only cross_attend=True"
    ):
        Seq2SeqTarget((encoder, plain), bos_id=BOS)
    absolute = TransformerWrapper(
        num_tokens=V, max_seq_len=16, attn_layers=Decoder(dim=16, depth=1, heads=2, cross_attend=True)
    )
    with pytest.raises(UnsupportedModel, match=r"absolute position embedding"):
        Seq2SeqTarget((encoder, absolute), bos_id=BOS)


# ------------------------------------------------------------------------------------------- data


def test_function_docstrings_removes_the_docstring_and_keeps_the_summary():
    text = (
        'class A:\n    def f(self, x):\n        """Add one.\n\n        Longer text.\n        """\n'
        "        return x + 1\n\n"
        'def g():\n    """Only a docstring."""\n\ndef h(): "same line"; return 1\n'
    )
    assert function_docstrings(text) == [("f", "def f(self, x):\n    return x + 1\n", "Add one.")]
    assert function_docstrings("def broken(:\n") == []


# ------------------------------------------------------------------------------------ HF T5


def make_t5(*, d_model: int = 32, layers: int = 2, seed: int = 0, std: float = 0.5, **special):
    """A tiny random T5 (nothing downloaded). Its default init decodes one token forever; normal weights
    of std 0.5 give outputs that vary with the source. `special` overrides the special token ids."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.T5Config(
        vocab_size=V,
        d_model=d_model,
        d_kv=16,
        d_ff=2 * d_model,
        num_layers=layers,
        num_decoder_layers=layers,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        **{"decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1, **special},
    )
    model = transformers.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" not in name:
                p.normal_(0.0, std)
    return model


T5_SOURCES = [[3, 4, 20, 30], [5, 6, 7, 8, 9, 5, 6, 7], [11, 3, 4, 20, 12, 30]]


def test_t5_plain_greedy_equals_t5_generate():
    from verify.encdec.t5 import T5Target

    model = make_t5()
    target = T5Target(model)
    outputs = set()
    for source in T5_SOURCES:
        ours = plain_generate(target, [source], max_new_tokens=16, eos_id=1).tokens[0]
        ref = model.generate(torch.tensor([source]), do_sample=False, max_new_tokens=16)[0, 1:].tolist()
        assert ours == ref
        outputs.add(tuple(ours))
    assert len(outputs) > 1


@pytest.mark.parametrize("drafter", ["self", "small", "lookup"])
@pytest.mark.parametrize("gamma", [1, 3])
def test_t5_greedy_speculative_equals_plain(drafter, gamma):
    from verify.encdec.t5 import T5DraftDrafter, T5Target

    target = T5Target(make_t5())
    make = {
        "self": lambda: T5DraftDrafter(make_t5()),
        "small": lambda: T5DraftDrafter(make_t5(d_model=16, layers=1, seed=3)),
        "lookup": lambda: PromptLookupDrafter(vocab_size=V),
    }
    for source in T5_SOURCES:
        plain = plain_generate(target, [source], max_new_tokens=16, eos_id=1)
        spec = speculative_generate(
            target, make[drafter](), [source], max_new_tokens=16, eos_id=1, spec=SpecConfig(gamma=gamma)
        )
        assert spec.tokens == plain.tokens
        if drafter == "self":
            assert spec.stats.alpha == 1.0


def test_t5_a_list_of_eos_ids_equals_t5_generate():
    from verify.encdec.t5 import T5DraftDrafter, T5Target

    model = make_t5()
    source = T5_SOURCES[0]
    free = plain_generate(T5Target(model), [source], max_new_tokens=24).tokens[0]
    eos = [1, free[1]]  # the source's output meets the second id at its 2nd token, and never meets 1
    ref = model.generate(torch.tensor([source]), do_sample=False, max_new_tokens=24, eos_token_id=eos)[0, 1:].tolist()
    assert ref == free[:2] and 1 not in free
    assert plain_generate(T5Target(model), [source], max_new_tokens=24, eos_id=eos).tokens[0] == ref
    for gamma in (1, 3):  # the self-draft is always right: the EOS is inside an accepted draft for gamma 3
        out = speculative_generate(
            T5Target(model),
            T5DraftDrafter(make_t5()),
            [source],
            max_new_tokens=24,
            eos_id=eos,
            spec=SpecConfig(gamma=gamma),
        )
        assert out.tokens[0] == ref


def test_t5_starts_at_the_bos_without_a_decoder_start_token_as_t5_generate():
    from verify.encdec.t5 import T5DraftDrafter, T5Target

    model = make_t5(decoder_start_token_id=None, bos_token_id=7)
    target = T5Target(model)
    assert target.bos_id == 7
    for source in T5_SOURCES:
        ref = model.generate(torch.tensor([source]), do_sample=False, max_new_tokens=12)[0].tolist()
        assert ref[0] == 7
        assert plain_generate(target, [source], max_new_tokens=12, eos_id=1).tokens[0] == ref[1:]
        out = speculative_generate(
            target,
            T5DraftDrafter(make_t5(decoder_start_token_id=None, bos_token_id=7)),
            [source],
            max_new_tokens=12,
            eos_id=1,
            spec=SpecConfig(gamma=3),
        )
        assert out.tokens[0] == ref[1:]
    # generation_config before config, as generate reads them
    model = make_t5()
    model.generation_config.decoder_start_token_id = 9
    ref = model.generate(torch.tensor([T5_SOURCES[0]]), do_sample=False, max_new_tokens=12)[0].tolist()
    assert ref[0] == 9 and model.config.decoder_start_token_id == 0
    assert plain_generate(T5Target(model), [T5_SOURCES[0]], max_new_tokens=12, eos_id=1).tokens[0] == ref[1:]


def test_t5_without_a_start_token_is_a_one_line_error():
    from verify.encdec.t5 import T5Target

    model = make_t5(decoder_start_token_id=None, bos_token_id=None)
    with pytest.raises(ValueError) as theirs:
        model.generate(torch.tensor([T5_SOURCES[0]]), max_new_tokens=4)
    assert "decoder_start_token_id" in str(theirs.value)
    with pytest.raises(ValueError) as excinfo:
        T5Target(model)
    assert str(excinfo.value) == (
        "decoder_start_token_id=None and bos_token_id=None: a T5 decoder needs a start token (set "
        "decoder_start_token_id, or bos_token_id, in the model's generation_config or config)"
    )
    with pytest.raises(ValueError, match=r"^decoder_start_token_id=40: must be a token id in \[0, 40\)$"):
        T5Target(make_t5(decoder_start_token_id=V))


def test_t5_and_draft_model_misuse_is_refused_in_one_line(model):
    from tests.conftest import make_lm
    from verify.backends.hf import HFBase
    from verify.drafters.draft_model import DraftModelDrafter
    from verify.encdec.t5 import T5DraftDrafter, T5Target

    causal = make_lm(num_tokens=V)
    for bad in (causal, model, HFBase(tiny_llama())):
        for cls in (T5Target, T5DraftDrafter):
            with pytest.raises(ValueError) as excinfo:
                cls(bad)
            assert str(excinfo.value) == (
                f"{cls.__name__} takes a transformers T5ForConditionalGeneration (an encoder-decoder), got "
                f"{type(bad).__name__}"
            )
    for bad in (make_t5(), model):
        with pytest.raises(ValueError) as excinfo:
            DraftModelDrafter(bad)
        assert str(excinfo.value) == (
            "DraftModelDrafter takes a causal LM (an x-transformers TransformerWrapper, or a Hugging Face causal LM "
            f"wrapped as HFBase), got {type(bad).__name__}: for T5 use T5DraftDrafter (verify.encdec.t5), for an "
            "x-transformers encoder-decoder Seq2SeqDraftDrafter (verify.encdec.seq2seq)"
        )
    DraftModelDrafter(causal)  # a causal LM is taken


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(config).eval()


def test_t5_rollback_then_extend_equals_a_fresh_run():
    from verify.encdec.t5 import T5Target

    model = make_t5()
    target = T5Target(model)
    target.prefill([T5_SOURCES[1]])
    target.extend(torch.tensor([[7, 8, 9, 10]]))
    target.commit(torch.tensor([[True, True, False, False]]))
    assert target.row_lengths.tolist() == [3]
    out = target.extend(torch.tensor([[12]])).logits[0, -1]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([T5_SOURCES[1]]), decoder_input_ids=torch.tensor([[0, 7, 8, 12]])).logits[
            0, -1
        ]
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_t5_refuses_batches_trees_and_layers_in_one_line():
    from verify.encdec.t5 import T5Target

    target = T5Target(make_t5())
    with pytest.raises(
        ValueError, match=r"^batch of 2 sources: the T5 target decodes one source at a time \(batch 1\)$"
    ):
        plain_generate(target, T5_SOURCES[:2], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"^source 0 has token id 40: ids must be in \[0, 40\)$"):
        plain_generate(target, [[1, V]], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"^layers=\[1\]: a T5 target gives no layer states"):
        target.use_layers((1,))
    target.prefill([T5_SOURCES[0]])
    with pytest.raises(ValueError, match=r"^parents given: the T5 target verifies chains only"):
        target.extend(torch.tensor([[5, 6]]), parents=torch.tensor([-1, -1]))
    target.extend(torch.tensor([[5, 6]]))
    with pytest.raises(ValueError, match=r"^keep is not a prefix"):
        target.commit(torch.tensor([[False, True]]))


# ------------------------------------------------------------------------------------ entry point

TINY = [
    "logger=none",
    "data.max_files=60",
    "data.vocab_size=512",
    "target.dim=32",
    "target.enc_depth=1",
    "target.dec_depth=1",
    "target.heads=2",
    "draft.dim=16",
    "draft.enc_depth=1",
    "draft.dec_depth=1",
    "draft.heads=2",
    "train.target_steps=6",
    "train.draft_steps=4",
    "train.batch_size=4",
    "train.log_every=2",
    "train.eval_pairs=8",
    "bench.pairs=3",
    "bench.batch=2",
    "bench.max_new_tokens=8",
    "bench.repeats=1",
]


def seq2seq_cfg(*overrides: str):
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        return compose("seq2seq", overrides=["out_dir=/tmp/unused", *overrides])


@pytest.mark.parametrize(
    "override, match",
    [
        ("mode=serve", r"^mode='serve': use one of train, bench, all$"),
        ("mode=bench", r"^mode=bench needs checkpoints="),
        ("target.dim=30", r"^target.dim=30 must be a multiple of target.heads=4$"),
        ("draft.enc_depth=0", r"^draft.enc_depth=0: must be an integer >= 1$"),
        ("pairs.max_target_tokens=1", r"^pairs.max_target_tokens=1: must be an integer >= 2$"),
        ("train.draft_minutes=0", r"^train.draft_minutes=0: must be a number > 0, or null"),
        ("bench.max_new_tokens=65", r"^bench.max_new_tokens=65: must be at most pairs.max_target_tokens=64"),
        ("bench.batch=0", r"^bench.batch=0: must be an integer >= 1$"),
        ("bench.temperatures=[]", r"^bench.temperatures=\[\]: must be a non-empty list of finite numbers >= 0$"),
        ("bench.temperatures=[0,inf]", r"^bench.temperatures=\[0, inf\]: must be a non-empty list of finite numbers"),
        ("bench.temperatures=[1e-30]", r"^temperature=1e-30: must be a number >= 0, and 0 or at least 1e-06"),
        ("train.lr=inf", r"^train.lr=inf: must be a finite number > 0$"),
        ("train.checkpoint_every=0", r"^train.checkpoint_every=0: must be an integer >= 1$"),
        ("train.eval_every=0", r"^train.eval_every=0: must be an integer >= 1$"),
        ("train.patience=-1", r"^train.patience=-1: must be null or an integer >= 1$"),
        ("train.patience=2.5", r"^train.patience=2.5: must be null or an integer >= 1$"),
        ("train.min_delta=-1", r"^train.min_delta=-1: must be a finite number >= 0$"),
        ("data=files", r"^data.source='files': the function -> docstring task reads the stdlib only"),
    ],
)
def test_bad_settings_raise_one_line_errors_before_any_work(override, match):
    from experiments.train_seq2seq import validate_config

    validate_config(seq2seq_cfg())  # the defaults are valid
    with pytest.raises(ValueError, match=match):
        validate_config(seq2seq_cfg(override))


@pytest.mark.slow
def test_train_and_benchmark_end_to_end(tmp_path):
    import json

    from experiments.lib.store.checkpoint import load_checkpoint
    from experiments.train_seq2seq import run

    cfg = seq2seq_cfg(*TINY, f"data.cache_dir={tmp_path / 'data'}")
    cfg.out_dir = str(tmp_path / "run")
    result = run(cfg)
    assert {"target", "draft", "bench"} <= result.keys()
    meta = load_checkpoint(tmp_path / "run" / "target" / "checkpoint").meta
    assert meta["model_config"]["dim"] == 32 and meta["task"] == "function -> docstring summary"
    rows = json.loads((tmp_path / "run" / "results.json").read_text())["rows"]
    assert {(r["method"], r["temperature"]) for r in rows} == {
        (m, t) for m in ("plain", "draft", "lookup") for t in (0.0, 1.0)
    }
    assert all(r["identical_to_plain"] for r in rows if r["temperature"] == 0)
    assert "| 0 | lookup |" in (tmp_path / "run" / "results.md").read_text()


@pytest.mark.slow
def test_a_crash_during_the_draft_keeps_the_target_and_resumes_the_draft(tmp_path, monkeypatch):
    from experiments.lib.store.checkpoint import load_checkpoint
    from experiments.lib.training import loop as training
    from experiments.train_seq2seq import run

    def cfg(*more):
        c = seq2seq_cfg(
            *TINY,
            "mode=train",
            "train.checkpoint_every=2",
            "train.target_minutes=null",
            "train.draft_minutes=null",
            "threads=1",
            f"data.cache_dir={tmp_path / 'data'}",
            *more,
        )
        return c

    clean = cfg()
    clean.out_dir = str(tmp_path / "clean")
    run(clean)
    real_step = training.TrainLoop.step

    def crash_in_the_draft(self, elapsed):
        if self.unit == "pairs" and self.out_dir.name == "draft" and self.state.step == 3:
            raise RuntimeError("killed")
        return real_step(self, elapsed)

    crashed = cfg()
    crashed.out_dir = str(tmp_path / "crashed")
    monkeypatch.setattr(training.TrainLoop, "step", crash_in_the_draft)
    with pytest.raises(RuntimeError, match="killed"):
        run(crashed)
    monkeypatch.undo()
    target_before = load_checkpoint(tmp_path / "crashed" / "target" / "checkpoint").meta
    assert target_before["finished"] and load_checkpoint(tmp_path / "crashed" / "draft" / "last").meta["step"] == 2
    run(crashed)
    target_after = load_checkpoint(tmp_path / "crashed" / "target" / "checkpoint").meta
    assert target_after["provenance"]["time"] == target_before["provenance"]["time"]  # reused, not retrained
    for name in ("target", "draft"):  # and both equal the uninterrupted run's, bit for bit
        fingerprints = {
            load_checkpoint(tmp_path / run_dir / name / "checkpoint").meta["fingerprint"]
            for run_dir in ("clean", "crashed")
        }
        assert len(fingerprints) == 1, name
