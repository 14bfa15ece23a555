"""The anchored training-time test (prophet.model.Prophet.unroll_anchored, prophet.train.loss anchors=A): steps
2..S computed only on the chains that start at A sampled indices equal the full unroll's steps there, the loss's
last step over every chain equals the full loss's, and bad settings are one-line errors."""

import pytest
import torch

from experiments.lib.store.lm import build_lm
from prophet import train as prophet_train
from prophet.model import Prophet
from tests.test_export_safety import LM
from verify.training.features import FeatureBatch

pytestmark = pytest.mark.usefixtures("one_thread")
B, T = 2, 40


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    return build_lm(**LM).eval()


def prophet_on(base, arch: str) -> Prophet:
    """A prophet whose weights are moved off their initialisation (an EAGLE layer starts near the identity)."""
    fuse = [1, 2, 3] if arch == "eagle3" else None
    prophet = Prophet.from_base(base, arch=arch, fuse_layers=fuse, dim=16, heads=2)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in prophet.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=g))
    return prophet


def batch_for(base, prophet: Prophet, mask: bool = False) -> FeatureBatch:
    g = torch.Generator().manual_seed(2)
    d = base.to_logits.in_features
    top = torch.randn(B, T, 64, generator=g).log_softmax(-1).topk(8, dim=-1)
    return FeatureBatch(
        tokens=torch.randint(0, 64, (B, T + 1), generator=g),
        hidden=torch.randn(B, T, d, generator=g),
        top_ids=top.indices,
        top_logp=top.values,
        layers=torch.randn(B, T, len(prophet.fuse_layers), d, generator=g) if prophet.fuse_layers else None,
        mask=(torch.rand(B, T, generator=g) < 0.7) if mask else None,
    )


@pytest.mark.parametrize("arch", ["eagle", "eagle3"])
def test_anchored_steps_equal_the_full_unroll_at_their_chains(base, arch):
    prophet = prophet_on(base, arch)
    batch = batch_for(base, prophet)
    args = (batch.hidden, batch.tokens[:, 1:], 4)
    full = prophet.unroll(*args, layers=batch.layers)
    anchors = torch.tensor([0, 5, 17, T - 1 - 4])  # the first and the last chain a 4-step unroll has room for
    anchored = prophet.unroll_anchored(*args, anchors, layers=batch.layers)
    assert torch.equal(anchored[0], full[0])
    for j in range(2, 5):
        torch.testing.assert_close(anchored[j - 1], full[j - 1][:, anchors + j - 1], rtol=0, atol=1e-5)
    # the negative control: read at the neighbouring chains, step 3 is another prediction
    assert (anchored[2] - full[2][:, anchors + 3]).abs().max() > 1e-2


def test_the_last_step_over_every_chain_is_the_full_losss(base):
    """With anchors covering every chain a 3-step unroll has room for, step 3's terms are the full unroll's (its
    valid indices are exactly those chains'), answer mask included; steps 1 and 2 are means over fewer or as many."""
    prophet = prophet_on(base, "eagle3")
    batch = batch_for(base, prophet, mask=True)
    _, full = prophet_train.loss(prophet, base, batch, unroll=3)
    torch.manual_seed(0)
    _, anchored = prophet_train.loss(prophet, base, batch, unroll=3, anchors=10_000)
    for key in ("step1_feature", "step1_ce", "step3_feature", "step3_ce", "step3_agree"):
        assert anchored[key] == pytest.approx(full[key], rel=1e-5, abs=1e-6), key


def test_an_anchored_loss_trains_every_step(base):
    prophet = prophet_on(base, "eagle")
    batch = batch_for(base, prophet)
    loss, metrics = prophet_train.loss(prophet, base, batch, unroll=3, anchors=4)
    loss.backward()
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert {"step2_ce", "step3_ce"} <= set(metrics)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in prophet.parameters() if p.requires_grad)


@pytest.mark.parametrize(
    "arch, anchors, match",
    [
        ("eagle", 0, "anchors=0: must be an integer >= 1"),
        ("eagle", True, "anchors=True: must be an integer >= 1"),
        ("xtransformers", 4, "anchored training-time test needs arch=eagle or eagle3"),
    ],
)
@pytest.mark.parametrize("unroll", [1, 2])
def test_bad_anchor_settings_are_one_line_errors(base, arch, anchors, match, unroll):
    prophet = prophet_on(base, arch) if arch != "xtransformers" else Prophet.from_base(base, dim=16, heads=2)
    with pytest.raises(ValueError, match=match):
        prophet_train.loss(prophet, base, batch_for(base, prophet), unroll=unroll, anchors=anchors)


def test_anchors_beyond_the_window_are_refused(base):
    prophet = prophet_on(base, "eagle")
    batch = batch_for(base, prophet)
    with pytest.raises(ValueError, match=r"anchors must be 1 indices in \[0, 36\]"):
        prophet.unroll_anchored(batch.hidden, batch.tokens[:, 1:], 3, torch.tensor([37]))
