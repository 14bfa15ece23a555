"""Early exit on a Hugging Face Llama (the real base's kind, SmolLM2) on the lean Llama engine: the first-blocks
forward, an exit head that starts as the Llama's logit lens (RMSNorm + lm_head), exact greedy drafting on the
target's own cache, the rollback of that cache, the training path through Llama features, and one-line errors.
Tiny random Llamas built from a config, as tests/test_hf.py builds them (nothing is downloaded)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from experiments.lib.families import early_exit as exit_family  # noqa: E402
from experiments.lib.training.features import teacher_batch  # noqa: E402
from prophet.model import base_features  # noqa: E402
from tests.test_hf import PROMPTS, gpt2  # noqa: E402
from verify.backends.hf import HFBase, HFTarget  # noqa: E402
from verify.backends.lean import lean  # noqa: E402
from verify.backends.target import Target  # noqa: E402
from verify.drafters.early_exit import EarlyExitDrafter, make_drafter  # noqa: E402
from verify.loop.plain import plain_generate  # noqa: E402
from verify.loop.sampling import SamplingConfig  # noqa: E402
from verify.loop.speculative import SpecConfig, speculative_generate  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
V = 97
DEPTH = 4
EPS = 0.25  # far from the default 1e-6: a head that ignored the config's eps would not be the logit lens


def llama(*, seed: int = 0, tied: bool = True) -> HFBase:
    """A 4-block Llama with grouped-query attention and, as SmolLM2, the output layer tied to the embeddings."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=DEPTH,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=EPS,
        tie_word_embeddings=tied,
        initializer_range=0.5,  # wide: the default 0.02 gives near-uniform logits, where greedy rides on float noise
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return HFBase(transformers.LlamaForCausalLM(config)).eval()


def noisy_head(base: HFBase, layer: int, scale: float = 0.05, seed: int = 0) -> exit_family.ExitHead:
    """An exit head moved away from the logit lens, so that drafts are both accepted and rejected."""
    head = exit_family.build(base, layer=layer)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return head


@pytest.mark.parametrize("blocks", [1, 2, 3])
def test_first_blocks_are_the_llamas_layer_states_and_write_only_their_layers(blocks):
    base = llama()
    engine = lean(base)
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9]])
    cache = engine.decoder.new_cache(1, 16)
    state = engine.first_blocks(tokens, cache, blocks=blocks)  # (1, 6, d)
    _, _, reference = base_features(base, tokens, (blocks,))  # transformers' own hidden_states[blocks]
    torch.testing.assert_close(state, reference[:, :, 0], atol=1e-4, rtol=1e-4)
    full = engine.decoder.new_cache(1, 16)
    engine(tokens, full)
    for layer in range(DEPTH):  # the first `blocks` attention layers hold the full forward's entries; the rest none
        if layer < blocks:
            torch.testing.assert_close(cache.k[layer][:, :, :6], full.k[layer][:, :, :6])
            torch.testing.assert_close(cache.v[layer][:, :, :6], full.v[layer][:, :, :6])
        else:
            assert not cache.k[layer].any() and not cache.v[layer].any()
    assert cache.lengths.tolist() == [6]


def test_fresh_head_is_the_llamas_logit_lens_and_a_copy_of_its_tied_output_layer():
    base = llama()
    head = exit_family.build(base, layer=2)
    tokens = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    _, _, states = base_features(base, tokens, (2,))
    state = states[:, :, 0]
    with torch.no_grad():  # the base's own final RMSNorm (its gain, the config's eps) and lm_head on that state
        lens = base.hf.lm_head(base.hf.model.norm(state))
    torch.testing.assert_close(head(state), lens, atol=1e-5, rtol=1e-5)
    # training moves the head's copy only: the base's lm_head, tied to its embeddings, is never touched
    embeddings = base.hf.model.embed_tokens.weight.detach().clone()
    opt = torch.optim.SGD(head.parameters(), lr=1.0)
    batch = teacher_batch(base, torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(1)), layers=(2,))
    loss, _ = exit_family.loss(head, base, batch)
    loss.backward()
    opt.step()
    assert all(p.grad is None for p in base.parameters())
    assert not torch.equal(head.projection.weight, base.hf.lm_head.weight)  # the copy moved
    assert base.hf.lm_head.weight is base.hf.model.embed_tokens.weight  # still tied: the base was not rebuilt
    assert torch.equal(base.hf.model.embed_tokens.weight, embeddings)


def test_training_on_llama_features_raises_agreement():
    """The drafter trainer's path: the feature batch carries layer `layer`'s states (teacher_batch, as the feature
    cache writes them), the loss trains the head on them, evaluate reports chain_tau."""
    base = llama()
    head = exit_family.build(base, layer=1)
    tokens = torch.randint(0, V, (8, 33), generator=torch.Generator().manual_seed(0))
    batch = teacher_batch(base, tokens, layers=(1,))
    before = exit_family.evaluate(head, base, batch)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(60):
        loss, _ = exit_family.loss(head, base, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = exit_family.evaluate(head, base, batch)
    assert after["agree"] > before["agree"] + 0.2, (before, after)
    assert after["chain_tau"] > before["chain_tau"], (before, after)


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_early_exit_on_a_llama_equals_plain_greedy(share, batch, gamma):
    base = llama()
    prompts = PROMPTS[:batch]
    reference = plain_generate(Target(base), prompts, max_new_tokens=24).tokens
    drafter = make_drafter(noisy_head(base, layer=2), base, share_cache=share)
    out = speculative_generate(Target(base), drafter, prompts, max_new_tokens=24, spec=SpecConfig(gamma=gamma))
    assert out.tokens == reference
    accepted = int(out.stats.accepted.sum())
    assert 0 < accepted < int(out.stats.proposed.sum()), accepted  # accepted and rejected: rollbacks ran


def test_propose_leaves_the_llama_targets_cache_as_it_found_it():
    base = llama()
    target = Target(base)
    drafter = make_drafter(noisy_head(base, layer=3), base)
    drafter.attach(target)
    prefill = target.prefill(PROMPTS)
    pending = prefill.logits[:, -1].argmax(-1)
    drafter.begin(PROMPTS, prefill, pending)
    lengths = target.cache.lengths.clone()
    before = [(target.cache.k[i].clone(), target.cache.v[i].clone()) for i in range(DEPTH)]
    draft = drafter.propose(4, SamplingConfig(), None)
    assert draft.tokens.shape == (3, 4)
    assert torch.equal(target.cache.lengths, lengths) and target.cache.exact_bound() == int(lengths.max())
    for i, (k, v) in enumerate(before):  # every committed entry is untouched
        for row, n in enumerate(lengths.tolist()):
            assert torch.equal(k[row, :, :n], target.cache.k[i][row, :, :n])
            assert torch.equal(v[row, :, :n], target.cache.v[i][row, :, :n])
    # verification after drafting sees the cache plain decoding would: the same logits as a target that never drafted
    chain = torch.cat((pending[:, None], draft.tokens), dim=1)
    verified = target.extend(chain)
    fresh = Target(base)
    fresh.prefill(PROMPTS)
    torch.testing.assert_close(verified.logits, fresh.extend(chain).logits, atol=0, rtol=0)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda b: exit_family.build(b, layer=0), r"drafter.module.layer=\[0\]: 0 is not a block index in \[1, 3\]"),
        (lambda b: exit_family.build(b, layer=DEPTH), r"layer=\[4\]: 4 is not a block index in \[1, 3\]"),
        (lambda b: exit_family.build(b, layer=True), r"True is not a block index in \[1, 3\]"),
        (lambda b: exit_family.build(b, layer="2"), r"'2' is not a block index in \[1, 3\]"),
        (lambda b: EarlyExitDrafter(b, lambda s: s, layer=DEPTH), r"layer=\[4\]: 4 is not a block index in \[1, 3\]"),
        (
            lambda b: exit_family.build(gpt2(), layer=1),
            r"early exit needs a base the lean engine runs .*got a Hugging Face GPT2LMHeadModel",
        ),
        (
            lambda b: make_drafter(exit_family.build(b, layer=1), b).attach(HFTarget(b)),
            r"share_cache=True drafts on the lean engine's cache.*\(HFTarget\)",
        ),
        (
            lambda b: make_drafter(exit_family.build(b, layer=1), llama(seed=1)).attach(Target(b)),
            r"built on another model than the target",
        ),
    ],
)
def test_bad_arguments_raise_one_line_errors(make, match):
    with pytest.raises(ValueError, match=match) as excinfo:
        make(llama())
    assert "\n" not in str(excinfo.value)
