"""Cost-aware draft budgets: the pure model (verify/plan/budget.py) on hand-computed numbers."""

import pytest

from verify.plan.budget import best_chain, best_tree, expected_tokens_chain, extend_acceptance, interpolate_cost

ACCEPTANCE = [0.8, 0.6, 0.4, 0.2]  # cumulative: P(accepted >= 1), P(accepted >= 2), ...
FLAT = {1: 1.0, 64: 1.0}  # a forward costs 1 s whatever its width


def test_expected_tokens_chain_sums_cumulative_acceptance():
    assert expected_tokens_chain(ACCEPTANCE, 1) == pytest.approx(1.8)
    assert expected_tokens_chain(ACCEPTANCE, 2) == pytest.approx(2.4)
    assert expected_tokens_chain(ACCEPTANCE, 4) == pytest.approx(3.0)


def test_expected_tokens_chain_extrapolates_with_the_last_conditional_rate():
    # last conditional rate 0.4 / 0.8 = 0.5: positions 3 and 4 get 0.2 and 0.1
    assert extend_acceptance([0.8, 0.4], 4) == pytest.approx([0.8, 0.4, 0.2, 0.1])
    assert expected_tokens_chain([0.8, 0.4], 4) == pytest.approx(2.5)
    assert extend_acceptance([0.5], 3) == pytest.approx([0.5, 0.25, 0.125])  # one position: its own rate
    assert extend_acceptance([0.5, 0.0], 3) == [0.5, 0.0, 0.0]
    assert extend_acceptance([0.3, 0.4], 3) == pytest.approx([0.3, 0.4, 0.4])  # non-monotone noise: rate capped at 1


def test_cheap_drafting_picks_a_long_chain():
    gamma, table = best_chain(ACCEPTANCE, verify_cost=FLAT, draft_step_cost=0.01, draft_fixed_cost=0.0, max_gamma=4)
    assert gamma == 4
    assert [r["gamma"] for r in table] == [1, 2, 3, 4]
    assert table[3]["expected_tokens"] == pytest.approx(3.0)
    assert table[3]["seconds_per_step"] == pytest.approx(1.04)
    assert table[3]["tokens_per_s"] == pytest.approx(3.0 / 1.04)
    assert table[0]["tokens_per_s"] == pytest.approx(1.8 / 1.01)


def test_expensive_drafting_picks_gamma_one():
    gamma, table = best_chain(ACCEPTANCE, verify_cost=FLAT, draft_step_cost=1.0, draft_fixed_cost=0.0, max_gamma=4)
    assert gamma == 1
    assert table[0]["tokens_per_s"] == pytest.approx(0.9)  # 1.8 tokens / (1 s forward + 1 s draft)
    assert [r["tokens_per_s"] for r in table] == pytest.approx([0.9, 0.8, 0.7, 0.6])


def test_verify_cost_and_fixed_cost_shift_the_choice():
    # forwards grow steeply with width: C(k) = k seconds -> g = 1 (1.8 / 2 = 0.9 beats 2.4 / 3 = 0.8)
    steep = {1: 1.0, 2: 2.0}
    assert best_chain(ACCEPTANCE, verify_cost=steep, draft_step_cost=0.0, draft_fixed_cost=0.0, max_gamma=4)[0] == 1
    # a large fixed cost per step makes every step dearer, so the longest chain wins again
    gamma, table = best_chain(ACCEPTANCE, verify_cost=steep, draft_step_cost=0.0, draft_fixed_cost=100.0, max_gamma=4)
    assert gamma == 4 and table[3]["seconds_per_step"] == pytest.approx(105.0)


def test_interpolate_cost():
    costs = {2: 1.0, 4: 3.0, 8: 5.0}
    assert interpolate_cost(costs, 2) == 1.0
    assert interpolate_cost(costs, 3) == pytest.approx(2.0)
    assert interpolate_cost(costs, 6) == pytest.approx(4.0)
    assert interpolate_cost(costs, 1) == 1.0  # clamped below
    assert interpolate_cost(costs, 12) == pytest.approx(7.0)  # the last slope (0.5 s per token) continued
    assert interpolate_cost({1: 2.0, 2: 1.0}, 5) == 1.0  # a negative last slope is floored at 0
    assert interpolate_cost({3: 2.0}, 9) == 2.0  # one measurement: constant


def test_best_tree():
    cost = {1: 1.0, 5: 1.0, 17: 2.0}
    small = {"tree_nodes": 4, "depth": 3, "tau": 2.0, "draft_seconds_per_step": 0.5}
    large = {"tree_nodes": 16, "depth": 5, "tau": 3.0, "draft_seconds_per_step": 0.5}
    index, table = best_tree([small, large], verify_cost=cost)
    assert index == 0
    assert table[0]["tokens_per_s"] == pytest.approx(2.0 / 1.5)
    assert table[1]["tokens_per_s"] == pytest.approx(3.0 / 2.5)
    assert table[1]["depth"] == 5 and table[1]["seconds_per_step"] == pytest.approx(2.5)
    # a large overhead per step favours the tree that emits more tokens per step
    index, table = best_tree(
        [{**small, "overhead_seconds_per_step": 10.0}, {**large, "overhead_seconds_per_step": 10.0}], verify_cost=cost
    )
    assert index == 1 and table[1]["tokens_per_s"] == pytest.approx(3.0 / 12.5)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: expected_tokens_chain([], 2), r"acceptance=\[\]"),
        (lambda: expected_tokens_chain([0.5], 0), "gamma=0: must be an integer >= 1"),
        (lambda: expected_tokens_chain([0.5, 1.5], 2), r"acceptance\[1\]=1.5"),
        (lambda: interpolate_cost({}, 2), "verify_cost={}"),
        (lambda: interpolate_cost({1: -0.1}, 2), r"verify_cost\[1\]=-0.1: must be .* > 0"),
        (lambda: interpolate_cost({0: 1.0}, 2), "verify_cost key k=0"),
        (lambda: interpolate_cost({1: 1.0}, 0), "k=0"),
        (
            lambda: best_chain([0.5], verify_cost=FLAT, draft_step_cost=-1.0, draft_fixed_cost=0.0, max_gamma=2),
            "draft_step_cost=-1.0",
        ),
        (
            lambda: best_chain([0.5], verify_cost=FLAT, draft_step_cost=0.0, draft_fixed_cost=-1, max_gamma=2),
            "draft_fixed_cost=-1",
        ),
        (
            lambda: best_chain([0.5], verify_cost=FLAT, draft_step_cost=0.0, draft_fixed_cost=0.0, max_gamma=0),
            "max_gamma=0",
        ),
        (lambda: best_tree([], verify_cost=FLAT), r"candidates=\[\]"),
        (
            lambda: best_tree([{"tree_nodes": 4}], verify_cost=FLAT),
            r"candidates\[0\] lacks tau, draft_seconds_per_step",
        ),
        (
            lambda: best_tree([{"tree_nodes": 0, "tau": 1.0, "draft_seconds_per_step": 0.0}], verify_cost=FLAT),
            "tree_nodes=0",
        ),
        (
            lambda: best_tree([{"tree_nodes": 2, "tau": 0.0, "draft_seconds_per_step": 0.0}], verify_cost=FLAT),
            r"tau=0.0",
        ),
        (
            lambda: best_tree([{"tree_nodes": 2, "tau": 1.0, "draft_seconds_per_step": -2.0}], verify_cost=FLAT),
            "draft_seconds_per_step=-2.0",
        ),
    ],
)
def test_bad_inputs_raise_one_line_errors(call, message):
    with pytest.raises(ValueError, match=message) as info:
        call()
    assert "\n" not in str(info.value)


# ------------------------------------------------------------- calibration on a tiny random model

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from experiments.lib.common.machine import machine_key  # noqa: E402
from experiments.lib.methods import calibrate  # noqa: E402
from experiments.lib.methods.calibrate import (  # noqa: E402
    binary_tree,
    cached_verify_cost,
    choose_chain_budget,
    choose_tree_budget,
    format_cost_table,
    measure_verify_cost,
    pilot,
)
from verify.backends.target import Target  # noqa: E402
from verify.drafters.prompt_lookup import PromptLookupDrafter  # noqa: E402
from verify.loop.drafter import Draft  # noqa: E402
from verify.loop.sampling import SamplingConfig  # noqa: E402

KS = (1, 2, 4, 8)
QUICK = dict(ks=KS, prompt_len=16, repeats=2, warmup=1)
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4]]
PILOT = dict(sampling=SamplingConfig(), eos_id=None, max_new_tokens=16, seed=0)


def test_machine_key_names_torch_threads_and_device():
    key = machine_key()
    assert f"torch {torch.__version__}" in key and f"{torch.get_num_threads()} threads" in key and key.endswith("cpu")


def test_measure_verify_cost_rolls_back_and_skips_what_does_not_fit(lm):
    target = Target(lm)  # max_seq_len 96: with a 16-token prompt, k = 100 cannot fit
    costs = measure_verify_cost(target, **{**QUICK, "ks": (*KS, 100)})
    assert list(costs) == list(KS)
    assert all(s > 0 for s in costs.values())
    assert target.row_lengths.tolist() == [16]  # every extend was rolled back
    with pytest.raises(ValueError, match="none fits"):
        measure_verify_cost(target, ks=(100,), prompt_len=16)


def test_tree_costs_are_measured_on_trees_and_cached_apart(lm, tmp_path, monkeypatch):
    target, seen = Target(lm), []
    extend = target.extend
    monkeypatch.setattr(
        target, "extend", lambda tokens, parents=None: seen.append(parents) or extend(tokens, parents=parents)
    )
    costs = measure_verify_cost(target, **QUICK, tree=True)
    assert list(costs) == list(KS) and target.row_lengths.tolist() == [16]
    assert seen and all(p is not None and p.tolist() == binary_tree(len(p)).tolist() for p in seen)
    key = {"base": "abc123"}
    cached_verify_cost(target, key_parts=key, cache_dir=tmp_path, **QUICK)
    cached_verify_cost(target, key_parts=key, cache_dir=tmp_path, **QUICK, tree=True)
    assert len(list(tmp_path.glob("verify_cost-*.json"))) == 2  # a chain's table never stands for a tree's


def test_cached_verify_cost_reads_its_file_and_rewrites_a_corrupt_one(lm, tmp_path, monkeypatch):
    target = Target(lm)
    key = {"base": "abc123", "dtype": "float32", "compile": False}
    first = cached_verify_cost(target, key_parts=key, cache_dir=tmp_path, **QUICK)
    (path,) = tmp_path.glob("verify_cost-*.json")
    assert list(first) == list(KS)

    def fail(*args, **kwargs):
        raise AssertionError("measured again instead of reading the cache")

    measure = calibrate.measure_verify_cost
    monkeypatch.setattr(calibrate, "measure_verify_cost", fail)
    assert cached_verify_cost(target, key_parts=key, cache_dir=tmp_path, **QUICK) == first
    with pytest.raises(AssertionError):  # another base model is another key
        cached_verify_cost(target, key_parts={**key, "base": "def456"}, cache_dir=tmp_path, **QUICK)

    monkeypatch.setattr(calibrate, "measure_verify_cost", measure)
    path.write_text('{"key": {"machine": "half a fi')
    again = cached_verify_cost(target, key_parts=key, cache_dir=tmp_path, **QUICK)
    assert list(again) == list(KS)
    assert json.loads(path.read_text())["costs"].keys() == {str(k) for k in KS}
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind


def test_pilot_and_chain_budget_with_prompt_lookup(lm):
    target = Target(lm)
    factory = lambda: PromptLookupDrafter(vocab_size=lm.num_tokens)  # noqa: E731
    result = pilot(target, factory, PROMPTS, spec=calibrate.SpecConfig(gamma=3), **PILOT)
    assert result["steps"] > 0 and result["tau"] >= 1.0
    assert len(result["acceptance"]) == 3 and all(0 <= a <= 1 for a in result["acceptance"])
    assert result["draft_seconds_per_step"] > 0 and result["overhead_seconds_per_step"] >= 0
    assert result["begin_seconds_per_batch"] >= 0  # prompt lookup indexes the prompt in begin
    assert result["tokens"] == 2 * 16

    costs = measure_verify_cost(target, **QUICK)
    chosen = choose_chain_budget(target, factory, PROMPTS, verify_cost=costs, max_gamma=4, **PILOT)
    assert 1 <= chosen["gamma"] <= 4
    assert [r["gamma"] for r in chosen["table"]] == [1, 2, 3, 4]
    best = max(chosen["table"], key=lambda r: r["tokens_per_s"])
    assert best["gamma"] == chosen["gamma"]
    assert len(chosen["pilot"]["acceptance"]) == 4


class FlatLookup(PromptLookupDrafter):
    flat_draft_cost = True  # as Medusa's heads and the block prophet: one computation per step, whatever gamma


@pytest.mark.parametrize("flat", [False, True])
def test_a_flat_draft_cost_does_not_grow_with_gamma(lm, flat):
    """Linear drafters (the default) pay their measured draft time per drafted token; a flat one pays all of it
    at every gamma, so a short chain is not predicted cheaper than it is."""
    target = Target(lm)
    factory = lambda: (FlatLookup if flat else PromptLookupDrafter)(vocab_size=lm.num_tokens)  # noqa: E731
    costs = measure_verify_cost(target, **QUICK)
    chosen = choose_chain_budget(target, factory, PROMPTS, verify_cost=costs, max_gamma=4, **PILOT)
    beyond = [r["seconds_per_step"] - interpolate_cost(costs, r["gamma"] + 1) for r in chosen["table"]]
    pilot_result = chosen["pilot"]
    if flat:
        total = pilot_result["draft_seconds_per_step"] + pilot_result["overhead_seconds_per_step"]
        assert beyond == pytest.approx([total] * 4)
    else:
        assert beyond[0] < beyond[-1]  # the draft part grows with gamma


class TreeLookup:
    """A tree for tests: prompt lookup's chain of min(depth, gamma) nodes, then wrong guesses under the root."""

    def __init__(self, vocab_size: int, *, tree_nodes: int, depth: int):
        self.lookup, self.vocab_size, self.nodes, self.depth = (
            PromptLookupDrafter(vocab_size=vocab_size),
            vocab_size,
            tree_nodes,
            depth,
        )

    def begin(self, prompts, prefill, pending):
        self.lookup.begin(prompts, prefill, pending)

    def propose(self, gamma, sampling, generator):
        d = min(self.depth, gamma, self.nodes)
        chain = self.lookup.propose(d, sampling, generator).tokens  # (b, d)
        siblings = (chain[:, :1] + 1 + torch.arange(self.nodes - d)) % self.vocab_size  # (b, nodes - d)
        parents = torch.tensor(list(range(-1, d - 1)) + [-1] * (self.nodes - d))
        return Draft(tokens=torch.cat((chain, siblings), dim=1), parents=parents)

    def commit(self, verdict):
        self.lookup.commit(verdict)


def test_choose_tree_budget(lm):
    target = Target(lm)
    seen = []

    def make(kwargs):
        seen.append(kwargs)
        return lambda: TreeLookup(lm.num_tokens, **kwargs)

    candidates = [{"tree_nodes": 2, "depth": 2}, {"tree_nodes": 6, "depth": 3}]
    costs = measure_verify_cost(target, **QUICK)
    chosen = choose_tree_budget(target, make, PROMPTS, candidates=candidates, verify_cost=costs, **PILOT)
    assert seen == candidates
    assert chosen["drafter_kwargs"] in candidates and chosen["gamma"] == chosen["drafter_kwargs"]["depth"]
    assert [r["tree_nodes"] for r in chosen["table"]] == [2, 6]
    assert all(r["tau"] >= 1 and r["tokens_per_s"] > 0 for r in chosen["table"])
    assert max(chosen["table"], key=lambda r: r["tokens_per_s"])["tree_nodes"] == chosen["drafter_kwargs"]["tree_nodes"]
    with pytest.raises(ValueError, match=r"candidates\[0\].depth=None"):
        choose_tree_budget(target, make, PROMPTS, candidates=[{"tree_nodes": 2}], verify_cost=costs, **PILOT)


def test_format_cost_table():
    text = format_cost_table({1: 0.002, 4: 0.003}, {"prompt_lookup": 0.001})
    lines = text.splitlines()
    assert lines[0] == "| k | seconds | ratio to k=1 |"
    assert lines[2] == "| 1 | 0.002000 | 1.00 |" and lines[3] == "| 4 | 0.003000 | 1.50 |"
    assert lines[-1] == "| prompt_lookup | 0.001000 | 0.50 |"
    assert "drafter" not in format_cost_table({1: 0.002})
    both = format_cost_table({1: 0.002, 4: 0.003}, tree_cost={1: 0.002, 4: 0.004}).splitlines()
    assert both[0] == "| k | chain seconds | ratio to k=1 | tree seconds | ratio to k=1 |"
    assert both[3] == "| 4 | 0.003000 | 1.50 | 0.004000 | 2.00 |"


def test_binary_tree_is_a_tree_in_topological_order():
    assert binary_tree(1).tolist() == [-1] and binary_tree(6).tolist() == [-1, 0, 0, 1, 1, 2]
    parents = binary_tree(64)
    assert all(parents[i] < i for i in range(1, 64)) and int((parents == -1).sum()) == 1


def test_timing_and_recording_wrappers_pass_the_optional_protocol_members_on():
    """A fused prophet reads the target's layer states, which speculative_generate asks for from
    drafter.target_layers; an early-exit drafter needs `attach(target)`. A wrapper that hid either would
    make every such pilot or recording fail; one that invented them would change what the loop does."""
    from experiments.generate import RecordingDrafter
    from experiments.lib.methods.calibrate import _BeginTimer

    class Fused:
        vocab_size, target_layers = 7, (2, 5)

    class Plain:
        vocab_size = 7

    class Exit:
        vocab_size = 7

        def attach(self, target) -> None:
            self.target = target

    for wrap in (_BeginTimer, RecordingDrafter):
        assert wrap(Fused()).target_layers == (2, 5)
        assert getattr(wrap(Plain()), "target_layers", ()) == () and getattr(wrap(Plain()), "attach", None) is None
        inner = Exit()
        wrap(inner).attach("the target")
        assert inner.target == "the target"


def test_auto_dtype_is_measured_once_and_decides(monkeypatch, tmp_path):
    """dtype=auto on a CPU with native bf16: both dtypes measured on the lean engine (the base's fp32 weights
    untouched), cached, and the cheaper chosen; on a CPU that would emulate bf16 nothing is measured."""
    from tests.conftest import make_lm

    model = make_lm()
    cpu = torch.device("cpu")
    monkeypatch.setattr(calibrate, "native_bf16", lambda device: (True, "CPU has amx_bf16"))
    chosen = calibrate.decode_precision("auto", model, cpu, key_parts={"base": "t"}, cache_dir=tmp_path)
    assert chosen["used"] in ("fp32", "bf16") and "8-token verify" in chosen["reason"]
    assert next(model.parameters()).dtype == torch.float32  # measured on a copy
    assert len(sorted(tmp_path.rglob("*.json"))) == 2  # one cost table per dtype
    monkeypatch.setattr(calibrate, "measure_verify_cost", lambda *a, **k: pytest.fail("measured again"))
    assert calibrate.decode_precision("auto", model, cpu, key_parts={"base": "t"}, cache_dir=tmp_path) == chosen
    monkeypatch.setattr(calibrate, "native_bf16", lambda device: (False, "CPU lacks amx_bf16 and avx512_bf16"))
    assert calibrate.decode_precision("auto", model, cpu, key_parts={"base": "u"}, cache_dir=tmp_path)["used"] == "fp32"


# ------------------------------------------------------------------------- budget=auto's pilot prompts


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([], r"budget=auto: prompts.file='.*q.jsonl' holds 3 questions and prompts.num_prompts=3 benchmarks every "
         r"one, leaving none for its pilot runs; give prompts.num_prompts=2 or fewer, or budget=fixed"),
        (["prompts=chat_mix", "prompts.num_prompts=96"], r"budget=auto: prompts.set='chat_mix' holds 96 questions"),
    ],
)  # fmt: skip
def test_a_prompt_set_the_benchmark_takes_whole_is_refused_before_any_work(tmp_path, monkeypatch, overrides, message):
    """The pilots take questions of the same file that no benchmark prompt is: with none to spare, one line naming
    budget=auto and the file's size, before the base loads (not 'prompts=[]' after minutes of calibration)."""
    from hydra import compose, initialize_config_dir

    from experiments import benchmark as bench_mod

    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"prompt": f"question {i}?"}) + "\n" for i in range(3)))

    def no_work(*args, **kwargs):  # the first work: finding (or training) the base's checkpoint
        raise AssertionError("work began before the refusal")

    monkeypatch.setattr(bench_mod, "checkpoint_for", no_work)
    conf = Path(__file__).resolve().parents[1] / "conf"
    file = [f"prompts.file={questions}", "prompts.num_prompts=3"]
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("benchmark", overrides=["budget=auto", f"out_dir={tmp_path}", *(overrides or file)])
    with pytest.raises(ValueError, match=message):
        bench_mod.benchmark(cfg)
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):  # one question to spare: no refusal
        cfg = compose("benchmark", overrides=["budget=auto", f"out_dir={tmp_path}", *file[:1], "prompts.num_prompts=2"])
    with pytest.raises(AssertionError, match="work began"):
        bench_mod.benchmark(cfg)
