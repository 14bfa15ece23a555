"""Early exit: the engine's first-blocks forward, the exit head, the drafter on the target's own cache
(exactness against plain greedy, rollback, losslessness at T=1) and one-line errors."""

import pytest
import torch

from experiments.lib.families import early_exit as exit_family
from experiments.lib.training.features import teacher_batch
from prophet.model import base_features
from tests.conftest import make_lm
from tests.test_lossless import NEW, PROMPT, TRIALS, VOCAB, chi_square, exact_joint
from verify.backends.lean import lean
from verify.backends.target import Target
from verify.drafters.early_exit import make_drafter
from verify.loop.drafter import Verdict
from verify.loop.plain import plain_generate
from verify.loop.sampling import SamplingConfig
from verify.loop.speculative import SpecConfig, speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]  # ragged on purpose


def noisy_head(lm, layer: int, scale: float = 0.05, seed: int = 0):
    """An exit head moved away from its initialisation (a fresh head is the logit lens)."""
    head = exit_family.build(lm, layer=layer)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return head


@pytest.mark.parametrize("blocks", [1, 2, 3])
def test_first_blocks_are_the_base_layer_states_and_write_only_their_layers(blocks):
    lm = make_lm(depth=4)
    engine = lean(lm)
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9]])
    cache = engine.decoder.new_cache(1, 16)
    state = engine.first_blocks(tokens, cache, blocks=blocks)  # (1, 6, d)
    _, _, reference = base_features(lm, tokens, (blocks,))
    torch.testing.assert_close(state, reference[:, :, 0], atol=1e-5, rtol=1e-4)
    full = engine.decoder.new_cache(1, 16)
    engine(tokens, full)
    for layer in range(4):  # the first `blocks` attention layers hold the full forward's keys; the rest nothing
        if layer < blocks:
            torch.testing.assert_close(cache.k[layer][:, :, :6], full.k[layer][:, :, :6], atol=1e-5, rtol=1e-4)
        else:
            assert not cache.k[layer].any()
    assert cache.lengths.tolist() == [6]


def test_fresh_head_is_the_logit_lens_and_only_the_head_gets_gradients():
    lm = make_lm(depth=3)
    head = exit_family.build(lm, layer=2)
    tokens = torch.randint(0, 97, (2, 9))
    _, _, states = base_features(lm, tokens, (2,))
    norm = lm.attn_layers.final_norm
    torch.testing.assert_close(head(states[:, :, 0]), lm.to_logits(norm(states[:, :, 0])), atol=1e-5, rtol=1e-4)
    batch = teacher_batch(lm, torch.randint(0, 97, (2, 10)), layers=(2,))
    loss, metrics = exit_family.loss(head, lm, batch)
    loss.backward()
    assert all(p.grad is None for p in lm.parameters())
    assert all(p.grad is not None for p in head.parameters())
    assert not any(name.startswith(("token_emb", "attn_layers")) for name in head.state_dict())
    assert 0 <= metrics["agree"] <= 1


def test_training_raises_agreement_with_the_base():
    lm = make_lm(depth=3)
    head = exit_family.build(lm, layer=1)
    batch = teacher_batch(lm, torch.randint(0, 97, (8, 33), generator=torch.Generator().manual_seed(0)), layers=(1,))
    before = exit_family.evaluate(head, lm, batch)["agree"]
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(60):
        loss, _ = exit_family.loss(head, lm, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = exit_family.evaluate(head, lm, batch)["agree"]
    assert after > before + 0.2, (before, after)


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("gamma", [1, 2, 3, 5])
def test_greedy_early_exit_equals_plain_greedy(share, batch, gamma):
    lm = make_lm(depth=4)
    prompts = PROMPTS[:batch]
    reference = plain_generate(Target(lm), prompts, max_new_tokens=24).tokens
    drafter = make_drafter(noisy_head(lm, layer=2), lm, share_cache=share)
    out = speculative_generate(Target(lm), drafter, prompts, max_new_tokens=24, spec=SpecConfig(gamma=gamma))
    assert out.tokens == reference
    assert int(out.stats.accepted.sum()) > 0  # drafts were accepted, so the rollbacks were exercised


def test_trimmed_vocabulary_and_eos_stay_exact():
    lm = make_lm(depth=3)
    vocab = torch.arange(0, 97, 2)  # even ids only: odd tokens can never be drafted
    reference = plain_generate(Target(lm), PROMPTS, max_new_tokens=20, eos_id=5).tokens
    drafter = make_drafter(noisy_head(lm, layer=1), lm, vocab=vocab)
    out = speculative_generate(Target(lm), drafter, PROMPTS, max_new_tokens=20, spec=SpecConfig(gamma=3), eos_id=5)
    assert out.tokens == reference


def test_shared_and_own_cache_draft_the_same_tokens():
    lm = make_lm(depth=4)
    head = noisy_head(lm, layer=2)
    runs = []
    for share in (True, False):
        out = speculative_generate(
            Target(lm), make_drafter(head, lm, share_cache=share), PROMPTS, max_new_tokens=24, spec=SpecConfig(gamma=3)
        )
        runs.append(out.stats.accepted.tolist())
    assert runs[0] == runs[1]


def test_propose_leaves_the_targets_cache_as_it_found_it():
    lm = make_lm(depth=4)
    target = Target(lm)
    drafter = make_drafter(noisy_head(lm, layer=3), lm)
    drafter.attach(target)
    prefill = target.prefill(PROMPTS)
    pending = prefill.logits[:, -1].argmax(-1)
    drafter.begin(PROMPTS, prefill, pending)
    lengths = target.cache.lengths.clone()
    keys = [k.clone() for k in target.cache.k]
    draft = drafter.propose(4, SamplingConfig(), None)
    assert draft.tokens.shape == (3, 4)
    # bound: an upper bound kept without a host read after a rewind; exact_bound reads the lengths back
    assert torch.equal(target.cache.lengths, lengths) and target.cache.exact_bound() == int(lengths.max())
    for before, after in zip(keys, target.cache.k):  # every committed entry is untouched
        for row, n in enumerate(lengths.tolist()):
            assert torch.equal(before[row, :, :n], after[row, :, :n])
    # verification after drafting gives the same logits as without drafting
    verified = target.extend(torch.cat((pending[:, None], draft.tokens), dim=1))
    fresh = Target(lm)
    fresh.prefill(PROMPTS)
    torch.testing.assert_close(verified.logits, fresh.extend(torch.cat((pending[:, None], draft.tokens), dim=1)).logits)


def sharp(lm, scale: float = 2.0):
    with torch.no_grad():
        lm.to_logits.weight.mul_(scale)
    return lm


def test_sampling_reproduces_the_target_distribution():
    lm = sharp(make_lm(num_tokens=VOCAB, dim=16, depth=2, seed=0, max_seq_len=16))  # caches of TRIALS rows: small
    head = noisy_head(lm, layer=1, scale=0.3)
    sampling = SamplingConfig(temperature=1.0)
    out = speculative_generate(
        Target(lm),
        make_drafter(head, lm),
        [PROMPT] * TRIALS,
        max_new_tokens=NEW + 1,
        spec=SpecConfig(gamma=2),
        sampling=sampling,
        generator=torch.Generator().manual_seed(0),
    )
    assert 0 < out.stats.alpha < 1  # both acceptance and rejection were exercised
    stat, critical = chi_square([t[:NEW] for t in out.tokens], exact_joint(lm, sampling))
    assert stat < critical, f"chi2 {stat:.1f} >= critical {critical:.1f}: the output is not the target's distribution"


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda lm: exit_family.build(lm, layer=0), r"layer=\[0\]: 0 is not a block index in \[1, 3\]"),
        (lambda lm: exit_family.build(lm, layer=4), r"4 is not a block index in \[1, 3\]"),
        (lambda lm: exit_family.build(lm, layer=True), r"True is not a block index"),
        (lambda lm: exit_family.build(lm, layer=1, num_layers=-1), r"num_layers=-1: must be an integer >= 0"),
        (lambda lm: make_drafter(exit_family.build(lm, layer=1), lm, share_cache="yes"), r"share_cache='yes'"),
        (
            lambda lm: make_drafter(exit_family.build(lm, layer=1), make_lm(depth=4, seed=1)).attach(Target(lm)),
            r"built on another model than the target",
        ),
    ],
)
def test_bad_arguments_raise_one_line_errors(make, match):
    with pytest.raises(ValueError, match=match) as excinfo:
        make(make_lm(depth=4))
    assert "\n" not in str(excinfo.value)


def test_shared_cache_without_the_loop_says_how_to_decode():
    lm = make_lm(depth=2)
    drafter = make_drafter(exit_family.build(lm, layer=1), lm)
    prefill = Target(lm).prefill(PROMPTS)
    with pytest.raises(ValueError, match="speculative_generate, which calls drafter.attach"):
        drafter.begin(PROMPTS, prefill, prefill.logits[:, -1].argmax(-1))


def test_head_needs_its_layer_in_the_batch():
    lm = make_lm(depth=3)
    head = exit_family.build(lm, layer=1)
    with pytest.raises(ValueError, match="needs the batch's states of that one layer"):
        exit_family.loss(head, lm, teacher_batch(lm, torch.randint(0, 97, (2, 9))))


def test_verdict_commit_keeps_the_own_cache_in_step():
    """With an own cache, rejected drafts leave it and accepted ones stay: it always holds what the target's
    holds except the uncached tokens before the pending one (the last accepted one; more after a step
    without drafts), in every row still generating."""
    lm = make_lm(depth=4)
    target = Target(lm)
    drafter = make_drafter(noisy_head(lm, layer=2), lm, share_cache=False)
    seen = []
    original = drafter.commit

    def spy(verdict: Verdict) -> None:
        original(verdict)
        active, waiting = verdict.active, drafter.uncached.shape[1] - 1  # uncached tokens the target has cached
        seen.append(bool(torch.equal(drafter.cache.lengths[active] + waiting, target.cache.lengths[active])))

    drafter.commit = spy
    speculative_generate(target, drafter, PROMPTS, max_new_tokens=16, spec=SpecConfig(gamma=3))
    assert seen and all(seen)


@pytest.mark.slow
@pytest.mark.parametrize("share", [True, False])
def test_compiled_early_exit_equals_plain_greedy(share):
    """torch.compile'd draft steps (the first blocks on the cache's whole buffers) against a compiled target."""
    lm = make_lm(depth=4)
    reference = plain_generate(Target(lm), PROMPTS, max_new_tokens=24).tokens
    drafter = make_drafter(noisy_head(lm, layer=2), lm, share_cache=share, compile=True)
    out = speculative_generate(
        Target(lm, compile=True, widths=(1, 4)), drafter, PROMPTS, max_new_tokens=24, spec=SpecConfig(gamma=3)
    )
    assert out.tokens == reference and int(out.stats.accepted.sum()) > 0
