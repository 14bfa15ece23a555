"""bf16 weights prepacked for oneDNN (verify/backends/packed.py): what an eager bf16 engine decodes with on a CPU
that computes bf16 natively. Packing must not change a single bit of any output (the engine's results with
and without it are compared exactly), each row of a forward must not depend on how many rows it shares the
forward with (else a k-token verification could round differently from k one-token steps)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import make_lm
from verify.backends import packed
from verify.backends.choose import make_target
from verify.backends.lean import lean
from verify.drafters.prompt_lookup import PromptLookupDrafter
from verify.loop.plain import plain_generate
from verify.loop.speculative import SpecConfig, speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")
needs_packing = pytest.mark.skipif(
    not packed.can_pack(torch.zeros(2, 2, dtype=torch.bfloat16)), reason="no native bf16 oneDNN on this CPU"
)


def test_only_cpu_bf16_matrices_are_packed():
    assert packed.pack(None) is None
    for plain in (torch.zeros(4, 4), torch.zeros(4, dtype=torch.bfloat16)):  # fp32 matrices, bf16 vectors
        assert packed.pack(plain) is plain


@needs_packing
@pytest.mark.parametrize("inputs", [40, 1536])  # 1536: SmolLM2's down projection, where one row took another kernel
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 64])
def test_packed_linear_is_bitwise_f_linear_and_row_independent(rows, inputs):
    torch.manual_seed(rows)
    w, b = torch.randn(576, inputs).bfloat16(), torch.randn(576).bfloat16()
    x = torch.randn(2, rows, inputs).bfloat16()
    p = packed.pack(w)
    assert isinstance(p, packed.Packed)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):  # decoding runs on 2 threads here: the kernels a row count picks differ with threads
            torch.set_num_threads(n)
            out = packed.linear(x, p, b)
            assert torch.equal(out, F.linear(x, w, b))
            flat = x.reshape(-1, inputs)  # each row alone: a one-row call, as a one-token step makes
            alone = torch.cat([packed.linear(flat[i : i + 1], p, b) for i in range(flat.shape[0])])
            assert torch.equal(alone, out.reshape(alone.shape))
    finally:
        torch.set_num_threads(threads)


def llama():
    from tests.test_hf import llama as tiny_llama  # transformers is installed with the hf extra

    return tiny_llama(dim=64)


@needs_packing
@pytest.mark.parametrize("build", [make_lm, llama], ids=["x-transformers", "llama"])
def test_an_eager_bf16_engine_is_packed_and_decodes_exactly(monkeypatch, build):
    model = build().to(torch.bfloat16)
    engine = lean(model)
    assert isinstance(engine.head_weight, packed.Packed)
    assert all(isinstance(w[1], packed.Packed) for _, w in engine.decoder.blocks)
    prompts = [[5, 9, 3, 5, 9, 3, 7, 5, 9], [4, 4, 2]]
    ours = plain_generate(make_target(model), prompts, max_new_tokens=20).tokens
    spec = speculative_generate(
        make_target(model), PromptLookupDrafter(vocab_size=97), prompts, spec=SpecConfig(gamma=4), max_new_tokens=20
    )
    assert spec.tokens == ours
    monkeypatch.setattr(packed, "can_pack", lambda w: False)  # the same weights, unpacked
    unpacked = copy.deepcopy(model)
    assert not isinstance(lean(unpacked).head_weight, packed.Packed)
    assert plain_generate(make_target(unpacked), prompts, max_new_tokens=20).tokens == ours
