"""A draft model cut from its base (`drafter.module.init=base`): a copy of a Llama base's embeddings, first blocks,
final norm and output layer. Checked: the cut model is the base's logit lens at that depth (so every weight is the
base's, in the right place), training moves its blocks but never its input and output layers nor the base,
a checkpoint rebuilds it, speculative decoding with it equals plain decoding at T=0 (also with a trimmed vocabulary),
and bad settings get one line. Tiny random Llamas from a config (nothing is downloaded)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from experiments.lib.families import draft as draft_family  # noqa: E402
from experiments.lib.training.features import teacher_batch  # noqa: E402
from experiments.lib.training.loop import make_optimizer, set_lr  # noqa: E402
from prophet.model import base_features  # noqa: E402
from tests.conftest import make_lm  # noqa: E402
from tests.test_early_exit_llama import DEPTH, V, llama  # noqa: E402
from tests.test_hf import PROMPTS, gpt2  # noqa: E402
from verify.backends.target import Target  # noqa: E402
from verify.drafters.draft_model import make_drafter  # noqa: E402
from verify.loop.plain import plain_generate  # noqa: E402
from verify.loop.speculative import SpecConfig, speculative_generate  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def nudged(module: torch.nn.Module, scale: float = 0.05, seed: int = 0) -> torch.nn.Module:
    """The cut model moved off the logit lens (as training moves it), so its drafts are accepted and rejected."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return module


@pytest.mark.parametrize("depth", [1, 2, DEPTH - 1])
def test_cut_model_is_the_bases_logit_lens_at_its_depth(depth):
    base = llama()
    draft = draft_family.build(base, init="base", depth=depth)
    assert draft.depth == depth and draft.num_tokens == base.num_tokens
    tokens = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(0))
    _, _, states = base_features(base, tokens, (depth,))
    with torch.no_grad():  # the base's final norm and output layer on its own residual stream after `depth` blocks
        lens = base.hf.lm_head(base.hf.model.norm(states[:, :, 0]))
        torch.testing.assert_close(draft(tokens), lens, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_training_moves_the_blocks_never_the_input_and_output_layers_or_the_base(tied):
    base = llama(tied=tied)
    before = {name: p.detach().clone() for name, p in base.named_parameters()}
    draft = draft_family.build(base, init="base", depth=2)
    frozen = {"embed": draft.hf.model.embed_tokens.weight, "head": draft.to_logits.weight}
    assert not any(p.requires_grad for p in frozen.values())
    assert (frozen["head"] is frozen["embed"]) == tied  # tied as the base ties them
    kept = {name: p.detach().clone() for name, p in frozen.items()}
    blocks = {name: p.detach().clone() for name, p in draft.hf.model.layers.named_parameters()}
    tokens = torch.randint(0, V, (8, 33), generator=torch.Generator().manual_seed(1))
    batch = teacher_batch(base, tokens)
    start = draft_family.evaluate(draft, base, batch)
    opt = make_optimizer(draft, lr=3e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    set_lr(opt, 3e-2)  # as the training loop sets it each step: fine-tuning, a gentler lr
    assert all(group["lr"] == pytest.approx(3e-2 * draft_family.LR_SCALE) for group in opt.param_groups)
    for _ in range(40):
        loss, _ = draft_family.loss(draft, base, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    end = draft_family.evaluate(draft, base, batch)
    assert end["agree"] > start["agree"] + 0.05, (start, end)
    assert all(torch.equal(frozen[name], kept[name]) for name in frozen)
    moved = [name for name, p in draft.hf.model.layers.named_parameters() if not torch.equal(p, blocks[name])]
    assert len(moved) == len(blocks), set(blocks) - set(moved)  # every block parameter learned
    assert all(torch.equal(p, before[name]) for name, p in base.named_parameters())  # the base is frozen
    assert (base.hf.lm_head.weight is base.hf.model.embed_tokens.weight) == tied  # and not rebuilt


def test_a_checkpoint_rebuilds_the_trained_cut_model():
    """What load_drafter does: build(base, **module) again (a fresh cut), then the saved state strictly."""
    base = llama()
    trained = nudged(draft_family.build(base, init="base", depth=2))
    state = trained.state_dict()
    rebuilt = draft_family.build(base, init="base", depth=2)
    rebuilt.load_state_dict(state, strict=True)
    tokens = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(tokens), trained(tokens), atol=0, rtol=0)


@pytest.mark.parametrize("trimmed", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_decoding_with_the_cut_draft_model_equals_plain(trimmed, batch, gamma):
    base = llama()
    prompts = PROMPTS[:batch]
    reference = plain_generate(Target(base), prompts, max_new_tokens=24).tokens
    vocab = torch.arange(0, V, 2) if trimmed else None  # a trimmed output layer: drafts only even ids
    drafter = make_drafter(nudged(draft_family.build(base, init="base", depth=2)), base, vocab=vocab)
    out = speculative_generate(Target(base), drafter, prompts, max_new_tokens=24, spec=SpecConfig(gamma=gamma))
    assert out.tokens == reference
    accepted = int(out.stats.accepted.sum())
    assert 0 < accepted < int(out.stats.proposed.sum()), accepted  # accepted and rejected: rollbacks ran


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda b: draft_family.build(b, init="pretrained"), r"init='pretrained': must be one of random, base"),
        (lambda b: draft_family.build(b, init="base", depth=0), r"depth=0: init='base' takes 1 to 3 of the base's 4"),
        (lambda b: draft_family.build(b, init="base", depth=DEPTH), r"depth=4: init='base' takes 1 to 3"),
        (lambda b: draft_family.build(b, init="base", depth=True), r"depth=True: init='base' takes 1 to 3"),
        (lambda b: draft_family.build(gpt2(), init="base"), r"from a Llama base .*this base is GPT2LMHeadModel"),
    ],
)
def test_bad_settings_raise_one_line_errors(make, match):
    with pytest.raises(ValueError, match=match) as excinfo:
        make(llama())
    assert "\n" not in str(excinfo.value)


def test_an_x_transformers_base_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"from a Llama base .*this base is TransformerWrapper: use init=random"):
        draft_family.build(make_lm(), init="base", depth=1)
