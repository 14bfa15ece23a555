"""Continuous batching (verify/loop/continuous.py): every prompt's answer is the answer plain decoding gives it in a
batch of one with the same seed, bit for bit, in bfloat16 on the lean Llama engine, at real prompt lengths (64-1,024
tokens) with more prompts than rows, whatever the batch size, and however rows finish, refill and are shed; greedy
and T = 1 prompts mixed; an engine, attention, compiled step or device whose batch invariance is not tested is
refused, as are bad inputs, in one line."""

from collections import deque

import pytest
import torch

from tests.conftest import make_lm
from verify.backends.choose import make_target
from verify.backends.target import Target
from verify.common.numerics import NonFiniteError
from verify.loop.continuous import Request, continuous_generate, serve
from verify.loop.plain import plain_generate
from verify.loop.sampling import SamplingConfig

transformers = pytest.importorskip("transformers")

from verify.backends.hf import HFBase  # noqa: E402

V = 199
EOS = 7


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return HFBase(transformers.LlamaForCausalLM(config)).eval().to(torch.bfloat16)


def prompts_of(count: int, seed: int, *, short: bool = False) -> list[list[int]]:
    """Real lengths: 64 to 1,024 tokens, across the ordered attention's chunk boundaries (1-150 with short=True,
    for the tests of other behaviour)."""
    g = torch.Generator().manual_seed(seed)
    low, high = (1, 150) if short else (64, 1025)
    lengths = torch.randint(low, high, (count,), generator=g).tolist()
    lengths[: min(count, 2)] = [high - 1, low][: min(count, 2)]  # the extremes in every set
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]


def alone(base, prompt, *, budget, cfg, seed, eos_id=EOS) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return plain_generate(
        make_target(base), [prompt], max_new_tokens=budget, sampling=cfg, generator=g, eos_id=eos_id
    ).tokens[0]


@pytest.mark.parametrize(
    ("batch", "count", "longest"),
    [(2, 5, 14), (3, 9, 33), pytest.param(8, 20, 33, marks=pytest.mark.slow)],
)  # more prompts than rows: rows refilled beside rows of other lengths (the fast two: 1-10 s on 2 cores, by load)
def test_every_answer_equals_plain_decoding_alone(llama, batch, count, longest):
    prompts = prompts_of(count, seed=batch)
    budgets = [5 + (longest - 5) * (i % 5) // 4 for i in range(len(prompts))]  # rows finish at different steps
    cfgs = [SamplingConfig(temperature=1.0) if i % 2 else SamplingConfig() for i in range(len(prompts))]
    seeds = [100 + i for i in range(len(prompts))]
    target = make_target(llama)
    got = {}
    for answer in continuous_generate(
        target, prompts, max_new_tokens=budgets, batch=batch, sampling=cfgs, seeds=seeds, eos_id=EOS
    ):
        assert answer.index not in got
        got[answer.index] = answer.tokens
    assert sorted(got) == list(range(len(prompts)))
    for i, prompt in enumerate(prompts):
        assert got[i] == alone(llama, prompt, budget=budgets[i], cfg=cfgs[i], seed=seeds[i]), f"prompt {i}"


def test_a_row_stops_at_eos_and_is_refilled(llama):
    prompts = prompts_of(6, seed=3, short=True)
    free = [alone(llama, p, budget=40, cfg=SamplingConfig(), seed=0, eos_id=None) for p in prompts]
    eos = free[0][4]  # the first prompt's fifth token: that row ends early and takes the next prompt
    answers = list(continuous_generate(make_target(llama), prompts, max_new_tokens=40, batch=2, eos_id=eos))
    by_index = {a.index: a.tokens for a in answers}
    for i, tokens in enumerate(free):
        cut = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        assert by_index[i] == tokens[:cut]
    assert len(by_index[0]) <= 5
    assert answers[0].index == 0  # finished first, while the other row went on


def test_an_engine_whose_batch_invariance_is_not_tested_is_refused(llama, tiny_base_model):
    """x-transformers (attention over the slots in no position order, rows not padded), the lean Llama engine
    without ordered attention, a compiled step and a GPU: one line each, before any forward."""
    gpu = make_target(llama)
    gpu.device = torch.device("cuda")  # never used: the check comes first
    for target, message in [
        (Target(tiny_base_model), r"engine=LeanDecoder \(an x-transformers LM\): its rows' bits are not tested"),
        (make_target(llama, ordered=False), "ordered=False: continuous batching runs on the lean Llama engine"),
        (make_target(llama, compile=True), "compile=True: continuous batching runs on the lean Llama engine"),
        (gpu, "device=cuda: continuous batching runs on the lean Llama engine with ordered attention, eager, on a CPU"),
    ]:
        with pytest.raises(ValueError, match=message):
            next(continuous_generate(target, [[1, 2, 3]], max_new_tokens=4, batch=2))
        with pytest.raises(ValueError, match=message):
            next(serve(target, lambda: None, batch=1, capacity=8))


@pytest.fixture(scope="module")
def tiny_base_model():
    return make_lm(num_tokens=64, max_seq_len=64, seed=1).eval()


def test_nan_logits_name_the_prompt(llama):
    target = make_target(llama)
    clean = target.engine.embedding
    embedding = clean.clone()
    embedding[3] = float("nan")  # only the second prompt holds token 3
    target.engine.embedding = embedding
    try:
        with pytest.raises(NonFiniteError, match="decode step 0 .*row 1"):
            list(continuous_generate(target, [[1, 2], [3, 4]], max_new_tokens=3, batch=1))
    finally:  # the engine is built once per model (verify/backends/lean.py): later tests' targets share it
        target.engine.embedding = clean


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(batch=0), "batch=0: must be an integer >= 1"),
        (dict(batch=True), "batch=True"),
        (dict(max_new_tokens=0), "max_new_tokens=0"),
        (dict(max_new_tokens=[3]), "max_new_tokens has 1 entries for 2 prompts"),
        (dict(seeds=[1, 2, 3]), "seeds has 3 entries for 2 prompts"),
        (dict(seeds=1.5), "seed=1.5"),
        (dict(sampling=0.7), "sampling=0.7: must be a SamplingConfig"),
    ],
)
def test_bad_inputs_refused_in_one_line(llama, kwargs, message):
    args = dict(max_new_tokens=4, batch=2) | kwargs
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        next(continuous_generate(make_target(llama), [[1, 2], [3]], **args))


def test_a_prompt_the_model_cannot_take_is_refused(llama):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        next(continuous_generate(make_target(llama), [[1, 2], []], max_new_tokens=4))


def test_a_follow_up_queued_while_serving_is_served_as_if_alone(llama):
    """The data engine queues a second turn when the first answer arrives: served in the same batch, same bits."""
    firsts = prompts_of(5, seed=9, short=True)
    queue = deque(Request(p, 12) for p in firsts)

    follow_ups, got = {}, {}
    for answer in serve(
        make_target(llama), lambda: queue.popleft() if queue else None, batch=3, capacity=400, eos_id=None
    ):
        got[answer.index] = answer.tokens
        if answer.index < len(firsts):  # a first turn: ask a follow-up built on its answer
            follow = firsts[answer.index] + answer.tokens + [5, 6]
            queue.append(Request(follow, 8, SamplingConfig(temperature=1.0), seed=answer.index))
            follow_ups[len(firsts) + len(follow_ups)] = (follow, answer.index)
    assert len(got) == 2 * len(firsts)
    for i, (prompt, seed) in follow_ups.items():
        assert got[i] == alone(llama, prompt, budget=8, cfg=SamplingConfig(temperature=1.0), seed=seed, eos_id=None)


def test_a_request_past_the_rows_capacity_is_refused(llama):
    with pytest.raises(ValueError, match="prompt 1 has 3 tokens \\+ max_new_tokens=9: more than the rows' capacity=10"):
        requests = iter([Request([1], 4), Request([1, 2, 3], 9)])
        list(serve(make_target(llama), lambda: next(requests, None), batch=1, capacity=10))


def test_a_remembered_prompt_is_prefilled_once_with_the_same_answers(llama):
    """Requests sharing a prompt (the base asked for its own questions from one template prefix): with remember=True
    each distinct prompt runs the model once, and every answer is still plain decoding's alone, bit for bit; rows
    refilled from the copy after other prompts have used them (stale slots past the prompt) included."""
    shared = prompts_of(3, seed=11, short=True)
    order = [i % 3 for i in range(10)]
    cfgs = [SamplingConfig(temperature=1.0) if i % 4 else SamplingConfig() for i in range(len(order))]
    budgets = [4 + 9 * (i % 3) for i in range(len(order))]
    requests = deque(Request(shared[j], budgets[i], cfgs[i], seed=500 + i, remember=True) for i, j in enumerate(order))
    target = make_target(llama)
    prefills = []
    engine = target.engine

    class Counting:
        def __getattr__(self, name):
            return getattr(engine, name)

        def __call__(self, tokens, *args, **kwargs):
            if kwargs.get("attention") == "fused" and tokens.shape[0] == 1:  # a one-row prefill (fill_row)
                prefills.append(tuple(tokens[0].tolist()))
            return engine(tokens, *args, **kwargs)

    target.engine = Counting()
    capacity = max(len(p) for p in shared) + max(budgets)
    got = {
        a.index: a.tokens
        for a in serve(target, lambda: requests.popleft() if requests else None, batch=3, capacity=capacity, eos_id=EOS)
    }
    assert sorted(prefills) == sorted(tuple(p) for p in shared)  # each distinct prompt once
    for i, j in enumerate(order):
        assert got[i] == alone(llama, shared[j], budget=budgets[i], cfg=cfgs[i], seed=500 + i), f"request {i}"
