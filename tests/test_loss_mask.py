"""The answer mask of a FeatureBatch: every family's loss and evaluate read only the predictions whose target
token is an answer token. Per family: no mask equals an all-True one; changing the teacher (and the target tokens
where tokens are only targets) at masked-out positions changes nothing, at one masked-in position it changes the
loss; gradients reach only the masked-in positions; an all-False mask is a finite zero loss that still has a graph,
with NaN-free metrics; a mask of the wrong shape or dtype is a one-line ValueError. And the shared pieces: the
masked distillation loss and agreement, the batch's own methods, the rows taken for ranks and micro-batches, the
positions Medusa samples and the starts the block prophet draws, validation's weights."""

import math
from dataclasses import dataclass, replace
from types import ModuleType

import pytest
import torch
from torch import Tensor, nn

from experiments.lib.families import draft as draft_family
from experiments.lib.families import early_exit as exit_family
from experiments.lib.families.registry import family as find_family
from experiments.lib.store.lm import build_lm
from experiments.lib.training import drafter_trainer
from experiments.lib.training.distributed import Dist, shard, take_rows
from experiments.lib.training.features import teacher_batch
from medusa import sequential_train
from medusa import train as medusa_train
from prophet import block_train
from prophet import train as prophet_train
from verify.training.distill import agreement, distill_loss, masked_mean
from verify.training.features import FeatureBatch

pytestmark = pytest.mark.usefixtures("one_thread")
V, B, T, TOP_K, HEADS, BLOCK = 97, 3, 20, 8, 3, 4
INSIDE = 7  # an answer position of row 0 that every family reads a target at (Medusa's head 1 from t = 6, ...)


def answer_mask() -> Tensor:
    """(B, T): chat-like windows, a question then an answer then a follow-up question and its answer; rows differ."""
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, 5:11] = mask[0, 14:] = True
    mask[1, 2:9] = mask[1, 16:19] = True
    mask[2, 9:] = True
    return mask


def perturbed(module: nn.Module, seed: int = 1, scale: float = 0.1) -> nn.Module:
    """A module moved away from its initialisation (a fresh head often copies the base: agreement would be 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=g))
    return module


@dataclass
class Case:
    family: ModuleType
    module: nn.Module
    base: nn.Module
    batch: FeatureBatch  # without a mask
    settings: dict
    tokens_are_targets: bool  # the family reads tokens only as targets (target="true"), never as inputs
    exact: bool  # with an all-True mask every term is computed exactly as without one

    def loss(self, batch: FeatureBatch, **settings) -> tuple[Tensor, dict[str, float]]:
        torch.manual_seed(0)  # the same sampled positions or starts for every call
        return self.family.loss(self.module, self.base, batch, **(self.settings | settings))

    def evaluate(self, batch: FeatureBatch) -> dict[str, float]:
        return self.family.evaluate(self.module, self.base, batch)


def base_lm(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    base = build_lm(num_tokens=V, dim=32, depth=3, heads=2, max_seq_len=96).eval()
    return base.requires_grad_(False)


def windows(base: nn.Module, layers: tuple[int, ...] = ()) -> FeatureBatch:
    tokens = torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(3))
    return teacher_batch(base, tokens, layers=layers, top_k=TOP_K)


def make_case(name: str) -> Case:
    base = base_lm()
    torch.manual_seed(0)
    if name in ("medusa", "sequential"):
        family = medusa_train if name == "medusa" else sequential_train
        module = perturbed(family.build(base, num_heads=HEADS))
        return Case(family, module, base, windows(base), {"positions": None}, name == "medusa", True)
    if name.startswith("prophet"):
        arch = {"prophet": {}, "prophet_eagle": {"arch": "eagle"}}.get(name, {"arch": "eagle3", "fuse_layers": [1, 2]})
        module = perturbed(prophet_train.build(base, dim=32, depth=1, heads=2, **arch))
        batch = windows(base, tuple(arch.get("fuse_layers", ())))
        return Case(prophet_train, module, base, batch, {"unroll": 2}, False, False)
    if name == "block":
        module = perturbed(block_train.build(base, dim=32, depth=1, heads=2, block=BLOCK))
        return Case(block_train, module, base, windows(base), {"starts": 3}, False, False)
    if name == "draft":
        module = perturbed(draft_family.build(base, dim=32, depth=1, heads=2))
        return Case(draft_family, module, base, windows(base), {}, False, True)
    module = perturbed(exit_family.build(base, layer=1))
    return Case(exit_family, module, base, windows(base, (1,)), {}, True, True)


NAMES = ["medusa", "sequential", "prophet", "prophet_eagle", "prophet_eagle3", "block", "draft", "early_exit"]


@pytest.fixture(scope="module", params=NAMES)
def case(request) -> Case:
    return make_case(request.param)


def masked(batch: FeatureBatch, mask: Tensor | None = None) -> FeatureBatch:
    return replace(batch, mask=answer_mask() if mask is None else mask)


def changed(batch: FeatureBatch, where: Tensor, *, tokens: bool = False) -> FeatureBatch:
    """The batch with the teacher reversed (its top-1 becomes its k-th) and moved to the next token ids at positions
    `where` (B, T), and with `tokens` the target tokens there too (token t + 1 for position t). Moved as well as
    reversed: a near-uniform student's tv loss sums min(p, q) = q over the same tokens in any order."""
    top_ids = torch.where(where[..., None], (batch.top_ids.flip(-1) + 1) % V, batch.top_ids)
    out = replace(batch, top_ids=top_ids)
    if tokens:
        targets = torch.where(where, (batch.tokens[:, 1:] + 1) % V, batch.tokens[:, 1:])
        out = replace(out, tokens=torch.cat((batch.tokens[:, :1], targets), dim=1))
    return out


def one_position(row: int, t: int) -> Tensor:
    where = torch.zeros(B, T, dtype=torch.bool)
    where[row, t] = True
    return where


# ---------------------------------------------------------------------------------------------- families


def test_no_mask_equals_an_all_true_mask(case):
    everything = masked(case.batch, torch.ones(B, T, dtype=torch.bool))
    loss, metrics = case.loss(case.batch)
    loss_all, metrics_all = case.loss(everything)
    if case.exact:
        assert torch.equal(loss, loss_all)
        assert metrics == metrics_all
    else:  # the feature regression is a mean of per-prediction means under a mask: equal up to rounding
        torch.testing.assert_close(loss, loss_all, rtol=1e-6, atol=0)
        assert metrics == pytest.approx(metrics_all, rel=1e-6, abs=0)
    assert case.evaluate(case.batch) == case.evaluate(everything)


@pytest.mark.parametrize("target", ["kl", "argmax", "true", "tv", "kl_tv"])
def test_masked_out_positions_change_nothing_and_a_masked_in_one_does(case, target):
    if target == "true" and not case.tokens_are_targets:
        pytest.skip("the family reads the tokens as inputs: changing them changes every later prediction")
    tokens = target == "true"
    batch = masked(case.batch)
    assert batch.mask[0, INSIDE]
    loss, metrics = case.loss(batch, target=target)
    outside_loss, outside_metrics = case.loss(changed(batch, ~batch.mask, tokens=tokens), target=target)
    assert torch.equal(loss, outside_loss) and metrics == outside_metrics
    assert case.evaluate(batch) == case.evaluate(changed(batch, ~batch.mask, tokens=tokens))
    inside_loss, _ = case.loss(changed(batch, one_position(0, INSIDE), tokens=tokens), target=target)
    assert not torch.equal(loss, inside_loss)  # the negative control: the mask does not simply drop everything


def test_all_false_mask_is_a_zero_loss_with_a_graph_and_nan_free_metrics(case):
    batch = masked(case.batch, torch.zeros(B, T, dtype=torch.bool))
    loss, metrics = case.loss(batch)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()  # a step on such a batch runs and moves nothing
    assert all(p.grad is None or not p.grad.any() for p in case.module.parameters())
    case.module.zero_grad(set_to_none=True)
    values = metrics | case.evaluate(batch)
    assert values and all(math.isfinite(v) for v in values.values()), values


@pytest.mark.parametrize(
    "mask", [torch.ones(B, T + 1, dtype=torch.bool), torch.ones(B, T), torch.ones(T, dtype=torch.bool)]
)
def test_a_mask_of_the_wrong_shape_or_dtype_is_refused_in_one_line(case, mask):
    batch = replace(case.batch, mask=mask)
    for call in (case.loss, case.evaluate):
        with pytest.raises(ValueError, match="mask must be bool") as err:
            call(batch)
        assert "\n" not in str(err.value)


def test_prophets_regress_features_only_at_answer_positions():
    """f_{T-1} is read by no kept prediction (causal attention; the last index predicts nothing in the batch), only
    regressed onto: changing it changes the loss exactly when its token T is an answer token."""
    for name in ("prophet", "prophet_eagle3", "block"):
        case = make_case(name)
        hidden = case.batch.hidden.clone()
        hidden[:, -1] += 1.0
        for last in (False, True):
            mask = answer_mask()
            mask[:, -1] = last
            before, _ = case.loss(masked(case.batch, mask))
            after, _ = case.loss(masked(replace(case.batch, hidden=hidden), mask))
            assert torch.equal(before, after) != last, (name, last)


@pytest.mark.parametrize("name", ["medusa", "early_exit"])
def test_gradients_reach_only_the_inputs_of_masked_in_predictions(name):
    """Medusa's heads and the exit head read one position each: the gradient of the loss reaches the input at t
    only where a prediction made at t has an answer target (for Medusa, any head's token t + 1 + k)."""
    case = make_case(name)
    batch = masked(case.batch)
    field = "hidden" if name == "medusa" else "layers"
    inputs = getattr(batch, field).clone().requires_grad_(True)
    loss, _ = case.loss(replace(batch, **{field: inputs}))
    loss.backward()
    reached = inputs.grad.flatten(2).abs().sum(-1) > 0  # (B, T)
    if name == "medusa":
        expected = torch.zeros(B, T, dtype=torch.bool)
        expected[:, : T - HEADS] = batch.mask.unfold(1, HEADS, 1)[:, 1:].any(-1)
    else:
        expected = batch.mask
    assert torch.equal(reached, expected)


@pytest.mark.parametrize("name", ["draft", "early_exit"])
def test_agreement_is_a_rate_over_the_answer_positions(name):
    """A teacher whose top-1 is the student's own guess at every masked-out position and never at a masked-in
    one: the masked rates are 0, the unmasked ones the share of masked-out positions."""
    case = make_case(name)
    with torch.no_grad():
        logits = (
            draft_family._logits(case.module, case.batch.tokens[:, :-1], None)
            if name == "draft"
            else case.module(case.batch.layers[:, :, 0])
        )
    own, mask = logits.argmax(-1), answer_mask()  # (B, T) each
    guess = torch.where(mask, (own + 1) % V, own)
    batch = replace(case.batch, top_ids=torch.cat((guess[..., None], case.batch.top_ids[..., 1:]), dim=-1))
    if name == "early_exit":  # its inputs are the layer states: the corpus tokens are only targets
        batch = replace(batch, tokens=torch.cat((batch.tokens[:, :1], guess), dim=1))
    keys = ["agree"] + (["top1"] if name == "early_exit" else [])
    share = (~mask).float().mean().item()
    assert all(case.evaluate(replace(batch, mask=mask))[k] == 0.0 for k in keys)
    assert all(case.evaluate(batch)[k] == pytest.approx(share) for k in keys)
    assert case.loss(replace(batch, mask=mask))[1]["agree"] == 0.0
    assert case.loss(batch)[1]["agree"] == pytest.approx(share)


# ---------------------------------------------------------------------------------------------- shared pieces


def test_distill_loss_and_agreement_are_means_over_the_masked_positions():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(10, V, generator=g, requires_grad=True)
    top = torch.randn(10, V, generator=g).log_softmax(-1).topk(TOP_K)
    mask = torch.tensor([True, False] * 5)
    full = distill_loss(logits, top_ids=top.indices, top_logp=top.values, mask=mask)
    subset = distill_loss(logits[mask], top_ids=top.indices[mask], top_logp=top.values[mask])
    torch.testing.assert_close(full, subset, rtol=1e-6, atol=0)
    assert agreement(logits, top.indices, mask=mask) == agreement(logits[mask], top.indices[mask])
    none = torch.zeros(10, dtype=torch.bool)
    zero = distill_loss(logits, top_ids=top.indices, top_logp=top.values, mask=none)
    assert zero.item() == 0.0 and zero.grad_fn is not None
    assert agreement(logits, top.indices, mask=none).item() == 0.0
    assert masked_mean(torch.ones(10), none).item() == 0.0
    for bad in (torch.ones(10), torch.ones(11, dtype=torch.bool)):
        with pytest.raises(ValueError, match="loss mask must be bool"):
            distill_loss(logits, top_ids=top.indices, top_logp=top.values, mask=bad)


def test_the_mask_travels_with_the_batch():
    base = base_lm()
    batch = masked(windows(base))
    assert batch.check() == (B, T)
    assert torch.equal(batch.to(torch.device("cpu")).mask, batch.mask)
    assert torch.equal(batch.mask_at(2), batch.mask[:, 2:]) and replace(batch, mask=None).mask_at(2) is None
    rows = take_rows(batch, slice(1, 3))  # a micro-batch
    assert torch.equal(rows.mask, batch.mask[1:3]) and rows.check() == (2, T)
    mine = shard(batch, Dist(rank=1, world=2))  # rank 1 of 2: rows 1, 3, ...
    assert torch.equal(mine.mask, batch.mask[1::2]) and torch.equal(mine.tokens, batch.tokens[1::2])


def test_medusa_samples_only_positions_where_some_head_has_an_answer_target():
    case = make_case("medusa")
    batch = masked(case.batch)
    torch.manual_seed(0)
    row, pos = medusa_train.sample_positions(case.module, batch, weight=0.8, target="kl", positions=10)
    assert row.numel() == 10
    offsets = torch.arange(1, HEADS + 1)
    assert batch.mask[row[:, None], pos[:, None] + offsets].any(-1).all()
    eligible = int(batch.mask.unfold(1, HEADS, 1)[:, 1:].any(-1).sum())
    assert case.loss(batch, positions=1000)[1]["positions"] == eligible  # capped at the eligible ones


def test_block_starts_are_drawn_among_those_whose_slots_hold_an_answer():
    case = make_case("block")
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[1, 9:12] = True  # start s's slots read mask[:, s + 2 .. s + K]: starts 5 .. 9 reach these
    _, metrics = case.loss(masked(case.batch, mask), starts=100)
    assert metrics["starts"] == 5
    _, metrics = case.loss(masked(case.batch, torch.zeros(B, T, dtype=torch.bool)), starts=100)
    assert metrics["starts"] == T - BLOCK  # nothing to train: every start, all masked out


def test_validation_weighs_batches_by_their_answer_positions():
    case = make_case("medusa")
    family = find_family("medusa")
    answered = masked(case.batch)
    prompts_only = masked(windows(base_lm()), torch.zeros(B, T, dtype=torch.bool))
    both = drafter_trainer.validate(family, case.module, case.base, [answered, prompts_only], vocab=None)
    alone = drafter_trainer.validate(family, case.module, case.base, [answered], vocab=None)
    assert both == pytest.approx(alone, rel=1e-6)
    assert drafter_trainer.positions_trained(answered, {}) == int(answered.mask.sum())
    assert drafter_trainer.positions_trained(case.batch, {}) == B * T


def test_chain_tau_counts_the_leading_run_of_matches_per_start():
    from verify.training.distill import chain_tau

    m1 = torch.tensor([[1, 1, 0, 1, 1]], dtype=torch.bool)  # draft 1 of the chain started at s = 0..4
    m2 = torch.tensor([[1, 0, 1, 1]], dtype=torch.bool)  # draft 2 (one start fewer: it runs past the end)
    m3 = torch.tensor([[0, 1, 1, 1]], dtype=torch.bool)
    # runs per start: 2 (third draft rejected), 1, 0 (a match after a rejection counts nothing), 3
    assert chain_tau([m1, m2, m3]).item() == pytest.approx(1 + 6 / 4)
    mask = torch.tensor([[True, False, True, True, True]])
    assert chain_tau([m1, m2, m3], mask).item() == pytest.approx(1 + 5 / 3)
    assert chain_tau([m1, m2, m3], depth=1).item() == pytest.approx(1 + 4 / 5)  # draft 1 alone, every start
    assert chain_tau([m1, m2, m3], torch.zeros(1, 5, dtype=torch.bool)).item() == 1.0  # no answer: no NaN
