"""The lean engine: the same logits as x-transformers' own forward (fp32, max abs difference <= 1e-4) for
prefill, chains, trees and ragged batches; one-line refusals of options it does not implement."""

import pytest
import torch
from x_transformers import Decoder, TransformerWrapper

from experiments.lib.store.lm import build_lm
from verify.backends.cache import tree_attention
from verify.backends.engine import LeanDecoder, UnsupportedModel
from verify.backends.lean import check_against_reference, lean
from verify.backends.target import Target

TOL = 1e-4


def project_lm(seed: int = 0):
    """The project's own base shape (build_lm: dim // heads per head, partial rotary), random weights."""
    torch.manual_seed(seed)
    return build_lm(num_tokens=101, dim=64, depth=3, heads=4, max_seq_len=80).eval()


def full(lm, seq):
    return lm(torch.tensor([seq]))[0]


def test_prefill_and_chain_match_x_transformers():
    lm = project_lm()
    prompts = [[5, 6, 7], list(range(10, 30)), [1] * 9]  # ragged
    target = Target(lm)
    first = target.prefill(prompts)
    chain = torch.tensor([[40, 41, 42, 43]] * 3)
    out = target.extend(chain).logits
    for i, p in enumerate(prompts):
        ref = full(lm, p + chain[i].tolist())
        assert (first.logits[i, -len(p) :] - ref[: len(p)]).abs().max() <= TOL
        assert (out[i] - ref[len(p) :]).abs().max() <= TOL


def test_hidden_states_match_x_transformers():
    lm = project_lm(1)
    seq = list(range(3, 40))
    target = Target(lm)
    hidden = target.prefill([seq]).hidden[0]
    _, ref = lm(torch.tensor([seq]), return_logits_and_embeddings=True)
    assert (hidden - ref[0]).abs().max() <= TOL


def test_tree_after_ragged_rollback_matches_paths_alone():
    lm = project_lm(2)
    prompts = [[5, 6, 7, 8], list(range(20, 31))]
    target = Target(lm)
    target.prefill(prompts)
    target.extend(torch.tensor([[50, 51, 52], [60, 61, 62]]))
    keep = torch.tensor([[True, True, False], [True, False, False]])
    target.commit(keep)
    parents = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 1, 1, 0]])
    tokens = torch.tensor([[70, 71, 72, 73, 74], [80, 81, 82, 83, 84]])
    out = target.extend(tokens, parents=parents).logits
    ancestors, _ = tree_attention(parents)
    for i, p in enumerate(prompts):
        ctx = p + [[50, 51], [60]][i]
        for node in range(5):
            path = ancestors[i, node].nonzero().flatten().tolist()
            assert (out[i, node] - full(lm, ctx + tokens[i, path].tolist())[-1]).abs().max() <= TOL


def test_padded_fixed_width_extends_equal_unpadded():
    """What a compiled target does (pad every extend to a fixed width) changes no logits and no cache."""
    lm = project_lm(3)
    prompts = [[5, 6, 7], list(range(10, 22))]
    plain, padded = Target(lm), Target(lm)
    padded.compiled, padded.widths = True, (8,)  # the padding path, on the eager engine
    for t in (plain, padded):
        t.prefill(prompts)
    chain = torch.tensor([[30, 31, 32], [33, 34, 35]])
    parents = torch.tensor([-1, 0, 0, 1])
    tree = torch.tensor([[40, 41, 42, 43], [44, 45, 46, 47]])
    for t in (plain, padded):
        t.out = [t.extend(chain).logits]
        t.commit(torch.tensor([[True, True, False], [True, False, False]]))
        t.out.append(t.extend(tree, parents=parents).logits)
        t.commit(torch.tensor([[True, False, True, False], [True, True, False, True]]))
        t.out.append(t.extend(torch.tensor([[9], [9]])).logits)
    assert padded.row_lengths.tolist() == plain.row_lengths.tolist() == [3 + 2 + 2 + 1, 12 + 1 + 3 + 1]
    for a, b in zip(plain.out, padded.out):
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-5


def test_eager_attention_reads_only_the_slots_in_use(monkeypatch):
    """Eager steps attend over the used slots rounded up to 64, not the whole buffer, with the same logits."""
    lm = project_lm(12)
    target = Target(lm, max_draft=100)  # capacity 181
    spans = []
    real = LeanDecoder.forward
    monkeypatch.setattr(
        LeanDecoder,
        "forward",
        lambda self, x, k, v, *a, **kw: spans.append(k[0].shape[2]) or real(self, x, k, v, *a, **kw),
    )
    seq = list(range(1, 75))
    target.prefill([seq[:10]])
    out = target.extend(torch.tensor([seq[10:74]])).logits[0]
    assert spans == [64, 128] and target.cache.capacity == 161
    assert (out - full(lm, seq)[10:]).abs().max() <= TOL


def test_cache_grows_past_its_capacity():
    lm = project_lm(4)
    target = Target(lm, max_draft=1)  # 80 + 1 + 1 = 82 slots
    seq = list(range(1, 90))
    target.prefill([seq[:70]])
    assert target.cache.capacity == 82
    out = target.extend(torch.tensor([seq[70:89]])).logits[0]  # 70 + 19 > 82: the buffers grow
    assert target.cache.capacity >= 89
    assert (out - full(lm, seq)[70:]).abs().max() <= TOL


def _wrapper(**decoder_kwargs):
    kwargs = dict(dim=32, depth=1, heads=2, rotary_pos_emb=True, verbose=False) | decoder_kwargs
    return TransformerWrapper(num_tokens=50, max_seq_len=32, use_abs_pos_emb=False, attn_layers=Decoder(**kwargs))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(ff_glu=True), "feed-forward"),
        (dict(attn_qk_norm=True), "qk_norm"),
        (dict(attn_num_mem_kv=2), "num_mem_kv"),
        (dict(attn_kv_heads=1), "kv_heads"),
        (dict(sandwich_norm=True), "sandwich_norm"),
        (dict(use_rmsnorm=True), "LayerNorm"),
        (dict(rotary_pos_emb=False), "rotary"),
        (dict(rotary_xpos=True), "rotary"),
        (dict(residual_attn=True), "residual_attn"),
    ],
)
def test_unsupported_options_refused_in_one_line(kwargs, match):
    with pytest.raises(UnsupportedModel, match=match) as err:
        Target(_wrapper(**kwargs))
    assert "\n" not in str(err.value)


def test_absolute_positions_refused():
    model = TransformerWrapper(num_tokens=50, max_seq_len=32, attn_layers=Decoder(dim=32, depth=1, heads=2))
    with pytest.raises(UnsupportedModel, match="absolute position"):
        Target(model)


def test_numerical_check_catches_what_structure_misses():
    lm = project_lm(5)
    engine = lean(lm)
    with torch.no_grad():
        lm.to_logits.weight.add_(1.0)  # the engine shares this weight: give it another one, so only the reference moves
        engine.head_weight = torch.randn(101, 64)
        with pytest.raises(UnsupportedModel, match="differs from the model.s own forward"):
            check_against_reference(lm, engine)


def test_trimmed_output_layer_gives_the_subsets_logits():
    lm = project_lm(11)
    ids = torch.tensor([0, 3, 7, 50, 100])
    target = Target(lm, vocab=ids)
    seq = list(range(2, 20))
    logits = target.prefill([seq]).logits[0]  # (n, N)
    assert logits.shape == (len(seq), 5)
    assert (logits - full(lm, seq)[:, ids]).abs().max() <= TOL


def test_engine_rebuilt_when_weights_change():
    lm = project_lm(6)
    first = lean(lm)
    assert lean(lm) is first  # cached
    with torch.no_grad():
        lm.attn_layers.layers[0][1].to_q.weight.mul_(1.5)  # an optimizer step does this in place
    second = lean(lm)
    assert second is not first
    seq = list(range(5, 25))
    logits, _ = second(torch.tensor([seq]), second.decoder.new_cache(1, 32))
    assert (logits[0] - full(lm, seq)).abs().max() <= TOL


def test_decoder_only_engine_matches():
    torch.manual_seed(7)
    decoder = Decoder(dim=32, depth=2, heads=4, rotary_pos_emb=True, verbose=False).eval()
    engine = lean(decoder, LeanDecoder)
    x = torch.randn(2, 9, 32)
    with torch.inference_mode():
        out = engine(x, engine.new_cache(2, 16))
    assert (out - decoder(x)).abs().max() <= TOL


@pytest.mark.slow
def test_compiled_target_matches_eager():
    lm = project_lm(8)
    prompts = [[5, 6, 7], list(range(10, 22))]
    eager, compiled = Target(lm), Target(lm, compile=True, widths=(1, 4))
    outs = []
    for t in (eager, compiled):
        t.prefill(prompts)
        outs.append(
            [t.extend(torch.tensor([[30, 31, 32], [33, 34, 35]])).logits, t.extend(torch.tensor([[1], [2]])).logits]
        )
    for a, b in zip(*outs):
        assert (a - b).abs().max() <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("family", ["draft_model", "prophet_chain", "prophet_tree", "fused_chain", "fused_tree"])
def test_compiled_drafters_stay_exact(family):
    """Greedy speculative decoding with compiled target and drafter steps equals compiled plain decoding."""
    from prophet import train as prophet_train
    from prophet.drafter import make_drafter
    from verify.drafters.draft_model import DraftModelDrafter
    from verify.loop.plain import plain_generate
    from verify.loop.speculative import SpecConfig, speculative_generate

    base = project_lm(9)
    prompts = [[5, 6, 7, 8], list(range(10, 25))]
    if family == "draft_model":
        drafter = DraftModelDrafter(project_lm(10), compile=True)
    else:
        fuse = [1] if family.startswith("fused") else None  # EAGLE-3 fusion: the target returns block 1's states
        prophet = prophet_train.build(base, dim=32, depth=1, heads=2, fuse_layers=fuse).eval()
        if fuse:
            with torch.no_grad():  # a mix that really reads the layer states (a fresh one ignores them)
                prophet.mix.weight.add_(
                    0.1 * torch.randn(prophet.mix.weight.shape, generator=torch.Generator().manual_seed(0))
                )
        drafter = make_drafter(prophet, base, mode=family.split("_")[1], compile=True)
    target = Target(base, compile=True, widths=(1, 4, 17))
    ref = plain_generate(target, prompts, max_new_tokens=12).tokens
    out = speculative_generate(target, drafter, prompts, max_new_tokens=12, spec=SpecConfig(gamma=3))
    assert out.tokens == ref
    # the same drafts as the eager drafter (greedy output alone would hold whatever was drafted), and no
    # silent fallback to eager: the engine makes torch fail at its recompile limit instead
    drafter.compile = False
    if family == "draft_model":
        drafter = DraftModelDrafter(project_lm(10))
    eager = speculative_generate(Target(base), drafter, prompts, max_new_tokens=12, spec=SpecConfig(gamma=3))
    assert (
        out.stats.accepted.tolist() == eager.stats.accepted.tolist()
        and out.stats.forwards.tolist() == eager.stats.forwards.tolist()
    )
    assert torch._dynamo.config.fail_on_recompile_limit_hit


# ------------------------------------------------------------------------ layer states (prophet fusion)


def layer_states(lm, seq, layers):
    """x-transformers' residual states after `layers` for one sequence: (n, S, d) (prophet.model.base_features)."""
    from prophet.model import base_features

    return base_features(lm, torch.tensor([seq]), layers)[2][0]


def test_layer_states_match_base_features():
    """prefill (left-padded like hidden), a chain and a tree after a ragged rollback: each position's states
    after the chosen blocks, in the order chosen, equal x-transformers' for its own context."""
    lm = project_lm(13)
    layers = (2, 1)
    prompts = [[5, 6, 7, 8], list(range(20, 31))]
    target = Target(lm)
    target.use_layers(layers)
    first = target.prefill(prompts)
    assert first.layers.shape == (2, 11, 2, 64)
    for i, p in enumerate(prompts):
        assert (first.layers[i, -len(p) :] - layer_states(lm, p, layers)).abs().max() <= TOL
    drafts = [[50, 51, 52], [60, 61, 62]]
    chain = target.extend(torch.tensor(drafts))
    for i, p in enumerate(prompts):
        assert (chain.layers[i] - layer_states(lm, p + drafts[i], layers)[len(p) :]).abs().max() <= TOL
        assert (chain.hidden[i, :, None] - chain.layers[i]).abs().max() > 0.1  # not the final hidden state
    target.commit(torch.tensor([[True, True, False], [True, False, False]]))
    parents = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 1, 1, 0]])
    tokens = torch.tensor([[70, 71, 72, 73, 74], [80, 81, 82, 83, 84]])
    tree = target.extend(tokens, parents=parents)
    ancestors, _ = tree_attention(parents)
    for i, p in enumerate(prompts):
        ctx = p + [[50, 51], [60]][i]
        for node in range(5):
            path = ancestors[i, node].nonzero().flatten().tolist()
            ref = layer_states(lm, ctx + tokens[i, path].tolist(), layers)[-1]
            assert (tree.layers[i, node] - ref).abs().max() <= TOL


def test_layer_states_cost_nothing_unless_asked_and_survive_padding():
    """No layers asked: the engine returns logits and hidden only and outputs carry None. A padded
    fixed-width extend (what a compiled target does) gives the unpadded layer states."""
    lm = project_lm(14)
    prompts = [[5, 6, 7], list(range(10, 22))]
    target = Target(lm)
    assert len(target.engine(torch.tensor([[1, 2]]), target.engine.decoder.new_cache(1, 8))) == 2
    assert target.prefill(prompts).layers is None and target.extend(torch.tensor([[1], [2]])).layers is None
    plain, padded = Target(lm), Target(lm)
    padded.compiled, padded.widths = True, (8,)  # the padding path, on the eager engine
    outs = []
    for t in (plain, padded):
        t.use_layers([1])
        t.prefill(prompts)
        outs.append(
            [
                t.extend(torch.tensor([[30, 31, 32], [33, 34, 35]])).layers,
                t.extend(torch.tensor([[40, 41, 42, 43]] * 2), parents=torch.tensor([-1, 0, 0, 1])).layers,
            ]
        )
    for a, b in zip(*outs):
        assert a.shape == b.shape and a.shape[2] == 1 and (a - b).abs().max() <= 1e-5


@pytest.mark.parametrize(
    "layers, match",
    [
        ((0,), r"0 is not a block index in \[1, 2\]"),
        ((3,), r"3 is not a block index in \[1, 2\]"),
        ((-1,), r"-1 is not a block index"),
        ((1.0,), r"1.0 is not a block index"),
        ((True,), r"True is not a block index"),
        ((1, 1), "each block at most once"),
        (2, "must be a list of block indices"),
    ],
)
def test_bad_layers_refused_in_one_line(layers, match):
    target = Target(project_lm(15))
    with pytest.raises(ValueError, match=match) as err:
        target.use_layers(layers)
    assert "\n" not in str(err.value) and target.layers == ()
    with pytest.raises(ValueError, match="single block"):
        Target(_wrapper()).use_layers((1,))


@pytest.mark.slow
def test_compiled_layer_states_match_eager():
    lm = project_lm(16)
    prompts = [[5, 6, 7], list(range(10, 22))]
    eager, compiled = Target(lm), Target(lm, compile=True, widths=(1, 4))
    outs = []
    for t in (eager, compiled):
        t.use_layers((1, 2))
        t.prefill(prompts)
        outs.append([t.extend(torch.tensor([[30, 31, 32], [33, 34, 35]])), t.extend(torch.tensor([[1], [2]]))])
    for a, b in zip(*outs):
        assert b.layers.shape == a.layers.shape
        assert (a.layers - b.layers).abs().max() <= TOL and (a.hidden - b.hidden).abs().max() <= TOL
    seq = prompts[1] + [33, 34, 35, 2]
    assert (outs[1][1].layers[1] - layer_states(lm, seq, (1, 2))[-1:]).abs().max() <= TOL
