"""The target's cache: extend-by-k equals a full forward, rollback equals never having drafted,
ragged rows equal rows run alone, tree nodes equal their paths run alone."""

import pytest
import torch

from verify.backends.cache import tree_attention
from verify.backends.target import Target

TOL = 1e-5


def full_logits(lm, seq):
    return lm(torch.tensor([seq]))[0]


def test_extend_by_k_equals_full_forward(lm):
    seq = torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    target = Target(lm)
    out = [target.prefill([seq[:10]]).logits[0]]
    for a, b in [(10, 11), (11, 15), (15, 23), (23, 30)]:
        out.append(target.extend(torch.tensor([seq[a:b]])).logits[0])
    assert torch.allclose(torch.cat(out), full_logits(lm, seq), atol=TOL)
    assert target.row_lengths.tolist() == [30]


def test_rollback_then_continue_equals_never_drafting(lm):
    seq = list(range(3, 23))
    target = Target(lm)
    target.prefill([seq[:8]])
    target.extend(torch.tensor([[5, 6, 7, 8]]))
    target.commit(torch.tensor([[True, False, False, False]]))  # keep one of four
    target.extend(torch.tensor([[9, 9]]))
    target.commit(torch.zeros(1, 2, dtype=torch.bool))  # reject everything
    out = target.extend(torch.tensor([seq[8:12]])).logits[0]
    expected = full_logits(lm, seq[:8] + [5] + seq[8:12])[-4:]
    assert torch.allclose(out, expected, atol=TOL)
    assert target.row_lengths.tolist() == [13]


def test_ragged_batch_rows_equal_rows_alone(lm):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]
    nxt = torch.tensor([[20, 21], [22, 23], [24, 25]])
    target = Target(lm)
    first = target.prefill(prompts).logits[:, -1]
    out = target.extend(nxt).logits
    for i, p in enumerate(prompts):
        ref = full_logits(lm, p + nxt[i].tolist())
        assert torch.allclose(first[i], ref[len(p) - 1], atol=TOL)
        assert torch.allclose(out[i], ref[-2:], atol=TOL)


def test_ragged_commit_keeps_each_rows_own_tokens(lm):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]
    draft = torch.tensor([[30, 31, 32, 33], [40, 41, 42, 43], [50, 51, 52, 53]])
    keep = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]).bool()
    target = Target(lm)
    target.prefill(prompts)
    target.extend(draft)
    target.commit(keep)
    nxt = torch.tensor([[60, 61], [62, 63], [64, 65]])
    out = target.extend(nxt).logits
    for i, p in enumerate(prompts):
        seq = p + draft[i][keep[i]].tolist() + nxt[i].tolist()
        assert torch.allclose(out[i], full_logits(lm, seq)[-2:], atol=TOL)
    assert target.row_lengths.tolist() == [3 + 2 + 2, 7 + 1 + 2, 5 + 4 + 2]


def test_tree_attention_positions_and_ancestors():
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3]])
    mask, depth = tree_attention(parents)
    assert depth[0].tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert mask[0, 6].nonzero().flatten().tolist() == [0, 1, 3, 6]
    assert mask[0, 5].nonzero().flatten().tolist() == [0, 2, 5]
    assert mask[0, 4].nonzero().flatten().tolist() == [0, 1, 4]


@pytest.mark.parametrize("per_row", [False, True])
def test_tree_nodes_equal_their_paths_alone_and_commit(lm, per_row):
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11, 12]]
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
    if per_row:  # each row its own tree shape (dynamic trees)
        parents = torch.stack([parents, torch.tensor([-1, 0, 1, 2, 0, 4, 4]), torch.tensor([-1, 0, 0, 0, 3, 3, 5])])
    tokens = torch.randint(0, 97, (3, 7), generator=torch.Generator().manual_seed(2))
    target = Target(lm)
    target.prefill(prompts)
    out = target.extend(tokens, parents=parents).logits
    rows_parents = parents if per_row else parents.expand(3, -1)
    for i, p in enumerate(prompts):
        for node in range(7):
            path, cur = [], node
            while cur >= 0:
                path.insert(0, cur)
                cur = int(rows_parents[i, cur])
            ref = full_logits(lm, p + tokens[i, path].tolist())[-1]
            assert torch.allclose(out[i, node], ref, atol=TOL)
    # commit a root-to-leaf path per row and continue from it
    paths = [[0, 1, 3], [0, 1], [0]]  # root-to-node paths in both tree shapes
    keep = torch.zeros(3, 7, dtype=torch.bool)
    for i, path in enumerate(paths):
        keep[i, path] = True
    target.commit(keep)
    out = target.extend(torch.tensor([[90], [91], [92]])).logits
    for i, p in enumerate(prompts):
        seq = p + tokens[i, paths[i]].tolist() + [90 + i]
        assert torch.allclose(out[i, 0], full_logits(lm, seq)[-1], atol=TOL)


def test_bad_prompts_rejected_before_work(lm):
    target = Target(lm)
    with pytest.raises(ValueError, match="token id 97"):
        target.check_tokens([[1, 97]], max_new_tokens=1)
    with pytest.raises(ValueError, match="token id -1"):
        target.check_tokens([[-1]], max_new_tokens=1)
    with pytest.raises(ValueError, match="max_seq_len - max_new_tokens = 86"):
        target.check_tokens([[1] * 90], max_new_tokens=10)
    with pytest.raises(ValueError, match="empty"):
        target.check_tokens([[]], max_new_tokens=1)
    with pytest.raises(ValueError, match="at least one prompt"):
        target.check_tokens([], max_new_tokens=1)
    # no prompt can fit: the error is about max_new_tokens (it read "at most ... = -4" of the prompt's length)
    with pytest.raises(ValueError, match=r"^max_new_tokens=100: must be less than the model's max_seq_len=96 \("):
        target.check_tokens([[1]], max_new_tokens=100)


def test_a_long_context_model_gets_a_cache_sized_to_the_prompt_and_grows_past_it():
    """A model with a long context (SmolLM2: 8,192 positions) gets room for the longest prompt and ROOM new
    tokens, not its whole context; a longer generation grows the cache, and the output is what a cache of
    the model's whole context gives."""
    from tests.conftest import make_lm
    from verify.backends import target as target_module
    from verify.loop.plain import plain_generate

    model = make_lm(max_seq_len=2048)
    prompts = [[5, 9, 3, 5, 9, 3, 7], [4, 4, 2]]
    short = Target(model)
    short.prefill(prompts)
    assert short.cache.capacity == 512 + short.max_draft + 1  # 7 + ROOM (256), up to a power of two
    out = plain_generate(short, prompts, max_new_tokens=600).tokens  # past 512 slots: the cache grows
    assert short.cache.capacity > 512 + short.max_draft + 1
    whole = Target(model)
    original = target_module.ROOM
    try:
        target_module.ROOM = 4096  # a cache of the model's whole context
        assert plain_generate(whole, prompts, max_new_tokens=600).tokens == out
        assert whole.cache.capacity == 2048 + whole.max_draft + 1
    finally:
        target_module.ROOM = original


def test_a_prefill_for_decoding_reads_each_ragged_rows_last_logits_only(lm):
    """last_logits=True (what plain and speculative decoding ask for) runs the output layer on each row's last
    prompt position only, and gives exactly the logits a full prefill gives there; the Hugging Face adapter too."""
    from tests.test_hf import llama
    from verify.backends.hf import HFTarget

    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13]]  # ragged: rows end at other indices
    for target in (Target(lm), Target(llama()), HFTarget(llama())):
        full = target.prefill(prompts).logits[:, -1]
        last = target.prefill(prompts, last_logits=True)
        assert last.logits.shape[:2] == (3, 1) and torch.equal(last.logits[:, 0], full)
        assert last.hidden.shape[1] == 7  # every position's hidden state, for the drafters
