"""Trimmed drafter vocabularies (the subset helpers on hand-made numbers, and token counts) and
Medusa's stacked heads, which equal the heads' own forward."""

import pytest
import torch
from torch import nn

from experiments.data import PreparedData, token_counts
from medusa.heads import MedusaHeads
from tests.conftest import make_lm
from verify.vocab import check_vocab, expand_probs, frequent_tokens, full_ids, subset_logits, trim_linear

V = 97
EVEN = torch.arange(0, V, 2)  # a subset that misses about half of what the models would draft


# ------------------------------------------------------------------------------------------- helpers


def test_frequent_tokens_picks_the_most_frequent_ids_sorted():
    counts = torch.tensor([5, 0, 9, 9, 1, 3])
    assert frequent_tokens(counts, 3).tolist() == [0, 2, 3]
    assert frequent_tokens(counts, 4).tolist() == [0, 2, 3, 5]
    assert frequent_tokens(torch.tensor([2, 2, 2, 1]), 2).tolist() == [0, 1]  # ties: the lower ids
    assert frequent_tokens(counts, None) is None and frequent_tokens(counts, 6) is None and frequent_tokens(counts, 99) is None


@pytest.mark.parametrize("n", [0, -3, 2.5, True, "4"])
def test_frequent_tokens_rejects_bad_sizes_in_one_line(n):
    with pytest.raises(ValueError, match=f"n={n!r}") as err:
        frequent_tokens(torch.tensor([1, 2, 3]), n)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "ids, match",
    [(torch.tensor([3, 1]), "sorted and distinct"), (torch.tensor([1, 1]), "sorted and distinct"),
     (torch.tensor([0, 6]), r"span \[0, 6\]: must lie in \[0, 6\)"), (torch.tensor([-1, 2]), "span"),
     (torch.tensor([], dtype=torch.long), "non-empty"), (torch.tensor([0.0, 1.0]), "non-empty 1-D tensor of token ids"),
     ([0, 1], "non-empty 1-D tensor")],
)
def test_check_vocab_rejects_bad_subsets_in_one_line(ids, match):
    with pytest.raises(ValueError, match=match) as err:
        check_vocab(ids, 6)
    assert "\n" not in str(err.value)


def test_trim_expand_and_map_back():
    layer = nn.Linear(4, 6)
    ids = torch.tensor([1, 4, 5])
    weight, bias = trim_linear(layer, ids)
    x = torch.randn(2, 4)
    assert weight.shape == (3, 4) and bias.shape == (3,) and weight.is_contiguous()
    assert torch.allclose(nn.functional.linear(x, weight, bias), subset_logits(layer(x), ids), atol=1e-6)
    assert trim_linear(nn.Linear(4, 6, bias=False), ids)[1] is None
    q = torch.tensor([[0.25, 0.25, 0.5]])
    assert expand_probs(q, ids, 6).tolist() == [[0, 0.25, 0, 0, 0.25, 0.5]]
    assert full_ids(torch.tensor([[2, 0], [1, 1]]), ids).tolist() == [[5, 1], [4, 4]]
    assert expand_probs(q, None, 6) is q and full_ids(ids, None) is ids and subset_logits(x, None) is x


def test_token_counts_count_the_training_split_only():
    data = PreparedData(tokenizer=None, train_ids=torch.tensor([0, 3, 3, 5, 0, 3]), val_ids=torch.tensor([1, 1, 1]),
                        train_bytes=6, val_bytes=3, eos_id=0, vocab_size=7, val_files=[], cache_key="x")
    assert token_counts(data, 7).tolist() == [2, 0, 0, 3, 0, 1, 0]
    assert frequent_tokens(token_counts(data, 7), 2).tolist() == [0, 3]
    with pytest.raises(ValueError, match="vocab_size=5: must exceed the largest training id 5"):
        token_counts(data, 5)


# ------------------------------------------------------------------------------------------- stacked Medusa heads


def perturb(module: nn.Module, seed: int, scale: float = 0.2) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return module


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("vocab", [None, EVEN])
def test_stacked_heads_equal_the_heads_forward(share, layers, bias, vocab):
    torch.manual_seed(0)
    projection = perturb(nn.Linear(32, V, bias=bias), seed=5)
    heads = perturb(MedusaHeads(projection=projection, num_heads=3, num_layers=layers, share_base_projection=share), seed=1)
    stacked = heads.stacked(vocab)
    assert stacked.block_weight.shape == (3, layers, 32, 32) and stacked.block_bias.shape == (3, layers, 32)
    n = V if vocab is None else len(vocab)
    assert stacked.proj_weight.shape == ((n, 32) if share else (3, n, 32))
    hidden = torch.randn(5, 32)
    expected = heads(hidden[:, None])[:, 0]  # (b, K, V)
    if vocab is not None:
        expected = expected[..., vocab]
    got = stacked(hidden)
    assert got.shape == (5, 3, n)
    assert (got - expected).abs().max() < 1e-5


def test_stacked_heads_load_from_a_checkpoint_of_the_heads():
    base = make_lm(dim=32)
    heads = perturb(MedusaHeads.from_base(base, num_heads=2, num_layers=1), seed=0)
    rebuilt = MedusaHeads.from_base(base, num_heads=2, num_layers=1)
    rebuilt.load_state_dict(heads.state_dict())  # the format is unchanged
    hidden = torch.randn(3, 32)
    assert torch.equal(rebuilt.stacked()(hidden), heads.stacked()(hidden))
