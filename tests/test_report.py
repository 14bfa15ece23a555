"""repeated_ngram_share (the benchmark's rep4 column) on hand-computed rows, and its one-line errors."""

from __future__ import annotations

import json

import pytest

from experiments.lib.report.results import repeated_ngram_share


def test_no_repeats_is_zero() -> None:
    assert repeated_ngram_share([[1, 2, 3]], [list(range(10, 40))]) == 0.0


def test_echo_of_the_prompt_hand_computed() -> None:
    # s = 1 2 3 4 | 1 2 3 4: the output's 4-grams end at 4..7: (2,3,4,1) (3,4,1,2) (4,1,2,3) new, (1,2,3,4) seen
    assert repeated_ngram_share([[1, 2, 3, 4]], [[1, 2, 3, 4]]) == 0.25


def test_only_tokens_that_end_a_4gram_count() -> None:
    # no prompt: indices 0-2 end no 4-gram; index 3 (7,7,7,7) is new, index 4 repeats it -> 1 of 2
    assert repeated_ngram_share([[]], [[7, 7, 7, 7, 7]]) == 0.5
    assert repeated_ngram_share([[]], [[7, 7, 7]]) == 0.0  # nothing counted
    assert repeated_ngram_share([[1]], [[]]) == 0.0


def test_a_loop_is_near_one() -> None:
    # the output loops the prompt's last four tokens 25 times: all but the first 3 of 100 tokens repeat
    share = repeated_ngram_share([[9, 9, 5, 6, 7, 8]], [[5, 6, 7, 8] * 25])
    assert share == pytest.approx(97 / 100)


def test_rows_are_pooled_not_averaged() -> None:
    # row 1: 1 repeat of 4 counted (as above); row 2: 0 of 2 -> 1 / 6, not the mean of ratios (1/8)
    share = repeated_ngram_share([[1, 2, 3, 4], [20, 21, 22, 23]], [[1, 2, 3, 4], [24, 25]])
    assert share == pytest.approx(1 / 6)


def test_rows_do_not_see_each_other() -> None:
    # the second row's 4-gram occurred in the first row only: not a repeat
    assert repeated_ngram_share([[1, 2, 3], [1, 2, 3]], [[4], [4]]) == 0.0


def test_other_n() -> None:
    assert repeated_ngram_share([[5]], [[5, 6, 5]], n=1) == pytest.approx(2 / 3)  # 5 seen, 6 new, 5 seen
    # bigrams ending at output indices 2..4 of s = 1 2 | 1 2 3: (2,1) new, (1,2) seen, (2,3) new
    assert repeated_ngram_share([[1, 2]], [[1, 2, 3]], n=2) == pytest.approx(1 / 3)


@pytest.mark.parametrize("n", [0, -1, 2.5, True, "4"])
def test_bad_n_is_a_one_line_error(n) -> None:
    with pytest.raises(ValueError) as excinfo:
        repeated_ngram_share([[1]], [[2]], n=n)
    assert str(excinfo.value) == f"n={n!r}: must be an integer >= 1"


def test_prompts_and_outputs_must_pair_up() -> None:
    with pytest.raises(ValueError, match="2 prompts but 1 outputs"):
        repeated_ngram_share([[1], [2]], [[3]])


def test_curves_read_agreement_under_current_and_older_names(tmp_path):
    from experiments.curves import agreement, main

    assert agreement({"head2_agree": 0.2, "head1_agree": 0.4, "head1_top1": 0.1}) == {
        "head1_agree": 0.4,
        "head2_agree": 0.2,
    }
    assert agreement({"head1_rank0": 0.3, "head1_rank1": 0.1}) == {"head1_agree": 0.3}  # older Medusa runs
    assert agreement({"step1_top1": 0.5, "step10_top1": 0.2, "step2_top1": 0.4}) == {
        "step1_agree": 0.5,
        "step2_agree": 0.4,
        "step10_agree": 0.2,
    }  # position order, not string order
    run = tmp_path / "prophet"
    run.mkdir()
    rows = [
        {"kind": "train", "step": 1, "elapsed_s": 1.0, "loss": 2.0},
        {"kind": "val", "step": 2, "elapsed_s": 60.0, "step1_agree": 0.3, "step2_agree": 0.2},
        {"kind": "val", "step": 4, "elapsed_s": 120.0, "step1_agree": 0.5, "step2_agree": 0.4},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([f"out={tmp_path / 'c.png'}", str(run)]) == 0 and (tmp_path / "c.png").stat().st_size > 0
    assert main([str(tmp_path / "missing")]) == 1


def results_fixture() -> dict:
    """Two settings and temperatures; figures chosen so every derived column can be computed by hand."""
    plain = [
        dict(temperature=t, threads=2, compiled=c, repeat4=r, tokens_per_s=s, speedup=s / 1000, warmup_s=1.0)
        for t, r in ((0.0, 0.25), (1.0, 0.05))
        for c, s in ((False, 500.0), (True, 1000.0))
    ]
    row = dict(
        rule="greedy", lossless=True, repeat4=0.25, alpha=0.5, efficiency=0.5, exact=True, threads=2, warmup_s=1.0
    )
    methods = [
        {**row, "name": "fast", "temperature": 0.0, "compiled": True, "tau": 2.5, "tokens_per_s": 1300.0}
        | dict(
            speedup=1.3, speedup_lo=1.1, speedup_hi=1.5, target_seconds_per_step=0.0015, draft_seconds_per_step=0.0002
        )
        | dict(draft_share=0.1, target_share=0.8),
        {**row, "name": "slow", "temperature": 0.0, "compiled": False, "tau": 3.0, "tokens_per_s": 600.0}
        | dict(speedup=0.6, speedup_lo=0.5, speedup_hi=0.7, target_seconds_per_step=0.004, draft_seconds_per_step=0.002)
        | dict(draft_share=0.3, target_share=0.6),
        {**row, "name": "lenient", "temperature": 1.0, "compiled": True, "tau": 1.5, "tokens_per_s": 900.0}
        | dict(
            speedup=0.9, speedup_lo=0.8, speedup_hi=1.0, target_seconds_per_step=0.001, draft_seconds_per_step=0.0001
        )
        | dict(lossless=False)
        | dict(draft_share=0.2, target_share=0.7, rule="speculative", exact=None),
    ]
    return dict(plain=plain, methods=methods)


def test_the_table_shows_the_regime_and_the_time_outside_draft_and_target() -> None:
    """verify/step and draft/step divide by plain decoding's seconds per token in the SAME setting; rest % is
    what neither drafting nor the target took."""
    from experiments.lib.report.results import markdown_table

    lines = markdown_table(results_fixture()).splitlines()
    fast = next(line for line in lines if line.startswith("| fast "))
    slow = next(line for line in lines if line.startswith("| slow "))
    assert "| 1.50 | 0.20 | 10 | 10 | yes |" in fast  # 1.5 ms / 1 ms, 0.2 ms / 1 ms (compiled plain: 1000 tok/s)
    assert "| 2.00 | 1.00 | 30 | 10 | yes |" in slow  # 4 ms / 2 ms, 2 ms / 2 ms (eager plain: 500 tok/s)


def test_the_verdict_names_the_fastest_method_per_temperature() -> None:
    """A winner only where its interval lies above 1.0 (T=0's fast); at T=1 none does (lenient's reaches 1.0)."""
    from experiments.lib.report.results import verdict

    line = verdict(results_fixture())
    assert line.count("\n") == 2 and line.startswith("\nVerdict: ")
    assert (
        "at T=0 fast (compiled 2t) at 1.30x [1.10, 1.50] the fastest plain decoding (tau 2.50; plain rep4 0.25)" in line
    )
    assert (
        "at T=1 no method measurably faster (highest: lenient (compiled 2t, NOT lossless) at 0.90x [0.80, 1.00]" in line
    )
    assert "plain rep4 0.05" in line


def test_the_header_names_the_cpu_and_the_base() -> None:
    from experiments.lib.report.results import header_line

    results = {"cpu": "AMD EPYC", "base": {"parameters": 10_500_000, "dim": 256, "depth": 8}}
    assert header_line(results) == "CPU: AMD EPYC; base: 10.5M parameters (256 x 8), float32 decoding\n\n"
    assert header_line({"cpu": "AMD EPYC"}) == "CPU: AMD EPYC\n\n" and header_line({}) == ""


FAKE_H100 = dict(name="NVIDIA H100 80GB HBM3", total_memory=85_029_158_912)  # what torch reports of an H100


@pytest.fixture
def fake_h100(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU-only machine seen as one with an H100 (torch 2.11.0+cu130, CUDA 13.0) on an AMD EPYC host."""
    import types

    import torch

    from experiments.lib.common import machine

    monkeypatch.setattr(machine, "cpu_model", lambda: "AMD EPYC 9454")
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: types.SimpleNamespace(**FAKE_H100))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: FAKE_H100["name"])


def test_a_cuda_run_describes_its_gpu(fake_h100: None) -> None:
    from experiments.lib.common.machine import device_description, device_info

    info = device_info("cuda")
    assert info == {
        "type": "cuda",
        "torch": "2.11.0+cu130",
        "name": "NVIDIA H100 80GB HBM3",
        "memory_gib": 79.2,
        "cuda": "13.0",
        "host_cpu": "AMD EPYC 9454",
    }
    assert json.loads(json.dumps(info)) == info  # stored in results.json as it is
    assert device_description("cuda:0") == (
        "GPU: NVIDIA H100 80GB HBM3 (79.2 GiB), torch 2.11.0+cu130, CUDA 13.0; host CPU: AMD EPYC 9454"
    )


def test_a_cpu_run_describes_its_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from experiments.lib.common import machine

    monkeypatch.setattr(machine, "cpu_model", lambda: "AMD EPYC 9454")
    info = machine.device_info("cpu")
    threads = torch.get_num_threads()
    assert info == {"type": "cpu", "torch": torch.__version__, "name": "AMD EPYC 9454", "threads": threads}
    assert machine.device_description(torch.device("cpu")) == "CPU: AMD EPYC 9454"  # the header's line as before


def test_the_machine_key_of_a_gpu_names_it(fake_h100: None) -> None:
    """A cost table measured on a CPU (or on another GPU) must never be read back on this GPU."""
    from experiments.lib.common.machine import machine_key

    gpu, cpu = machine_key("cuda"), machine_key("cpu")
    assert gpu.startswith("AMD EPYC 9454 | torch 2.11.0+cu130 | ") and "NVIDIA H100 80GB HBM3" in gpu
    assert gpu.endswith(" | cuda | NVIDIA H100 80GB HBM3 | CUDA 13.0") and cpu.endswith(" | cpu") and gpu != cpu
    assert "H100" not in cpu


def test_the_header_names_the_gpu_of_a_cuda_run(fake_h100: None) -> None:
    from experiments.lib.common.machine import device_info
    from experiments.lib.report.results import header_line

    results = {"cpu": "AMD EPYC 9454", "device_info": device_info("cuda"), "base": {"parameters": 10_500_000}}
    assert header_line(results) == (
        "GPU: NVIDIA H100 80GB HBM3 (79.2 GiB), torch 2.11.0+cu130, CUDA 13.0; host CPU: AMD EPYC 9454; "
        "base: 10.5M parameters, float32 decoding\n\n"
    )
    # a results.json written before device_info (its cpu alone) keeps its old header
    assert header_line({"cpu": "AMD EPYC 9454"}) == "CPU: AMD EPYC 9454\n\n"


def test_the_report_says_which_checkpoint_each_row_used() -> None:
    from experiments.lib.report.results import checkpoint_lines

    results = {
        "base_record": {"checkpoint": "runs/base/checkpoint", "step": 1381, "selected": None, "last_step": None},
        "checkpoints": {
            "medusa": {"checkpoint": "runs/medusa/checkpoint", "step": 800, "selected": "best", "last_step": 1000},
            "prophet": {"checkpoint": "runs/prophet/checkpoint", "step": 1000, "selected": "last", "last_step": 1000},
        },
    }
    lines = checkpoint_lines(results).strip().splitlines()
    assert lines[0] == "Checkpoints:"
    assert lines[1] == "- base: runs/base/checkpoint step 1381 (best/last not recorded)"
    assert lines[2] == "- medusa: runs/medusa/checkpoint step 800 (best of its run, run's last step 1000)"
    assert lines[3] == "- prophet: runs/prophet/checkpoint step 1000 (last of its run, run's last step 1000)"
    assert checkpoint_lines({}) == ""


def test_the_header_names_the_decoded_dtype_and_the_prompt_set() -> None:
    from experiments.lib.report.results import header_line

    results = {
        "cpu": "Intel Xeon",
        "base": {"parameters": 134_515_008},
        "dtype": "bfloat16",
        "prompts": 12,
        "prompt_set": {"source": "chat_mix", "chat": True, "turns": 2, "categories": {"coding": 4, "qa": 8}},
    }
    assert header_line(results) == (
        "CPU: Intel Xeon; base: 134.5M parameters, bfloat16 decoding; "
        "prompts: 12 from chat_mix, chat template, turns 1 and 2 (coding 4, qa 8)\n\n"
    )


def test_scaling_plots_best_chain_tau_against_answer_tokens_and_fits_a_log_line(tmp_path):
    from experiments.curves import main, plot_scaling

    runs = []
    for family, tokens, taus in [
        ("medusa", 10_000, [1.2, 1.4]),
        ("medusa", 100_000, [1.3, 1.6]),
        ("prophet", 10_000, [1.5]),
    ]:
        run = tmp_path / f"{family}-{tokens}"
        (run / "checkpoint").mkdir(parents=True)
        meta = {"model_config": {"package": family, "module": {"arch": "eagle3"}}, "train_tokens": tokens}
        (run / "checkpoint" / "meta.json").write_text(json.dumps(meta))
        rows = [{"kind": "val", "elapsed_s": 60.0 * (i + 1), "chain_tau": t, "agree": 0.5} for i, t in enumerate(taus)]
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        runs.append(run)
    table = plot_scaling(runs, tmp_path / "scaling.png")
    assert "| medusa-100000 | medusa-eagle3 | ? | 100,000 | 1.600 |" in table  # the family names its arch
    # medusa: 1.4 at 10k, 1.6 at 100k -> tau = 0.6 + 0.2 log10(tokens): 1.80 at 1M
    assert "| medusa-eagle3 | 0.600 + 0.200 log10 | 1.80 |" in table
    assert "| prophet-eagle3 |" not in table.split("\n\n")[1]  # one size: no line to fit
    assert (tmp_path / "scaling.png").stat().st_size > 0
    (runs[0] / "checkpoint" / "meta.json").write_text(json.dumps({"model_config": {"package": "medusa"}}))
    assert main(["scaling=true", f"out={tmp_path / 'x.png'}", str(runs[0])]) == 1  # no train_tokens: one line


def test_scaling_keeps_time_budgets_apart_and_names_each_teacher(tmp_path):
    """Runs of one family under other time budgets are other curves, each with its own line; the teacher each run's
    features came from is in its row."""
    from experiments.curves import plot_scaling

    cache = tmp_path / "features-bf16"
    cache.mkdir()
    (cache / "meta.json").write_text(json.dumps({"spec": {"teacher": "bf16"}}))
    runs = []
    for minutes, tokens, tau, features, record in [(6, 10_000, 1.2, None, None), (6, 100_000, 1.3, None, None),
                                                   (20, 10_000, 1.3, None, "fp32"),
                                                   (20, 100_000, 1.6, str(cache), None)]:  # fmt: skip
        run = tmp_path / f"medusa-{minutes}-{tokens}"
        (run / "checkpoint").mkdir(parents=True)
        (run / ".hydra").mkdir()
        (run / ".hydra" / "config.yaml").write_text(f"max_minutes: {minutes}\n")
        meta = {"model_config": {"package": "medusa"}, "train_tokens": tokens, "features": features}
        meta |= {"feature_teacher": record} if record else {}  # the checkpoint's record, or the cache's meta
        (run / "checkpoint" / "meta.json").write_text(json.dumps(meta))
        (run / "metrics.jsonl").write_text(
            json.dumps({"kind": "val", "elapsed_s": 60.0, "chain_tau": tau, "agree": 0.5})
        )
        runs.append(run)
    fits = plot_scaling(runs, tmp_path / "s.png").split("\n\n")[1]
    assert "| medusa, 6 min | 0.800 + 0.100 log10 |" in fits  # 1.2 at 10k, 1.3 at 100k
    assert "| medusa, 20 min | 0.100 + 0.300 log10 |" in fits  # 1.3 at 10k, 1.6 at 100k: one curve, two teachers
    table = plot_scaling(runs, tmp_path / "s.png")
    assert "| medusa-20-100000 | medusa, 20 min | bf16 | 100,000 | 1.600 |" in table
    assert "| medusa-20-10000 | medusa, 20 min | fp32 | 10,000 | 1.300 |" in table
    assert "| medusa-6-10000 | medusa, 6 min | ? | 10,000 | 1.200 |" in table  # neither: not known
