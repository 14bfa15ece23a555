"""Decoding the pretrained base on its real weights (SmolLM2-135M-Instruct, base=smollm2): the project's lean Llama
engine against transformers' own greedy `generate` on chat prompts (fp32: token for token; bf16: logits within a
stated tolerance, and every first divergence at a near-tie), speculative decoding against plain decoding of the
same engine and precision, and a bf16 tree's nodes against their paths.

A file of its own (the conversion and the data checks are in tests/test_smollm2.py) so that pytest-xdist, which
keeps a file on one worker, runs the two halves side by side. The fast tier compares the first chat prompt; the
other two prompts are the slow tier's (each costs about 20 s of fp32 generation on a shared core).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import SMOL_CHATS
from verify.backends.choose import make_target
from verify.drafters.prompt_lookup import PromptLookupDrafter
from verify.loop.plain import plain_generate
from verify.loop.speculative import SpecConfig, speculative_generate

NEW = 48
# bf16 keeps 8 bits of mantissa: a logit of magnitude ~20 carries ~0.1 of rounding per operation, and the lean
# engine fuses matmuls (qkv, gate-and-up) that transformers runs apart, so the two round differently. Measured
# here: max |logit difference| 0.2-0.4 at the last prompt position. The stated tolerance:
BF16_LOGIT_TOL = 1.0
EOS = 2  # <|im_end|>
PROMPTS = [pytest.param(i, marks=[pytest.mark.slow] if i else []) for i in range(len(SMOL_CHATS))]


def hf_greedy(base, prompt: list[int], new: int) -> list[int]:
    """transformers' own greedy generate on the same weights (stopping at EOS, as the project does)."""
    out = base.hf.generate(
        torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=EOS, pad_token_id=EOS
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("which", PROMPTS)
def test_fp32_lean_engine_equals_transformers_generate(smol, which):
    base, _, _, prompts = smol
    target = make_target(base)  # the lean Llama engine
    assert type(target).__name__ == "Target"
    prompt = prompts[which]
    ours = plain_generate(target, [prompt], max_new_tokens=NEW, eos_id=EOS).tokens[0]
    assert ours == hf_greedy(base, prompt, NEW)
    spec = speculative_generate(
        target,
        PromptLookupDrafter(vocab_size=49152, max_ngram=3),
        [prompt],
        spec=SpecConfig(gamma=4),
        max_new_tokens=NEW,
        eos_id=EOS,
    )
    assert spec.tokens[0] == ours


@pytest.mark.parametrize("which", PROMPTS)
def test_bf16_logits_within_tolerance_and_divergences_at_near_ties(smol, smol_bf16, which):
    base, _, _, prompts = smol
    prompt = prompts[which]
    ours = make_target(smol_bf16).prefill([prompt]).logits[0, -1].float()
    with torch.no_grad():
        theirs = smol_bf16.hf(torch.tensor([prompt])).logits[0, -1].float()
        exact = base.hf(torch.tensor([prompt])).logits[0, -1]
    assert (ours - theirs).abs().max() < BF16_LOGIT_TOL
    assert (ours - exact).abs().max() < BF16_LOGIT_TOL
    lean = plain_generate(make_target(smol_bf16), [prompt], max_new_tokens=NEW, eos_id=EOS).tokens[0]
    hf = hf_greedy(smol_bf16, prompt, NEW)
    common = next((i for i, (a, b) in enumerate(zip(lean, hf)) if a != b), None)
    if common is None:
        return
    with torch.no_grad():  # where they part, transformers' own top-2 logits are within the tolerance
        logits = smol_bf16.hf(torch.tensor([prompt + hf[:common]])).logits[0, -1].float()
    top2 = logits.topk(2).values
    assert {lean[common], hf[common]} <= set(logits.topk(2).indices.tolist())
    assert top2[0] - top2[1] < BF16_LOGIT_TOL


def test_bf16_speculative_equals_bf16_plain(smol, smol_bf16):
    _, _, _, prompts = smol
    target = make_target(smol_bf16)
    plain = plain_generate(target, prompts, max_new_tokens=NEW, eos_id=EOS).tokens  # a ragged batch of 3
    spec = speculative_generate(
        target,
        PromptLookupDrafter(vocab_size=49152, max_ngram=3),
        prompts,
        spec=SpecConfig(gamma=4),
        max_new_tokens=NEW,
        eos_id=EOS,
    )
    assert spec.tokens == plain


TREE = [-1, 0, 0, 0, 1, 1, 2, 3, 4, 4, 5, 6, 8, 9, 12, 13]  # parents: a 16-node draft tree, 5 levels


def tree_mismatches(base, prompt: list[int], tokens: list[int], ordered: bool = True) -> list[int]:
    """Nodes whose logits in one tree forward differ (bitwise) from their path decoded one token at a time."""
    target = make_target(base, ordered=ordered)
    target.prefill([prompt])
    out = target.extend(torch.tensor([tokens]), parents=torch.tensor(TREE)).logits[0]
    bad = []
    for node in range(len(TREE)):
        path, j = [], node
        while j >= 0:
            path, j = [tokens[j]] + path, TREE[j]
        step = make_target(base, ordered=ordered)
        step.prefill([prompt])
        for token in path:
            last = step.extend(torch.tensor([[token]])).logits[0, -1]
        bad += [] if torch.equal(out[node], last) else [node]
    return bad


@pytest.mark.slow  # 30-40 s on 2 threads; the fast tier checks the order on a small bf16 Llama
def test_bf16_tree_nodes_equal_their_paths_only_in_position_order(smol_bf16):
    """Behind a 600-token prefix, bf16 tree nodes whose ancestors are not contiguous in the cache left their
    paths' logits when attention summed over slots (seen: 3 of 16 nodes on 2 threads; on 1 thread the old order
    happened to agree), and with SDPA's fused kernel (ordered=False); summed in position order, none does."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 49152, (600,), generator=g).tolist()
    tokens = torch.randint(0, 49152, (len(TREE),), generator=g).tolist()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # as decoding runs here; the old order's sums split across the threads
    try:
        with torch.inference_mode():
            assert tree_mismatches(smol_bf16, prompt, tokens) == []
            assert tree_mismatches(smol_bf16, prompt, tokens, ordered=False) != []  # SDPA's fused kernel
    finally:
        torch.set_num_threads(threads)
